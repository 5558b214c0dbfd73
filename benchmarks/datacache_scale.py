"""DataCache at the scale it is for (shi2021 sec. 4.1, Fig. 9; issue 45): tens of thousands
of samples per node, from a slow source, against tf.data's `.cache()` per rank.

A data set of --images distinct JPEGs (scikit-learn's digits at --size px with noise, made
once and kept under --data-dir, default ~/.cache/hvdx/bench-datacache) is read through
`hvdx.data.SlowSource` (--latency-ms per open, --mib-per-s: a network file system). Per
rank, with the same decode to --resolution px and batches of --batch:

- `plain`: tf.data reads and decodes its shard every epoch (16 parallel reads, as many as
  DataCache's `io_threads`);
- `tf_cache`: the same, `.cache()` after decoding, then a full shuffle (a copy per rank);
- `datacache`: `hvdx.data.DataCache(...).dataset(...)` over the rank's share (one store
  per node).

Each round is cold (new stores, new caches); the methods take turns. Epoch 1 of each, then
epochs 2+ of `.cache()` and DataCache taking turns: without augmentation, with the same
uncompiled Keras augmentation mapped over the batches of either (`keras`), and with a
per-sample pad-crop-flip (`crop`: `.map` per sample before `.batch` for tf.data,
DataCache's `augment=`, compiled with XLA). Then a restarted job (`restart`): after the last
round the node stores are kept and the job is launched again on the same nodes (--relaunches
times, a new process per rank, as after a crash or a preemption): it builds DataCache over
its node's store and times its epoch 1, then --repeats epochs 2+; the ratio is the median
over relaunches of (its epochs 2+ / its epoch 1) (an epoch of 2x2 is ~0.3 s: one sample of
it is mostly scheduling noise). The relaunches take turns over --restart-variants (the
processes' environment: RESTART_VARIANTS; the first is the table's). An epoch's time
is split into its fixed cost (the first batch: the iterator's start and the epoch's
planning) and the time per sample after it.
Memory per node: DataCache's store (allocated blocks on /dev/shm), `.cache()`'s RSS growth
summed over the node's ranks. Times are the slowest rank's. Last, what a new process pays to
map a slab (`mapping`: on /dev/shm and on a tmpfs with huge pages). `--only-restarts` and
`--only-mapping` redo just those parts into an earlier run's JSON.

    python benchmarks/datacache_scale.py                       # the table (about 15 minutes)
    python benchmarks/datacache_scale.py --quick --out /tmp/x  # smoke run
    python benchmarks/datacache_scale.py --only-restarts --restart-variants default,model,huge-pages

Writes <out>/datacache_scale.json and the table of benchmarks/README.md.
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hvdx  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvdx.data import DataCache, GFileSource, SlowSource  # noqa: E402
from hvdx.data.catalog import ImageFolder  # noqa: E402
from hvdx.data.store import Slab, remove_store  # noqa: E402
try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import (ROOT, add_output_arguments, freeze_start_up, launch_ranks, load_during,  # noqa: E402
                        markdown_table, readme_path, slowest, under_launcher, update_readme)
    from datacache import augment, keras_augmented, make_dataset, rss, source_loader, verdict  # noqa: E402
except ImportError:
    from benchmarks.common import (ROOT, add_output_arguments, freeze_start_up, launch_ranks,  # noqa: E402
                                   load_during, markdown_table, readme_path, slowest, under_launcher,
                                   update_readme)
    from benchmarks.datacache import augment, keras_augmented, make_dataset, rss, source_loader, verdict  # noqa: E402

#: Issue 45's goals: speed ratios (baseline time / DataCache time) and the restart's.
GOALS = {"epoch2_none": 1.0, "epoch2_keras": 1.2, "epoch2_crop": 1.2, "epoch1": 0.9, "restart": 0.9}
AUGMENTS = ("none", "keras", "crop")
PARALLEL_READS = 16


def data_set(args: argparse.Namespace) -> Path:
    """The JPEG folder tree of the run's size, made once under --data-dir."""
    root = Path(args.data_dir).expanduser() / f"jpeg-{args.images}-{args.size}"
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        make_dataset(root, args.images, args.size)
        (root / ".complete").write_text("made by benchmarks/datacache_scale.py\n")
    return root


def source_of(args: argparse.Namespace):
    return SlowSource(latency_s=args.latency_ms / 1e3, mib_per_s=args.mib_per_s) if args.latency_ms > 0 \
        else GFileSource()


