"""Table 3 of shi2021 in miniature: the training step a user sees, per aggregation strategy.

`model.fit`'s own train function (forward, backward, aggregation at Keras' hook, apply) of
the same model with every optimizer: no communication at all (the floor: each rank trains
alone), Horovod's `hvd.DistributedOptimizer` (the baseline), and `hvdx.DistributedOptimizer`
with each strategy. Optimizers take turns within each round (a slow spell of the shared
machine hits all of them alike); a time is the slowest rank's time of `--steps` steps over
`--steps`; speed-ups are medians of the per-round ratios to Horovod's.

    python benchmarks/train_step.py                     # emulated cluster, 2x2 and 2x1, 1 Gbit/s (root)
    python benchmarks/train_step.py --local             # horovodrun over loopback (no shaping)
    python benchmarks/train_step.py --profile           # also: where the time of one step goes
    python benchmarks/train_step.py --engines gloo,mpi  # each topology under Gloo, then under mpirun (root)
    python benchmarks/train_step.py --engines gloo,shm  # Gloo, then Gloo with node_engine="shm" for 2DTAR/HiTopK
    python benchmarks/train_step.py --keras 2,3 --name train_step_keras3  # each optimizer under Keras 2 and Keras 3

With `--keras 2,3` (issue 64) every optimizer but Horovod's (Keras 2 only) also runs on the
same model built with Keras 3 (`import keras`; the Keras 3 SGD, `hvdx.DistributedOptimizer`'s
Keras 3 path, `jit_compile=False`), in the same rounds, each Keras 3 run next to its Keras 2
one; the report adds Keras 3's step time over Keras 2's per optimizer (median and range of
the per-round ratios) and whether Keras 3's median step lies within Keras 2's rounds.

With `--profile`, rank 0 records one step of each optimizer with TensorFlow's profiler and
Horovod's timeline and sums the time of the step's operations by what they do (forward and
backward, fusion copies and casts, residual update, MSTopK, sparse accumulation, each
collective, split, apply). Every run also counts what one step runs on its traced graph
(`graph_census`: ops, collectives and their bytes, casts, concats, conds, finiteness
checks), which no load changes. Writes <out>/<name>.json, .png (--name, default train_step) and
the tables of benchmarks/README.md (section <name> with "-" for "_": train-step).
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    import common
    from common import (README, add_output_arguments, add_topology_arguments, cluster_description, freeze_start_up,
                        markdown_table, run_topologies, timed_rounds, update_readme)
except ImportError:
    from benchmarks import common
    from benchmarks.common import (README, add_output_arguments, add_topology_arguments, cluster_description,
                                   freeze_start_up, markdown_table, run_topologies, timed_rounds, update_readme)

#: hvdx's strategies; "none" is the no-communication floor, "horovod" the baseline.
STRATEGIES = ["allreduce", "hierarchical", "sparse_allgather", "hitopk"]
#: "<strategy>_fused": the strategy on one fused buffer (bucket_bytes=None), no overlap.
#: "hierarchical_sized": 2DTAR with the size rule (buckets under 4 MiB through a flat
#: allreduce, `Hierarchical(flat_below=4 << 20)`, "hierarchical"'s default since),
#: "hierarchical_all": 2DTAR on every bucket (`flat_below=0`); not in the default set.
OPTIMIZERS = ["none", "horovod", *STRATEGIES, "hierarchical_fused", "hitopk_fused"]
#: The compressors beside top-k (issue 66), not in the default set: PowerSGD at its default
#: rank (hierarchical on 2 tiers, its default; "powersgd_flat": over all ranks at once), and
#: the low-bit wire at 8 and 4 bits ("lowbit4"), HiTopK with its values as 8-bit codes
#: ("hitopk_bits8": `value_bits=8`).
COMPRESSORS = ["powersgd", "powersgd_flat", "lowbit", "lowbit4", "hitopk_bits8"]
ALL_KEYS = [*OPTIMIZERS, "hierarchical_sized", "hierarchical_all", *COMPRESSORS]
LABELS = {"none": "no communication (floor)", "horovod": "Horovod DistributedOptimizer",
          "allreduce": "hvdx allreduce", "hierarchical": "hvdx hierarchical (2DTAR)",
          "sparse_allgather": "hvdx sparse_allgather (NaiveAG)", "hitopk": "hvdx hitopk (HiTopKComm)",
          "hierarchical_fused": "hvdx hierarchical, one fused buffer", "hitopk_fused": "hvdx hitopk, one fused buffer",
          "hierarchical_sized": "hvdx hierarchical, buckets < 4 MiB flat",
          "hierarchical_all": "hvdx hierarchical, 2DTAR on every bucket",
          "powersgd": "hvdx powersgd (rank 4)", "powersgd_flat": "hvdx powersgd (rank 4), flat", "lowbit": "hvdx lowbit (8 bits)", "lowbit4": "hvdx lowbit (4 bits)",
          "hitopk_bits8": "hvdx hitopk, 8-bit values"}
#: Every key a run may have, in table order: each optimizer under Keras 2, then Keras 3 (--keras).
ROW_KEYS = common.keras_keys(ALL_KEYS, (2, 3))
#: The issue's goals, per-round ratio medians of Horovod's step time over hvdx's (MLP, 2x2).
GOALS = {"hitopk": 3.0, "hierarchical": 1.25, "allreduce": 1.0}
DEFAULT_NAME = "train_step"


def label(key: str) -> str:
    """A row's label: the optimizer's, with " (Keras 3)" for a Keras 3 run."""
    return common.keras_label(key, LABELS)


# -- models --------------------------------------------------------------------------------
MODELS = ("mlp", "cnn", "resnet")
DEFAULT_MODELS = ["mlp", "cnn", "resnet"]


def build_model(kind: str, scale: float = 1.0, keras=None):
    """The issue's MLP (1024-4096-4096-10, 21M parameters), a convolutional model (VGG-like
    on 32x32x3, 5.2M parameters) or a small ResNet (conv + batch norm: a 3x3 stem and three
    stages of two basic blocks, 32-64-128 filters, on 32x32x3, 0.7M parameters; He et al.,
    "Deep Residual Learning for Image Recognition", 2016, arXiv:1512.03385, sec. 4.2's CIFAR
    networks); `scale` shrinks widths (the tests' tiny runs); `keras`: the Keras module to
    build with (None: Keras 2; `keras`: Keras 3, the same layers)."""
    from hvdx import zoo

    w = lambda n: max(4, int(n * scale))  # noqa: E731
    if kind == "mlp":
        return zoo.mlp(w(1024), (w(4096), w(4096)), name="mlp", keras=keras)
    if kind == "cnn":
        return zoo.cnn((32, 32, 3), (w(64), w(128), w(256), w(256)), padding="same", pool_after=(1, 2, 3),
                       head="flatten", dense=(w(1024),), name="cnn", keras=keras)
    if kind == "resnet":  # He et al.'s CIFAR ResNet, two basic blocks per stage
        return zoo.resnet((w(32), w(64), w(128)), input_shape=(32, 32, 3), blocks_per_stage=2, layer_names=False,
                          shortcut_first=False, name="resnet", keras=keras)
    raise ValueError(f"unknown model {kind!r}: one of {', '.join(MODELS)}")


def input_shape(model) -> tuple:
    return tuple(model.input_shape[1:])


def make_optimizer(key: str, args: argparse.Namespace, keras=None):
    """SGD with momentum: alone ("none"), under Horovod's DistributedOptimizer ("horovod"), or
    under hvdx's with the strategy `key` ("<strategy>_fused": one fused buffer); with
    `args.sparse_as_dense` (if it has one) embeddings' sparse gradients are aggregated dense.
    `keras`: the Keras module of the SGD (None: tf.keras); hvdx's wrapper takes either."""
    import tensorflow as tf

    inner = (keras or tf.keras).optimizers.SGD(0.01, momentum=0.9)
    dense = {"sparse_as_dense": True} if getattr(args, "sparse_as_dense", False) else {}
    if key == "none":
        return inner
    if key == "horovod":
        import horovod.tensorflow.keras as hvd_keras

        return hvd_keras.DistributedOptimizer(inner, **dense)
    import hvdx

    node_engine = os.environ.get(NODE_ENGINE_ENV, "horovod")  # --engines shm: 2DTAR's and HiTopK's node collectives
    if key in ("hierarchical_sized", "hierarchical_all"):
        options = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes or None}
        flat_below = 4 << 20 if key == "hierarchical_sized" else 0
        return hvdx.DistributedOptimizer(
            inner, communication=hvdx.comm.Hierarchical(flat_below=flat_below, node_engine=node_engine), **options)
    strategy, fused = (key[:-len("_fused")], True) if key.endswith("_fused") else (key, False)
    if strategy == "hitopk_bits8":
        strategy, dense = "hitopk", dict(dense, value_bits=8)
    options = {"density": args.density, **dense} if strategy in ("sparse_allgather", "hitopk") else dict(dense)
    if strategy == "lowbit4":
        strategy, options["bits"] = "lowbit", 4
    if strategy == "powersgd_flat":
        strategy, options["hierarchical"] = "powersgd", False
    if fused or args.bucket_bytes is not None:
        options["bucket_bytes"] = None if fused else args.bucket_bytes or None
    if node_engine != "horovod" and strategy in ("hierarchical", "hitopk"):
        extra = {option: options.pop(option) for option in ("density", "value_bits") if option in options}
        return hvdx.DistributedOptimizer(
            inner, communication=hvdx.comm.get(strategy, node_engine=node_engine, **extra), **options)
    return hvdx.DistributedOptimizer(inner, communication=strategy, **options)


