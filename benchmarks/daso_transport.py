"""DASO's group transport (hvdx/transport/ring.py): does the global exchange overlap computation?

coquelin2021, section 3 and Figure 5: in the cycling phase the parameters travel while the
next forward-backward passes run. For a float32 vector of d elements this measures, on every
rank of the job:

- exchange alone: `GroupTransport.allreduce_sum` over the rank's cross set (its DASO group);
- compute alone: a tf.function loop of chained TF matmuls (like a train step), calibrated once
  to last about as long as the exchange;
- together: the exchange submitted, the same loop run, until both are done;
- idle / together_idle: the same with a main thread that sleeps as long as one exchange instead
  of computing, as a step running on an accelerator would: what the transport overlaps when
  the CPU is not the bottleneck (here 2 x 1 emulated nodes share the machine's every core);
- horovod: `hvd.allreduce` (Sum) of the same vector on the same cross set, for throughput.

Overlap ratio = (compute alone + exchange alone) / together (2 = perfect overlap of equal
parts, 1 = none; the best possible is (c + e) / max(c, e)), the median of per-round ratios;
hidden fraction = (c + e - together) / e. Exchange CPU = the process's CPU seconds during an
exchange alone (user + system, all threads; kernel work in softirq context is not counted).
A time is the slowest rank's, median of rounds after a warm-up round, the methods taking turns
within each round. Throughput = bytes a member sends, 2 (P-1)/P x 4d, per second.

    python -m hvdx.runner --nodes 2 --ranks-per-node 1 --rate 1gbit --no-delay -- \\
        .venv/bin/python benchmarks/daso_transport.py      # as root; see hvdx/runner/cluster.py
    python benchmarks/daso_transport.py --sizes 100000 --rounds 1   # relaunches itself on 2x1, loopback

Writes <out>/daso_transport.json (benchmarks/daso.py reuses the numbers; no README table).
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import by_key, cluster_description, launch_ranks, medians, slowest, timed_rounds, under_launcher
except ImportError:
    from benchmarks.common import (by_key, cluster_description, launch_ranks, medians, slowest, timed_rounds,
                                   under_launcher)

HERE = Path(__file__).resolve().parent
DEFAULT_SIZES = [6_250_000, 25_000_000]   # 25 MB and 100 MB of float32
METHODS = ("exchange", "compute", "together", "idle", "together_idle", "horovod")


_loops: dict = {}


def matmul_loop(a, iterations: int) -> None:
    """`iterations` chained matmuls in one tf.function call, as a Keras train step runs: the
    Python thread waits in TensorFlow's runtime, without the GIL, while the cores compute."""
    import tensorflow as tf

    if "loop" not in _loops:
        @tf.function
        def loop(a, n):
            b = a
            for _ in tf.range(n):
                b = tf.tanh(tf.matmul(b, a) * 0.05)  # chained: nothing to hoist or skip
            return b[0, 0]
        _loops["loop"] = loop
    float(_loops["loop"](a, tf.constant(iterations)))