def tf_datasets(method: str, root: Path, args: argparse.Namespace, rank: int, size: int) -> Dict[str, tf.data.Dataset]:
    """tf.data over the rank's shard (`plain` or `tf_cache`), by augmentation."""
    source = source_of(args)
    folder = ImageFolder(str(root), source)
    paths, labels = folder.paths[rank::size], folder.labels[rank::size]  # ds.shard(size, rank)
    res = args.resolution
    ds = tf.data.Dataset.from_tensor_slices((paths, labels))
    if method == "plain":
        ds = ds.shuffle(len(paths), seed=args.seed, reshuffle_each_iteration=True)
    ds = ds.map(source_loader(source, res), num_parallel_calls=PARALLEL_READS)
    if method == "tf_cache":
        ds = ds.cache().shuffle(len(paths), seed=args.seed, reshuffle_each_iteration=True)
    crop = augment(res)
    none = ds.batch(args.batch).prefetch(tf.data.AUTOTUNE)
    return {"none": none, "keras": keras_augmented(none),
            "crop": ds.map(lambda x, y: (crop(x), y), num_parallel_calls=tf.data.AUTOTUNE)
            .batch(args.batch).prefetch(tf.data.AUTOTUNE)}


def datacache_datasets(root: Path, store_dir: Path, args: argparse.Namespace,
                       then: Optional[Callable[[], object]] = None) -> Tuple[Dict[str, tf.data.Dataset], DataCache]:
    """DataCache over the rank's share, by augmentation (the node's store under store_dir);
    `then` is called between making the DataCache and its datasets."""
    cache = DataCache(str(root), resolution=args.resolution, source=source_of(args),
                      cache_dir=str(store_dir / "disk"), store_dir=str(store_dir), seed=args.seed,
                      memory_bytes=2**34, io_threads=PARALLEL_READS)
    if then is not None:
        then()
    none = cache.dataset(args.batch)
    return {"none": none, "keras": keras_augmented(none),
            "crop": cache.dataset(args.batch, augment=augment(args.resolution))}, cache


def epoch(ds: tf.data.Dataset, name: str, size: int) -> Tuple[float, float, int]:
    """(seconds of one pass, seconds to its first batch, samples): the slowest rank's."""
    if size > 1:
        hvdx.barrier()
    start, first, samples = time.perf_counter(), None, 0
    for x, _ in ds:
        samples += int(x.shape[0])
        if first is None:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    if size > 1:
        return slowest(total, f"{name}.total"), slowest(first, f"{name}.first"), samples
    return total, first, samples


def bench(root: Path, store_root: Path, args: argparse.Namespace) -> dict:
    """Every round's epochs (seconds, first-batch seconds, samples) by key, and memory."""
    rank, size = 0, 1
    if under_launcher():
        topo = hvdx.init()
        rank, size = topo.rank, topo.size
    out: Dict[str, List] = {}
    memory: Dict[str, List[float]] = {"tf_cache_node": [], "datacache_node": []}

    def keep(key: str, value) -> None:
        out.setdefault(key, []).append(value)

    for r in range(args.rounds):
        store_dir = store_root / f"round{r}"
        order = ("plain", "tf_cache", "datacache") if r % 2 == 0 else ("datacache", "tf_cache", "plain")
        runs, cache = {}, None
        for method in order:
            before = rss()
            if method == "datacache":
                runs[method], cache = datacache_datasets(root, store_dir, args)
            else:
                runs[method] = tf_datasets(method, root, args, rank, size)
            keep(f"{method}_epoch1", epoch(runs[method]["none"], f"scale.{r}.{method}.1", size))
            if method == "tf_cache":
                grown = float(rss() - before)
                memory["tf_cache_node"].append(_node_sum(grown, f"scale.{r}.rss", size))
        memory["datacache_node"].append(float(cache.store.memory_used()))
        for method in ("tf_cache", "datacache"):
            for kind in ("keras", "crop"):  # tracing and XLA compilation, untimed
                epoch(runs[method][kind], f"scale.{r}.{method}.warm.{kind}", size)
        later: Dict[str, List] = {}
        for e in range(args.epochs - 1):
            for method in (("tf_cache", "datacache") if e % 2 == 0 else ("datacache", "tf_cache")):
                for kind in AUGMENTS:
                    for i in range(args.repeats if kind == "none" else 1):  # short epochs: more of them
                        later.setdefault(f"{method}_{kind}", []).append(
                            epoch(runs[method][kind], f"scale.{r}.{method}.{e}.{kind}.{i}", size))
        for key, epochs in later.items():
            keep(key, epochs)
        cache.close()
        del runs
        if size > 1:
            hvdx.barrier()
        # the last round's stores stay for the relaunched jobs (`relaunched`); main removes them
        if cache.placement.local_rank == 0 and (r < args.rounds - 1 or args.relaunches == 0):
            remove_store(cache.store.path)
            shutil.rmtree(store_dir, ignore_errors=True)
        if rank == 0:
            print(json.dumps({"round": r, **{k: v[-1] for k, v in out.items()}}), flush=True)
    return {"rounds": out, "memory_bytes": memory, "ranks": size}