#: The ranks' node engine for 2DTAR and HiTopK (set by the launcher for `--engines shm`).
NODE_ENGINE_ENV = "HVDX_BENCH_NODE_ENGINE"


# -- the ranks -----------------------------------------------------------------------------
def trainers(kind: str, args: argparse.Namespace) -> Dict[str, Callable[[int], float]]:
    """For each optimizer (under each Keras of --keras: `common.keras_keys`), a function that
    runs n steps of Keras' own train function (as model.fit does) and returns this rank's last
    loss (which waits for the step to end)."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    out = {}
    for key in common.keras_keys(args.optimizers, getattr(args, "keras", (2,))):
        base, version = common.split_keras(key)
        keras = common.keras_module(version)
        keras.utils.set_random_seed(1234)  # the same initial weights for every optimizer (of one Keras)
        model = build_model(kind, args.scale, keras=keras)
        model.compile(optimizer=make_optimizer(base, args, keras=keras),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **({"jit_compile": False} if version == 3 else {}))  # Horovod's ops are not XLA's
        rng = np.random.default_rng(hvd.rank())
        x = rng.standard_normal((args.batch * 4, *input_shape(model))).astype("float32")
        y = rng.integers(0, 10, args.batch * 4)
        iterator = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(2))
        model.make_train_function()  # Keras 3's returns None: both set model.train_function
        train = model.train_function

        def run(n: int, train=train, iterator=iterator) -> float:
            logs = None
            for _ in range(n):
                logs = train(iterator)
            return float(logs["loss"])

        run.census = lambda train=train, iterator=iterator: graph_census(train, iterator)
        out[key] = run
    return out


def measure(kind: str, args: argparse.Namespace) -> Dict[str, List[float]]:
    """Per round, the slowest rank's time per step of every optimizer (turns rotate)."""
    import horovod.tensorflow as hvd

    import hvdx

    runs = trainers(kind, args)
    for key, run in runs.items():  # warm-up: tracing, residuals, layout checks
        run(2)
        hvdx.barrier()
    census = {key: run.census() for key, run in runs.items()}  # every rank: no rank traces alone
    per_round: Dict[str, List[float]] = {key: [] for key in runs}
    cpu: Dict[str, List[float]] = {key: [] for key in runs}

    def call(key: str, run: Callable[[int], float]) -> None:
        start = time.process_time()  # every thread of the process: TensorFlow's, Horovod's, Gloo's
        run(args.steps)
        cpu[key].append((time.process_time() - start) / args.steps)

    calls = {key: (lambda key=key, run=run: call(key, run)) for key, run in runs.items()}
    for r, times in enumerate(timed_rounds(calls, args.rounds, f"ts.{kind}", warmup=0, rotate=True)):
        for key, seconds in times.items():
            per_round[key].append(seconds / args.steps)
        if hvd.rank() == 0:
            print(f"[{kind}] round {r}: " + ", ".join(f"{k} {per_round[k][-1] * 1e3:.0f} ms" for k in runs), flush=True)
    out = {"rounds": per_round, "census": census, "cpu_seconds": cpu_per_step(cpu, f"ts.{kind}.cpu")}
    if args.profile:
        out["profile"] = profile_steps(kind, runs, args)
    return out


