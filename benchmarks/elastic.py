"""Elastic training (issue 40): wall time to a target accuracy when a node is preempted and
comes back, on the emulated cluster (2 nodes x 2 ranks, 1 Gbit/s links, each node pinned to
its share of this machine's cores, so that a node that leaves takes its compute with it).

The task is convergence.py's communication-bound MLP on the digits (momentum SGD at
0.025 x ranks, batch --batch per rank, an epoch one pass over the training set whatever the
number of ranks), trained for --epochs epochs as a user's Keras script would (tf.data's
autotuning off in its pipeline unless --autotune: docs/elastic.md#tfdatas-autotuning).
Cases, for each of hvdx's `--methods` (HiTopK, 2DTAR = "hierarchical"):

- `uninterrupted`: the elastic script under `horovodrun --min-np 2 --max-np 4
  --host-discovery-script` (hvdx.runner.cluster.run_elastic_job); no node changes;
- `elastic`: the same job; at a third of the epochs (plus half an epoch: mid-epoch) node 1 is
  preempted (its processes SIGKILLed, the discovery script stops listing it), at two thirds it
  is listed again; Horovod's elastic driver resets the job both times;
- `relaunch`: the non-elastic way: a fixed-size job under horovodrun (`-np 4 -H node0:2,node1:2`,
  hvdx.runner.cluster.run_horovodrun_job) that writes a checkpoint (model and optimizer) every
  epoch; the same preemption fails it, and it is relaunched (`-np 2 -H node0:2`) on the node
  left with `--resume` from the last checkpoint and runs to the end;
- `relaunch-hvdx`: the same with hvdx's own launcher (hvdx.runner.cluster.run_job), which starts
  the ranks without horovodrun's start-up (its Gloo build check imports TensorFlow in a forked
  process first): a relaunch as cheap as this machine allows;
- `horovod-elastic`: the `elastic` case with Horovod's own DistributedOptimizer (dense).

Time counts from the launch (start-up included) to the first epoch end at which rank 0's
test accuracy reaches --target. Cases take turns within each repeat.

    python benchmarks/elastic.py                  # root: the emulated cluster; ~25 min
    python benchmarks/elastic.py --smoke --out /tmp/x

Writes benchmarks/results/elastic.json and elastic.png and its section of benchmarks/README.md.
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import contextlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

try:
    import common
    import convergence
except ImportError:  # imported as benchmarks.elastic
    from benchmarks import common, convergence

CASES = ("uninterrupted", "elastic", "relaunch", "relaunch-hvdx", "horovod-elastic")
#: The cases of a fixed-size job, relaunched after the preemption.
RELAUNCHES = ("relaunch", "relaunch-hvdx")
#: The issue's goals: elastic within 15 % of uninterrupted, and 1.3x sooner than a relaunch.
MAX_ELASTIC_OVERHEAD = 1.15
MIN_SPEEDUP_OVER_RELAUNCH = 1.3
#: A preempted node's workers fail; Horovod blacklists a failed host, for good unless given a
#: cooldown: with it the node rejoins once the discovery script lists it again.
COOLDOWN = ("--blacklist-cooldown-range", "1", "5")


# -- a rank ----------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One rank of a case: `--mode elastic` (hvd.elastic.run with a KerasState) or `fixed`
    (a checkpoint per epoch, `--resume` from it). Rank 0 appends one JSON line per epoch
    to --progress: {"t", "epoch", "accuracy", "size"}."""
    common.freeze_start_up()
    import numpy as np
    import tensorflow as tf

    if args.method == "horovod":
        import horovod.tensorflow.keras as hvd
    else:
        import hvdx.keras as hvd

    hvd.init()
    x_train, y_train, x_test, y_test = convergence.digits("mlp")
    tf.keras.utils.set_random_seed(args.seed)
    model = convergence.build_model("mlp", args)
    inner = convergence.inner_optimizer("mlp", hvd.size())
    optimizer = (hvd.DistributedOptimizer(inner) if args.method == "horovod"
                 else hvd.DistributedOptimizer(inner, communication=args.method))
    model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])
    model.build((None, x_train.shape[1]))

    def dataset():
        """This rank's shard of the training set, reshuffled every epoch (rank and size are
        read again after a reset)."""
        x, y = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
        # tf.data's autotuning off unless --autotune: its thread is not woken when the iterator
        # is deleted (the end of a fit, or a fit interrupted by a reset) and the deleting rank
        # waits out its sleep, up to 60 s (docs/elastic.md#tfdatas-autotuning); the data is in
        # memory
        options = tf.data.Options()
        options.autotune.enabled = args.autotune
        return (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=args.seed + hvd.rank())
                .repeat().batch(args.batch).with_options(options))

    def steps_per_epoch() -> int:
        return math.ceil(len(x_train) / (args.batch * hvd.size()))

    class Progress(tf.keras.callbacks.Callback):
        def __init__(self, first_epoch: int):
            super().__init__()
            self.first_epoch = first_epoch

        def on_epoch_end(self, epoch, logs=None):
            if hvd.rank() != 0:
                return
            predicted = np.argmax(self.model(x_test, training=False).numpy(), axis=1)
            line = {"t": time.time(), "epoch": self.first_epoch + epoch + 1,
                    "accuracy": float(np.mean(predicted == y_test)), "size": hvd.size()}
            with open(args.progress, "a") as f:
                f.write(json.dumps(line) + "\n")

    if args.mode == "elastic":
        state = hvd.elastic.KerasState(model, batch=0, epoch=0)

        def on_reset():
            tf.keras.backend.set_value(model.optimizer.learning_rate, 0.025 * hvd.size())

        state.register_reset_callbacks([on_reset])

        @hvd.elastic.run
        def train(state):
            callbacks = [Progress(state.epoch), hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every),
                         hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]
            model.fit(dataset(), steps_per_epoch=steps_per_epoch(), epochs=args.epochs - state.epoch,
                      callbacks=callbacks, verbose=0)

        train(state)
    else:
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        prefix, done = Path(args.checkpoint) / "ckpt", Path(args.checkpoint) / "epoch.json"
        first = 0
        if args.resume and done.exists():
            first = json.loads(done.read_text())["epoch"]
            checkpoint.read(str(prefix)).expect_partial()

        class Save(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if hvd.rank() == 0:
                    checkpoint.write(str(prefix))
                    done.write_text(json.dumps({"epoch": first + epoch + 1}))

        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), Progress(first), Save()]
        model.fit(dataset(), steps_per_epoch=steps_per_epoch(), epochs=args.epochs - first, callbacks=callbacks,
                  verbose=0)
    hvd.allreduce(tf.constant(0.0), name="elastic.benchmark.end")  # every rank ends together
    if hvd.rank() == 0:
        with open(args.progress, "a") as f:
            f.write(json.dumps({"t": time.time(), "done": True}) + "\n")