def relaunched(root: Path, store_dir: Path, args: argparse.Namespace) -> dict:
    """A relaunched job on the nodes of the last round (a new process per rank): DataCache
    over its node's store, epoch 1 and --repeats epochs 2+ (seconds, first-batch seconds,
    samples: the slowest rank's), and whether the store served epoch 1 without a file read."""
    size = 1
    if under_launcher():
        size = hvdx.init().size
    model = []
    build = (lambda: model.append(user_model(args))) if args.relaunch_variant == "model" else None
    datasets, cache = datacache_datasets(root, store_dir, args, then=build)
    try:
        first = epoch(datasets["none"], "relaunch.1", size)
        read = cache.stats["store"]["misses"] + cache.stats["disk"]["misses"]  # decoded or read again
        later = [epoch(datasets["none"], f"relaunch.{i + 2}", size) for i in range(args.repeats)]
    finally:
        cache.close()
    return {"epoch1": first, "later": later, "epoch1_misses": read}


#: The restarted job's variants (--restart-variants), in the environment of its processes:
#: as a user runs it; with TensorFlow's oneDNN graph rewrites off (TF_ENABLE_ONEDNN_OPTS=0:
#: what a new process' first iterator pays beyond a later one's, see benchmarks/README.md);
#: `model`: a job that builds and compiles its model (`user_model`) after making the
#: DataCache and before its datasets, as a training script does (the epochs time the data);
#: `huge-pages`: as `default`, over a copy of the node stores on a tmpfs mounted with
#: huge=within_size (`huge_tmpfs`; skipped where none can be had).
RESTART_VARIANTS = {"default": {}, "onednn-off": {"TF_ENABLE_ONEDNN_OPTS": "0"}, "model": {}, "huge-pages": {}}


def user_model(args: argparse.Namespace) -> tf.keras.Model:
    """The model a restarted training job builds before its first epoch: ResNet-50 (Keras'
    application, no weights) for --resolution px and the digits' 10 classes, compiled."""
    model = tf.keras.applications.ResNet50(weights=None, input_shape=(args.resolution, args.resolution, 3),
                                           classes=10)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


def relaunch_all(topology: str, root: Path, store_dir: Path, work: Path,
                 args: argparse.Namespace) -> Dict[str, List[dict]]:
    """--relaunches new jobs of `topology` ("1" or NxM) per restart variant, the variants
    taking turns, over the stores of the last round (`relaunched` in each), then the stores
    removed. Returns the jobs' results by variant. Raises SystemExit if one fails."""
    stores = {v: store_dir for v in args.restart_variants}
    try:
        with contextlib.ExitStack() as stack:
            if "huge-pages" in stores:
                huge, why = stack.enter_context(huge_tmpfs(_tree_bytes(store_dir) + 2**26, args))
                if huge is None:
                    print(f"restart variant huge-pages skipped: {why}", flush=True)
                    del stores["huge-pages"]
                else:  # no process has the stores open: their files copy whole
                    stores["huge-pages"] = huge / store_dir.name
                    shutil.copytree(store_dir, stores["huge-pages"])
            results: Dict[str, List[dict]] = {v: [] for v in stores}
            _relaunch_turns(topology, root, stores, work, args, results)
    finally:  # no process has the stores open any more: their files go with the folder
        shutil.rmtree(store_dir, ignore_errors=True)
    return results


def only_restarts(root: Path, args: argparse.Namespace) -> dict:
    """The restarted jobs alone, per topology of --topologies: a first job of the topology
    fills new node stores (not counted), then `relaunch_all`. Returns {"date", "variants":
    {topology: (results by variant, load average start/end)}}."""
    work = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-scale-"))
    store = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-scale-", dir="/dev/shm"))
    out = {}
    try:
        for topology in [t for t in args.topologies.split(",") if t]:
            store_dir = store / topology
            _relaunch_turns(topology, root, {"default": store_dir}, work, argparse.Namespace(**{**vars(args),
                            "relaunches": 1}), {"default": []})
            with load_during() as load:
                variants = relaunch_all(topology, root, store_dir, work, args)
            out[topology] = (variants, [round(load["start"][0], 2), round(load["end"][0], 2)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    return {"date": time.strftime("%Y-%m-%d"), "load_average": {t: v[1] for t, v in out.items()}, "variants": out}


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@contextlib.contextmanager
def huge_tmpfs(size: int, args: argparse.Namespace):
    """(a directory on a tmpfs with huge pages of at least `size` bytes, None) for the block:
    a new one under --huge-dir if given, else a tmpfs mounted with huge=within_size for the
    block (root only); (None, why) where none can be had (with --quick: never mounted)."""
    from hvdx.data.pages import huge_pages

    if args.huge_dir:
        place = Path(tempfile.mkdtemp(prefix="hvdx-bench-huge-", dir=args.huge_dir))
        try:
            yield (place, None) if huge_pages(str(place)) else (None, f"--huge-dir {args.huge_dir} has no huge pages")
        finally:
            shutil.rmtree(place, ignore_errors=True)
        return
    if args.quick:
        yield None, "--quick"
        return
    mount = Path(tempfile.mkdtemp(prefix="hvdx-bench-huge-"))
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={size}", "hvdx-bench",
                               str(mount)], capture_output=True, text=True)
        if done.returncode != 0:
            yield None, ("no tmpfs with huge=within_size (mounting one needs root; or pass --huge-dir): "
                         + done.stderr.strip())
            return
        try:
            yield mount, None
        finally:
            subprocess.run(["umount", str(mount)], check=False)
    finally:
        shutil.rmtree(mount, ignore_errors=True)