def cpu_per_step(cpu: Dict[str, List[float]], name: str) -> Dict[str, float]:
    """Per optimizer, the CPU seconds one step took on all ranks together (each rank's median
    over the rounds, summed by one all-reduce named `name`): over the step's wall time, how
    many cores were busy, which on an oversubscribed machine says whether the step is
    computation-bound."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    keys = list(cpu)
    mine = tf.constant([statistics.median(cpu[key]) for key in keys], tf.float64)
    total = hvd.allreduce(mine, op=hvd.Sum, name=name).numpy()
    return {key: float(seconds) for key, seconds in zip(keys, total)}


# -- graph census ----------------------------------------------------------------------------
#: Op types counted by `graph_census`, by what they cost (the first match wins).
CENSUS_KINDS = [
    ("collectives", lambda t: t.startswith("Horovod") and t not in ("HorovodSize", "HorovodRank",
                                                                     "HorovodLocalSize", "HorovodLocalRank",
                                                                     "HorovodProcessSetIncluded")),
    ("tf.cond (If) on a computed predicate", lambda t: t in ("If", "StatelessIf")),
    ("finiteness checks (IsFinite)", lambda t: t == "IsFinite"),
    ("casts", lambda t: t == "Cast"),
    ("concats, splits, slices", lambda t: t in ("ConcatV2", "Split", "SplitV", "Slice", "StridedSlice", "Pack",
                                                 "Unpack")),
    ("reshapes, identities", lambda t: t in ("Reshape", "Identity", "IdentityN")),
]
_BRANCH_ATTRS = ("then_branch", "else_branch", "branches", "body", "cond", "f")


def _constant_predicate(op) -> Optional[bool]:
    """The value of an If op's predicate when it is a constant (Horovod's `_allreduce_cond`
    on a fixed number of ranks), else None."""
    source = op.inputs[0].op
    while source.type == "Identity":
        source = source.inputs[0].op
    if source.type != "Const":
        return None
    from tensorflow.python.framework import tensor_util

    return bool(tensor_util.MakeNdarray(source.get_attr("value")))


def _step_ops(graph, depth: int = 0):
    """Every op one call of `graph` runs (into called functions; of an If on a constant
    predicate only the branch taken)."""
    for op in graph.get_operations():
        branches = []
        for attr in _BRANCH_ATTRS:
            try:
                value = op.get_attr(attr)
            except (ValueError, TypeError):
                continue
            branches.extend(value if isinstance(value, list) else [value])
        fixed = _constant_predicate(op) if op.type in ("If", "StatelessIf") else None
        if fixed is not None:
            branches = branches[:1] if fixed else branches[1:2]  # then_branch, else_branch
        else:
            yield op
        for branch in branches:
            name = getattr(branch, "name", None)
            function = graph._get_function(name) if name and depth < 8 else None  # noqa: SLF001
            sub = getattr(function, "graph", None)
            if sub is not None:
                yield from _step_ops(sub, depth + 1)


def _traced(train):
    """The tf.function of Keras' train function: Keras 2's is one; Keras 3's (TensorFlow
    backend) is a Python function calling its `multi_step_on_iterator`, a tf.function."""
    if hasattr(train, "get_concrete_function"):
        return train
    cells = dict(zip(train.__code__.co_freevars, (c.cell_contents for c in train.__closure__ or ())))
    return cells["multi_step_on_iterator"]


def graph_census(train, iterator) -> Dict[str, object]:
    """What one call of Keras' train function runs, counted on its traced graph (before
    TensorFlow's graph optimizer): ops in all, ops by costly kind (`CENSUS_KINDS`), and the
    Horovod collectives as [op type, float tensors it takes, their bytes] (static sizes). Counts do
    not depend on the machine's load, so they compare optimizers where wall times cannot."""
    graph = _traced(train).get_concrete_function(iterator).graph
    counts: Dict[str, int] = collections.Counter()
    collectives: List[List] = []
    total = 0
    for op in _step_ops(graph):
        total += 1
        for kind, test in CENSUS_KINDS:
            if test(op.type):
                counts[kind] += 1
                break
        if CENSUS_KINDS[0][1](op.type):
            data = [x for x in op.inputs if x.dtype.is_floating]
            nbytes = sum(x.shape.num_elements() * x.dtype.size for x in data if x.shape.is_fully_defined())
            collectives.append([op.type, len(data), nbytes])
    return {"ops": total, "kinds": dict(counts), "collectives": collectives,
            "collective_bytes": sum(b for _, _, b in collectives)}