# -- a case ----------------------------------------------------------------------------------
def _records(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _epochs(path: Path) -> List[dict]:
    return [r for r in _records(path) if "accuracy" in r]


def _worker_command(args: argparse.Namespace, method: str, mode: str, folder: Path, resume: bool = False) -> List[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--method", method, "--mode", mode,
               "--progress", str(folder / "progress.jsonl"), "--checkpoint", str(folder),
               "--epochs", str(args.epochs), "--batch", str(args.batch), "--seed", str(args.seed),
               "--mlp-scale", str(args.mlp_scale), "--commit-every", str(args.commit_every)]
    return command + (["--smoke"] if args.smoke else []) + (["--resume"] if resume else []) + (
        ["--autotune"] if args.autotune else [])


def _kill_jobs(dump: Path) -> None:
    """Kills the job this process launched (its launcher's whole process tree), after writing
    where each of its ranks is to `dump` where py-spy is installed."""
    import shutil
    import subprocess

    import psutil

    from hvdx.runner.launch import kill_tree

    if shutil.which("py-spy"):
        with open(dump, "w") as out:
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "--worker" in proc.cmdline():
                        out.write(f"=== {proc.pid}\n")
                        out.flush()
                        subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], stdout=out, stderr=out, timeout=60)
    for child in psutil.Process().children():
        kill_tree(child.pid)