def _relaunch_turns(topology: str, root: Path, stores: Dict[str, Path], work: Path, args: argparse.Namespace,
                    results: Dict[str, List[dict]]) -> None:
    """--relaunches jobs per variant of `stores` (variant -> the node stores' folder), taking
    turns; appends each job's result to `results[variant]`. Raises SystemExit if one fails."""
    for i in range(args.relaunches):
        for variant, store_dir in stores.items():
            path = work / f"relaunch-{topology}-{variant}-{i}.json"
            command = [str(Path(__file__).resolve()), "--relaunch-json", str(path), "--data-root", str(root),
                       "--store-root", str(store_dir), f"--relaunch-variant={variant}", *worker_argv(args)]
            env = RESTART_VARIANTS[variant]
            if topology == "1":
                failed = subprocess.run([sys.executable, *command],
                                        env=dict(os.environ, PYTHONPATH=str(ROOT), **env)).returncode
            else:
                failed = launch_ranks(command, *(int(x) for x in topology.split("x")), env=env)
            if failed:
                raise SystemExit(f"the relaunched {topology} job ({variant}) failed")
            results[variant].append(json.loads(path.read_text()))


#: A new process maps a file of the slab's size (`mapping`): madvise(MADV_POPULATE_READ), the
#: page-table memory it built (VmPTE) and the part mapped by huge pages (ShmemPmdMapped).
_MAP_CHILD = """
import ctypes, json, mmap, os, sys, time
import numpy as np
def kib(path, field):
    return sum(int(l.split()[1]) for l in open(path) if l.startswith(field + ":"))
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
view = np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), np.uint8)
libc = ctypes.CDLL(None, use_errno=True)
before = kib("/proc/self/status", "VmPTE")
start = time.perf_counter()
failed = libc.madvise(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), ctypes.c_int(22))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "failed": failed, "page_table_kib": kib("/proc/self/status", "VmPTE") - before,
                  "huge_kib": kib("/proc/self/smaps_rollup", "ShmemPmdMapped"), "bytes": size}))
"""


def mapping(args: argparse.Namespace) -> dict:
    """What a restarted process pays to map its node's slab (1 rank: the whole data set at
    --resolution), on /dev/shm (4 KiB pages) and on a tmpfs mounted with huge=within_size
    (--huge-dir, else mounted here for the run, which needs root; not with --quick): --relaunches new
    processes per place, taking turns; each reports the seconds of MADV_POPULATE_READ, the
    page table it built and the bytes mapped by huge pages. Returns them by place, with
    `huge_pages` (hvdx.data.pages) of each and why a place was not measured."""
    from hvdx.data.pages import huge_pages

    size = Slab.file_size(args.images, (args.resolution, args.resolution, 3))
    out: Dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        small = Path(tempfile.mkdtemp(prefix="hvdx-bench-mapping-", dir="/dev/shm"))
        stack.callback(shutil.rmtree, small, ignore_errors=True)
        places = {"4k": small}
        huge, why = stack.enter_context(huge_tmpfs(size + 2**26, args))
        if huge is None:
            out["huge"] = {"skipped": why}
        else:
            places["huge"] = huge
        chunk = memoryview(np.random.default_rng(0).integers(0, 255, 2**24, dtype=np.uint8).tobytes())
        for name, place in places.items():
            with open(place / "slab", "wb") as f:  # written as a slab's pixels are, in chunks
                for offset in range(0, size, len(chunk)):
                    f.write(chunk[:size - offset])
            out[name] = {"dir": str(place), "huge_pages": huge_pages(str(place)), "runs": []}
        for _ in range(args.relaunches):
            for name, place in places.items():
                done = subprocess.run([sys.executable, "-c", _MAP_CHILD, str(place / "slab")], capture_output=True,
                                      text=True, check=True)
                out[name]["runs"].append(json.loads(done.stdout))
    return out


