"""Shared by the benchmark scripts: launching their ranks, timing them, and their tables.

- launching (hvdx.runner): `under_launcher`, `launch_ranks` (horovodrun over loopback, or
  the emulated cluster), `add_topology_arguments` + `run_topologies` (one job per "MxN"),
  `cluster_description` (the emulated network a rank runs on);
- timing, inside a Horovod job: `slowest` (the slowest rank's time), `timed_rounds` (calls
  taking turns, round after round), `by_key`, `medians`; `load_during` (how busy the
  machine was);
- a rank's start: `freeze_start_up` (its imports out of the garbage collector's passes);
- data: `digits_shards` (scikit-learn's digits, split and sharded the same way everywhere);
- Keras 2 beside Keras 3 (issue 64): `add_keras_argument` (--keras 2,3), `keras_keys` (each
  method's key under each Keras: "hitopk", "hitopk@keras3"), `split_keras`, `keras_module`,
  `keras_label`;
- reporting: `add_output_arguments` + `readme_path` (where results and the README go),
  `markdown_table`, `update_readme` (a script's section of benchmarks/README.md).

A script imports it as `common` (run as a file, benchmarks/ is on sys.path) or as
`benchmarks.common` (imported by the tests).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"


# -- a rank's start --------------------------------------------------------------------------
def freeze_start_up() -> None:
    """Imports what every rank runs on (TensorFlow and its Keras, Horovod, hvdx; the scripts
    import them lazily so that their host side stays light), then moves every object alive
    out of the garbage collector's passes (`gc.freeze`): a full collection during the run
    traverses only what the run made. Without it a smoke run's ranks spent ~15 % of their CPU
    in the collector, and a full pass landing in a timed step lengthens that step
    (docs/developing.md, "The collector")."""
    import horovod.tensorflow  # noqa: F401
    import tensorflow as tf

    import hvdx  # noqa: F401

    tf.keras.layers.Dense  # noqa: B018 - Keras loads on first use
    gc.freeze()


# -- data ---------------------------------------------------------------------------------
def digits_shards(rank: int, size: int):
    """scikit-learn's digits as float32 in [0, 1], 75/25 stratified split (seed 0), the training
    part sharded over `size` ranks in equal parts (every rank runs the same number of steps).

    Returns:
        (x_shard, y_shard, x_train, y_train, x_test, y_test): this rank's shard, the whole
        training set, the test set.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                                        stratify=digits.target)
    shard = slice(rank, len(x_train) - len(x_train) % size, size)
    return x_train[shard], y_train[shard], x_train, y_train, x_test, y_test


# -- Keras 2 beside Keras 3 (issue 64) -------------------------------------------------------
#: A Keras 3 run's key: its method's key and this suffix ("hitopk@keras3"); a Keras 2 run's
#: key is the method's, as before --keras existed.
KERAS3 = "@keras3"
#: Methods that run under Keras 2 alone: Horovod's Keras integration fails under Keras 3
#: ("'Variable' object has no attribute 'ref'", horovod#4290).
KERAS2_ONLY = ("horovod",)


def _keras_versions(text: str) -> List[int]:
    try:
        versions = sorted({int(v) for v in text.split(",")})
    except ValueError:
        versions = []
    if not versions or not set(versions) <= {2, 3}:
        raise argparse.ArgumentTypeError(f"--keras {text!r}: pass 2, 3 or 2,3")
    return versions


def add_keras_argument(parser: argparse.ArgumentParser) -> None:
    """--keras: the Keras the models and optimizers are built with (a list, default [2])."""
    parser.add_argument("--keras", default=[2], type=_keras_versions,
                        help="2, 3 or 2,3: build each model and optimizer with Keras 2 (tf.keras in these scripts) "
                             "and/or Keras 3 (`import keras`, compiled with jit_compile=False); with both, every "
                             "method runs under each, the two taking turns (Horovod's optimizer: Keras 2 only)")


def keras_keys(keys: Sequence[str], versions: Sequence[int] = (2,)) -> List[str]:
    """Each of `keys` under each Keras of `versions`, a key's runs side by side (Keras 2's as
    the key, Keras 3's with `KERAS3`); `KERAS2_ONLY` under Keras 2 alone."""
    return [key + (KERAS3 if version == 3 else "") for key in keys for version in sorted(versions)
            if version == 2 or key not in KERAS2_ONLY]


def split_keras(key: str) -> Tuple[str, int]:
    """("hitopk", 3) for "hitopk@keras3", ("hitopk", 2) for "hitopk"."""
    return (key[:-len(KERAS3)], 3) if key.endswith(KERAS3) else (key, 2)


def keras_label(key: str, labels: Mapping[str, str]) -> str:
    """A key's label in tables: its method's (`labels`, else the key), with " (Keras 3)"."""
    base, version = split_keras(key)
    return labels.get(base, base) + (" (Keras 3)" if version == 3 else "")


