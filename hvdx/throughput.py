"""Throughput per phase of a phased training run and its scaling efficiency (shi2021 Table 4).

A phase's throughput is the samples/s over all ranks of its training steps (validation
left out), the median over its epochs after the first; an epoch's first step is left out
too (a new phase's first step traces the model at its shape). Table 4's scaling efficiency
is SE = samples/s on P ranks / (P x one rank's samples/s) at the same resolution and batch;
one rank's comes from `single_rank_throughput` (every rank training alone, at once) or from
a 1-rank run's summary (`load_baseline`).

    timer = hvdx.callbacks.EpochTimer()        # a Keras callback: timer.last after each epoch
    rows = phase_throughput(history, phases)   # history: one dict per epoch (see phase_throughput)
    scaling_efficiency(rows, ranks, single_rank_throughput(model, phases, 20, rank, classes), "20 steps")
    print(table(rows, ranks, nodes))
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from hvdx.phases import Phase
from hvdx import legacy_keras

keras2 = legacy_keras.keras2()  # Keras 2: tf.keras where it is, else tf_keras (hvdx.legacy_keras)

__all__ = ["EpochTime", "comm_shares", "comm_time", "load_baseline", "phase_throughput",
           "scaling_efficiency", "single_rank_throughput", "table"]


@dataclass(frozen=True)
class EpochTime:
    """The wall time of one epoch: `steps` training steps took `seconds` (validation left
    out), `epoch_seconds` with validation; the first step ended `first_step_s` after the
    epoch began (None: not seen)."""

    steps: int
    seconds: float
    epoch_seconds: float
    first_step_s: Optional[float] = None

    def timed(self) -> tuple:
        """(steps, seconds) of the steps after the first, or of all of them when there is one
        step or the first's end was not seen."""
        if self.first_step_s is None or self.steps < 2:
            return self.steps, self.seconds
        return self.steps - 1, self.seconds - self.first_step_s

    @property
    def step_s(self) -> float:
        """Seconds per timed step."""
        steps, seconds = self.timed()
        return seconds / steps

    def samples_per_s(self, batch_size: int, ranks: int) -> float:
        """Samples/s over all ranks of the timed steps, `batch_size` samples per rank and step."""
        steps, seconds = self.timed()
        return steps * batch_size * ranks / seconds


def phase_throughput(history: Sequence[dict], phases: Sequence[Phase]) -> List[dict]:
    """One row per phase that `history` has epochs of: {"phase": str(phase), "epochs": [...],
    "communication": sorted strategy names, "samples_per_s", "step_s"}, the medians over the
    phase's epochs after its first (all of them if it has one).

    Args:
        history: one dict per epoch with "epoch", "phase" (index into `phases`),
            "communication", "samples_per_s" and "step_s" (or "seconds" and "steps").
    """
    rows = []
    for index, phase in enumerate(phases):
        epochs = [h for h in history if h["phase"] == index]
        if not epochs:
            continue
        timed = epochs[1:] or epochs
        rows.append(dict(phase=str(phase), epochs=[h["epoch"] for h in epochs],
                         communication=sorted({h["communication"] for h in epochs}),
                         samples_per_s=statistics.median(h["samples_per_s"] for h in timed),
                         step_s=statistics.median(h["step_s"] if "step_s" in h else h["seconds"] / h["steps"]
                                                  for h in timed)))
    return rows


def comm_time(strategy: Callable, d: int, rank: int, rounds: int = 12) -> float:
    """Median seconds of `strategy` aggregating a d-element float32 buffer, over `rounds`
    calls after the first two. Collective: every rank calls it with the same d."""
    buffer = tf.random.stateless_normal([d], seed=[rank, 0])
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        strategy(buffer, name="hvdx_throughput_comm_timing")
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])


def comm_shares(rows: List[dict], seconds: Dict[str, float]) -> None:
    """Adds "comm_share" to each row: {strategy: its aggregation's seconds (`seconds`, by
    strategy name) / the row's step_s} for the row's strategies that `seconds` has."""
    for row in rows:
        row["comm_share"] = {c: seconds[c] / row["step_s"] for c in row["communication"] if c in seconds}