def mapping_text(result: Optional[dict]) -> str:
    """The mapping measurement in words (empty without one)."""
    if not result:
        return ""
    med = statistics.median
    parts = []
    for name, what in (("4k", "/dev/shm (4 KiB pages)"), ("huge", "a tmpfs mounted with `huge=within_size`")):
        place = result.get(name, {})
        if "runs" not in place:
            parts.append(f"{what}: not measured ({place.get('skipped', 'not asked')})")
            continue
        runs = place["runs"]
        gib = runs[0]["bytes"] / 2**30
        parts.append(f"{what}: {med(r['seconds'] for r in runs) * 1e3 / gib:.1f} ms per GiB "
                     f"(relaunches {min(r['seconds'] for r in runs) * 1e3 / gib:.1f}-"
                     f"{max(r['seconds'] for r in runs) * 1e3 / gib:.1f}), "
                     f"{med(r['page_table_kib'] for r in runs) / gib / 1024:.2f} MiB of page table per GiB, "
                     f"{med(r['huge_kib'] for r in runs) / 1024 / (runs[0]['bytes'] / 2**20):.0%} in huge pages "
                     f"(`hvdx.data.pages.huge_pages`: {place['huge_pages']})")
    runs = result.get("4k", {}).get("runs")
    n = len(runs) if runs else 0
    return ("\n\n**Mapping the slab** (what every process of a restarted job pays per GiB of its node's slab: "
            f"a new process maps a file of the 1-rank slab's size, `madvise(MADV_POPULATE_READ)`, {n} relaunches "
            "per place taking turns, medians): " + "; ".join(parts) + ".")


def over_budget(root: Path, store_dir: Path, args: argparse.Namespace) -> dict:
    """One rank, a memory budget of --budget-fraction of the decoded data set: the slab does
    not fit, samples go into the store's LMDB values until the budget is spent, the others
    are read from level 1 (the local disk copy) and decoded again every epoch. Epochs
    (seconds, first-batch seconds, samples) and the caches' counters after each."""
    decoded = args.images * args.resolution ** 2 * 3
    budget = int(decoded * args.budget_fraction)
    cache = DataCache(str(root), resolution=args.resolution, source=source_of(args), cache_dir=str(store_dir / "disk"),
                      store_dir=str(store_dir), seed=args.seed, memory_bytes=budget, io_threads=PARALLEL_READS)
    ds, epochs, stats = cache.dataset(args.batch), [], []
    try:
        for e in range(args.epochs):
            epochs.append(epoch(ds, f"budget.{e}", 1))
            stats.append(cache.stats)
            print(json.dumps({"over_budget_epoch": e + 1, "seconds": epochs[-1][0], "stats": stats[-1]}), flush=True)
        memory = cache.store.memory_used()
    finally:
        cache.close()
        remove_store(cache.store.path)
        shutil.rmtree(store_dir, ignore_errors=True)
    return {"budget_bytes": budget, "decoded_bytes": decoded, "epochs": epochs, "stats": stats,
            "memory_bytes": memory}


def budget_text(budget: Optional[dict], result: dict) -> str:
    """The over-budget run in words, against the in-budget DataCache epochs 2+ of 1 rank."""
    if not budget:
        return ""
    later = [e[0] for e in budget["epochs"][1:]]
    one = result["topologies"].get("1")
    full = statistics.median(e[0] for r in one["rounds"]["datacache_none"] for e in r) if one else None
    first, last = budget["stats"][0], budget["stats"][-1]
    hits = last["store"]["hits"] - first["store"]["hits"]
    misses = last["store"]["misses"] - first["store"]["misses"]
    served = hits / max(1, hits + misses)
    return (f"\n\n**Over the memory budget** (1 rank, `memory_bytes` = {budget['budget_bytes'] / 2**20:.0f} MiB, "
            f"{budget['budget_bytes'] / budget['decoded_bytes']:.0%} of the {budget['decoded_bytes'] / 2**20:.0f} MiB "
            "decoded): no slab (the part does not fit whole); samples go into the store's LMDB values until the "
            f"budget is spent ({budget['memory_bytes'] / 2**20:.0f} MiB held), the others are read from level 1 "
            "(the local disk copy, not the slow source) and decoded again every epoch. Epochs 2+: "
            f"{served:.0%} of the samples served from memory, {statistics.median(later):.2f} s per epoch"
            + (f" ({statistics.median(later) / full:.1f}x the in-budget epoch's {full:.2f} s, plain tf.data's epoch "
               f"from the slow source {statistics.median(e[0] for e in one['rounds']['plain_epoch1']):.0f} s)"
               if full else "")
            + f"; epoch 1 {budget['epochs'][0][0]:.1f} s.")


def _node_sum(value: float, name: str, size: int) -> float:
    """The sum of `value` over this node's ranks (the mean over nodes)."""
    if size == 1:
        return value
    import horovod.tensorflow as hvd

    total = float(hvd.allreduce(tf.constant(value, tf.float64), op=hvd.Sum, name=name))
    return total / max(1, hvdx.topology().num_nodes)


