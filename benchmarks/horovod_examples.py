"""Horovod's own TF2 MNIST examples as users run them, with Horovod and with hvdx, over seeds
(issue 44: equal accuracy on users' own scripts).

Each run is Horovod v0.28.1's unmodified example (tests/upstream/horovod/) with only these
changes: scikit-learn's digits for MNIST (`digits_as_mnist.load_data`, as
tests/test_horovod_upstream.py), the length of the run, every rank seeded with seed + rank
after `hvd.init()` (`digits_as_mnist.seed`: the same initial weights, shuffles and dropout
masks for every method of a seed), and the final model's accuracy on the 450 test digits taken
by rank 0 at the end (`digits_as_mnist.report`). Everything else is the script's: batch 128
per rank, Adam at 0.001 x ranks, and for the Keras example `Model.fit` with its callbacks
(`BroadcastGlobalVariablesCallback`, `MetricAverageCallback`, `LearningRateWarmupCallback`
over 3 epochs, `ModelCheckpoint`).

Scripts: `keras` (examples/tensorflow2/tensorflow2_keras_mnist.py, --epochs x
--steps-per-epoch) and `tape` (examples/tensorflow2/tensorflow2_mnist.py, its custom loop
with `hvd.DistributedGradientTape`, --epochs x --steps-per-epoch steps).
Methods: `horovod` (the script as written, `import horovod.tensorflow[.keras] as hvd`),
`allreduce` (`import hvdx...` instead, dense), `hitopk` (the same with
$HVDX_COMMUNICATION=hitopk, $HVDX_DENSITY=--density: how a user switches an unmodified script
to HiTopK; hvdx's default aids). The methods take turns within each seed.

    python benchmarks/horovod_examples.py                      # keras and tape, 5 seeds, 2x2 loopback
    python benchmarks/horovod_examples.py --scripts keras --seeds 1 --epochs 1 --steps-per-epoch 4 --out /tmp/x

Writes benchmarks/results/horovod_examples.json and .png and its section of
benchmarks/README.md (with the default --out).
"""
from __future__ import annotations

from hvdx.legacy_keras import use_keras2  # noqa: E402

if __name__ == "__main__":  # written for Keras 2 as tf.keras; imported, it leaves the importer's Keras
    use_keras2(__file__)  # before TensorFlow's import

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

try:
    import common
except ImportError:  # imported as benchmarks.horovod_examples
    from benchmarks import common

if str(common.ROOT) not in sys.path:
    sys.path.insert(0, str(common.ROOT))
from tests.test_horovod_upstream import DIGITS_IMPORT, HVDX_KERAS, MNIST, UPSTREAM  # noqa: E402

SCRIPTS = {"keras": "tensorflow2_keras_mnist.py", "tape": "tensorflow2_mnist.py"}
HVDX_IMPORT = {"keras": HVDX_KERAS, "tape": ("import horovod.tensorflow as hvd", "import hvdx.tensorflow as hvd")}
METHODS = ("horovod", "allreduce", "hitopk")
LABELS = {"horovod": "Horovod", "allreduce": "hvdx allreduce", "hitopk": "hvdx HiTopK (defaults)"}
DEFAULT_NAME = "horovod_examples"
SEED = ("    hvd.init()\n", "    hvd.init()\n    digits_as_mnist.seed(hvd.rank())\n")


def changes(script: str, method: str, epochs: int, steps_per_epoch: int) -> List[Tuple[str, str]]:
    """The (old, new) replacements that make the run of `script` under `method`; each must
    occur exactly once in Horovod's file."""
    edits = [MNIST, DIGITS_IMPORT, SEED]
    if method != "horovod":
        edits.append(HVDX_IMPORT[script])
    if script == "keras":
        fit = ("mnist_model.fit(dataset, steps_per_epoch=500 // hvd.size(), callbacks=callbacks, epochs=24, "
               "verbose=verbose)")
        run = fit.replace("500 // hvd.size()", str(steps_per_epoch)).replace("epochs=24", f"epochs={epochs}")
        edits.append((fit, run + "\n    digits_as_mnist.report(mnist_model, hvd.rank())"))
    else:
        edits.append(("dataset.take(10000 // hvd.size())", f"dataset.take({epochs * steps_per_epoch})"))
        save = "    # Horovod: save checkpoints only on worker 0 to prevent other workers from\n"
        edits.append((save, "    digits_as_mnist.report(mnist_model, hvd.rank())\n\n" + save))
    return edits


