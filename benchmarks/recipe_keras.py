"""The DAWNBench recipe's throughput per phase (shi2021 Table 4 form) on Keras 3 beside Keras 2.

`examples/dawnbench.py --preset demo` (the README's `make demo`: DataCache, progressive
resizing, HiTopK then 2DTAR, LARS with the parallel tensor operator) run as a user runs it, on
2 nodes x 2 ranks, once with tf.keras as TensorFlow makes it (Keras 3 from TensorFlow 2.16 on)
and once with `TF_USE_LEGACY_KERAS=1` (Keras 2, tf_keras), the two taking turns for
`--rounds` rounds (the order alternating). Per Keras: each phase's samples/s and step time
(the recipe's own medians over the phase's epochs after its first), Table 4's scaling
efficiency (the recipe's one-rank runs, `--se-steps`), the final top-1 validation accuracy
and the training time to the recipe's target; Keras 3's over Keras 2's as ratios of the
medians over rounds.

    python benchmarks/recipe_keras.py                       # loopback 2x2, 3 rounds, writes the README's table
    python benchmarks/recipe_keras.py --rounds 1 --out /tmp/x --readme /tmp/x/README.md

Writes <out>/recipe_keras.json, recipe_keras.png and the table of benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

try:  # run as a script, benchmarks/ is on sys.path; imported by the tests, it is benchmarks.common
    from common import ROOT, add_output_arguments, launch_ranks, load_during, markdown_table, readme_path, update_readme
except ImportError:
    from benchmarks.common import (ROOT, add_output_arguments, launch_ranks, load_during, markdown_table, readme_path,
                                   update_readme)

LEGACY = "TF_USE_LEGACY_KERAS"
KERAS = {"2": "Keras 2 (TF_USE_LEGACY_KERAS=1)", "3": "Keras 3 (TensorFlow's tf.keras)"}


def run_recipe(keras: str, args, out: Path) -> dict:
    """One run of the recipe on `keras` ("2" or "3"): its summary.json, with the load average.

    Raises:
        SystemExit: the run failed.
    """
    saved = os.environ.pop(LEGACY, None)
    if keras == "2":
        os.environ[LEGACY] = "1"
    try:
        with load_during() as load:
            rc = launch_ranks([str(ROOT / "examples" / "dawnbench.py"), "--preset", "demo", "--no-plot",
                               "--verbose", "0", "--se-steps", str(args.se_steps), "--out", str(out)],
                              args.nodes, args.ranks_per_node, cluster=args.cluster, rate=args.rate)
    finally:
        os.environ.pop(LEGACY, None)
        if saved is not None:
            os.environ[LEGACY] = saved
    if rc != 0:
        raise SystemExit(f"the recipe on Keras {keras} failed (exit status {rc})")
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("history", None)
    return {**summary, "load_average": [load["start"][0], load["end"][0]]}


def summarize(runs: Dict[str, List[dict]]) -> dict:
    """Per Keras: per phase the medians over rounds of samples/s, step ms and SE; the final
    val_top1 and the seconds to the target per round; Keras 3 over Keras 2 where both ran."""
    out: dict = {}
    for keras, rounds in runs.items():
        phases = [p["phase"] for p in rounds[0]["phases"]]
        per_phase = {}
        for name in phases:
            rows = [next(p for p in r["phases"] if p["phase"] == name) for r in rounds]
            per_phase[name] = {
                "communication": rows[0]["communication"],
                "samples_per_s": statistics.median(p["samples_per_s"] for p in rows),
                "step_ms": 1000 * statistics.median(p["step_s"] for p in rows),
                "scaling_efficiency": (statistics.median(p["scaling_efficiency"] for p in rows)
                                       if all("scaling_efficiency" in p for p in rows) else None),
                "samples_per_s_rounds": [p["samples_per_s"] for p in rows]}
        reached = [r["reached"]["elapsed_s"] if r.get("reached") else None for r in rounds]
        out[keras] = {"phases": per_phase, "val_top1": [r["final"].get("val_top1") for r in rounds],
                      "to_target_s": reached, "trained_s": [r["trained_s"] for r in rounds]}
    if "2" in out and "3" in out:
        out["ratio_3_over_2"] = {
            name: out["3"]["phases"][name]["samples_per_s"] / out["2"]["phases"][name]["samples_per_s"]
            for name in out["3"]["phases"] if name in out["2"]["phases"]}
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kerases = [k for k in ("2", "3") if k in summary]
    names = list(summary[kerases[0]]["phases"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(kerases)
    for i, keras in enumerate(kerases):
        values = [summary[keras]["phases"][n]["samples_per_s"] for n in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=KERAS[keras])
    ax.set_xticks([x + width * (len(kerases) - 1) / 2 for x in range(len(names))])
    ax.set_xticklabels([f"{n}\n{'+'.join(summary[kerases[0]]['phases'][n]['communication'])}" for n in names])
    ax.set_ylabel("samples/s (4 ranks, median over rounds)")
    ax.set_title("DAWNBench recipe (demo preset) per phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(args, runs: Dict[str, List[dict]], summary: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recipe_keras.json").write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": runs,
         "summary": summary}, indent=1) + "\n")
    plot(summary, args.out / "recipe_keras.png")
    readme = readme_path(args)
    if readme is None:
        return
    rows = []
    for keras in (k for k in ("2", "3") if k in summary):
        s = summary[keras]
        for name, p in s["phases"].items():
            ratio = summary.get("ratio_3_over_2", {}).get(name) if keras == "3" else None
            se = f"{p['scaling_efficiency']:.0%}" if p["scaling_efficiency"] is not None else "-"
            rows.append([KERAS[keras], name, "+".join(p["communication"]), f"{p['samples_per_s']:.0f}",
                         ", ".join(f"{v:.0f}" for v in p["samples_per_s_rounds"]), f"{p['step_ms']:.1f}", se,
                         f"{ratio:.2f}" if ratio is not None else ""])
    accuracy = [[KERAS[k], ", ".join(f"{v:.4f}" for v in summary[k]["val_top1"] if v is not None),
                 ", ".join("-" if t is None else f"{t:.1f}" for t in summary[k]["to_target_s"]),
                 ", ".join(f"{t:.1f}" for t in summary[k]["trained_s"])] for k in ("2", "3") if k in summary]
    loads = ", ".join(f"{r['load_average'][0]:.1f}" for k in runs for r in runs[k])
    where = f"the emulated cluster ({args.rate} between nodes)" if args.cluster else "horovodrun over loopback"
    body = (f"`python benchmarks/recipe_keras.py --rounds {args.rounds}`: `examples/dawnbench.py --preset demo "
            f"--se-steps {args.se_steps}` on {args.nodes}x{args.ranks_per_node} ranks ({where}), on each Keras in turn "
            f"for {args.rounds} round(s), the order alternating; per phase the medians over rounds of the recipe's "
            f"own per-phase medians (Table 4 form; SE: over {args.se_steps} steps per phase of each rank alone). "
            f"1-minute load average at each run's start: {loads}. `results/recipe_keras.json`, "
            "`results/recipe_keras.png`.\n\n"
            + markdown_table(["Keras", "phase", "strategy", "samples/s (median)", "per round", "step ms", "SE",
                              "Keras 3 / Keras 2"], rows, 3)
            + "\n\n" + markdown_table(["Keras", "final val_top1 per round", "s to the target per round",
                                       "s trained per round"], accuracy, 1))
    update_readme("recipe_keras", body, readme)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kerases", default="2,3", help="which Keras, comma-separated: 2, 3")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--se-steps", type=int, default=5, help="the recipe's one-rank steps per phase for SE")
    parser.add_argument("--cluster", action="store_true", help="on the emulated cluster (root) instead of loopback")
    parser.add_argument("--rate", default="1gbit", help="with --cluster: the links between nodes")
    add_output_arguments(parser, readme=None)
    args = parser.parse_args(argv)
    kerases = args.kerases.split(",")
    if not kerases or any(k not in KERAS for k in kerases):
        parser.error(f"--kerases takes 2 and/or 3, got {args.kerases!r}")
    runs: Dict[str, List[dict]] = {k: [] for k in kerases}
    with tempfile.TemporaryDirectory(prefix="hvdx-recipe-keras-") as tmp:
        for r in range(args.rounds):
            for keras in (kerases if r % 2 == 0 else kerases[::-1]):
                runs[keras].append(run_recipe(keras, args, Path(tmp) / f"{keras}-{r}"))
    summary = summarize(runs)
    report(args, runs, summary)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