def calibrate(a, seconds: float) -> int:
    """Matmul iterations that take about `seconds` here (the fastest of three timings of a
    tenth of a second), the same number on every rank (rank 0's)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    matmul_loop(a, 3)
    per_iteration = float("inf")
    for _ in range(3):
        n = 5
        while True:
            start = time.perf_counter()
            matmul_loop(a, n)
            elapsed = time.perf_counter() - start
            if elapsed > 0.1:
                break
            n *= 2
        per_iteration = min(per_iteration, elapsed / n)
    iterations = max(5, int(seconds / per_iteration))
    return int(hvd.broadcast(tf.constant(iterations), root_rank=0, name=f"calibrate.{id(a)}"))


def measure(size: int, rounds: int, transport, topo, tag: str) -> dict:
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import hvdx

    vector = np.random.default_rng(topo.rank).standard_normal(size).astype(np.float32)
    tensor = tf.constant(vector)
    a = tf.random.normal([512, 512])
    expected = None

    cpu_seconds: List[float] = []

    def exchange():
        nonlocal expected
        before = resource.getrusage(resource.RUSAGE_SELF)
        out = transport.allreduce_sum(vector).wait(600)
        after = resource.getrusage(resource.RUSAGE_SELF)
        # the process's CPU time, all threads
        cpu_seconds.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        expected = out

    def horovod():
        out = hvd.allreduce(tensor, op=hvd.Sum, process_set=topo.cross_set, name=f"{tag}.hvd")
        out.numpy()

    # warm-up, and the loop length: about one exchange
    warm = []
    for k in range(3):
        hvdx.barrier()
        start = time.perf_counter()
        exchange()
        warm.append(slowest(time.perf_counter() - start, f"{tag}.warm{k}"))
    target = statistics.median(warm)
    iterations = calibrate(a, target)

    together_stamps: List[dict] = []

    def together():
        request = transport.allreduce_sum(vector)
        loop_start = time.perf_counter()
        matmul_loop(a, iterations)
        loop_end = time.perf_counter()
        out = request.wait(600)
        assert out.tobytes() == expected.tobytes()  # the same sum as alone
        together_stamps.append({"exchange_began": request.began - request.started,
                                "exchange_finished": request.finished - request.started,
                                "loop_start": loop_start - request.started, "loop_end": loop_end - request.started})

    def together_idle():
        """The exchange beside a main thread that waits without using a core, as a step on an
        accelerator would: what the transport overlaps when the CPU is not the bottleneck."""
        request = transport.allreduce_sum(vector)
        time.sleep(target)
        request.wait(600)

    calls: Dict[str, Callable[[], None]] = {"exchange": exchange, "compute": lambda: matmul_loop(a, iterations),
                                            "together": together, "idle": lambda: time.sleep(target),
                                            "together_idle": together_idle, "horovod": horovod}
    per_round = by_key(timed_rounds({m: calls[m] for m in METHODS}, rounds, tag, rotate=True))
    # the copy the caller would pay if allreduce_sum copied its input on the caller's thread
    start = time.perf_counter()
    for _ in range(3):
        vector.copy()
    copy_seconds = (time.perf_counter() - start) / 3

    p = len(transport.members)
    sent_bytes = 2 * (p - 1) / p * 4 * size
    ratios = [(c + e) / t for c, e, t in zip(per_round["compute"], per_round["exchange"], per_round["together"])]
    idle_ratios = [(c + e) / t for c, e, t in zip(per_round["idle"], per_round["exchange"], per_round["together_idle"])]
    hidden = [(c + e - t) / e for c, e, t in zip(per_round["compute"], per_round["exchange"], per_round["together"])]
    seconds = medians(per_round)
    cpu = statistics.median(cpu_seconds[3:])  # after the warm-up exchanges
    cpu = slowest(cpu, f"{tag}.cpu")
    return {
        "d": size, "bytes": 4 * size, "group_size": p, "matmul_iterations": iterations,
        "rounds_seconds": per_round, "seconds": seconds,
        "overlap_ratio": statistics.median(ratios), "overlap_ratio_rounds": ratios,
        "overlap_ratio_ideal": (seconds["compute"] + seconds["exchange"]) / max(seconds["compute"],
                                                                                seconds["exchange"]),
        "exchange_hidden_fraction": statistics.median(hidden),
        "overlap_ratio_idle_main_thread": statistics.median(idle_ratios),
        "exchange_cpu_seconds": cpu,
        "throughput_MBps": {"transport": sent_bytes / seconds["exchange"] / 1e6,
                            "horovod": sent_bytes / seconds["horovod"] / 1e6},
        "transport_over_horovod_time": seconds["exchange"] / seconds["horovod"],
        "caller_copy_seconds": copy_seconds,
        "together_stamps_rank0_last_round": together_stamps[-1] if together_stamps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="float32 elements")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2, help="nodes when relaunching over loopback")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--shared-machine", action=argparse.BooleanOptionalAction, default=True,
                        help="all emulated nodes share this machine's cores (TF threads per rank = cores / ranks)")
    args = parser.parse_args()
    if not under_launcher():  # --nodes x 1 emulated nodes over loopback
        sys.exit(launch_ranks([__file__, *sys.argv[1:]], args.nodes, 1))

    import horovod
    import tensorflow as tf

    import hvdx
    from hvdx.transport.ring import GroupTransport

    # Each rank computes on its share of the machine's cores, as a rank would on its own GPU
    # (set before TensorFlow's runtime starts, i.e. before hvdx.init()).
    ranks_here = int(os.environ["HOROVOD_SIZE" if args.shared_machine else "HOROVOD_LOCAL_SIZE"])
    threads = max(1, (os.cpu_count() or 1) // ranks_here)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    topo = hvdx.init()
    groups = [tuple(node[l] for node in topo.node_ranks) for l in range(topo.local_size)]
    transport = GroupTransport.create(groups, topo.rank, timeout=600)
    rows = []
    for size in args.sizes:
        row = measure(size, args.rounds, transport, topo, f"d{size}")
        rows.append(row)
        if topo.rank == 0:
            s = row["seconds"]
            print(f"d={size:,}: exchange {s['exchange']:.3f}s (cpu {row['exchange_cpu_seconds']:.3f}s) compute "
                  f"{s['compute']:.3f}s together {s['together']:.3f}s overlap {row['overlap_ratio']:.2f}x "
                  f"(best {row['overlap_ratio_ideal']:.2f}x, hidden {row['exchange_hidden_fraction']:.0%}); idle "
                  f"main thread {row['overlap_ratio_idle_main_thread']:.2f}x; throughput "
                  f"{row['throughput_MBps']['transport']:.1f} MB/s vs horovod {row['throughput_MBps']['horovod']:.1f}",
                  flush=True)
    transport.close()
    cluster = cluster_description()
    if topo.rank == 0:
        result = {
            "benchmark": "daso_transport",
            "topology": {"nodes": topo.num_nodes, "ranks_per_node": topo.local_size},
            "network": cluster or "loopback (horovodrun, emulated nodes on one machine)",
            "rounds": args.rounds,
            "tf_intra_op_threads": threads,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "tensorflow": tf.__version__, "horovod": horovod.__version__,
                        "load_average": os.getloadavg()},
            "method": "slowest rank's time per call, median of rounds after a warm-up round, methods taking "
                      "turns; overlap ratio = (compute alone + exchange alone) / together, median of per-round "
                      "ratios; throughput = 2(P-1)/P x bytes per second",
            "rows": rows,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "daso_transport.json").write_text(json.dumps(result, indent=1) + "\n")
    hvdx.barrier()


if __name__ == "__main__":
    main()