def run_case(case: str, method: str, args: argparse.Namespace, cluster, folder: Path) -> Dict[str, Any]:
    """Runs one case on `cluster` and returns its record: the launch time, rank 0's epochs
    (`records`), when the node was preempted and listed again, the jobs' exit statuses."""
    from hvdx.runner.cluster import run_elastic_job, run_horovodrun_job, run_job

    folder.mkdir(parents=True)
    hosts, discovery = folder / "hosts", folder / "discover.sh"
    both = "".join(f"{cluster.node_hostname(i)}:{args.ranks_per_node}\n" for i in range(cluster.nodes))
    hosts.write_text(both)
    discovery.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discovery.chmod(0o755)
    progress = folder / "progress.jsonl"
    env = {"PYTHONPATH": str(common.ROOT)}
    if args.gloo_timeout:  # the rendezvous (patch 0003) waits for a returning node's new processes
        env.update(HOROVOD_GLOO_TIMEOUT_SECONDS=str(args.gloo_timeout), HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS="120")
    codes: List[int] = []
    mode = "fixed" if case in RELAUNCHES else "elastic"
    worker_method = "horovod" if case == "horovod-elastic" else method

    def launch(resume: bool = False, nodes=None) -> threading.Thread:
        command = _worker_command(args, worker_method, mode, folder, resume)
        if mode == "fixed":
            fixed = run_horovodrun_job if case == "relaunch" else run_job
            target = lambda: codes.append(fixed(cluster, args.ranks_per_node, command, timeout=args.timeout,  # noqa: E731
                                                env=env, out=log, nodes=nodes))
        else:
            target = lambda: codes.append(run_elastic_job(  # noqa: E731
                cluster, args.ranks_per_node, command, discovery_script=str(discovery), min_np=args.ranks_per_node,
                timeout=args.timeout, env=env, out=log, horovodrun_args=COOLDOWN))
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    events: Dict[str, float] = {}
    with open(folder / "output.log", "w") as log:
        start = time.time()
        job = launch()
        preempt_after, back_after = args.epochs // 3, 2 * args.epochs // 3
        while job.is_alive():
            job.join(0.2)
            records = _epochs(progress)
            if records and time.time() - records[-1]["t"] > args.stall and "stalled" not in events:
                events["stalled"] = time.time() - start  # no epoch for --stall seconds: the job hangs
                _kill_jobs(folder / "stall.txt")
            if case == "uninterrupted" or not records:
                continue
            last = records[-1]
            if "preempted" not in events and last["epoch"] >= preempt_after:
                # mid-epoch: half an epoch after the boundary, as the last epoch took
                epoch_s = last["t"] - (records[-2]["t"] if len(records) > 1 else start)
                time.sleep(max(0.0, last["t"] + epoch_s / 2 - time.time()))
                hosts.write_text(f"{cluster.node_hostname(0)}:{args.ranks_per_node}\n")
                cluster.kill_node(1)
                events["preempted"] = time.time() - start
                if case in RELAUNCHES:
                    job.join(args.timeout)
                    events["relaunched"] = time.time() - start
                    job = launch(resume=True, nodes=[0])
            elif case not in RELAUNCHES and "preempted" in events and "back" not in events and last["epoch"] >= back_after:
                hosts.write_text(both)
                events["back"] = time.time() - start
        end = time.time() - start
    records = _epochs(progress)
    for r in records:
        r["t"] -= start
    done = [r["t"] - start for r in _records(progress) if r.get("done")]
    if done:
        events["training_done"] = done[-1]
    return {"case": case, "method": method, "records": records, "events": events, "seconds": end,
            "exit_codes": codes, "log": str(folder / "output.log")}


def seconds_to(record: dict, target: float) -> Optional[float]:
    """When rank 0's test accuracy first reached `target` (seconds from the launch), or None."""
    return next((r["t"] for r in record["records"] if r["accuracy"] >= target), None)


def reset_costs(record: dict) -> List[float]:
    """Seconds each change of the number of ranks cost: the gap between the last epoch before
    it and the first after, less the median epoch at the new size (the epoch's own work)."""
    epochs = record["records"]
    durations: Dict[int, List[float]] = {}
    for before, after in zip(epochs, epochs[1:]):
        if before["size"] == after["size"]:
            durations.setdefault(after["size"], []).append(after["t"] - before["t"])
    return [round(after["t"] - before["t"] - statistics.median(durations.get(after["size"], [0.0])), 1)
            for before, after in zip(epochs, epochs[1:]) if before["size"] != after["size"]]