def _sample_time(run, batch: int) -> float:
    """Seconds per sample of an epoch (seconds, first-batch seconds, samples) after its first batch."""
    total, first, samples = run
    return (total - first) / max(1, samples - batch)


def summary(result: dict, batch: int) -> dict:
    """Per-round ratios (baseline / DataCache) of per-sample times and epoch times, and the
    fixed costs (ms) of the methods' epochs 2+."""
    t = result["rounds"]
    med = statistics.median

    def sample_time(run) -> float:
        return _sample_time(run, batch)

    ratios = {
        f"epoch2_{kind}": [med(sample_time(e) for e in a) / med(sample_time(e) for e in b)
                           for a, b in zip(t[f"tf_cache_{kind}"], t[f"datacache_{kind}"])] for kind in AUGMENTS}
    ratios["epoch2_none_whole"] = [med(e[0] for e in a) / med(e[0] for e in b)
                                   for a, b in zip(t["tf_cache_none"], t["datacache_none"])]
    ratios["epoch1"] = [a[0] / b[0] for a, b in zip(t["plain_epoch1"], t["datacache_epoch1"])]
    ratios["restart"] = [med(e[0] for e in job["later"]) / job["epoch1"][0] for job in result["relaunched"]]
    ratios["restart_per_sample"] = [med(sample_time(e) for e in job["later"]) / sample_time(job["epoch1"])
                                    for job in result["relaunched"]]
    fixed = {m: med(med(e[1] for e in r) for r in t[f"{m}_none"]) * 1e3 for m in ("tf_cache", "datacache")}
    per = {m: med(med(sample_time(e) for e in r) for r in t[f"{m}_none"]) * 1e6 for m in ("tf_cache", "datacache")}
    mem = {k: med(v) for k, v in result["memory_bytes"].items()}
    return {"ratios": ratios, "fixed_ms": fixed, "per_sample_us": per, "memory_per_node_bytes": mem}


def table(results: Dict[str, dict], batch: int) -> str:
    rows = []
    for topology, result in results.items():
        s = summary(result, batch)
        r = s["ratios"]
        mem = s["memory_per_node_bytes"]
        rows.append([topology, *(verdict(r[k], GOALS[k]) for k in ("epoch2_none", "epoch2_keras", "epoch2_crop",
                                                                    "epoch1", "restart")),
                     " / ".join(f"{s['per_sample_us'][m]:.1f}" for m in ("datacache", "tf_cache")),
                     " / ".join(f"{s['fixed_ms'][m]:.0f}" for m in ("datacache", "tf_cache")),
                     f"{mem['datacache_node'] / 2**20:.0f} / {mem['tf_cache_node'] / 2**20:.0f}"])
    return markdown_table(["ranks", "epoch 2+ per sample, no augmentation: DataCache over `.cache()`",
                           "epoch 2+ per sample, uncompiled Keras augmentation per batch",
                           "epoch 2+ per sample, pad-crop-flip per sample (DataCache: `augment=`, XLA)",
                           "epoch 1 from the slow source: DataCache over plain tf.data",
                           "restarted job's epoch 1 over DataCache's epoch 2+",
                           "us per sample, epoch 2+ (DataCache / `.cache()`)",
                           "fixed cost per epoch, ms (DataCache / `.cache()`)",
                           "node memory, MiB (DataCache / `.cache()`)"], rows, 1)


def restart_table(results: Dict[str, dict], batch: int) -> str:
    """The restarted job by variant (RESTART_VARIANTS): its epoch 1 over its epochs 2+, whole
    and per sample, and its first batch (the iterator's start) in epoch 1 and in epochs 2+."""
    med = statistics.median
    rows = []
    for topology, result in results.items():
        for variant, jobs in result.get("relaunched_variants", {}).items():
            whole = [med(e[0] for e in job["later"]) / job["epoch1"][0] for job in jobs]
            per = [med(_sample_time(e, batch) for e in job["later"]) / _sample_time(job["epoch1"], batch)
                   for job in jobs]
            rows.append([topology, variant, verdict(whole, GOALS["restart"]), f"{med(per):.2f}x",
                         f"{med(job['epoch1'][1] for job in jobs) * 1e3:.0f} / "
                         f"{med(e[1] for job in jobs for e in job['later']) * 1e3:.0f}"])
    return markdown_table(["ranks", "restarted job", "epoch 1 over epochs 2+", "per sample (after the first batch)",
                           "first batch, ms: epoch 1 / epochs 2+"], rows, 2) if rows else ""