# -- profile -------------------------------------------------------------------------------
_STRATEGY_SCOPE = re.compile(r"^(?:.*/)?(hitopk|hierarchical|allreduce|sparse_allgather)(?:_\d+)?/")
CATEGORIES = [  # (category, test on (name with scopes, op type)); the first match wins
    ("MSTopK", lambda n, t: t in ("HvdxMstopk", "HvdxStatelessMstopk")),
    ("error feedback (residual add, update)", lambda n, t: "error_feedback" in n),
    ("sparse accumulation", lambda n, t: t in ("HvdxSparseAccumulate", "HvdxSparseScatter")),
    ("collective ops (TF side)", lambda n, t: t.startswith("Horovod")),
    ("finiteness check, commit", lambda n, t: n.startswith("commit/") or "/commit/" in n or "/finite/" in n),
    ("fusion copies, casts", lambda n, t: n.startswith("fuse/") or "/fuse/" in n),
    ("split", lambda n, t: n.startswith("split/") or "/split/" in n),
    ("strategy: slices, sums, packets", lambda n, t: bool(_STRATEGY_SCOPE.match(n))),
    ("backward", lambda n, t: n.startswith("gradient_tape/")),
    ("forward, loss", lambda n, t: n.split("/")[0] in (*MODELS, "sparse_categorical_crossentropy")),
    ("apply (SGD)", lambda n, t: "SGD" in n.split("/")[0]),
]


def keras2_name(name: str) -> str:
    """An op's name in Keras 2's form: Keras 3's train function is one StatefulPartitionedCall
    whose scopes are numbered (mlp_1/, sgd_1/) and whose loss is under compile_loss/."""
    parts = name.removeprefix("StatefulPartitionedCall/").split("/")
    if parts[0] == "compile_loss":
        parts = parts[1:]
    i = 1 if parts[0] == "gradient_tape" and len(parts) > 1 else 0
    if i and parts[i] == "compile_loss":
        del parts[i]
    scope = re.fullmatch(r"(sgd|%s)(?:_\d+)?" % "|".join(MODELS), parts[i])
    if scope:
        parts[i] = "SGD" if scope.group(1) == "sgd" else scope.group(1)
    return "/".join(parts)


def categorize(name: str, op_type: str) -> str:
    name = keras2_name(name)
    for category, test in CATEGORIES:
        if test(name, op_type):
            return category
    return "other"


