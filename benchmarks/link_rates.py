"""Time to target against the rate of the link between nodes, every method (issue 68).

Reads the runs of `convergence.py` made at several link rates (each its own JSON in --out,
`--runs NAME,NAME,...`, by default streaming DiLoCo's at 1 Gbit/s, 100 Mbit/s and 20 Mbit/s)
and puts them side by side: for each rate and method the mean seconds to the target
accuracy over the seeds that reached it (and how many did), its speed-up over Horovod in the
same run (over the seeds where both reached it), the final accuracy against Horovod's in points, and which method reached the
target first. Nothing is run here: each rate's ratios are those of its own run (methods
taking turns, alone on the machine); ratios of different runs are not compared.

    python benchmarks/link_rates.py                       # the kept streaming DiLoCo runs
    python benchmarks/link_rates.py --runs a_1gbit,a_100mbit --name link_rates_a

Writes <out>/<name>.json and <name>.png (seconds to target against the link rate, log-log,
one line per method) and the section <name> (with - for _) of benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import add_output_arguments, markdown_table, readme_path, update_readme
except ImportError:
    from benchmarks.common import add_output_arguments, markdown_table, readme_path, update_readme

DEFAULT_RUNS = ("streaming_diloco_1gbit", "streaming_diloco_100mbit", "streaming_diloco_20mbit")
BASELINE = "horovod"


def rate_label(bps: float) -> str:
    """'1 Gbit/s', '100 Mbit/s', '20 Mbit/s' for a rate in bit/s."""
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def load_runs(out: Path, names: Sequence[str]) -> List[dict]:
    """The convergence runs `names` (<out>/<name>.json), fastest link first.

    Raises:
        SystemExit: a run is missing (says the command that makes it) or has no link rate
            (a loopback run: it measured no link).
    """
    runs = []
    for name in names:
        path = out / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `python benchmarks/convergence.py ... --name {name}` first "
                             f"(benchmarks/README.md gives each run's command)")
        run = json.loads(path.read_text())
        if not (run.get("network") or {}).get("rate_bps"):
            raise SystemExit(f"{path} was run without the emulated cluster's shaped link (--local): no link rate")
        runs.append(dict(run, name=name))
    return sorted(runs, key=lambda run: -run["network"]["rate_bps"])


def rows_of(run: dict, task: str) -> Dict[str, dict]:
    """{method: its entry} of one run and task: mean seconds to target over the seeds that
    reached it, how many did of how many, the run's own speed-up over Horovod (convergence.py:
    over the seeds where both reached it; None where none did), final accuracy and its points
    against Horovod's."""
    summary = run["summary"][task]
    return {method: {"mean_seconds_to_target": entry["mean_seconds_to_target"],
                     "reached": sum(t is not None for t in entry["seconds_to_target"]),
                     "seeds": len(entry["seconds_to_target"]),
                     "speedup_vs_horovod": entry.get("speedup_vs_horovod"),
                     "final_accuracy": entry["mean"], "gap_points": entry.get("gap_points"),
                     "target": summary[method]["target"]}
            for method, entry in run["seeds"][task].items()}


def first_to_target(rows: Mapping[str, dict]) -> Optional[str]:
    """The method with the least mean seconds to target among those whose every seed reached it."""
    whole = {m: r["mean_seconds_to_target"] for m, r in rows.items() if r["reached"] == r["seeds"] and r["seeds"]}
    return min(whole, key=whole.get) if whole else None


def tabulate(runs: Sequence[dict], task: str) -> str:
    """The Markdown table (one row per rate and method) and one line per rate naming the first
    method to the target."""
    header = ["link", "method", "s to target (mean)", "seeds reached", "vs Horovod", "final acc.",
              "vs Horovod (points)", "steps"]
    lines, winners = [], []
    for run in runs:
        rate = rate_label(run["network"]["rate_bps"])
        rows = rows_of(run, task)
        for method, r in rows.items():
            lines.append([rate, method, "-" if r["mean_seconds_to_target"] is None else f"{r['mean_seconds_to_target']:.1f}",
                          f"{r['reached']}/{r['seeds']}",
                          "" if r["speedup_vs_horovod"] is None else f"{r['speedup_vs_horovod']:.2f}x",
                          f"{r['final_accuracy']:.3f}", "" if r["gap_points"] is None else f"{r['gap_points']:+.1f}",
                          run["arguments"]["steps"]])
        best = first_to_target({m: r for m, r in rows.items() if m != BASELINE})
        if best is not None:
            speedup = rows[best]["speedup_vs_horovod"]
            winners.append(f"- {rate} (`{run['name']}`): **{best}** first to {rows[best]['target']:g}"
                           + ("" if speedup is None else f", {speedup:.2f}x sooner than Horovod"))
    return markdown_table(header, lines, text_columns=2) + "\n\nFirst to the target at each rate (every seed reached it):\n" + \
        "\n".join(winners)


def plot(runs: Sequence[dict], task: str, path: Path) -> None:
    """Seconds to target against link rate, log-log, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods: Dict[str, List[tuple]] = {}
    for run in runs:
        for method, r in rows_of(run, task).items():
            if r["mean_seconds_to_target"] is not None:
                methods.setdefault(method, []).append((run["network"]["rate_bps"] / 1e6, r["mean_seconds_to_target"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, points in methods.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=method, linewidth=2.5 if method == BASELINE else 1.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link between nodes (Mbit/s)")
    ax.set_ylabel("seconds to target (mean over seeds that reached it)")
    ax.set_title(f"{task}: time to target against the link rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), type=lambda s: s.split(","),
                        help="convergence.py runs (names in --out) at different link rates")
    parser.add_argument("--task", default="mlp")
    parser.add_argument("--name", default="link_rates")
    add_output_arguments(parser)
    args = parser.parse_args()
    runs = load_runs(args.out, args.runs)
    if any(args.task not in run["seeds"] for run in runs):
        raise SystemExit(f"--task {args.task}: not in every run ({[sorted(run['seeds']) for run in runs]})")
    result = {"task": args.task, "runs": [run["name"] for run in runs],
              "rates": {run["name"]: run["network"]["rate_bps"] for run in runs},
              "rows": {run["name"]: rows_of(run, args.task) for run in runs}}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(runs, args.task, args.out / f"{args.name}.png")
    text = (f"`python benchmarks/link_rates.py --runs {','.join(result['runs'])} --name {args.name}` "
            f"(task {args.task}; each rate's ratios from its own run):\n\n" + tabulate(runs, args.task))
    print(text)
    readme = readme_path(args)
    if readme is not None:
        update_readme(args.name.replace("_", "-"), text, readme)


if __name__ == "__main__":
    main()
