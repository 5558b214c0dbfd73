"""Figure 9 of shi2021 (sec. 5.4): training with and without DataCache (sec. 4.1).

A JPEG data set is generated on the fly (scikit-learn's digits upscaled to --size px, with
noise so that they compress like photographs) and read through `hvdx.data.SlowSource`,
which sleeps --latency-ms per open and 1/--mib-per-s s per MiB: the network file system of
a cloud cluster. Three input pipelines, the same decode (`hvdx.data.decode_image` to
--resolution px), augmentation (random crop after 4-px padding, random flip), batching and
prefetching, take turns in every round, each round starting cold (no local copy, no store):

- `no_cache`: tf.data reads and decodes every file every epoch (`num_parallel_calls=AUTOTUNE`);
- `no_cache_16`: the same with 16 parallel reads (a generous baseline for epoch 1);
- `tf_cache`: tf.data's in-memory `.cache()` after decoding, then a full shuffle;
- `datacache`: `hvdx.data.DataCache(...).dataset(...)` (augmentation per sample over each
  batch, compiled with XLA: `compile_augment=True`, the default);
- `datacache_uncompiled` (epoch 2+ only, on the same warm cache): the same with
  `compile_augment=False`, the augmentation's ops run one by one as in the other pipelines;
- `datacache_rerun` (epoch 1 only): DataCache again with its level-1 directory warm (a later
  run of a hyper-parameter sweep), the node store cold.

Input time is the time to iterate one epoch with nothing else to do. End-to-end, a small CNN
trains on each pipeline (epoch 1 cold, one method after the other; epochs 2+ taking turns)
and the time per step is reported. Memory per
node: DataCache keeps one store per node (its file's blocks on /dev/shm, measured); a
`.cache()` rank holds its own copy (RSS growth, measured), so a node whose n ranks reshuffle
its part every epoch holds n copies (--local-size n).

    python benchmarks/datacache.py                       # the figure (a few minutes)
    python benchmarks/datacache.py --quick --out /tmp/x  # smoke run

Writes <out>/datacache.json, <out>/datacache.png and the table of benchmarks/README.md.
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hvdx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvdx import zoo  # noqa: E402
from hvdx.data import DataCache, SlowSource, decode_image  # noqa: E402
from hvdx.data.catalog import ImageFolder  # noqa: E402
from hvdx.data.store import remove_store  # noqa: E402
try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import (add_output_arguments, freeze_start_up, launch_ranks, load_during,  # noqa: E402
                        markdown_table, readme_path, slowest, under_launcher, update_readme)
except ImportError:
    from benchmarks.common import (add_output_arguments, freeze_start_up, launch_ranks, load_during,  # noqa: E402
                                   markdown_table, readme_path, slowest, under_launcher, update_readme)

INPUT_METHODS = ("no_cache", "no_cache_16", "tf_cache", "datacache")
TRAIN_METHODS = ("no_cache", "tf_cache", "datacache")
LABELS = {"no_cache": "no cache (tf.data, AUTOTUNE)", "no_cache_16": "no cache (tf.data, 16 parallel reads)",
          "tf_cache": "tf.data `.cache()`", "datacache": "DataCache",
          "datacache_uncompiled": "DataCache, augmentation not compiled", "datacache_rerun": "DataCache, later run"}
GOAL_EPOCH2 = 10.0


def make_dataset(root: Path, n: int, size: int, seed: int = 0) -> None:
    """`n` RGB JPEGs of `size` px, one folder per digit."""
    from sklearn.datasets import load_digits

    data = load_digits()
    rng = np.random.default_rng(seed)
    for i in range(n):
        j = i % len(data.images)
        image = tf.image.resize(data.images[j][..., None] * 12, (size, size)).numpy()
        tint = rng.uniform(0.5, 1.5, 3)
        image = image * tint + rng.normal(60, 25, (size, size, 3))
        image = np.clip(image, 0, 255).astype(np.uint8)
        folder = root / f"digit{data.target[j]}"
        folder.mkdir(parents=True, exist_ok=True)
        tf.io.write_file(str(folder / f"{i:06d}.jpg"), tf.io.encode_jpeg(image, quality=90))


def augment(resolution: int) -> Callable[[tf.Tensor], tf.Tensor]:
    def fn(image: tf.Tensor) -> tf.Tensor:
        padded = tf.image.pad_to_bounding_box(image, 4, 4, resolution + 8, resolution + 8)
        return tf.image.random_flip_left_right(tf.image.random_crop(padded, [resolution, resolution, 3]))
    return fn


def source_loader(source: SlowSource, resolution: int) -> Callable[[tf.Tensor, tf.Tensor], tuple]:
    """(path, label) -> (image decoded to `resolution`, label), the file read through `source`
    in a `py_function` (how a plain tf.data pipeline reads a Python-level source)."""
    def load(path: tf.Tensor, label: tf.Tensor):
        data = tf.py_function(lambda p: source.read(p.numpy().decode()), [path], tf.string)
        data.set_shape([])
        return decode_image(data, resolution), label
    return load


def keras_augmented(ds: tf.data.Dataset) -> tf.data.Dataset:
    """`ds`'s batches through `keras_augment` (the same code after every pipeline)."""
    return ds.map(keras_augment(), num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def tf_pipeline(paths: List[str], labels: np.ndarray, source: SlowSource, args: argparse.Namespace,
                cache: bool, parallel: int) -> tf.data.Dataset:
    """The plain tf.data pipeline: read (through the slow source), decode, [cache], augment."""
    res = args.resolution
    load = source_loader(source, res)
    ds = tf.data.Dataset.from_tensor_slices((paths, labels))
    if not cache:
        ds = ds.shuffle(len(paths), seed=args.seed, reshuffle_each_iteration=True)
    ds = ds.map(load, num_parallel_calls=parallel)
    if cache:
        ds = ds.cache().shuffle(len(paths), seed=args.seed, reshuffle_each_iteration=True)
    ds = ds.map(lambda x, y: (augment(res)(x), y), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(args.batch).prefetch(tf.data.AUTOTUNE)


class Run:
    """One cold start of one method: its dataset and what must be cleaned up after it."""

    def __init__(self, method: str, root: Path, work: Path, args: argparse.Namespace, disk_dir: Optional[Path] = None):
        self.method = method
        self.source = SlowSource(latency_s=args.latency_ms / 1e3, mib_per_s=args.mib_per_s)
        self.cache: Optional[DataCache] = None
        self.dirs: List[Path] = []
        if method.startswith("datacache"):
            disk = disk_dir or Path(tempfile.mkdtemp(prefix="disk-", dir=work))
            store = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-", dir="/dev/shm"))
            self.dirs += [store] + ([] if disk_dir else [disk])
            self.disk_dir = disk
            self.cache = DataCache(str(root), resolution=args.resolution, source=self.source, cache_dir=str(disk),
                                   store_dir=str(store), seed=args.seed, memory_bytes=2**33)
            self.dataset = self.cache.dataset(args.batch, augment=augment(args.resolution))
        else:
            folder = ImageFolder(str(root), self.source)  # DataCache's listing: the same files and labels
            parallel = 16 if method == "no_cache_16" else tf.data.AUTOTUNE
            self.dataset = tf_pipeline(folder.paths, folder.labels, self.source, args, method == "tf_cache", parallel)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def time_epoch(dataset: tf.data.Dataset, step: Optional[Callable] = None) -> tuple:
    """(wall seconds, batches, CPU seconds of this process) of one pass; `step(x, y)` per
    batch when training. CPU time is the cost of the pass whatever else runs on the machine."""
    start, cpu, batches = time.perf_counter(), time.process_time(), 0
    for x, y in dataset:
        if step is not None:
            step(x, y)
        batches += 1
    return time.perf_counter() - start, batches, time.process_time() - cpu


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def small_cnn(resolution: int) -> tf.keras.Model:
    """uint8 pixels rescaled, three stride-2 ReLU convolutions (16, 32, 64), average-pooled, 10 logits."""
    return zoo.cnn((resolution, resolution, 3), (16, 32, 64), strides=2, rescale=1 / 255.0, seed=0)


def bench_input(root: Path, work: Path, args: argparse.Namespace) -> dict:
    """Input time per epoch of every method, methods taking turns, each round cold."""
    extra = ("datacache_uncompiled", "datacache_rerun")
    times: Dict[str, List[List[Optional[float]]]] = {m: [] for m in INPUT_METHODS + extra}
    cpu: Dict[str, List[List[Optional[float]]]] = {m: [] for m in INPUT_METHODS + extra}
    memory: Dict[str, int] = {}
    for r in range(args.rounds):
        order = INPUT_METHODS if r % 2 == 0 else INPUT_METHODS[::-1]
        for method in order:
            before = rss()
            run = Run(method, root, work, args)
            epochs = [time_epoch(run.dataset) for _ in range(args.epochs)]
            times[method].append([e[0] for e in epochs])
            cpu[method].append([e[2] for e in epochs])
            if method == "tf_cache" and "tf_cache_rank" not in memory:
                memory["tf_cache_rank"] = rss() - before
            if method == "datacache":
                memory.setdefault("datacache_node", run.cache.store.memory_used())
                plain = run.cache.dataset(args.batch, augment=augment(args.resolution), compile_augment=False)
                later = [time_epoch(plain) for _ in range(args.epochs - 1)]  # the store is warm: epochs 2+
                times["datacache_uncompiled"].append([None] + [e[0] for e in later])
                cpu["datacache_uncompiled"].append([None] + [e[2] for e in later])
                disk_dir = run.disk_dir
                run.dirs.remove(disk_dir)
                run.close()
                rerun = Run("datacache_rerun", root, work, args, disk_dir=disk_dir)  # level 1 warm, store cold
                seconds, _, cpu_seconds = time_epoch(rerun.dataset)
                times["datacache_rerun"].append([seconds])
                cpu["datacache_rerun"].append([cpu_seconds])
                rerun.close()
                shutil.rmtree(disk_dir, ignore_errors=True)
            else:
                run.close()
            del run
            print(json.dumps({"round": r, "method": method, "epochs_s": [round(t, 3) for t in times[method][-1]]}),
                  flush=True)
    return {"rounds_seconds": times, "rounds_cpu_seconds": cpu, "memory_bytes": memory}


def train_step(resolution: int) -> Callable:
    """A small CNN's training step (a fresh model), traced before it is timed."""
    model = small_cnn(resolution)
    optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=[tf.TensorSpec([None, resolution, resolution, 3], tf.uint8),
                                  tf.TensorSpec([None], tf.int64)])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    step(tf.zeros([2, resolution, resolution, 3], tf.uint8), tf.zeros([2], tf.int64))
    return step


def bench_training(root: Path, work: Path, args: argparse.Namespace) -> dict:
    """Seconds per training step of a small CNN fed by each pipeline: epoch 1 (cold) one
    method after the other, then epochs 2+ with the methods taking turns (order reversed
    every epoch), so that the machine's other load falls on all of them alike."""
    runs, steps = {}, {}
    out: Dict[str, List[float]] = {m: [] for m in TRAIN_METHODS}
    try:
        for method in TRAIN_METHODS:
            runs[method], steps[method] = Run(method, root, work, args), train_step(args.resolution)
            seconds, batches, _ = time_epoch(runs[method].dataset, steps[method])
            out[method].append(seconds / batches)
        for e in range(1, args.epochs):
            for method in (TRAIN_METHODS if e % 2 else TRAIN_METHODS[::-1]):
                seconds, batches, _ = time_epoch(runs[method].dataset, steps[method])
                out[method].append(seconds / batches)
    finally:
        for run in runs.values():
            run.close()
    for method, per_step in out.items():
        print(json.dumps({"train": method, "step_s": [round(t, 4) for t in per_step]}), flush=True)
    return out


# -- reporting -------------------------------------------------------------------------------------

def summarize(inputs: dict, training: dict, args: argparse.Namespace) -> dict:
    t = inputs["rounds_seconds"]
    n = args.images
    rows = {}
    for method, rounds in t.items():
        if rounds[0][0] is None:  # epochs 2+ only
            later = statistics.median(statistics.median(r[1:]) for r in rounds)
            c = inputs["rounds_cpu_seconds"][method]
            rows[method] = {"epoch1_s": None, "epoch2plus_s": later, "epoch1_samples_per_s": None,
                            "epoch2plus_samples_per_s": n / later, "epoch1_cpu_s": None,
                            "epoch2plus_cpu_s": statistics.median(statistics.median(r[1:]) for r in c)}
            continue
        first = statistics.median(r[0] for r in rounds)
        later = statistics.median(statistics.median(r[1:]) for r in rounds) if len(rounds[0]) > 1 else None
        c = inputs["rounds_cpu_seconds"][method]
        rows[method] = {"epoch1_s": first, "epoch2plus_s": later, "epoch1_samples_per_s": n / first,
                        "epoch2plus_samples_per_s": n / later if later else None,
                        "epoch1_cpu_s": statistics.median(r[0] for r in c),
                        "epoch2plus_cpu_s": statistics.median(statistics.median(r[1:]) for r in c) if later else None}

    def paired(num: str, den: str, epoch: slice) -> List[float]:
        return [statistics.median(a[epoch]) / statistics.median(b[epoch]) for a, b in zip(t[num], t[den])]

    later = slice(1, None)
    decoded = n * args.resolution ** 2 * 3
    mem = inputs["memory_bytes"]
    c = inputs["rounds_cpu_seconds"]
    goals = {
        "epoch2_no_cache_over_datacache": paired("no_cache", "datacache", later),
        "epoch2_datacache_throughput_over_tf_cache": paired("tf_cache", "datacache", later),
        "epoch2_datacache_cpu_throughput_over_tf_cache": [  # samples per CPU second: what load does not change
            statistics.median(a[later]) / statistics.median(b[later]) for a, b in zip(c["tf_cache"], c["datacache"])],
        "epoch1_no_cache_over_datacache": paired("no_cache", "datacache", slice(0, 1)),
    }
    if t.get("datacache_uncompiled"):
        goals["epoch2_datacache_uncompiled_throughput_over_tf_cache"] = paired("tf_cache", "datacache_uncompiled",
                                                                               later)
        goals["epoch2_datacache_uncompiled_cpu_throughput_over_tf_cache"] = [
            statistics.median(a[later]) / statistics.median(b[later])
            for a, b in zip(c["tf_cache"], c["datacache_uncompiled"])]
    return {"methods": rows, "paired_ratios": goals, "decoded_bytes": decoded,
            "memory_per_node_bytes": {"datacache": mem.get("datacache_node"),
                                      "tf_cache": mem.get("tf_cache_rank", 0) * args.local_size},
            "tf_cache_rank_bytes": mem.get("tf_cache_rank"), "training_step_s": {
                m: {"epoch1": s[0], "epoch2plus": statistics.median(s[1:]) if len(s) > 1 else None}
                for m, s in training.items()}}


def verdict(ratios: List[float], goal: float) -> str:
    value = statistics.median(ratios)
    spread = f"rounds {min(ratios):.2f}-{max(ratios):.2f}x"
    if value >= goal:
        return f"**{value:.2f}x** (goal >= {goal:g}x: met; {spread})"
    return f"**{value:.2f}x** (goal >= {goal:g}x: missed by {100 * (1 - value / goal):.0f}%; {spread})"


def goals_text(summary: dict, args: argparse.Namespace) -> str:
    g = summary["paired_ratios"]
    mem = summary["memory_per_node_bytes"]
    steps = summary["training_step_s"]
    mib = 2**20
    lines = [
        f"- Epoch 2+ input time, no cache over DataCache: {verdict(g['epoch2_no_cache_over_datacache'], GOAL_EPOCH2)}.",
        f"- Epoch 2+ throughput, DataCache over tf.data `.cache()`: "
        f"{verdict(g['epoch2_datacache_throughput_over_tf_cache'], 1.0)}; per CPU second (what the machine's "
        f"other load does not change): {verdict(g['epoch2_datacache_cpu_throughput_over_tf_cache'], 1.0)}.",
        *([f"- The same with DataCache's augmentation not compiled (`compile_augment=False`: per-sample ops "
           f"run one by one, as in `.cache()`'s pipeline): "
           f"{verdict(g['epoch2_datacache_uncompiled_throughput_over_tf_cache'], 1.0)}; per CPU second: "
           f"{verdict(g['epoch2_datacache_uncompiled_cpu_throughput_over_tf_cache'], 1.0)}."]
          if "epoch2_datacache_uncompiled_throughput_over_tf_cache" in g else []),
        f"- Epoch 1 input time, no cache over DataCache (DataCache no slower): "
        f"{verdict(g['epoch1_no_cache_over_datacache'], 1.0)}.",
        f"- Memory per node ({args.local_size} ranks per node, the node's part = {args.images} samples, "
        f"{summary['decoded_bytes'] / mib:.1f} MiB decoded): DataCache's one store "
        f"{mem['datacache'] / mib:.1f} MiB; `.cache()` {summary['tf_cache_rank_bytes'] / mib:.1f} MiB per rank "
        f"(RSS growth) x {args.local_size} ranks = {mem['tf_cache'] / mib:.1f} MiB.",
        f"- End to end, epoch 2+ steps of a small CNN: DataCache {steps['datacache']['epoch2plus'] * 1e3:.1f} ms, "
        f"`.cache()` {steps['tf_cache']['epoch2plus'] * 1e3:.1f} ms, no cache {steps['no_cache']['epoch2plus'] * 1e3:.1f} "
        f"ms; epoch 1: {steps['datacache']['epoch1'] * 1e3:.1f}, {steps['tf_cache']['epoch1'] * 1e3:.1f} and "
        f"{steps['no_cache']['epoch1'] * 1e3:.1f} ms.",
    ]
    return "\n".join(lines)


def input_table(summary: dict) -> str:
    rows = []
    base = summary["methods"]["no_cache"]
    for method, r in summary["methods"].items():
        later, first = r["epoch2plus_s"], r["epoch1_s"]
        rows.append([LABELS[method], "" if first is None else f"{first:.2f}",
                     "" if first is None else f"{r['epoch1_samples_per_s']:.0f}",
                     "" if first is None else f"{base['epoch1_s'] / first:.2f}x",
                     "" if first is None else f"{r['epoch1_cpu_s']:.2f}",
                     "" if later is None else f"{later:.3f}",
                     "" if later is None else f"{r['epoch2plus_samples_per_s']:.0f}",
                     "" if later is None else f"{base['epoch2plus_s'] / later:.1f}x",
                     "" if later is None else f"{r['epoch2plus_cpu_s']:.3f}"])
    return markdown_table(["input pipeline", "epoch 1 (s)", "epoch 1 (samples/s)", "epoch 1 speed-up", "epoch 1 CPU (s)",
                           "epoch 2+ (s)", "epoch 2+ (samples/s)", "epoch 2+ speed-up", "epoch 2+ CPU (s)"], rows,
                          text_columns=1)


def training_table(summary: dict) -> str:
    steps = summary["training_step_s"]
    base = steps["no_cache"]
    rows = [[LABELS[m], f"{s['epoch1'] * 1e3:.1f}", f"{base['epoch1'] / s['epoch1']:.2f}x",
             "" if s["epoch2plus"] is None else f"{s['epoch2plus'] * 1e3:.1f}",
             "" if s["epoch2plus"] is None else f"{base['epoch2plus'] / s['epoch2plus']:.2f}x"]
            for m, s in steps.items()]
    return markdown_table(["small CNN fed by", "step, epoch 1 (ms)", "speed-up", "step, epoch 2+ (ms)", "speed-up"],
                          rows, text_columns=1)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    methods = [m for m in summary["methods"] if m != "datacache_rerun"]
    x = np.arange(len(methods))
    rows = summary["methods"]
    left.bar(x - 0.2, [rows[m]["epoch1_s"] or 0 for m in methods], 0.4, label="epoch 1 (cold)")
    left.bar(x + 0.2, [rows[m]["epoch2plus_s"] for m in methods], 0.4, label="epoch 2+")
    left.set_yscale("log")
    left.set_xticks(x, [LABELS[m].replace(" (", "\n(") for m in methods], fontsize=8)
    left.set(ylabel="input time per epoch (s, log)", title="Input time (Figure 9: I/O)")
    left.legend()
    steps = summary["training_step_s"]
    names = list(steps)
    x = np.arange(len(names))
    right.bar(x - 0.2, [steps[m]["epoch1"] * 1e3 for m in names], 0.4, label="epoch 1 (cold)")
    right.bar(x + 0.2, [(steps[m]["epoch2plus"] or 0) * 1e3 for m in names], 0.4, label="epoch 2+")
    right.set_xticks(x, [LABELS[m].replace(" (", "\n(") for m in names], fontsize=8)
    right.set(ylabel="time per training step (ms)", title="End to end, small CNN (Figure 9: iteration time)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- like for like (issue 27): the same files on a local disk, the same augmentation code ----------

LIKE_GOALS = {"epoch2_none": 1.0, "epoch2_keras": 1.0, "epoch1": 0.8}


def keras_augment() -> Callable:
    """Uncompiled Keras augmentation, applied per batch after either pipeline (the same code)."""
    layers = tf.keras.Sequential([tf.keras.layers.RandomFlip("horizontal", seed=1),
                                  tf.keras.layers.RandomTranslation(0.1, 0.1, seed=2)])

    def fn(x: tf.Tensor, y: tf.Tensor):
        return layers(x, training=True), y
    return fn


def like_pipelines(method: str, root: Path, store_dir: Path, args: argparse.Namespace, rank: int, size: int):
    """(dataset, dataset with Keras augmentation, cache or None) of one cold start of `method`
    on this rank: tf.data over its shard of the files (`plain`: decode every epoch;
    `tf_cache`: `.cache()` after decoding, then a full shuffle), or DataCache (the default
    source: files on a local disk get no level-1 copy)."""
    cache = None
    if method == "datacache":
        cache = DataCache(str(root), resolution=args.resolution, cache_dir=str(store_dir / "disk"),
                          store_dir=str(store_dir), seed=args.seed, memory_bytes=2**33)
        base = cache.dataset(args.batch)
    else:
        folder = ImageFolder(str(root), hvdx.data.GFileSource())
        paths, labels = folder.paths[rank::size], folder.labels[rank::size]  # ds.shard(size, rank)
        res = args.resolution
        ds = tf.data.Dataset.from_tensor_slices((paths, labels))
        if method == "plain":
            ds = ds.shuffle(len(paths), seed=args.seed, reshuffle_each_iteration=True)
        ds = ds.map(lambda p, y: (decode_image(tf.io.read_file(p), res), y), num_parallel_calls=tf.data.AUTOTUNE)
        if method == "tf_cache":
            ds = ds.cache().shuffle(len(paths), seed=args.seed, reshuffle_each_iteration=True)
        base = ds.batch(args.batch).prefetch(tf.data.AUTOTUNE)
    return base, keras_augmented(base), cache


def bench_like(root: Path, store_dir: Path, args: argparse.Namespace) -> dict:
    """Seconds per epoch of the slowest rank: epoch 1 of plain tf.data, `.cache()` and DataCache
    (cold, taking turns), then epochs 2+ of `.cache()` and DataCache taking turns, without and
    with augmentation (an untimed augmented epoch first: tracing)."""
    rank, size = 0, 1
    if under_launcher():
        topo = hvdx.init()
        rank, size = topo.rank, topo.size

    def timed(ds: tf.data.Dataset, name: str) -> float:
        if size > 1:
            hvdx.barrier()
        start = time.perf_counter()
        for _ in ds:
            pass
        seconds = time.perf_counter() - start
        return slowest(seconds, name) if size > 1 else seconds

    out: Dict[str, List] = {"plain_epoch1": [], "tf_cache_epoch1": [], "datacache_epoch1": [],
                            "tf_cache_none": [], "datacache_none": [], "tf_cache_keras": [], "datacache_keras": []}
    for r in range(args.rounds):
        order = ("plain", "tf_cache", "datacache") if r % 2 == 0 else ("datacache", "tf_cache", "plain")
        runs = {}
        for method in order:
            runs[method] = like_pipelines(method, root, store_dir / f"round{r}", args, rank, size)
            out[f"{method}_epoch1"].append(timed(runs[method][0], f"like.{r}.{method}.1"))
        for method in ("tf_cache", "datacache"):
            timed(runs[method][1], f"like.{r}.{method}.warm")
        later = {f"{m}_{a}": [] for m in ("tf_cache", "datacache") for a in ("none", "keras")}
        for e in range(args.epochs - 1):
            for method in (("tf_cache", "datacache") if e % 2 == 0 else ("datacache", "tf_cache")):
                later[f"{method}_none"].append(timed(runs[method][0], f"like.{r}.{method}.{e}.none"))
                later[f"{method}_keras"].append(timed(runs[method][1], f"like.{r}.{method}.{e}.keras"))
        for key, seconds in later.items():
            out[key].append(seconds)
        cache = runs["datacache"][2]
        cache.close()
        if size > 1:
            hvdx.barrier()
        if cache.placement.local_rank == 0:
            shutil.rmtree(store_dir / f"round{r}", ignore_errors=True) if cache.placement.num_nodes == 1 else \
                remove_store(cache.store.path)
        if rank == 0:
            print(json.dumps({"round": r, **{k: v[-1] for k, v in out.items()}}, default=str), flush=True)
    return {"rounds_seconds": out, "ranks": size}


def like_summary(result: dict) -> dict:
    """Per-round ratios (speed of DataCache over the baseline: baseline time / DataCache time)."""
    t = result["rounds_seconds"]
    med = statistics.median
    return {"epoch2_none": [med(a) / med(b) for a, b in zip(t["tf_cache_none"], t["datacache_none"])],
            "epoch2_keras": [med(a) / med(b) for a, b in zip(t["tf_cache_keras"], t["datacache_keras"])],
            "epoch1": [a / b for a, b in zip(t["plain_epoch1"], t["datacache_epoch1"])]}


def like_table(results: Dict[str, dict]) -> str:
    rows = []
    for topology, result in results.items():
        ratios = like_summary(result)
        load = result.get("load_average")
        rows.append([topology, *(verdict(ratios[k], g) for k, g in LIKE_GOALS.items()),
                     "/".join(f"{v:g}" for v in load) if load else ""])
    return markdown_table(["ranks", "epoch 2+, no augmentation: DataCache over `.cache()`",
                           "epoch 2+, uncompiled Keras augmentation: DataCache over `.cache()`",
                           "epoch 1: DataCache over plain tf.data", "load average (1 min, start/end)"], rows, 1)


def render_like(result: dict, out: Path, readme: Optional[Path]) -> None:
    (out / "datacache_like.json").write_text(json.dumps(result, indent=2))
    table = like_table(result["topologies"])
    print(table)
    if readme is not None:
        c = result["config"]
        body = ("**Like for like** (issue 27), measured by `python benchmarks/datacache.py --like-for-like` on "
                f"{result['machine']['cpus']} CPU cores: {c['images']} JPEGs of {c['size']} px on a local disk, "
                f"decoded to {c['resolution']} px, batches of {c['batch']}, per rank: plain tf.data and `.cache()` "
                "over the rank's shard of the files (`ds.shard`), DataCache over its share (one store per node); "
                "augmentation, where there is some, is the same uncompiled Keras code (`RandomFlip`, "
                "`RandomTranslation`) mapped over the batches of either pipeline. Speed ratios of the slowest "
                f"rank (baseline time / DataCache time), medians of {c['rounds']} cold rounds (epochs 2-"
                f"{c['epochs']}, methods taking turns); raw times: `results/datacache_like.json`.\n\n" + table)
        update_readme("datacache-like", body, readme)


def run_like(args: argparse.Namespace, readme: Optional[Path]) -> None:
    """The like-for-like rows, on 1 rank and on the --like-topologies (horovodrun over loopback)."""
    if args.worker_json:  # a rank of a launched job
        freeze_start_up()
        result = bench_like(Path(args.data_root), Path(args.store_root), args)
        if hvd_rank() == 0:
            Path(args.worker_json).write_text(json.dumps(result))
        hvdx.barrier()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-like-"))
    store = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-like-", dir="/dev/shm"))
    results = {}
    try:
        root = work / "local"
        make_dataset(root, args.images, args.size)
        topologies = ["1"] + [t for t in args.like_topologies.split(",") if t]
        for topology in topologies:
            with load_during() as load:
                if topology == "1":
                    result = bench_like(root, store, args)
                else:
                    nodes, per_node = (int(x) for x in topology.split("x"))
                    path = work / f"{topology}.json"
                    argv = [str(Path(__file__).resolve()), "--like-for-like", "--worker-json", str(path),
                            "--data-root", str(root), "--store-root", str(store), *like_argv(args)]
                    if launch_ranks(argv, nodes, per_node):
                        raise SystemExit(f"the {topology} like-for-like run failed")
                    result = json.loads(path.read_text())
            result["load_average"] = [round(load["start"][0], 2), round(load["end"][0], 2)]
            results[topology] = result
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    config = {k: getattr(args, k) for k in ("images", "size", "resolution", "batch", "epochs", "rounds", "seed",
                                            "quick")}
    machine = {"cpus": os.cpu_count(), "tensorflow": tf.__version__, "hvdx": hvdx.__version__}
    render_like({"config": config, "machine": machine, "topologies": results}, args.out, readme)


def like_argv(args: argparse.Namespace) -> List[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("images", "size", "resolution", "batch", "epochs",
                                                                    "rounds", "seed")]


def hvd_rank() -> int:
    import horovod.tensorflow as hvd

    return hvd.rank()


def main(argv: Optional[List[str]] = None) -> None:
    """The command line (`argv`: its arguments, default sys.argv[1:]; the tests call it in their
    process for the runs that need no launch of their own)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--size", type=int, default=192, help="source images' side (px)")
    parser.add_argument("--resolution", type=int, default=96, help="training resolution (px), as in Figure 9")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=5.0, help="emulated NFS latency per open")
    parser.add_argument("--mib-per-s", type=float, default=100.0, help="emulated NFS bandwidth")
    parser.add_argument("--local-size", type=int, default=2, help="ranks per node, for memory per node")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    add_output_arguments(parser)
    parser.add_argument("--render", action="store_true",
                        help="redo the JSON's summary, the plot and the table from <out>/datacache.json")
    parser.add_argument("--like-for-like", action="store_true",
                        help="instead: files on a local disk, no augmentation and uncompiled Keras augmentation, "
                             "DataCache against `.cache()` (epochs 2+) and plain tf.data (epoch 1), on 1 rank and "
                             "--like-topologies")
    parser.add_argument("--like-topologies", default="2x2", help="nodes x ranks per node (horovodrun over loopback)")
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    parser.add_argument("--data-root", help=argparse.SUPPRESS)
    parser.add_argument("--store-root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    readme = readme_path(args)
    if args.render:
        render(json.loads((args.out / "datacache.json").read_text()), args.out, readme)
        if (args.out / "datacache_like.json").exists():
            render_like(json.loads((args.out / "datacache_like.json").read_text()), args.out, readme)
        return
    if args.quick:
        args.images, args.size, args.resolution, args.batch = 64, 48, 24, 16
        args.epochs, args.rounds, args.latency_ms = 2, 1, 1.0
    if args.like_for_like:
        if args.epochs < 2:
            raise SystemExit("--like-for-like needs --epochs >= 2 (epoch 1 cold, then epochs 2+)")
        run_like(args, readme)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-"))
    with load_during() as load:
        try:
            root = work / "nfs"
            make_dataset(root, args.images, args.size)
            file_bytes = sum(p.stat().st_size for p in root.rglob("*.jpg"))
            inputs = bench_input(root, work, args)
            training = bench_training(root, work, args)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    machine = {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
               "tensorflow": tf.__version__, "hvdx": hvdx.__version__,
               "load_average": {k: [round(v, 2) for v in vs] for k, vs in load.items()}}
    config = {k: getattr(args, k) for k in ("images", "size", "resolution", "batch", "epochs", "rounds", "latency_ms",
                                            "mib_per_s", "local_size", "seed", "quick")}
    result = {"figure": "shi2021 Figure 9", "config": config, "machine": machine,
              "mean_file_bytes": file_bytes / args.images, "rounds_seconds": inputs["rounds_seconds"],
              "rounds_cpu_seconds": inputs["rounds_cpu_seconds"], "memory_bytes": inputs["memory_bytes"],
              "training_step_seconds": training}
    render(result, args.out, readme)


def render(result: dict, out: Path, readme: Optional[Path]) -> None:
    """Summary, JSON, plot and README table of a run's raw measurements (`--render` redoes
    them from results/datacache.json without measuring again)."""
    args = argparse.Namespace(**result["config"])
    inputs = {k: result[k] for k in ("rounds_seconds", "rounds_cpu_seconds", "memory_bytes")}
    summary = summarize(inputs, result["training_step_seconds"], args)
    result = {**result, **summary}
    (out / "datacache.json").write_text(json.dumps(result, indent=2))
    plot(summary, out / "datacache.png")
    text = goals_text(summary, args)
    print(text)
    print(input_table(summary))
    print(training_table(summary))
    if readme is not None:
        machine = result["machine"]
        load = machine.get("load_average")
        loaded = (f", shared: load average (1, 5, 15 min) {'/'.join(f'{v:g}' for v in load['start'])} at the start, "
                  f"{'/'.join(f'{v:g}' for v in load['end'])} at the end" if load else "")
        body = (f"Measured by `python benchmarks/datacache.py{' --quick' if args.quick else ''}` on "
                f"{machine['cpus']} CPU cores{loaded} (TensorFlow {machine['tensorflow']}): {args.images} JPEGs of "
                f"{args.size} "
                f"px (mean {result['mean_file_bytes'] / 1024:.1f} KiB) read through `SlowSource` "
                f"({args.latency_ms:g} ms per open, {args.mib_per_s:g} MiB/s), decoded to {args.resolution} px, "
                f"batches of {args.batch}; {args.rounds} rounds, each cold, methods taking turns; times are "
                f"medians over rounds (epoch 2+: of epochs 2-{args.epochs}), goals are medians of per-round "
                "ratios. Plot: `results/datacache.png`, raw times: `results/datacache.json`.\n\n"
                + text + "\n\n" + input_table(summary) + "\n\n" + training_table(summary))
        update_readme("datacache", body, readme)


if __name__ == "__main__":
    main()