def op_times(logdir: str) -> Dict[str, float]:
    """Seconds of TensorFlow op execution in a profile, summed by category (ops run on
    several threads at once, so the sum can exceed the step's wall time)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    totals: Dict[str, float] = collections.Counter()
    names: Dict[str, float] = collections.Counter()
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        space.ParseFromString(Path(path).read_bytes())
        for plane in space.planes:
            if plane.name != "/host:CPU":
                continue
            for line in plane.lines:
                if not line.name.startswith(("tf_Compute", "tf_inter_op")):
                    continue
                for event in line.events:
                    label = plane.event_metadata[event.metadata_id].name
                    if ":" not in label or "::" in label:  # TF ops are "name:Type"; executor spans are not
                        continue
                    name, op_type = label.rsplit(":", 1)
                    category = categorize(name, op_type)
                    totals[category] += event.duration_ps * 1e-12
                    names[f"{category} | {label}"] += event.duration_ps * 1e-12
    if os.environ.get("HVDX_PROFILE_OPS"):  # the ops behind the categories, and time per op type
        top = int(os.environ["HVDX_PROFILE_OPS"])
        by_type: Dict[str, float] = collections.Counter()
        for key, seconds in names.items():
            by_type[key.rsplit(":", 1)[1]] += seconds
        print("op times:\n" + "\n".join(f"  {v * 1e3:8.1f} ms  {k}" for k, v in names.most_common(top))
              + "\nby op type:\n" + "\n".join(f"  {v * 1e3:8.1f} ms  {k}" for k, v in by_type.most_common(top)),
              flush=True)
    return dict(totals)


COLLECTIVES = [  # (kind, fragments of a Horovod tensor name with "_" read as "."), first match wins
    ("node all-to-all (reduce-scatter)", ("hitopk.rs", "2dtar.rs")),
    ("node all-gather", ("hitopk.ag2", "2dtar.ag")),
    ("cross-node allreduce (2DTAR)", ("2dtar.ar",)),
    ("cross-node all-gather", ("hitopk.ag",)),
    ("global all-gather (NaiveAG)", ("naiveag",)),
]


def collective_kind(tensor: str, activity: str) -> str:
    name = tensor.replace("_", ".").lower()
    for kind, fragments in COLLECTIVES:
        if any(fragment in name for fragment in fragments):
            return kind
    return f"global {activity.lower()}"  # Horovod's own gradients, hvdx's allreduce


def horovod_times(path: str) -> Dict[str, float]:
    """Seconds in Horovod's timeline (chrome trace): each kind of collective's run time
    (from the end of its negotiation to its end), and the negotiation itself, which is
    mostly waiting until every rank has submitted the tensor."""
    text = Path(path).read_text().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    tensors = {e["pid"]: e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    stacks: Dict[tuple, List[tuple]] = collections.defaultdict(list)
    totals: Dict[str, float] = collections.Counter()
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            stacks[key].append((e["ts"], e.get("name", "")))
        elif e.get("ph") == "E" and stacks[key]:
            ts, activity = stacks[key].pop()
            if stacks[key]:
                continue  # nested activities are parts of the collective counted at the top
            kind = "negotiation (waiting for all ranks)" if activity.startswith("NEGOTIATE") else \
                collective_kind(tensors.get(e.get("pid"), ""), activity)
            totals[kind] += (e["ts"] - ts) * 1e-6
    return dict(totals)


def profile_steps(kind: str, runs: Dict[str, Callable[[int], float]], args) -> Dict[str, dict]:
    """One recorded step per optimizer (rank 0 records; every rank runs the steps)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvdx

    out = {}
    for key, run in runs.items():
        hvdx.barrier()
        with tempfile.TemporaryDirectory(prefix=f"hvdx-prof-{key}-") as logdir:  # the trace read, then removed
            timeline = os.path.join(logdir, "horovod_timeline.json")
            if hvd.rank() == 0:
                hvd.start_timeline(timeline, mark_cycles=False)
                tf.profiler.experimental.start(logdir)
            start = time.perf_counter()
            run(args.profile_steps)
            wall = (time.perf_counter() - start) / args.profile_steps
            if hvd.rank() == 0:
                tf.profiler.experimental.stop()
                hvd.stop_timeline()
                ops = {k: v / args.profile_steps for k, v in op_times(logdir).items()}
                try:
                    colls = {k: v / args.profile_steps for k, v in horovod_times(timeline).items()}
                except (OSError, ValueError) as error:
                    colls = {"error": str(error)}
                out[key] = {"wall": wall, "ops": ops, "collectives": colls}
                print(f"[{kind}] profile {key}: wall {wall * 1e3:.0f} ms, ops "
                      + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))
                      + " | horovod " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in colls.items() if k != "error"),
                      flush=True)
    hvdx.barrier()
    return out


def run_ranks(args: argparse.Namespace) -> None:
    import horovod.tensorflow as hvd

    import hvdx

    topo = hvdx.init()
    results = {}
    for kind in args.models:
        results[kind] = measure(kind, args)
    if hvd.rank() == 0:
        Path(args.worker_json).write_text(json.dumps({
            "topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size},
            "engine": "mpi" if hvd.mpi_enabled() else os.environ.get(NODE_ENGINE_ENV) == "shm" and "shm" or "gloo",
            "network": cluster_description(), "models": results}, indent=1))
    hvdx.barrier()


# -- the summary -----------------------------------------------------------------------------
def summarize(models: dict) -> Dict[str, dict]:
    """Per model and optimizer: its Keras (2 or 3), the median step time, and the median (min,
    max) over rounds of the per-round ratio of Horovod's step time to this one's (> 1: faster
    than Horovod); a Keras 3 run whose optimizer also ran under Keras 2 adds "vs_keras2"
    (`keras3_against_keras2`)."""
    out = {}
    for kind, result in models.items():
        rounds = result["rounds"]
        rows = {}
        for key, times in rounds.items():
            base, version = common.split_keras(key)
            row = {"keras": version, "median_seconds": statistics.median(times)}
            if key in result.get("cpu_seconds", {}):
                row["cpu_seconds_all_ranks"] = result["cpu_seconds"][key]
            if "horovod" in rounds and key != "horovod":
                ratios = [h / t for h, t in zip(rounds["horovod"], times)]
                row.update(speedup_vs_horovod=statistics.median(ratios), speedup_range=[min(ratios), max(ratios)])
            if version == 3 and base in rounds:
                row["vs_keras2"] = keras3_against_keras2(times, rounds[base])
            rows[key] = row
        out[kind] = rows
    return out


def keras3_against_keras2(keras3: List[float], keras2: List[float]) -> Dict[str, object]:
    """One optimizer's step times per round under Keras 3 and Keras 2 (the same rounds):
    Keras 3's over Keras 2's, the median (min, max) of the per-round ratios (> 1: Keras 3
    slower); Keras 2's rounds' spread [fastest, slowest]; and the goal (issue 64): Keras 3's
    median step within that spread or below it ("within_spread"), else "over_by", the fraction
    by which it exceeds Keras 2's slowest round."""
    ratios = [k3 / k2 for k3, k2 in zip(keras3, keras2)]
    median3, slowest2 = statistics.median(keras3), max(keras2)
    return {"ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "keras2_spread": [min(keras2), slowest2], "keras3_median": median3,
            "within_spread": median3 <= slowest2, "over_by": max(0.0, median3 / slowest2 - 1.0)}