# -- reporting -------------------------------------------------------------------------------
def summarize(runs: List[dict], target: float) -> Dict[str, Dict[str, dict]]:
    """Per method and case: the median over repeats of the time to target, the final accuracy
    and the whole run; the ratios the goals name (elastic / uninterrupted, relaunch / elastic)."""
    out: Dict[str, Dict[str, dict]] = {}
    for run in runs:
        entry = out.setdefault(run["method"], {}).setdefault(run["case"], {"to_target": [], "final": [], "total": [],
                                                                           "hung": 0})
        entry["hung"] += "stalled" in run.get("events", {})
        entry.setdefault("resets", []).append(reset_costs(run))
        entry["to_target"].append(seconds_to(run, target))
        entry["final"].append(run["records"][-1]["accuracy"] if run["records"] else None)
        entry["total"].append(run["seconds"])
    for cases in out.values():
        for entry in cases.values():
            reached = [s for s in entry["to_target"] if s is not None]
            entry["median_to_target"] = statistics.median(reached) if len(reached) == len(entry["to_target"]) else None
            entry["median_final"] = statistics.median([a for a in entry["final"] if a is not None] or [0.0])
            entry["median_total"] = statistics.median(entry["total"])
        base, elastic, relaunch, cheap = (cases.get(c, {}).get("median_to_target")
                                          for c in ("uninterrupted", "elastic", *RELAUNCHES))
        cases["ratios"] = {"elastic_over_uninterrupted": elastic / base if elastic and base else None,
                           "relaunch_over_elastic": relaunch / elastic if relaunch and elastic else None,
                           "relaunch_hvdx_over_elastic": cheap / elastic if cheap and elastic else None}
    return out


def verdicts(summary: Dict[str, Dict[str, dict]]) -> List[str]:
    """One line per method and goal: met, or by how much it is missed."""
    lines = []
    for method, cases in summary.items():
        ratios = cases["ratios"]
        over, speedup = ratios["elastic_over_uninterrupted"], ratios["relaunch_over_elastic"]
        if over is None or speedup is None:
            lines.append(f"{method}: a case did not reach the target in every repeat (see the table)")
            continue
        over_goal = "met" if over <= MAX_ELASTIC_OVERHEAD else f"missed by {over - MAX_ELASTIC_OVERHEAD:.2f}"
        speedup_goal = ("met" if speedup >= MIN_SPEEDUP_OVER_RELAUNCH
                        else f"missed by {MIN_SPEEDUP_OVER_RELAUNCH - speedup:.2f}")
        against_hvdx = ratios.get("relaunch_hvdx_over_elastic")
        lines.append(f"{method}: elastic {over:.2f}x the uninterrupted time (goal <= {MAX_ELASTIC_OVERHEAD}: "
                     f"{over_goal}), {speedup:.2f}x sooner than a relaunch (goal >= {MIN_SPEEDUP_OVER_RELAUNCH}: "
                     f"{speedup_goal})"
                     + (f"; {against_hvdx:.2f}x sooner than a relaunch by hvdx's launcher" if against_hvdx else ""))
    return lines


def table(summary: Dict[str, Dict[str, dict]]) -> str:
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    rows = []
    for method, cases in summary.items():
        for case in CASES:
            if case in cases:
                e = cases[case]
                rows.append([method if case != "horovod-elastic" else "horovod (dense)", case,
                             fmt(e["median_to_target"]), " / ".join(fmt(s) for s in e["to_target"]),
                             fmt(e["median_final"], ".3f"),
                             fmt(e["median_total"]) + (f" (hung {e['hung']}/{len(e['total'])}, killed)" if e["hung"] else ""),
                             " / ".join(", ".join(fmt(c, ".0f") for c in costs) or "-" for costs in e["resets"])])
    return common.markdown_table(["method", "case", "s to target (median)", "each repeat", "final accuracy",
                                  "s in all", "s per size change (each repeat)"], rows, text_columns=2)


