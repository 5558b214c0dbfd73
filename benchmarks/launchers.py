"""Launchers compared (issue 22): the digits demo under Gloo and under MPI, on one machine.

Two measurements, two modes:

- `--mode cpu` (any time; load does not distort it much): the CPU seconds each rank burns,
  (a) idle for 3 s after hvd.init() and (b) per training step of the digits demo's model, and
  the share of the busiest thread, which is Horovod's background thread when it is the first
  thread hvd.init() started. Configurations: `horovodrun --gloo` 2 x 2; `mpirun` 1 x 4 with 4
  declared slots on fewer cores, spinning (HVDX_MPI_DEFAULTS=0) and yielding (hvdx's default,
  hvdx/mpi_defaults.py); `mpirun --oversubscribe` 1 x 4; `mpirun` 2 x 2 on emulated nodes
  (hvdx/runner/mpi.py) spinning (`--mca mpi_yield_when_idle 0`) and yielding. A configuration that
  does not finish within --timeout is reported as such (the spinning ones crawl under load).

- `--mode wall` (alone on the machine: `flock /tmp/hvdx-bench.lock`): wall time of the whole
  digits demo (`examples/train_digits.py`, launch to exit, and the training time it prints)
  under `horovodrun --gloo` 2 x 2, `mpirun` 2 x 2 (emulated nodes), `mpirun` 1 x 4,
  `horovodrun --mpi` 1 x 4, `srun` 2 x 2 (hvdx/runner/slurm.py's throwaway cluster), and Gloo
  against mpirun on the emulated cluster's 1 Gbit/s links (hvdx/runner/cluster.py, --mpi);
  the launchers take turns in each round; medians over rounds and
  each launcher's ratio to Gloo on the same network (horovodrun --gloo 2 x 2; on the emulated
  cluster, its Gloo job); issue 22's bar: within 1.5x.

    python benchmarks/launchers.py --mode cpu                        # ~5 min here
    flock /tmp/hvdx-bench.lock python benchmarks/launchers.py --mode wall --rounds 3

Writes <out>/launchers_<mode>.json and the "launchers-<mode>" section of benchmarks/README.md
(only when --out is the default). Needs root for the emulated nodes (skipped otherwise).
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
from hvdx.runner import hosts, launch, mpi, netns, slurm  # noqa: E402

DEMO = ROOT / "examples" / "train_digits.py"
SECTION = "launchers"


# -- the rank side of --mode cpu ---------------------------------------------------------------
def _threads() -> Dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def rank_cpu(epochs: int) -> None:
    """One rank of --mode cpu: prints `LAUNCHERS-RESULT <json>` on rank 0 with every rank's numbers."""
    sys.path.insert(0, str(ROOT / "examples"))
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from train_digits import build_model, shard

    import hvdx

    before = set(_threads())
    topo = hvdx.init()
    horovod_threads = sorted(set(_threads()) - before)
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target
    x_mine, y_mine = shard(x, y, topo.rank, topo.size)
    model = build_model(0)
    model.compile(optimizer=hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.05 * topo.size, momentum=0.9),
                                                      communication="hitopk"),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x_mine, y_mine, batch_size=16, epochs=1, verbose=0)  # warm-up: tracing
    hvdx.barrier()
    steps = epochs * -(-len(x_mine) // 16)
    mine = {"horovod_thread_first": horovod_threads[0] if horovod_threads else None}
    for phase in ("idle", "train"):
        wall, cpu, threads = time.perf_counter(), time.process_time(), _threads()
        if phase == "idle":
            time.sleep(3)
        else:
            model.fit(x_mine, y_mine, batch_size=16, epochs=epochs, verbose=0)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after = _threads()
        busiest = max(after, key=lambda t: after[t] - threads.get(t, 0.0))
        mine[phase] = {"wall_s": wall, "cpu_s": cpu, "busiest_cpu_s": after[busiest] - threads.get(busiest, 0.0),
                       "busiest_is_horovod": busiest == mine["horovod_thread_first"],
                       "busiest_is_main": busiest == os.getpid()}
        hvdx.barrier()
    everyone = hvd.allgather_object(mine, name="launchers.cpu")
    if topo.rank == 0:
        print("LAUNCHERS-RESULT " + json.dumps({"steps": steps, "nodes": topo.num_nodes, "per_node": topo.local_size,
                                                "ranks": everyone}), flush=True)
    hvdx.barrier()


# -- the driver ----------------------------------------------------------------------------------
def configurations(mode: str, rank_command: List[str]) -> Dict[str, tuple]:
    """name -> (command or None, why not) for this machine; every command runs `rank_command`."""
    cores = os.cpu_count() or 1
    out: Dict[str, tuple] = {"horovodrun --gloo 2x2": (launch.horovodrun_command(rank_command, np=4,
                                                                                   hosts=hosts(2, 2)), None)}
    why_mpi, why_emulated = mpi.mpi_unavailable(), mpi.emulation_unavailable()
    if mode == "cpu":
        declared = mpi.mpirun_command(rank_command, np=4, hosts="localhost:4")
        out["mpirun 1x4, 4 slots, spinning"] = (declared, why_mpi, {"HVDX_MPI_DEFAULTS": "0"})
        out["mpirun 1x4, 4 slots, hvdx yields"] = (declared, why_mpi)
        out["mpirun --oversubscribe 1x4"] = (mpi.mpirun_command(rank_command, np=4, oversubscribe=4 > cores), why_mpi)
        out["mpirun 2x2 emulated, spinning"] = ("emulated", why_emulated, {}, {"mpi_yield_when_idle": "0"})
        out["mpirun 2x2 emulated, yielding"] = ("emulated", why_emulated)
    else:
        out["mpirun 2x2 emulated"] = ("emulated", why_emulated)
        out["mpirun 1x4"] = (mpi.mpirun_command(rank_command, np=4, oversubscribe=4 > cores), why_mpi)
        out["horovodrun --mpi 1x4"] = (launch.horovodrun_command(rank_command, np=4, hosts="localhost:4",
                                                                 controller="mpi"), why_mpi)
        out["srun 2x2 (throwaway SLURM)"] = ("slurm", slurm.slurm_unavailable() or why_mpi)
        why_cluster = netns.unavailable()
        for label, use_mpi in (("gloo", False), ("mpirun", True)):
            out[f"emulated cluster 1gbit, {label} 2x2"] = (
                launch.cluster_command(rank_command, nodes=2, ranks_per_node=2, rate="1gbit", mpi=use_mpi),
                why_cluster or (why_emulated if use_mpi else None))
    return out


def run_one(spec: tuple, rank_command: List[str], timeout: float,
            cluster: Optional[slurm.LocalSlurm] = None) -> dict:
    command, why, env, mca = (tuple(spec) + ({}, {}))[:4]
    if why:
        return {"skipped": why}
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", **env)
    start = time.perf_counter()
    if command == "slurm":
        command = cluster.command(rank_command, ranks_per_node=2)
        job = launch.run(command, timeout=timeout, env=cluster.environment(full_env), cwd=ROOT)
    elif command == "emulated":
        with mpi.EmulatedNodes(2, 2) as nodes:
            command = nodes.command(rank_command, mca=mca)
            job = launch.run(command, timeout=timeout, env=full_env, cwd=ROOT)
    else:
        job = launch.run(command, timeout=timeout, env=full_env, cwd=ROOT)
    wall = time.perf_counter() - start
    out = {"command": " ".join(command), "wall_s": wall, "returncode": job.returncode, "timed_out": job.timed_out}
    for line in job.output.splitlines():
        if "LAUNCHERS-RESULT " in line:
            out.update(json.loads(line.split("LAUNCHERS-RESULT ", 1)[1]))
        if "trained " in line and " in " in line and " s: test accuracy" in line:
            out["train_s"] = float(line.split(" in ")[-1].split(" s:")[0])
            out["accuracy"] = float(line.split("test accuracy ")[1].split(",")[0])
    if job.returncode != 0:
        out["failure"] = "\n".join(job.output.splitlines()[-15:])
    return out


def cpu_table(results: Dict[str, dict]) -> str:
    rows = []
    for name, r in results.items():
        if "skipped" in r:
            rows.append([name, "skipped: " + r["skipped"], "", "", "", ""])
            continue
        if "ranks" not in r:
            rows.append([name, "did not finish" + (f" in {r['wall_s']:.0f} s" if r.get("timed_out") else ""),
                         "", "", "", ""])
            continue
        ranks, steps = r["ranks"], r["steps"]
        idle = statistics.median(x["idle"]["cpu_s"] / x["idle"]["wall_s"] for x in ranks)
        per_step = statistics.median(1e3 * x["train"]["cpu_s"] / steps for x in ranks)
        wall_step = max(1e3 * x["train"]["wall_s"] / steps for x in ranks)
        busiest = statistics.median(x["train"]["busiest_cpu_s"] / x["train"]["cpu_s"] for x in ranks)
        who = ("Horovod's background thread" if all(x["train"]["busiest_is_horovod"] for x in ranks) else
               "main" if all(x["train"]["busiest_is_main"] for x in ranks) else "mixed")
        rows.append([name, f"{r['nodes']} x {r['per_node']}", f"{idle:.2f}", f"{per_step:.1f}",
                     f"{busiest:.0%} ({who})", f"{wall_step:.0f}"])
    return common.markdown_table(["configuration", "topology", "idle CPU s/s per rank", "CPU ms per step per rank",
                                  "busiest thread's share", "wall ms per step (load-dependent)"], rows, text_columns=2)


def wall_table(results: Dict[str, List[dict]]) -> str:
    """One row per launcher; ratios to Gloo on the same network: horovodrun --gloo 2x2 on this
    machine's loopback, or the emulated cluster's Gloo job for the emulated cluster's rows."""
    def medians_of(name: str) -> tuple:
        ok = [r for r in results.get(name, []) if r.get("returncode") == 0 and "train_s" in r]
        if not ok:
            return None, None
        return statistics.median(r["wall_s"] for r in ok), statistics.median(r["train_s"] for r in ok)

    rows = []
    for name, rounds in results.items():
        ok = [r for r in rounds if r.get("returncode") == 0 and "train_s" in r]
        if not ok:
            rows.append([name, rounds[0].get("skipped", "failed"), "", "", "", ""])
            continue
        wall, train = medians_of(name)
        base_wall, base_train = medians_of("emulated cluster 1gbit, gloo 2x2" if name.startswith("emulated cluster")
                                           else "horovodrun --gloo 2x2")
        rows.append([name, f"{wall:.1f}", f"{min(r['wall_s'] for r in ok):.1f}-{max(r['wall_s'] for r in ok):.1f}",
                     f"{wall / base_wall:.2f}x" if base_wall else "", f"{train:.1f}",
                     f"{train / base_train:.2f}x" if base_train else ""])
    return common.markdown_table(["launcher", "wall s (median)", "range", "vs Gloo, same network", "training s (median)",
                                  "vs Gloo, same network"], rows, text_columns=1)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="--mode wall: rounds, launchers taking turns")
    parser.add_argument("--epochs", type=int, default=None,
                        help="training epochs (default: 3 for cpu, the demo's 20 for wall)")
    parser.add_argument("--timeout", type=float, default=300, help="per launch, seconds")
    parser.add_argument("--only", default=None, help="comma-separated substrings of configuration names")
    parser.add_argument("--rank-cpu", action="store_true", help=argparse.SUPPRESS)
    common.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.rank_cpu:
        return rank_cpu(args.epochs or 3)
    if args.mode == "cpu":
        rank_command = [sys.executable, str(Path(__file__).resolve()), "--rank-cpu", "--epochs", str(args.epochs or 3)]
    else:
        rank_command = [sys.executable, str(DEMO)] + (["--epochs", str(args.epochs)] if args.epochs else [])
    configs = configurations(args.mode, rank_command)
    if args.only:
        configs = {k: v for k, v in configs.items() if any(s in k for s in args.only.split(","))}
    rounds = 1 if args.mode == "cpu" else args.rounds
    results: Dict[str, List[dict]] = {name: [] for name in configs}
    with contextlib.ExitStack() as stack, common.load_during() as load:
        cluster = None
        if any(spec[0] == "slurm" and not spec[1] for spec in configs.values()):
            cluster = stack.enter_context(slurm.LocalSlurm(nodes=2, cpus_per_node=2))
        for round_ in range(rounds):
            for name, spec in configs.items():
                result = run_one(spec, rank_command, args.timeout, cluster)
                results[name].append(result)
                print(f"round {round_} {name}: " + json.dumps({k: v for k, v in result.items() if k != "ranks"}),
                      flush=True)
    if args.mode == "cpu":
        table = cpu_table({name: r[0] for name, r in results.items()})
    else:
        table = wall_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"launchers_{args.mode}.json").write_text(json.dumps(
        {"mode": args.mode, "cores": os.cpu_count(), "load": load, "results": results}, indent=1))
    load_text = f"load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end"
    print(table + "\n" + load_text)
    readme = common.readme_path(args)
    if readme is not None:
        common.update_readme(f"{SECTION}-{args.mode}", f"{table}\n\n{os.cpu_count()} cores, {load_text}.", readme)


if __name__ == "__main__":
    main()