def goal_verdicts(summary: Dict[str, dict]) -> Dict[str, dict]:
    """The issue's goals on the MLP (2x2): met, or by how much the speed-up falls short."""
    out = {}
    for key, goal in GOALS.items():
        row = summary.get("mlp", {}).get(key)
        if row is None or "speedup_vs_horovod" not in row:
            continue
        got = row["speedup_vs_horovod"]
        out[key] = {"goal": goal, "speedup": got, "met": got >= goal,
                    "short_by": 0.0 if got >= goal else 1.0 - got / goal}
    return out


def keras_verdict(result: dict) -> Optional[str]:
    """The Keras 3 goal of one launch in a sentence (None without Keras 3 beside Keras 2)."""
    pairs = [(kind, key, row["vs_keras2"]) for kind, summary in result["summary"].items()
             for key, row in summary.items() if "vs_keras2" in row]
    if not pairs:
        return None
    missed = [f"{kind} {label(common.split_keras(key)[0])} by {v['over_by']:.0%} (Keras 3 / Keras 2 {v['ratio']:.2f}x)"
              for kind, key, v in pairs if not v["within_spread"]]
    return (f"**Keras 3 beside Keras 2 ({run_label(result)}): Keras 3's median step within Keras 2's rounds' spread "
            f"(or faster) for {len(pairs) - len(missed)} of {len(pairs)} optimizers"
            + (": met for every one.**" if not missed else
               "; over Keras 2's slowest round: " + "; ".join(missed) + ".**"))


def keras_table(result: dict) -> str:
    """Per model and optimizer run under both Keras: each one's median step (and its rounds'
    range), Keras 3's over Keras 2's (median and range of the per-round ratios), the goal."""
    rows = []
    for kind, summary in result["summary"].items():
        for key, row in summary.items():
            v = row.get("vs_keras2")
            if v is None:
                continue
            base = common.split_keras(key)[0]
            k2, k3 = result["models"][kind]["rounds"][base], result["models"][kind]["rounds"][key]
            rows.append([run_label(result), kind, label(base),
                         f"{statistics.median(k2) * 1e3:.0f} ({min(k2) * 1e3:.0f}-{max(k2) * 1e3:.0f})",
                         f"{statistics.median(k3) * 1e3:.0f} ({min(k3) * 1e3:.0f}-{max(k3) * 1e3:.0f})",
                         f"{v['ratio']:.2f}x ({v['ratio_range'][0]:.2f}-{v['ratio_range'][1]:.2f})",
                         "yes" if v["within_spread"] else f"no: {v['over_by']:.0%} over its slowest round"])
    if not rows:
        return ""
    return markdown_table(["run", "model", "optimizer", "Keras 2 step (ms), median (min-max) of rounds",
                           "Keras 3 step (ms)", "Keras 3 / Keras 2, median (min-max) of per-round ratios",
                           "Keras 3's median within Keras 2's rounds"], rows, text_columns=3)


def run_label(result: dict) -> str:
    """"2x2 gloo": the topology (nodes x ranks per node) and the engine of one launch."""
    topo = result["topology"]
    return f"{topo['nodes']}x{topo['ranks_per_node']} {result.get('engine', 'gloo')}"


def step_table(result: dict) -> str:
    topo = result["topology"]
    rows = []
    for kind, summary in result["summary"].items():
        for key, row in summary.items():
            floor = summary.get(common.keras_keys(["none"], [row.get("keras", 2)])[0], {}).get("median_seconds")
            speedup = row.get("speedup_vs_horovod")
            low, high = row.get("speedup_range", (None, None))
            cpu = row.get("cpu_seconds_all_ranks")
            rows.append([f"{topo['nodes']}x{topo['ranks_per_node']}", result.get("engine", "gloo"), kind,
                         label(key),
                         f"{row['median_seconds'] * 1e3:.0f}",
                         "" if floor is None or common.split_keras(key)[0] == "none" else
                         f"{(row['median_seconds'] - floor) * 1e3:.0f}",
                         "" if cpu is None else f"{cpu * 1e3:.0f} ({cpu / row['median_seconds']:.1f})",
                         "1 (baseline)" if key == "horovod" else "" if speedup is None
                         else f"{speedup:.2f}x ({low:.2f}-{high:.2f})"])
    return markdown_table(["topology", "engine", "model", "optimizer", "step (ms)", "over the floor (ms)",
                           "CPU per step, all ranks (ms) (cores busy)",
                           "speed-up vs Horovod, median (min-max) of rounds"], rows, text_columns=4)


def census_table(result: dict) -> str:
    """What one step runs, per model and optimizer (`graph_census`): the same on every
    machine and under any load."""
    rows = []
    for kind, model in result["models"].items():
        for key in [k for k in ROW_KEYS if k in model.get("census", {})]:
            c = model["census"][key]
            colls = collections.Counter(t for t, _, _ in c["collectives"])
            rows.append([kind, label(key), str(c["ops"]),
                         ", ".join(f"{n} {t.replace('Horovod', '')}" for t, n in sorted(colls.items())) or "none",
                         str(sum(n for _, n, _ in c["collectives"])), f"{c['collective_bytes'] / 2 ** 20:.1f}",
                         *[str(c["kinds"].get(name, 0)) for name, _ in CENSUS_KINDS[1:]]])
    return markdown_table(["model", "optimizer", "ops per step", "collectives per step", "tensors in them",
                           "MiB in", *[name for name, _ in CENSUS_KINDS[1:]]], rows, text_columns=4)