def single_rank_throughput(model: keras2.Model, phases: Sequence[Phase], steps: int, rank: int,
                           num_classes: int) -> Dict[str, float]:
    """One rank's samples/s per phase (keyed by str(phase)), Table 4's baseline: `model`
    (compiled with a plain, not distributed, optimizer) trains `steps` steps at each phase's
    resolution and batch on a fixed synthetic batch (no input pipeline, no communication),
    after one untimed step that traces it. Every rank measures at the same time (as each GPU
    of a cluster would train alone); the slowest rank's time counts. Collective. It trains
    `model`: give it a copy, not the model being trained."""
    import horovod.tensorflow as hvd

    model.make_train_function()
    train = model.train_function  # both Keras keep it there (Keras 3's make_train_function returns None)
    out: Dict[str, float] = {}
    for i, phase in enumerate(dict.fromkeys(phases)):
        res, batch = phase.resolution, phase.batch_size
        x = tf.random.stateless_uniform([batch, res, res, 3], [rank, i], -1.0, 1.0)
        y = tf.one_hot(tf.random.stateless_uniform([batch], [rank, i + 1], 0, num_classes, tf.int32), num_classes)
        batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
        float(train(batches)["loss"])  # traced at this shape
        hvd.allreduce(tf.constant(0.0), name=f"hvdx.throughput.start.{i}")  # start together
        start = time.perf_counter()
        for _ in range(steps):
            logs = train(batches)
        float(logs["loss"])
        seconds = float(hvd.allreduce(tf.constant(time.perf_counter() - start, tf.float64), op=hvd.Max,
                                      name=f"hvdx.throughput.single.{i}"))
        out[str(phase)] = batch * steps / seconds
    return out


def load_baseline(path: str) -> Dict[str, float]:
    """One rank's samples/s per phase from a 1-rank run's summary.json ({"ranks": 1,
    "phases": [{"phase": "3x24@32", "samples_per_s": ...}, ...]}).

    Raises:
        ValueError: the run had more than one rank (its throughput is not a single rank's).
    """
    with open(path) as f:
        summary = json.load(f)
    if summary.get("ranks") != 1:
        raise ValueError(f"baseline {path}: that run had {summary.get('ranks')} ranks; give the summary.json "
                         f"of a 1-rank run of the same phases (the same script, started without horovodrun)")
    return {p["phase"]: p["samples_per_s"] for p in summary["phases"]}


def scaling_efficiency(rows: List[dict], ranks: int, single: Dict[str, float], source: str) -> None:
    """Adds Table 4's SE to each row whose phase `single` (one rank's samples/s by phase)
    covers: "single_samples_per_s", "scaling_efficiency" = samples_per_s / (ranks x
    single), and "se_source" = `source` (where one rank's figure came from)."""
    for row in rows:
        if row["phase"] in single:
            row.update(single_samples_per_s=single[row["phase"]], se_source=source,
                       scaling_efficiency=row["samples_per_s"] / (ranks * single[row["phase"]]))


def table(rows: Sequence[dict], ranks: int, nodes: int) -> str:
    """The per-phase report, a line per row: phase, epochs, strategies, samples/s, step ms,
    communication share, one rank's samples/s and SE ("-" where a row has none)."""
    lines = [f"per phase ({nodes} nodes x {ranks // nodes} ranks; as shi2021 Table 4):",
             f"  {'phase':>12} {'epochs':>7} {'strategy':>22} {'samples/s':>10} {'step ms':>8} {'comm share':>11} "
             f"{'1 rank':>10} {'SE':>5}"]
    for p in rows:
        share = ", ".join(f"{v:.0%}" for v in p.get("comm_share", {}).values()) or "-"
        single = f"{p['single_samples_per_s']:>10.1f} {p['scaling_efficiency']:>5.0%}" \
            if "scaling_efficiency" in p else f"{'-':>10} {'-':>5}"
        lines.append(f"  {p['phase']:>12} {len(p['epochs']):>7} {'+'.join(p['communication']):>22} "
                     f"{p['samples_per_s']:>10.1f} {p['step_s'] * 1e3:>8.1f} {share:>11} {single}")
    sources = {p["se_source"] for p in rows if "se_source" in p}
    if sources:
        lines.append(f"  (SE = samples/s / ({ranks} x 1 rank's); 1 rank's from {', '.join(sorted(sources))})")
    return "\n".join(lines)