def render(result: dict, out: Path, readme: Optional[Path]) -> None:
    (out / "datacache_scale.json").write_text(json.dumps(result, indent=2))
    c = result["config"]
    text = table(result["topologies"], c["batch"])
    print(text)
    if readme is not None:
        loads = "; ".join(f"{t}: {'/'.join(f'{v:g}' for v in r['load_average'])}"
                          for t, r in result["topologies"].items() if r.get("load_average"))
        body = ("**At scale** (issue 45), measured by `python benchmarks/datacache_scale.py` on "
                f"{result['machine']['cpus']} CPU cores (TensorFlow {result['machine']['tensorflow']}): "
                f"{c['images']} distinct JPEGs of {c['size']} px read through `SlowSource` ({c['latency_ms']:g} ms "
                f"per open, {c['mib_per_s']:g} MiB/s), decoded to {c['resolution']} px, batches of {c['batch']}; "
                "per rank: plain tf.data and `.cache()` over the rank's shard (16 parallel reads), DataCache over "
                "its share (one store per node). Speed ratios of the slowest rank (baseline time / DataCache time; "
                "per sample: after an epoch's first batch), medians of per-round ratios over "
                f"{c['rounds']} cold rounds (epochs 2-{c['epochs']}, without augmentation {c['repeats']} passes each, "
                "methods taking turns); the restarted job is the job launched again on the same nodes after "
                + ("a first job filled them (the later run below, " if result.get("restarts") else "the last round (")
                + f"{c['relaunches']} times, new processes): its epoch 1 over the median of its "
                f"{c['repeats']} epochs 2+, the median of the relaunches (per sample after the first batch: "
                + ", ".join(f"{t} {statistics.median(summary(r, c['batch'])['ratios']['restart_per_sample']):.2f}x"
                            for t, r in result["topologies"].items()) + "). "
                "Load average (1 min, start/end) "
                f"{loads}. Raw times: `results/datacache_scale.json`.\n\n" + text
                + budget_text(result.get("over_budget"), result) + mapping_text(result.get("mapping")))
        restarts = restart_table(result["topologies"], c["batch"])
        if restarts:
            again = result.get("restarts")
            body += ("\n\n**The restarted job by variant** (relaunches taking turns, medians of "
                     f"{c['relaunches']} each"
                     + (f"; from a later run, {again['date']}, `--only-restarts`: a first job fills new node stores, "
                        "then the relaunches; load average (1 min, start/end) "
                        + "; ".join(f"{t}: {'/'.join(f'{v:g}' for v in la)}" for t, la in again["load_average"].items())
                        + "; the table above takes its restarted-job column from it" if again else "")
                     + "): `default` as a user runs it; `onednn-off` with TensorFlow's oneDNN "
                     "graph rewrites off in its processes (`TF_ENABLE_ONEDNN_OPTS=0`); `model` builds and "
                     "compiles a ResNet-50 between making the DataCache and its datasets, as a training "
                     "script does (the epochs time the data alone); `huge-pages` as `default` over a copy of the "
                     "node stores on a tmpfs mounted with `huge=within_size`.\n\n" + restarts)
        update_readme("datacache-scale", body, readme)


def worker_argv(args: argparse.Namespace) -> List[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("images", "size", "resolution", "batch", "epochs", "rounds", "repeats", "relaunches", "seed",
                      "latency_ms", "mib_per_s")]


