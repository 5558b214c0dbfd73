"""TensorFlow 2.21 beside TensorFlow 2.15: the numbers of benchmarks/README.md that matter to
users, re-measured on each stack as ratios (issue 41).

For each benchmark, runs its command under each stack's venv in turn (stacks taking turns,
the same arguments), each into `<out>/<stack>/<benchmark>/`, then tabulates side by side:

- topk.py: `tf.math.top_k` / MSTopK and MSTopK / one `reduce_max(|x|)` per distribution
  (shi2021 Figure 6's goals), and the sparse accumulation's speed-up over
  `unsorted_segment_sum`;
- train_step.py: each strategy's `model.fit` step speed-up over Horovod's
  (2x2, Gloo, the emulated 1 Gbit/s cluster), median and range of the rounds;
- convergence.py: test accuracy after the same steps (mean over seeds), and points against
  Horovod.

A ratio is read within its own run: both stacks' runs are made back to back, the timed ones
alone on the machine (`flock /tmp/hvdx-bench.lock`). Each stack must be bootstrapped first
(`make bootstrap HVDX_STACK=<stack>`).

    flock /tmp/hvdx-bench.lock python benchmarks/stacks.py            # all three, ~35 min alone
    python benchmarks/stacks.py --only topk --stacks tf2.15,tf2.21
    python benchmarks/stacks.py --tabulate                           # the table from kept runs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import ROOT, add_output_arguments, markdown_table, readme_path, update_readme
except ImportError:
    from benchmarks.common import ROOT, add_output_arguments, markdown_table, readme_path, update_readme

STACKS = ("tf2.15", "tf2.21")

# The reduced configurations run on both stacks (the README's full runs take over an hour each).
COMMANDS: Dict[str, List[str]] = {
    "topk": ["benchmarks/topk.py", "--distributions", "normal", "student_t3", "resnet_grad",
             "--sizes", "1048576", "25000000", "--repeats", "5", "--rounds", "5"],
    "train_step": ["benchmarks/train_step.py", "--topologies", "2x2", "--models", "mlp,cnn",
                   "--optimizers", "none,horovod,allreduce,hierarchical,hitopk", "--rounds", "4", "--steps", "3"],
    "convergence": ["benchmarks/convergence.py", "--local", "--tasks", "mnist", "--steps", "200",
                    "--methods", "horovod,hitopk", "--seeds", "3"],
}
RESULT_FILE = {"topk": "topk.json", "train_step": "train_step.json", "convergence": "convergence.json"}


def venv_python(stack: str) -> Path:
    """The Python of `stack`'s venv (scripts/bootstrap.sh --venv).

    Raises:
        SystemExit: the stack is not bootstrapped (says the command that does it).
    """
    venv = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap.sh"), "--venv"], check=True, text=True,
                          capture_output=True, env={**os.environ, "HVDX_STACK": stack}, cwd=ROOT).stdout.strip()
    python = ROOT / venv / "bin" / "python"  # not resolved: the link is what makes it the venv's
    if not python.exists():
        raise SystemExit(f"stack {stack} has no venv at {venv}: run `make bootstrap HVDX_STACK={stack}` first")
    return python


def run(benchmark: str, stack: str, out: Path) -> float:
    """Runs `benchmark`'s command under `stack` into `out`; returns its wall seconds.

    Raises:
        SystemExit: the run failed (its exit status in the message).
    """
    out.mkdir(parents=True, exist_ok=True)
    # Its own README section goes beside its results: the benchmark's section of
    # benchmarks/README.md belongs to its own full runs, not to this reduced one.
    command = [str(venv_python(stack)), *COMMANDS[benchmark], "--out", str(out), "--readme", str(out / "README.md")]
    print(f"[stacks] {stack}: {' '.join(command)}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env.update(HVDX_STACK=stack, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    if code:
        raise SystemExit(f"{benchmark} on {stack} failed (exit status {code})")
    return time.monotonic() - start


def load(out: Path, stack: str, benchmark: str) -> dict:
    path = out / stack / benchmark / RESULT_FILE[benchmark]
    if not path.exists():
        raise SystemExit(f"no result at {path}: run `python benchmarks/stacks.py --only {benchmark}` first")
    return json.loads(path.read_text())


def ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}" if old else "-"


def topk_rows(results: Mapping[str, dict], stacks: Sequence[str]) -> List[List[str]]:
    """Per distribution and goal: each stack's ratio, then the new stack's over the old's."""
    rows = []
    first = results[stacks[0]]
    for i, dist in enumerate(first["distributions"]):
        for key, label in (("top_k_over_mstopk", "top_k / MSTopK"), ("mstopk_over_floor", "MSTopK / floor")):
            values = [results[s]["distributions"][i][key] for s in stacks]
            rows.append([f"{dist['distribution']} (d={dist['d']:,})", label, *(f"{v:.2f}x" for v in values),
                         ratio(values[-1], values[0])])
    for i, size in enumerate(first["accumulate_seconds"]):
        values = [results[s]["accumulate_seconds"][i] for s in stacks]
        speedups = [v["unsorted_segment_sum"] / v["sparse_accumulate"] for v in values]
        rows.append([f"accumulate (d={size['d']:,})", "segment_sum / ours", *(f"{v:.2f}x" for v in speedups),
                     ratio(speedups[-1], speedups[0])])
    return rows