def plot(runs: List[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in runs})
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4.5), squeeze=False)
    for ax, method in zip(axes[0], methods):
        for run in (r for r in runs if r["method"] == method):
            ax.plot([r["t"] for r in run["records"]], [r["accuracy"] for r in run["records"]], marker=".",
                    label=f"{run['case']} (seed {run.get('seed')})")
            for name, t in run["events"].items():
                ax.axvline(t, color="gray", lw=0.5, ls=":")
        ax.axhline(target, color="black", lw=0.8)
        ax.set(title=f"{method}: a node preempted at 1/3, back at 2/3", xlabel="seconds from launch",
               ylabel="test accuracy", ylim=(0.5, 1.0))
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def report(args: argparse.Namespace, result: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps(result, indent=1))
    plot(result["runs"], args.target, args.out / "elastic.png")
    readme = common.readme_path(args)
    if readme is not None:
        network = result["network"]
        body = (f"`python benchmarks/elastic.py {' '.join(result['argv'])}`: {network['nodes']} nodes x "
                f"{args.ranks_per_node} ranks, links {network['rate']}, node i on cores {network['cpus']}; "
                f"{args.epochs} epochs of the MLP (scale {args.mlp_scale}), batch {args.batch} per rank, tf.data's "
                f"autotuning {'on' if args.autotune else 'off'}, target "
                f"{args.target}; {args.repeats} repeat(s), cases taking turns; load average "
                f"{result['load_average'][0]:.1f} -> {result['load_average'][1]:.1f}.\n\n"
                + table(result["summary"]) + "\n\n" + "\n".join(f"- {line}" for line in result["verdicts"]))
        common.update_readme("elastic", body, readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="hitopk,hierarchical", type=lambda s: s.split(","))
    parser.add_argument("--cases", default=",".join(CASES), type=lambda s: s.split(","))
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.925)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--mlp-scale", type=float, default=0.5, help="width of the MLP (1: train_step.py's)")
    parser.add_argument("--commit-every", type=int, default=5, help="batches per elastic commit")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--rate", default="1gbit", help="inter-node link rate (tc syntax)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--gloo-timeout", type=int, default=None,
                        help="HOROVOD_GLOO_TIMEOUT_SECONDS of every job (default: Horovod's, 30); the "
                             "rendezvous then waits 120 s (HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS, Horovod patch 0003)")
    parser.add_argument("--stall", type=float, default=120.0, help="seconds without an epoch: the job is killed")
    parser.add_argument("--keep-logs", action="store_true", help="keep the jobs' logs (and py-spy dumps of hung jobs)")
    parser.add_argument("--smoke", action="store_true", help="a tiny MLP, 9 epochs of batches of 8 (tests)")
    parser.add_argument("--autotune", action="store_true",
                        help="tf.data's autotuning on in the ranks' datasets (TensorFlow's default; off here)")
    # a rank's options
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("elastic", "fixed"), help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    common.add_output_arguments(parser, readme=None)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.smoke:  # small batches: enough steps after the node's return for it to rejoin
        args.epochs, args.target, args.batch = 9, min(args.target, 0.5), 8
    sys.path.insert(0, str(common.ROOT))
    from hvdx.runner.cluster import Cluster, LinkSpec

    runs: List[dict] = []
    work = Path(tempfile.mkdtemp(prefix="hvdx-elastic-"))  # the jobs' logs, progress files, checkpoints
    print(f"logs in {work}{'' if args.keep_logs else ' (removed at the end; --keep-logs keeps them)'}", flush=True)
    with common.load_during() as load, Cluster(2, LinkSpec(rate=args.rate, delay=None), pin_cores=True) as cluster:
        network = cluster.describe()
        for repeat in range(args.repeats):
            for method in args.methods:
                for case in args.cases:
                    if case == "horovod-elastic" and method != args.methods[0]:
                        continue  # Horovod's dense run does not depend on hvdx's method
                    run = run_case(case, method, args, cluster, work / f"{method}-{case}-{repeat}")
                    run.update(repeat=repeat, seed=args.seed)
                    reached = seconds_to(run, args.target)
                    if run["exit_codes"][-1:] != [0] and not args.keep_logs:
                        print("".join(Path(run["log"]).read_text().splitlines(keepends=True)[-40:]), flush=True)
                    print(f"{method} {case} repeat {repeat}: exit {run['exit_codes']}, target "
                          f"{'-' if reached is None else f'{reached:.1f} s'}, final "
                          f"{run['records'][-1]['accuracy'] if run['records'] else None}, {run['seconds']:.1f} s in all, "
                          f"events {run['events']}", flush=True)
                    runs.append(run)
    if not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs, args.target)
    result = {"runs": runs, "summary": summary, "verdicts": verdicts(summary), "network": network,
              "load_average": [load["start"][0], load["end"][0]],
              "argv": list(argv if argv is not None else sys.argv[1:]),
              "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    report(args, result)
    print(table(summary))
    print("\n".join(result["verdicts"]))


if __name__ == "__main__":
    main()
