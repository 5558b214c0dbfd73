"""benchmarks/convergence.py runs end to end (tiny models, a few steps, over loopback; marked
`slow`), and its summary reads accuracy curves as the table says (made-up numbers)."""
import json
import subprocess
import sys

import pytest

from tests import harness


@pytest.mark.slow
@pytest.mark.multirank
def test_convergence_benchmark_writes_json_plot_and_table_with_keras3_beside_keras2(tmp_path):
    """Horovod's step, hvdx's allreduce, HiTopK with its aids and the methods beside the step
    (streaming DiLoCo, DASO, AD-PSGD: issue 68), each of hvdx's also on the task's Keras 3
    model (--keras 2,3, issue 64), taking turns: the curves, the summary against Horovod's,
    HiTopK against allreduce of the same Keras, the plot and the README section."""
    readme = tmp_path / "README.md"
    aided = "hitopk+mc+clip+warmup"
    local = ["streaming4", "daso", "adpsgd"]
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "convergence.py"), "--smoke", "--local",
                           "--tasks", "mlp", "--methods", ",".join(["horovod", "allreduce", aided, *local]),
                           "--keras", "2,3",
                           "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=600, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "convergence.json").read_text())
    assert result["topology"] == {"nodes": 2, "ranks_per_node": 2}
    runs = result["tasks"]["mlp"]
    assert sorted(runs) == sorted(["allreduce", "allreduce@keras3", aided, f"{aided}@keras3", "horovod",
                                   *local, *(f"{m}@keras3" for m in local)])
    for run in runs.values():
        assert run["steps"] == [4, 6] and all(0 <= a <= 1 for a in run["accuracy"])
        assert run["seconds"][1] > run["seconds"][0] > 0
    stats = result["by_seed"]["1234"]["mlp"]
    assert stats["daso"]["stats"]["blocking"]["count"] >= 1  # DASO's first and last chunks block
    assert stats["adpsgd@keras3"]["stats"]["steps"] >= 4     # the gossip took every local step
    assert stats["streaming4"]["stats"]["bytes_sent"]["cross"] > 0
    assert result["summary"]["mlp"]["horovod"]["gap_points"] == 0
    assert [(r["keras"], r["method"]) for r in result["vs_allreduce"]] == [(2, aided), (3, aided)]
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- convergence:begin -->" in text and f"| mlp | {aided}@keras3 |" in text
    assert f"| mlp | 3 | {aided} |" in text


def test_hitopk_is_judged_against_allreduce_of_the_same_keras():
    from benchmarks import convergence

    def run(final):
        return {"steps": [10], "accuracy": [final], "seconds": [1.0]}

    by_seed = {}
    finals = {"1": (0.90, 0.89, 0.90, 0.87), "2": (0.92, 0.92, 0.92, 0.89)}
    for seed, (dense2, sparse2, dense3, sparse3) in finals.items():
        by_seed[seed] = {"t": {"allreduce": run(dense2), "hitopk": run(sparse2), "allreduce@keras3": run(dense3),
                               "hitopk@keras3": run(sparse3)}}
    rows = convergence.against_allreduce(convergence.seed_spread(by_seed))
    assert [(r["keras"], r["gap_points"], r["met"]) for r in rows] == [(2, -0.5, True), (3, -3.0, False)]
    assert "| t | 3 | hitopk | 2 |" in convergence.allreduce_table(rows) and "2.0 points short" in \
        convergence.allreduce_table(rows)


def test_summary_gap_and_time_to_target_follow_the_curves():
    from benchmarks import convergence

    tasks = {"t": {"horovod": {"steps": [10, 20], "accuracy": [0.5, 0.95], "seconds": [2.0, 4.0]},
                   "hitopk": {"steps": [10, 20], "accuracy": [0.92, 0.94], "seconds": [1.0, 2.0]}}}
    summary = convergence.summarize(tasks, {"t": 0.9})["t"]
    assert summary["hitopk"]["gap_points"] == -1.0 and summary["horovod"]["gap_points"] == 0
    assert summary["hitopk"]["steps_to_target"] == 10 and summary["hitopk"]["seconds_to_target"] == 1.0
    assert summary["horovod"]["steps_to_target"] == 20 and summary["horovod"]["seconds_to_target"] == 4.0


def test_method_names_map_to_the_aids():
    from benchmarks import convergence

    args = convergence.main.__globals__["argparse"].Namespace(density=0.01, clip_norm=5.0, warmup_steps=0, steps=100,
                                                              dense_below=512)
    options = convergence.method_options("hitopk+mc+dense", "resnet", args)
    assert options["momentum_correction"] is True and options["warmup_steps"] == 20
    assert options["warmup_density"] == 1.0 and options["clip_norm"] is None and options["dense_below"] == 0
    assert convergence.method_options("hitopk+mc+small", "resnet", args)["dense_below"] == 512
    assert convergence.method_options("allreduce", "mnist", args) == {"communication": "allreduce"}
    with pytest.raises(ValueError, match="unknown aid"):
        convergence.method_options("hitopk+nope", "mnist", args)


def test_local_method_names_build_their_methods_and_evaluation_sees_the_anchor():
    import numpy as np
    import tensorflow as tf

    from benchmarks import convergence

    args = convergence.main.__globals__["argparse"].Namespace(sync_every=10, fragments=2)
    diloco, averaging = convergence.local_method("localsgd", args), convergence.local_method("localsgd_avg", args)
    assert type(diloco).__name__ == type(averaging).__name__ == "LocalSGD"
    assert diloco.outer_optimizer.get_config()["nesterov"] and float(diloco.outer_optimizer.learning_rate) == pytest.approx(0.7)
    assert float(averaging.outer_optimizer.learning_rate) == 1.0 and float(averaging.outer_optimizer.momentum) == 0.0
    streaming4 = convergence.local_method("streaming4", args)
    assert (streaming4.sync_every, streaming4.fragments, streaming4.overlap, streaming4.bits) == (10, 2, 1, 4)
    assert convergence.local_method("streaming", args).bits is None
    local = type("Local", (), {"variables": [tf.Variable([1.0, 2.0])], "anchor": [tf.Variable([5.0, 6.0])]})()
    with convergence.AnchorView(local):
        assert local.variables[0].numpy().tolist() == [5.0, 6.0]          # evaluated: the global model
    np.testing.assert_array_equal(local.variables[0].numpy(), [1.0, 2.0])  # training goes on from its own


def test_the_rate_warms_up_as_horovod_then_decays_as_lars_recipe():
    """--lr-warmup-steps W: Horovod's ramp from rate / ranks; --lr-decay-power p: then
    rate ((S - step) / (S - W))^p, 0 at step S; p = 0 keeps the rate after the warm-up."""
    from benchmarks import convergence

    args = convergence.main.__globals__["argparse"].Namespace(lr_warmup_steps=10, lr_decay_power=2.0, steps=110)
    rate = lambda step: convergence.scheduled_rate(0.4, step, args, 4)  # noqa: E731
    assert rate(0) == pytest.approx(0.1) and rate(5) == pytest.approx(0.25)  # 0.4 / 4 * (0.5 * 3 + 1)
    assert rate(10) == pytest.approx(0.4) and rate(60) == pytest.approx(0.1) and rate(110) == 0.0
    args.lr_decay_power = 0.0
    assert rate(60) == pytest.approx(0.4)