def write_script(script: str, method: str, into: Path, epochs: int, steps_per_epoch: int) -> Path:
    """The run's copy of Horovod's example in `into`, with digits_as_mnist.py beside it.

    Raises:
        ValueError: a change does not apply exactly once (Horovod's file changed).
    """
    name = SCRIPTS[script]
    text = (UPSTREAM / "horovod" / name).read_text()
    for old, new in changes(script, method, epochs, steps_per_epoch):
        if text.count(old) != 1:
            raise ValueError(f"{name}: expected {old!r} once, found it {text.count(old)} times")
        text = text.replace(old, new)
    (into / "digits_as_mnist.py").write_text((UPSTREAM / "digits_as_mnist.py").read_text())
    path = into / f"{method}_{name}"
    path.write_text(text)
    return path


def run_one(script: str, method: str, seed: int, args: argparse.Namespace) -> Dict[str, float]:
    """One launch of `script` under `method` with `seed`: {"accuracy", "seconds"} (seconds: the
    whole launch, start-up included).

    Raises:
        SystemExit: the launch failed.
    """
    env = {"HVDX_SEED": str(seed), "HVDX_DIGITS_PIXELS": str(args.pixels)}
    if method == "hitopk":
        env.update(HVDX_COMMUNICATION="hitopk", HVDX_DENSITY=str(args.density))
    elif method == "allreduce":
        env.update(HVDX_COMMUNICATION="allreduce")
    nodes, per_node = (int(x) for x in args.topology.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = write_script(script, method, work, args.epochs, args.steps_per_epoch)
        env["HVDX_RESULT_FILE"] = str(work / "result.json")
        here = os.getcwd()
        os.chdir(work)  # the examples write their checkpoints into the working directory
        try:
            start = time.perf_counter()
            code = common.launch_ranks([str(path)], nodes, per_node, env=env)
            seconds = time.perf_counter() - start
        finally:
            os.chdir(here)
        if code:
            raise SystemExit(f"{script} {method} seed {seed}: exit status {code}")
        accuracy = json.loads((work / "result.json").read_text())["accuracy"]
    print(f"{script} {method} seed {seed}: test accuracy {accuracy:.4f} ({seconds:.0f} s)", flush=True)
    return {"accuracy": accuracy, "seconds": seconds}


def baseline(methods: Sequence[str]) -> str:
    """The method the others are compared with: Horovod where it ran, else hvdx's dense step
    (`allreduce`: on TensorFlow 2.16+ Horovod's own Keras callbacks fail)."""
    return "horovod" if "horovod" in methods else "allreduce"


def summary(runs: Dict[str, Dict[str, List[dict]]]) -> Dict[str, Dict[str, dict]]:
    """Per script and method: the seeds' accuracies, their mean, min, max, and the mean's gap
    to the baseline's mean (points, `baseline`) with the paired per-seed differences."""
    out: Dict[str, Dict[str, dict]] = {}
    for script, by_method in runs.items():
        base = [r["accuracy"] for r in by_method.get(baseline(list(by_method)), [])]
        out[script] = {}
        for method, rs in by_method.items():
            acc = [r["accuracy"] for r in rs]
            s = {"accuracy": acc, "mean": statistics.fmean(acc), "min": min(acc), "max": max(acc),
                 "sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                 "mean_seconds": statistics.fmean(r["seconds"] for r in rs)}
            if base:
                s["points_vs_baseline"] = 100 * (s["mean"] - statistics.fmean(base))
                s["paired_points"] = [100 * (a - b) for a, b in zip(acc, base)]
            out[script][method] = s
    return out


def report(args: argparse.Namespace, runs: Dict[str, Dict[str, List[dict]]], load: dict) -> None:
    """JSON, PNG and the README section."""
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "load_average": [load["start"][0], load["end"][0]], "runs": runs, "summary": summary(runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scripts = list(runs)
    fig, axes = plt.subplots(1, len(scripts), figsize=(5 * len(scripts), 3.6), squeeze=False)
    for ax, script in zip(axes[0], scripts):
        for i, method in enumerate(runs[script]):
            stats = result["summary"][script][method]
            ax.scatter([i] * len(stats["accuracy"]), stats["accuracy"], s=14, alpha=0.7)
            ax.hlines(stats["mean"], i - 0.25, i + 0.25, color="black")
        ax.set_xticks(range(len(runs[script])), [LABELS[m] for m in runs[script]], fontsize=7)
        ax.set_title(f"{SCRIPTS[script]}, {args.topology}, {len(args.seed_list)} seeds", fontsize=9)
        ax.set_ylabel("final test accuracy (450 digits)")
    fig.tight_layout()
    fig.savefig(args.out / f"{args.name}.png", dpi=100)
    readme = common.readme_path(args)
    if readme is None:
        return
    rows = []
    methods = sorted({m for script in scripts for m in runs[script]})
    for script in scripts:
        for method, s in result["summary"][script].items():
            rows.append([SCRIPTS[script], LABELS[method], f"{s['mean']:.3f} ({s['min']:.3f}-{s['max']:.3f})",
                         f"{s.get('points_vs_baseline', 0):+.1f}",
                         ", ".join(f"{p:+.1f}" for p in s.get("paired_points", [])), f"{s['mean_seconds']:.0f}"])
    reuse = f" --reuse results/{args.reuse.name}" if args.reuse else ""
    named = f" --pixels {args.pixels} --name {args.name}" if args.name != DEFAULT_NAME else ""
    import tensorflow as tf

    body = (f"`python benchmarks/horovod_examples.py --scripts {args.scripts} --methods {args.methods} --seeds "
            f"{args.seeds} --epochs {args.epochs} --steps-per-epoch {args.steps_per_epoch}{reuse}{named}`: "
            f"{args.topology} over loopback, TensorFlow {tf.__version__}, {args.pixels}x{args.pixels} digits, "
            f"density {args.density}, seeds {args.seed_list[0]}-{args.seed_list[-1]}, load average "
            f"{load['start'][0]:.1f} -> {load['end'][0]:.1f}; the launch's seconds include start-up and are not "
            f"results under load. `results/{args.name}.json`, `.png`."
            + (f" Reused from `{args.reuse.name}` (an earlier run, same seeds): "
               + "; ".join(f"{s}: {', '.join(ms)}" for s, ms in args.reused.items() if ms) if args.reuse else "")
            + "\n\n"
            + common.markdown_table(["script", "method", "final test accuracy, mean (range)",
                                     f"vs {LABELS[baseline(methods)]} (points)",
                                     f"per seed vs {LABELS[baseline(methods)]} (points)", "s per launch"], rows,
                                    text_columns=2))
    common.update_readme(args.name, body, readme)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", default="keras,tape", help="comma-separated: " + ", ".join(SCRIPTS))
    parser.add_argument("--methods", default="horovod,hitopk", help="comma-separated: " + ", ".join(METHODS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234, help="the first seed")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--topology", default="2x2", help="nodes x ranks per node (horovodrun over loopback)")
    parser.add_argument("--pixels", type=int, choices=(8, 28), default=28,
                        help="the digits as 28x28 images (MNIST's size, the default) or 8x8 as scikit-learn has them")
    parser.add_argument("--name", default=DEFAULT_NAME,
                        help="the results' file stem and the README section (another for another table)")
    parser.add_argument("--reuse", type=Path, help="an earlier run's JSON: its runs of the methods not in --methods "
                        "(same scripts, seeds and length) join this run's, e.g. Horovod's after a change to hvdx")
    common.add_output_arguments(parser)
    args = parser.parse_args(argv)
    scripts, methods = args.scripts.split(","), args.methods.split(",")
    for name, allowed in ((scripts, SCRIPTS), (methods, METHODS)):
        unknown = set(name) - set(allowed)
        if unknown:
            parser.error(f"unknown {sorted(unknown)}; choose from {', '.join(allowed)}")
    args.seed_list = list(range(args.seed, args.seed + args.seeds))
    reused = reused_runs(args, scripts, methods)
    args.reused = {script: list(by_method) for script, by_method in reused.items()}  # for the README
    made: Dict[str, Dict[str, List[dict]]] = {s: {m: [] for m in methods} for s in scripts}
    with common.load_during() as load:
        for seed in args.seed_list:
            for script in scripts:
                for method in methods:  # taking turns: a slow spell hits every method of the seed
                    made[script][method].append(run_one(script, method, seed, args))
    runs = {s: {**reused.get(s, {}), **made.get(s, {})} for s in SCRIPTS if s in made or s in reused}
    report(args, runs, load)


def reused_runs(args: argparse.Namespace, scripts: List[str], methods: List[str]) -> Dict[str, Dict[str, List[dict]]]:
    """The runs of `--reuse` that this run does not make, by script (none without it): the other
    methods of this run's scripts, and every method of the earlier run's other scripts.

    Raises:
        SystemExit: the earlier run's seeds, length, density or topology differ, or it lacks one
            of this run's scripts while this run does not make Horovod's runs (the baseline).
    """
    if args.reuse is None:
        return {}
    earlier = json.loads(args.reuse.read_text())
    for key in ("seeds", "seed", "epochs", "steps_per_epoch", "density", "topology", "pixels"):
        if earlier["args"].get(key, 28 if key == "pixels" else None) != getattr(args, key):
            raise SystemExit(f"--reuse {args.reuse}: its {key} is {earlier['args'][key]!r}, this run's "
                             f"{getattr(args, key)!r}; reuse only a run of the same seeds and length")
    missing = [s for s in scripts if s not in earlier["runs"]]
    if missing and baseline(methods) not in methods:
        raise SystemExit(f"--reuse {args.reuse} has no runs of {missing}: add horovod or allreduce to --methods "
                         "for the baseline")
    return {s: {m: runs for m, runs in by_method.items() if s not in scripts or m not in methods}
            for s, by_method in earlier["runs"].items()}


if __name__ == "__main__":
    main()