def keras_module(version: int):
    """The Keras module of `version`: Keras 2 (hvdx.legacy_keras.keras2(): tf.keras in these
    scripts, which set TF_USE_LEGACY_KERAS=1) or Keras 3 (`import keras`).

    Raises:
        RuntimeError: Keras 3 asked for where `import keras` is not Keras 3 (TensorFlow < 2.16).
    """
    if version == 2:
        from hvdx import legacy_keras

        return legacy_keras.keras2()
    import keras

    if not str(keras.__version__).startswith("3."):
        raise RuntimeError(f"--keras 3: `import keras` is Keras {keras.__version__} here; Keras 3 comes with "
                           "TensorFlow >= 2.16 (the default stack)")
    return keras


# -- launching -----------------------------------------------------------------------------
def under_launcher() -> bool:
    """Whether this process is a rank of a job (horovodrun, mpirun or the emulated cluster)."""
    return any(v in os.environ for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def cluster_description() -> Optional[dict]:
    """The emulated network this rank runs on ($HVDX_CLUSTER, set by hvdx/runner/cluster.py),
    or None (horovodrun over loopback)."""
    text = os.environ.get("HVDX_CLUSTER")
    return json.loads(text) if text else None


def launch_ranks(argv: Sequence[str], nodes: int, per_node: int, *, cluster: bool = False, rate: str = "1gbit",
                 no_delay: bool = False, env: Optional[Dict[str, str]] = None, engine: str = "gloo") -> int:
    """Runs `python ARGV...` as nodes x per_node ranks, with this checkout importable: on
    horovodrun over loopback (emulated nodes, hvdx.runner.hosts), or with `cluster` on the
    emulated cluster, `rate` links between nodes (root; `no_delay`: no netem). `engine`:
    "gloo" (Horovod's Gloo controller and collectives) or "mpi" (mpirun, Open MPI's: on the
    emulated cluster its `--mpi` mode, else nodes emulated with `hvdx.runner.mpi.EmulatedNodes`;
    root). Prints the command line first; output goes to this process's. Returns the job's
    exit status.

    Raises:
        ValueError: an engine other than "gloo" or "mpi".
    """
    if engine not in ("gloo", "mpi"):
        raise ValueError(f"engine must be 'gloo' or 'mpi', got {engine!r}")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from hvdx.runner import cluster_command, horovodrun_command, hosts, run
    from hvdx.runner.mpi import EmulatedNodes

    worker = [sys.executable, *argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    with contextlib.ExitStack() as stack:
        if cluster:
            command = cluster_command(worker, nodes=nodes, ranks_per_node=per_node, rate=rate, no_delay=no_delay,
                                      mpi=engine == "mpi")
        elif engine == "mpi":
            command = stack.enter_context(EmulatedNodes(nodes, per_node)).command(worker)
        else:
            command = horovodrun_command(worker, np=nodes * per_node, hosts=hosts(nodes, per_node))
        print("launching:", " ".join(command), flush=True)
        return run(command, env=env, capture=False).returncode


def add_topology_arguments(parser: argparse.ArgumentParser, topologies: str = "2x2,2x1") -> None:
    """--topologies, --rate, --local, and the hidden --worker-json of `run_topologies`."""
    parser.add_argument("--topologies", default=topologies, help="nodes x ranks per node, comma-separated")
    parser.add_argument("--rate", default="1gbit", help="inter-node link rate (tc syntax)")
    parser.add_argument("--local", action="store_true", help="horovodrun over loopback instead of the emulated cluster")
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)


def run_topologies(script: str, args: argparse.Namespace, argv: Sequence[str],
                   env: Optional[Dict[str, str]] = None, engine: str = "gloo") -> Iterator[dict]:
    """For each "MxN" of args.topologies: `script --worker-json PATH ARGV...` on M nodes x N
    ranks (the emulated cluster at args.rate without delay, or loopback with args.local;
    `engine` as `launch_ranks`), then the JSON its rank 0 wrote to PATH, with the machine's
    1-minute load average before and after the run as "load_average" (the cores may be
    shared: a reader should know how busy they were).

    Raises:
        SystemExit: a run failed (its exit status in the message).
    """
    for topology in args.topologies.split(","):
        nodes, per_node = (int(x) for x in topology.split("x"))
        with tempfile.TemporaryDirectory() as tmp, load_during() as load:
            path = Path(tmp) / "ranks.json"
            code = launch_ranks([script, "--worker-json", str(path), *argv], nodes, per_node, cluster=not args.local,
                                rate=args.rate, no_delay=True, env=env, engine=engine)
            if code:
                raise SystemExit(f"the {nodes}x{per_node} run ({engine}) failed (exit status {code})")
            result = json.loads(path.read_text())
        result["load_average"] = [load["start"][0], load["end"][0]]
        yield result


# -- timing ----------------------------------------------------------------------------------
def slowest(seconds: float, name: str) -> float:
    """The largest of every rank's `seconds` (a Horovod allreduce, Max, named `name`): the job
    is as fast as its slowest rank."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    return float(hvd.allreduce(tf.constant(seconds, tf.float64), op=hvd.Max, name=name))


def timed_rounds(calls: Mapping[str, Callable[[], object]], repeats: int, tag: str, *, warmup: int = 1,
                 rotate: bool = False) -> Iterator[Dict[str, float]]:
    """For each of `repeats` rounds after `warmup` ones (tracing, first-use costs), the
    slowest rank's seconds of every call, by key. The calls take turns within a round, so a
    slow spell of a shared machine hits all of them alike and their per-round ratios stay
    fair; with `rotate`, round i starts with the (i mod len)-th call. A barrier before each
    call makes the ranks start it together. Collective names: f"{tag}.{key}.{round}"."""
    import hvdx

    keys = list(calls)
    for r in range(warmup + repeats):
        order = keys[r % len(keys):] + keys[:r % len(keys)] if rotate else keys
        times = {}
        for key in order:
            hvdx.barrier()
            start = time.perf_counter()
            calls[key]()
            times[key] = slowest(time.perf_counter() - start, f"{tag}.{key}.{r}")
        if r >= warmup:
            yield {key: times[key] for key in keys}


def by_key(rounds: Iterable[Mapping[str, float]]) -> Dict[str, List[float]]:
    """Rounds of {key: seconds} as {key: [seconds of each round]}."""
    out: Dict[str, List[float]] = {}
    for times in rounds:
        for key, seconds in times.items():
            out.setdefault(key, []).append(seconds)
    return out


def medians(per_round: Mapping[str, Sequence[float]]) -> Dict[str, float]:
    """The median of each key's rounds."""
    return {key: statistics.median(times) for key, times in per_round.items()}


def against_baseline(times: Sequence[Optional[float]], base: Sequence[Optional[float]]) -> Dict[str, object]:
    """A method's times to a target per round against a baseline's in the same rounds (None:
    never reached): `ratios` (the rounds both reached), `median_ratio`, `mean_time` (None
    unless every round reached it) and `mean_ratio`, the ratio of the mean times (issue 44:
    gains over seeds as means; None unless both means exist)."""
    ratios = [t / b for t, b in zip(times, base) if b and t is not None]
    mean = statistics.mean(times) if times and None not in times else None
    base_mean = statistics.mean(base) if base and None not in base else None
    return {"ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None, "mean_time": mean,
            "mean_ratio": mean / base_mean if mean is not None and base_mean else None}


def time_cells(times: Sequence[Optional[float]], versus: Mapping[str, object], over_seeds: bool) -> Tuple[str, str]:
    """A table's (time to target, ratio to the baseline) cells from `against_baseline`: over
    seeds the mean time and the ratio of the means, else the median time and the median of
    the rounds' ratios; the ratio's range is each round's; rounds that never reached the
    target are counted."""
    reached = [t for t in times if t is not None]
    cell = "not reached"
    if reached:
        cell = f"{(statistics.mean if over_seeds else statistics.median)(reached):.2f}"
        if len(reached) < len(times):
            cell += f" ({len(times) - len(reached)} not reached)"
    value = versus["mean_ratio" if over_seeds else "median_ratio"]
    ratios = versus["ratios"]
    if value is not None:
        return cell, f"{value:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
    if ratios:  # over seeds, a round that never reached it: no mean, each reached round's ratio
        return cell, f"- (rounds that reached it: {min(ratios):.2f}-{max(ratios):.2f})"
    return cell, "-"


@contextlib.contextmanager
def load_during() -> Iterator[Dict[str, Tuple[float, float, float]]]:
    """The machine's load average (1, 5, 15 min) when the block starts and when it ends:
    {"start": ..., "end": ...} ("end" once the block is over)."""
    load = {"start": os.getloadavg()}
    try:
        yield load
    finally:
        load["end"] = os.getloadavg()


# -- reporting -------------------------------------------------------------------------------
def add_output_arguments(parser: argparse.ArgumentParser, readme: Optional[Path] = None) -> None:
    """--out (default benchmarks/results) and --readme (default `readme`; None: `readme_path`'s)."""
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=readme, help="README whose section the run rewrites" + (
        "" if readme else " (default: benchmarks/README.md when --out is the default)"))


def readme_path(args: argparse.Namespace) -> Optional[Path]:
    """args.readme, or benchmarks/README.md when the results go to benchmarks/results: a run
    that writes its results elsewhere (a smoke run) leaves the README alone."""
    return args.readme or (README if args.out == RESULTS else None)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], text_columns: int = 0) -> str:
    """A Markdown table: the first `text_columns` columns left-aligned, the others (numbers) right."""
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in [header, align, *rows])


def update_readme(section: str, body: str, readme: Path) -> None:
    """Replaces the text between the section's markers (<!-- section:begin/end -->) in
    `readme`, or appends the section when it has none."""
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = readme.read_text() if readme.exists() else "# hvdx benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)