def engine_table(results: List[dict]) -> str:
    """Per topology run under Gloo and another engine (MPI, or Gloo with node_engine="shm"):
    each optimizer's median step under both and their ratio (> 1: faster under the other).
    The engines run one after the other, not in turns, so a change of load between the runs
    shows here: read it with their load averages."""
    by_label = {run_label(r): r for r in results}
    rows = []
    for result, engine in [(r, e) for r in results for e in ("mpi", "shm")]:
        topo = result["topology"]
        name = f"{topo['nodes']}x{topo['ranks_per_node']}"
        gloo, mpi = by_label.get(f"{name} gloo"), by_label.get(f"{name} {engine}")
        if result is not gloo or mpi is None:
            continue
        for kind, summary in gloo["summary"].items():
            for key, row in summary.items():
                other = mpi["summary"].get(kind, {}).get(key)
                if other is None:
                    continue
                g, m = row["median_seconds"], other["median_seconds"]
                rows.append([name, engine, kind, label(key), f"{g * 1e3:.0f}", f"{m * 1e3:.0f}",
                             f"{g / m:.2f}x",
                             "" if key == "horovod" or "speedup_vs_horovod" not in row else
                             f"{row['speedup_vs_horovod']:.2f}x / {other.get('speedup_vs_horovod', 0):.2f}x"])
    if not rows:
        return ""
    return markdown_table(["topology", "other engine", "model", "optimizer", "Gloo step (ms)", "other's step (ms)",
                           "other's speed-up", "vs Horovod, Gloo / other"], rows, text_columns=4)


def profile_table(result: dict, kind: str) -> str:
    profile = result["models"][kind].get("profile") or {}
    keys = [k for k in ROW_KEYS if k in profile]
    categories = [c for c, _ in CATEGORIES] + ["other"]
    kinds = sorted({c for k in keys for c in profile[k]["collectives"] if c != "error"})
    header = ["where the time goes (ms per step)", *[label(k) for k in keys]]
    rows = [["wall time of a profiled step", *[f"{profile[k]['wall'] * 1e3:.0f}" for k in keys]]]
    for category in categories:
        values = [profile[k]["ops"].get(category, 0.0) for k in keys]
        if any(v > 0 for v in values):
            rows.append([f"TF ops: {category}", *[f"{v * 1e3:.0f}" for v in values]])
    for c in kinds:
        rows.append([f"Horovod: {c}", *[f"{profile[k]['collectives'].get(c, 0.0) * 1e3:.0f}" for k in keys]])
    return markdown_table(header, rows, text_columns=1)