def train_step_rows(results: Mapping[str, dict], stacks: Sequence[str]) -> List[List[str]]:
    rows = []
    summary = {s: results[s]["runs"][0]["summary"] for s in stacks}
    for model, by_optimizer in summary[stacks[0]].items():
        for optimizer, entry in by_optimizer.items():
            if "speedup_vs_horovod" not in entry:
                continue
            cells = []
            for s in stacks:
                e = summary[s][model][optimizer]
                low, high = e["speedup_range"]
                cells.append(f"{e['speedup_vs_horovod']:.2f}x ({low:.2f}-{high:.2f})")
            values = [summary[s][model][optimizer]["speedup_vs_horovod"] for s in stacks]
            rows.append([model, optimizer, *cells, ratio(values[-1], values[0])])
        horovod = [summary[s][model]["horovod"]["median_seconds"] * 1000 for s in stacks]
        rows.append([model, "Horovod's step (ms)", *(f"{v:.0f}" for v in horovod), ratio(horovod[-1], horovod[0])])
    return rows


def convergence_rows(results: Mapping[str, dict], stacks: Sequence[str]) -> List[List[str]]:
    rows = []
    for task, by_method in results[stacks[0]]["summary"].items():
        for method in by_method:
            cells = []
            for s in stacks:
                e = results[s]["summary"][task][method]
                spread = (results[s].get("seeds") or {}).get(task, {}).get(method)
                seeds = f", seeds {spread['min']:.3f}-{spread['max']:.3f}" if spread else ""
                cells.append(f"{e['final_accuracy']:.3f} ({e['gap_points']:+.1f}{seeds})")
            rows.append([task, method, *cells, ""])
    return rows


TABLES = {
    "topk": ("top-k selection and sparse accumulation, 1 process (ratios: hvdx faster above 1)",
             ["input", "ratio"], topk_rows),
    "train_step": ("`model.fit` step, speed-up over Horovod's, median (range) of the rounds",
                   ["model", "optimizer"], train_step_rows),
    "convergence": ("test accuracy after 200 steps, mean of the seeds (points vs Horovod), 2x2 over loopback",
                    ["task", "method"], convergence_rows),
}


def tabulate(out: Path, stacks: Sequence[str], benchmarks: Sequence[str], seconds: Mapping[str, float]) -> str:
    """The markdown of the comparison: one table per benchmark, the last column new / old."""
    parts = []
    versions = {}
    for b in benchmarks:
        results = {s: load(out, s, b) for s in stacks}
        if b == "topk":
            versions = {s: results[s]["machine"]["tensorflow"] for s in stacks}
        title, head, rows = TABLES[b]
        command = " ".join(COMMANDS[b])
        parts.append(f"**{b}.py**: {title}. `python {command}` on each stack:\n")
        header = [*head, *stacks, f"{stacks[-1]} / {stacks[0]}"]
        parts.append(markdown_table(header, rows(results, stacks), text_columns=len(head)) + "\n")
    where = ", ".join(f"{s}: TensorFlow {versions[s]}" for s in stacks) if versions else ", ".join(stacks)
    took = "; ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
    head = (f"Measured by `python benchmarks/stacks.py` ({where}); each benchmark ran on both stacks back to back, "
            f"stacks taking turns." + (f" Wall time: {took}." if took else "") + "\n")
    return head + "\n" + "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", default=",".join(STACKS), type=lambda s: s.split(","))
    parser.add_argument("--only", default=",".join(COMMANDS), type=lambda s: s.split(","),
                        help="benchmarks to run and tabulate (topk, train_step, convergence)")
    parser.add_argument("--tabulate", action="store_true", help="no runs: the tables from the kept results")
    add_output_arguments(parser)
    args = parser.parse_args()
    unknown = [b for b in args.only if b not in COMMANDS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}: choose from {sorted(COMMANDS)}")
    out = args.out / "stacks"
    seconds: Dict[str, float] = {}
    if not args.tabulate:
        for b in args.only:
            for stack in args.stacks:
                seconds[f"{b} {stack}"] = run(b, stack, out / stack / b)
    text = tabulate(out, args.stacks, args.only, seconds)
    (out / "stacks.md").write_text(text)
    print(text)
    readme = readme_path(args)
    if readme is not None:
        update_readme("stacks", text, readme)


if __name__ == "__main__":
    main()