def main(argv: Optional[List[str]] = None) -> None:
    """The command line (`argv`: its arguments, default sys.argv[1:])."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=32000)
    parser.add_argument("--size", type=int, default=64, help="source images' side (px)")
    parser.add_argument("--resolution", type=int, default=96)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="epochs without augmentation per later epoch")
    parser.add_argument("--relaunches", type=int, default=3,
                        help="restarted jobs (new processes) over the last round's node stores")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="emulated NFS latency per open (0: local disk)")
    parser.add_argument("--mib-per-s", type=float, default=100.0, help="emulated NFS bandwidth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-fraction", type=float, default=0.5,
                        help="the over-budget run's memory budget, a fraction of the decoded data set (0: no such run)")
    parser.add_argument("--render", action="store_true", help="redo the table from <out>/datacache_scale.json")
    parser.add_argument("--only-over-budget", action="store_true",
                        help="run only the over-budget epochs and add them to <out>/datacache_scale.json")
    parser.add_argument("--only-restarts", action="store_true",
                        help="run only the restarted jobs (over node stores a first job fills) and put them into "
                        "<out>/datacache_scale.json")
    parser.add_argument("--only-mapping", action="store_true",
                        help="measure only the slab's mapping and add it to <out>/datacache_scale.json")
    parser.add_argument("--huge-dir", help="a directory on a tmpfs mounted with huge=within_size, for the mapping "
                        "measurement (default: one mounted for the run, which needs root)")
    parser.add_argument("--topologies", default="1,2x2", help="1 (this process) and/or nodes x ranks per node")
    parser.add_argument("--data-dir", default="~/.cache/hvdx/bench-datacache", help="where the JPEGs are kept")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    add_output_arguments(parser)
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    parser.add_argument("--data-root", help=argparse.SUPPRESS)
    parser.add_argument("--store-root", help=argparse.SUPPRESS)
    parser.add_argument("--restart-variants", default=",".join(RESTART_VARIANTS),
                        type=lambda v: [x for x in v.split(",") if x],
                        help="restarted jobs' variants, taking turns: " + ", ".join(RESTART_VARIANTS)
                        + " (the first is the table's)")
    parser.add_argument("--relaunch-json", help=argparse.SUPPRESS)
    parser.add_argument("--relaunch-variant", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.size, args.resolution, args.batch = 96, 32, 24, 16
        args.epochs, args.rounds, args.repeats, args.relaunches, args.latency_ms = 2, 1, 1, 1, 1.0
        args.restart_variants = args.restart_variants[:1]
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (epoch 1 cold, then epochs 2+)")
    if args.relaunches < 1:
        parser.error("--relaunches must be >= 1 (the restarted job's row)")
    unknown = [v for v in args.restart_variants if v not in RESTART_VARIANTS]
    if unknown or not args.restart_variants:
        parser.error(f"--restart-variants: {', '.join(unknown) or 'none given'}; known: {', '.join(RESTART_VARIANTS)}")
    if args.relaunch_json:  # a rank of a relaunched job
        freeze_start_up()
        result = relaunched(Path(args.data_root), Path(args.store_root), args)
        if not under_launcher() or hvdx.topology().rank == 0:
            Path(args.relaunch_json).write_text(json.dumps(result))
        if under_launcher():
            hvdx.barrier()
        return
    if args.worker_json:  # a rank of a launched job
        freeze_start_up()
        result = bench(Path(args.data_root), Path(args.store_root), args)
        import horovod.tensorflow as hvd

        if hvd.rank() == 0:
            Path(args.worker_json).write_text(json.dumps(result))
        hvdx.barrier()
        return
    readme = readme_path(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        render(json.loads((args.out / "datacache_scale.json").read_text()), args.out, readme)
        return
    if args.only_over_budget:  # added to the JSON of an earlier run
        result = json.loads((args.out / "datacache_scale.json").read_text())
        store = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-scale-", dir="/dev/shm"))
        try:
            result["over_budget"] = over_budget(data_set(args), store / "budget", args)
        finally:
            shutil.rmtree(store, ignore_errors=True)
        result["config"]["budget_fraction"] = args.budget_fraction
        render(result, args.out, readme)
        return
    if args.only_restarts:  # the restarted jobs again, into an earlier run's JSON
        result = json.loads((args.out / "datacache_scale.json").read_text())
        result["restarts"] = only_restarts(data_set(args), args)
        for topology, (variants, _) in result["restarts"].pop("variants").items():
            result["topologies"][topology]["relaunched"] = variants[args.restart_variants[0]]
            result["topologies"][topology]["relaunched_variants"] = variants
        result["config"].update(relaunches=args.relaunches, restart_variants=args.restart_variants)
        render(result, args.out, readme)
        return
    if args.only_mapping:
        result = json.loads((args.out / "datacache_scale.json").read_text())
        result["mapping"] = mapping(args)
        render(result, args.out, readme)
        return
    root = data_set(args) if not args.quick else None
    work = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-scale-"))
    store = Path(tempfile.mkdtemp(prefix="hvdx-bench-datacache-scale-", dir="/dev/shm"))
    results = {}
    try:
        if root is None:
            root = work / "jpeg"
            make_dataset(root, args.images, args.size)
        for topology in [t for t in args.topologies.split(",") if t]:
            with load_during() as load:
                if topology == "1":
                    result = bench(root, store, args)
                else:
                    nodes, per_node = (int(x) for x in topology.split("x"))
                    path = work / f"{topology}.json"
                    command = [str(Path(__file__).resolve()), "--worker-json", str(path), "--data-root", str(root),
                               "--store-root", str(store), *worker_argv(args)]
                    if launch_ranks(command, nodes, per_node):
                        raise SystemExit(f"the {topology} run failed")
                    result = json.loads(path.read_text())
                variants = relaunch_all(topology, root, store / f"round{args.rounds - 1}", work, args)
                result["relaunched"] = variants[args.restart_variants[0]]
                result["relaunched_variants"] = variants
            result["load_average"] = [round(load["start"][0], 2), round(load["end"][0], 2)]
            results[topology] = result
        budget = over_budget(root, store / "budget", args) if args.budget_fraction > 0 else None
        mapped = mapping(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    config = {k: getattr(args, k) for k in ("images", "size", "resolution", "batch", "epochs", "rounds", "repeats",
                                            "relaunches", "seed", "latency_ms", "mib_per_s", "budget_fraction", "quick",
                                            "restart_variants")}
    machine = {"cpus": os.cpu_count(), "tensorflow": tf.__version__, "hvdx": hvdx.__version__}
    render({"config": config, "machine": machine, "topologies": results, "over_budget": budget, "mapping": mapped},
           args.out, readme)


if __name__ == "__main__":
    main()