def plot(results: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(r, kind) for r in results for kind in r["summary"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (result, kind) in zip(axes[0], panels):
        summary = result["summary"][kind]
        keys = [k for k in ROW_KEYS if k in summary]
        times = [summary[k]["median_seconds"] * 1e3 for k in keys]
        colors = ["#999999" if k == "none" else "#d62728" if k == "horovod" else
                  "#ff7f0e" if k.endswith(common.KERAS3) else "#1f77b4" for k in keys]
        ax.bar(range(len(keys)), times, color=colors)
        for i, k in enumerate(keys):
            speedup = summary[k].get("speedup_vs_horovod")
            if speedup is not None and k != "none":
                ax.text(i, times[i], f"{speedup:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([k.replace("sparse_allgather", "naiveag").replace(common.KERAS3, " k3") for k in keys],
                           rotation=35, fontsize=8, ha="right")
        topo = result["topology"]
        ax.set_title(f"{kind}, {topo['nodes']} nodes x {topo['ranks_per_node']} ranks, {result.get('engine', 'gloo')}",
                     fontsize=9)
        ax.set_ylabel("median step time (ms)")
    fig.suptitle("model.fit step time; labels: speed-up vs Horovod (median of per-round ratios)"
                 + ("; orange, k3: Keras 3" if any(k.endswith(common.KERAS3) for r in results for s in
                                                   r["summary"].values() for k in s) else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace, results: List[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    verdicts = {run_label(r): goal_verdicts(r["summary"]) for r in results}
    keras3 = {run_label(r): {kind: {key: row["vs_keras2"] for key, row in summary.items() if "vs_keras2" in row}
                             for kind, summary in r["summary"].items()} for r in results}
    (args.out / f"{args.name}.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items() if k != "worker_json"},
        "goals_mlp_2x2": GOALS, "verdicts": verdicts,
        **({"keras3_vs_keras2": keras3} if 3 in args.keras and 2 in args.keras else {}), "runs": results}, indent=1))
    plot(results, args.out / f"{args.name}.png")
    network = next((r["network"] for r in results if r.get("network")), None)
    where = (f"on the emulated cluster of `hvdx/runner/cluster.py`, {args.rate} links between nodes (tbf-shaped, "
             "no added delay)" if network else "over loopback (horovodrun, unshaped)")
    engines = ",".join(args.engines)
    command = " ".join(["python benchmarks/train_step.py", *(["--local"] if args.local else []),
                        *([f"--engines {engines}"] if engines != "gloo" else []),
                        *([f"--models {','.join(args.models)}"] if args.models != DEFAULT_MODELS else []),
                        *([f"--optimizers {','.join(args.optimizers)}"] if args.optimizers != OPTIMIZERS else []),
                        *([f"--keras {','.join(map(str, args.keras))}"] if args.keras != [2] else []),
                        *([f"--name {args.name}"] if args.name != DEFAULT_NAME else [])])
    lines = [f"Measured by `{command}` {where} (engines: {engines}), "
             f"2 CPU cores for all ranks; `model.fit`'s train function, per-rank batch {args.batch}, SGD with "
             f"momentum; hvdx's sparse strategies at density {args.density}, buckets of "
             f"{'one fused buffer' if args.bucket_bytes == 0 else (args.bucket_bytes or 'the default')} bytes. "
             f"{args.rounds} rounds of {args.steps} steps per optimizer after a warm-up, optimizers taking turns"
             + (" (each under Keras 2 and then Keras 3, Horovod's under Keras 2 only; Keras 3: `import keras`'s "
                "layers and SGD, `jit_compile=False`)" if args.keras == [2, 3] else
                " (under Keras 3 only)" if args.keras == [3] else "") + "; "
             f"a step's time is the slowest rank's. Plot: `results/{args.name}.png`, raw: `results/{args.name}.json`. "
             "The machine's 1-minute load average when each topology's run started (other work sharing the 2 "
             "cores; the run adds its own ranks): " + ", ".join(
                 f"{run_label(r)} {r['load_average'][0]:.1f}" for r in results) + ".",
             ""]
    for name, verdict in verdicts.items():
        if verdict:
            lines.append(f"**Goals (MLP, {name}; speed-up vs Horovod's DistributedOptimizer): " + "; ".join(
                f"{key} {v['speedup']:.2f}x (goal {v['goal']}x: " +
                ("met" if v["met"] else f"{v['short_by']:.0%} short") + ")" for key, v in verdict.items()) + ".**")
            lines.append("")
    for result in results:
        lines += [step_table(result), ""]
    for result in results:
        verdict, compared = keras_verdict(result), keras_table(result)
        if compared:
            lines += [verdict, "", "Keras 3 beside Keras 2, the same optimizer in the same rounds:", "", compared, ""]
    compared = engine_table(results)
    if compared:
        lines += ["The same step under both engines (medians of each run):", "", compared, ""]
    lines += ["What one step runs (counted on the traced train function, before TensorFlow's graph optimizer; "
              "ops of a `tf.cond` on a constant, Horovod's on a fixed number of ranks, are those of the branch "
              f"taken; {run_label(results[0])}):", "", census_table(results[0]), ""]
    profiled = [(r, kind) for r in results for kind in r["models"] if r["models"][kind].get("profile")]
    if profiled:
        result, kind = profiled[0]
        lines += [f"Where the time of one step goes ({kind}, {run_label(result)}, rank 0, "
                  f"{args.profile_steps} profiled steps: TensorFlow's profiler and Horovod's timeline, which slow "
                  "the step down). TF ops: summed run time of the step's operations by what they do (they run on "
                  "several threads at once, and a rank shares 2 cores with the others, so sums can exceed the wall "
                  "time). Horovod: time each kind of collective ran in Horovod's background thread after its "
                  "negotiation, and the negotiation itself (mostly waiting until every rank has submitted).", "",
                  profile_table(result, kind), ""]
    update_readme(args.name.replace("_", "-"), "\n".join(lines).rstrip(), args.readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_topology_arguments(parser)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), type=lambda s: s.split(","),
                        help=f"of {', '.join(MODELS)}")
    parser.add_argument("--engines", default="gloo", type=lambda s: s.split(","),
                        help="gloo, mpi (mpirun, Open MPI; root) and/or shm (Gloo, 2DTAR's and HiTopK's node "
                             "collectives through hvdx's shared memory), each topology under each in turn")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), type=lambda s: s.split(","))
    common.add_keras_argument(parser)
    parser.add_argument("--name", default=DEFAULT_NAME,
                        help="results' stem (<out>/<name>.json, .png) and README section (with - for _)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--bucket-bytes", type=int, default=None, help="hvdx's bucket size (0: one fused buffer)")
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps timed per optimizer per round")
    parser.add_argument("--scale", type=float, default=1.0, help="width multiplier of the models (tests: tiny)")
    parser.add_argument("--profile", action="store_true", help="also profile one step per optimizer on rank 0")
    parser.add_argument("--profile-steps", type=int, default=2)
    add_output_arguments(parser, readme=README)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.engines) - {"gloo", "mpi", "shm"}) + sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown engine(s) or model(s): {', '.join(unknown)}")
    if args.worker_json:
        if 3 in args.keras:
            common.keras_module(3)  # imported before freeze_start_up's gc.freeze, as tf.keras is
        freeze_start_up()
        run_ranks(args)
        return
    results = []
    env = {"HOROVOD_TIMELINE": "DYNAMIC"} if args.profile else None  # hvd.start_timeline() around profiled steps
    argv = list(sys.argv[1:] if argv is None else argv)
    for topology in args.topologies.split(","):  # each topology under each engine, one after the other
        for engine in args.engines:
            one = argparse.Namespace(**{**vars(args), "topologies": topology})
            launch_env = dict(env or {}, **({NODE_ENGINE_ENV: "shm"} if engine == "shm" else {}))
            for result in run_topologies(__file__, one, argv, env=launch_env or None,
                                         engine="gloo" if engine == "shm" else engine):
                result["summary"] = summarize(result["models"])
                results.append(result)
    report(args, results)
    print(json.dumps([r["summary"] for r in results], indent=1))


if __name__ == "__main__":
    main()
