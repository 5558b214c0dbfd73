"""The benchmark scripts run end to end (tiny sizes; timings are never asserted; marked `slow`),
and their reporting works on made-up numbers."""
import dataclasses
import json
import subprocess
import sys

import pytest

from tests import harness

CLUSTER_UNAVAILABLE = harness.cluster_unavailable()


@pytest.mark.slow
def test_topk_benchmark_writes_json_plot_and_table(tmp_path):
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "topk.py"), "--quick", "--sizes", "65536",
                           "100003", "--repeats", "1", "--rounds", "1", "--out", str(tmp_path), "--readme", str(readme),
                           "--cache", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=300, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "topk.json").read_text())
    assert [row["d"] for row in result["topk_seconds"]] == [65536, 100003]
    assert all(row["mstopk"] > 0 and row["tf_top_k"] > 0 for row in result["topk_seconds"])
    rows = {row["distribution"]: row for row in result["distributions"]}
    assert sorted(rows) == sorted(["normal", "laplace", "student_t3", "cauchy", "resnet_grad", "transformer_grad",
                                   "resnet_ef"])
    assert rows["normal"]["d"] == 100003 and rows["resnet_grad"]["d"] > 1000
    for row in rows.values():  # one time per round and method, paired
        assert all(len(t) == 1 and t[0] > 0 for t in row["rounds_seconds"].values())
        assert row["mstopk_over_floor"] == pytest.approx(row["mstopk"] / row["floor"])
    assert (tmp_path / "topk.png").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        f"{name}-tf{result['machine']['tensorflow']}-quick.npy" for name in ("resnet_grad", "transformer_grad", "resnet_ef"))
    text = readme.read_text()
    assert "<!-- topk:begin -->" in text and "| 100,003 | 100 |" in text
    assert "Worst case over the 7 distributions" in text and "| resnet_ef | " in text


def test_topk_verdicts_say_by_how_much_a_goal_is_missed():
    from benchmarks import topk

    row = {"distribution": "cauchy", "mstopk_over_floor": 3.3, "top_k_over_mstopk": 1.5, "met": False}
    assert topk.verdict(row) == "missed: 10% over 3x floor, 25% short of 2x top_k"
    rows = [row, {"distribution": "normal", "mstopk_over_floor": 1.2, "top_k_over_mstopk": 7.0, "met": True}]
    assert topk.worst_case(rows).startswith("**Worst case over the 2 distributions: MSTopK 3.30x the floor (cauchy), "
                                           "1.5x faster than tf.math.top_k (cauchy); goals")
    assert "met on 1 of 2" in topk.worst_case(rows)


@pytest.mark.slow
@pytest.mark.multirank
def test_comm_benchmark_launches_itself_and_writes_results(tmp_path):
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "comm.py"), "--sizes", "10000",
                           "30001", "--breakdown-sizes", "20000", "--repeats", "1", "--out", str(tmp_path),
                           "--readme", str(readme)],
                          capture_output=True, text=True, timeout=300, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "comm.json").read_text())
    assert result["topology"] == {"nodes": 2, "ranks_per_node": 2}
    assert [row["d"] for row in result["aggregate_seconds"]] == [10000, 30001]
    for row in result["aggregate_seconds"]:  # one time per round per strategy; the median is the row's
        assert sorted(row["rounds_seconds"]) == sorted(["allreduce", "hierarchical", "sparse_allgather", "hitopk"])
        assert all(row[key] == times[0] > 0 for key, times in row["rounds_seconds"].items())
    steps = result["hitopk_breakdown_seconds"][0]["steps"]
    assert sorted(steps) == sorted(["reduce_scatter", "mstopk", "inter_allgather", "intra_allgather"])
    assert (tmp_path / "comm.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- comm:begin -->" in text and "| HiTopK speed-up over Allreduce | over Hierarchical |" in text


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(CLUSTER_UNAVAILABLE is not None, reason=str(CLUSTER_UNAVAILABLE))
def test_comm_benchmark_on_the_emulated_cluster_fits_the_model(tmp_path):
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "comm.py"), "--cluster", "--rate", "1gbit",
                           "--sizes", "30001", "--breakdown-sizes", "40000", "--repeats", "1", "--out", str(tmp_path),
                           "--readme", str(readme)],
                          capture_output=True, text=True, timeout=400, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "comm_cluster.json").read_text())
    assert result["network"]["rate_bps"] == 10**9 and result["topology"] == {"nodes": 2, "ranks_per_node": 2}
    (model,) = result["model_eqs_7_10"]
    assert model["d"] == 40000
    assert sorted(model["model"]) == sorted(model["measured"]) == sorted(
        ["reduce_scatter", "mstopk", "inter_allgather", "intra_allgather"])
    for where in ("inter", "intra"):
        assert len(model["links"][where]["seconds"]) == len(model["links"][where]["bytes_per_rank"]) > 2
    text = readme.read_text()
    assert "<!-- comm-cluster:begin -->" in text and "| reduce_scatter | eq. 7 |" in text


# -- the reporting of comm.py, on made-up numbers (no launch) --------------------------------

def test_link_fit_recovers_alpha_and_beta_and_never_goes_negative():
    import numpy as np

    from benchmarks import comm

    design = np.array([[1.0, b] for b in comm.FIT_BYTES])
    alpha, beta = comm.nonnegative_fit(design, design @ np.array([2e-3, 8e-9]))
    assert alpha == pytest.approx(2e-3) and beta == pytest.approx(8e-9)
    # Times that a straight line would meet below zero: alpha is held at 0, beta still fits.
    alpha, beta = comm.nonnegative_fit(design, design @ np.array([-3e-3, 8e-9]) + 1e-4)
    assert alpha == 0.0 and beta > 0


def test_goals_are_judged_on_paired_rounds_and_a_miss_says_why():
    from benchmarks import comm

    rounds = {"allreduce": [1.6, 2.0, 1.2], "hierarchical": [1.2, 1.4, 1.05],
              "sparse_allgather": [0.4, 0.4, 0.4], "hitopk": [0.4, 0.4, 0.3]}
    row = {"d": 25_000_000, **{k: sorted(v)[1] for k, v in rounds.items()}, "rounds_seconds": rounds}
    assert comm.speedup_range(row, "allreduce") == (pytest.approx(4.0), pytest.approx(4.0), pytest.approx(5.0))
    steps = {"reduce_scatter": 0.1, "mstopk": 0.1, "inter_allgather": 0.05, "intra_allgather": 0.05}
    links = {w: {"seconds": [0.03, 0.05]} for w in ("inter", "intra")}
    text = comm.goals_text([row], [{"d": 25_000_000, "steps": steps}], {"rate": "1gbit"}, links, ranks=4)
    assert "**4.00x** faster than Allreduce (dense) (goal >= 5x: missed by 20%; rounds ranged 4.00-5.00x)" in text
    assert "**3.50x** faster than Hierarchical (2DTAR) (goal >= 2x: met; rounds ranged 3.00-3.50x)" in text
    assert "(inter_allgather) is 17% of its time" in text and "a 4 KiB all-gather takes 30 ms" in text
    assert "| 25,000,000 | 1600.0 | 0.75 | 0.25 | 0.25 | 4.00x (4.00-5.00) | 3.50x (3.00-3.50) |" in comm.fig7_table([row])


@pytest.mark.slow
@pytest.mark.multirank
def test_train_step_benchmark_writes_json_plot_and_table(tmp_path):
    """A tiny MLP over loopback (horovodrun, 2 nodes x 1 rank), profile included."""
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "train_step.py"), "--local",
                           "--topologies", "2x1", "--models", "mlp", "--scale", "0.02", "--batch", "4", "--rounds", "2", "--steps", "1",
                           "--profile", "--profile-steps", "1", "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=400, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "train_step.json").read_text())
    from benchmarks import train_step

    (run,) = result["runs"]
    assert run["topology"] == {"nodes": 2, "ranks_per_node": 1}
    assert sorted(run["models"]) == ["mlp"]
    for kind, model in run["models"].items():
        assert sorted(model["rounds"]) == sorted(train_step.OPTIMIZERS)
        assert all(len(times) == 2 and min(times) > 0 for times in model["rounds"].values())
        summary = run["summary"][kind]
        assert sorted(model["cpu_seconds"]) == sorted(train_step.OPTIMIZERS)  # every rank's CPU, summed
        assert all(summary[key]["cpu_seconds_all_ranks"] == model["cpu_seconds"][key] > 0 for key in summary)
        horovod = model["rounds"]["horovod"]
        for key, times in model["rounds"].items():  # speed-ups: medians of per-round ratios
            if key != "horovod":
                ratios = sorted(h / t for h, t in zip(horovod, times))
                assert summary[key]["speedup_vs_horovod"] == pytest.approx((ratios[0] + ratios[1]) / 2)
        profile = model["profile"]
        assert sorted(profile) == sorted(train_step.OPTIMIZERS)
        assert profile["hitopk"]["ops"]["MSTopK"] > 0 and profile["none"]["ops"]["backward"] > 0
        assert "MSTopK" not in profile["allreduce"]["ops"]
        assert "cross-node all-gather" in profile["hitopk"]["collectives"]  # one rank per node: no node steps
        census = model["census"]  # what a step runs: Horovod's and hvdx's allreduce hand over the same gradients
        assert census["horovod"]["collectives"] == census["allreduce"]["collectives"]
        assert census["allreduce"]["ops"] <= census["horovod"]["ops"]
        assert census["none"]["collectives"] == [] and census["hitopk"]["kinds"]["finiteness checks (IsFinite)"] >= 1
    assert set(result["verdicts"]["2x1 gloo"]) == {"hitopk", "hierarchical", "allreduce"}
    assert (tmp_path / "train_step.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- train-step:begin -->" in text and "| 2x1 | gloo | mlp | hvdx hitopk (HiTopKComm) |" in text
    assert "CPU per step, all ranks (ms) (cores busy)" in text
    assert "| TF ops: " in text and "Horovod: cross-node all-gather" in text


def test_train_step_models_and_profile_categories():
    from benchmarks import train_step

    assert train_step.build_model("mlp").count_params() == 21_020_682  # the 1024-4096-4096-10 MLP
    assert train_step.build_model("cnn").count_params() == 5_166_474
    import tensorflow as tf

    resnet = train_step.build_model("resnet")  # the issue's conv + batch-norm model: He et al.'s CIFAR ResNet
    assert resnet.count_params() == 698_858
    assert sum(isinstance(layer, tf.keras.layers.BatchNormalization) for layer in resnet.layers) == 15
    assert sum(isinstance(layer, tf.keras.layers.Add) for layer in resnet.layers) == 6

    assert train_step.categorize("hitopk/HvdxMstopk", "HvdxMstopk") == "MSTopK"
    assert train_step.categorize("hitopk/HvdxStatelessMstopk", "HvdxStatelessMstopk") == "MSTopK"
    assert train_step.categorize("hitopk_1/error_feedback/AddN", "AddN") == "error feedback (residual add, update)"
    assert train_step.categorize("gradient_tape/mlp/dense/MatMul/MatMul", "_MklMatMul") == "backward"
    assert train_step.categorize("hitopk/fuse/concat", "ConcatV2") == "fusion copies, casts"
    assert train_step.categorize("commit/All", "All") == "finiteness check, commit"
    assert train_step.categorize("hitopk/unstack", "Unpack") == "strategy: slices, sums, packets"
    assert train_step.collective_kind("HorovodAlltoall_hvdx_hitopk_rs_v0_b1_a2a_0", "ALLTOALL") == \
        "node all-to-all (reduce-scatter)"
    assert train_step.collective_kind("hvdx.hitopk.ag2.v0_b0", "ALLGATHER") == "node all-gather"
    assert train_step.collective_kind("hvdx.hitopk.ag.v0_b0", "ALLGATHER") == "cross-node all-gather"
    assert train_step.collective_kind("DistributedSGD_Allreduce/cond/HorovodAllreduce_grads_0", "ALLREDUCE") == \
        "global allreduce"


@pytest.mark.slow
@pytest.mark.multirank
def test_train_step_benchmark_runs_keras3_beside_keras2(tmp_path):
    """--keras 2,3 (issue 64): each optimizer but Horovod's also on the Keras 3 model, in the
    same rounds; the summary carries each row's Keras and Keras 3's time over Keras 2's."""
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "train_step.py"), "--local",
                           "--topologies", "2x1", "--models", "mlp", "--scale", "0.02", "--batch", "4",
                           "--optimizers", "horovod,allreduce,hitopk", "--keras", "2,3", "--rounds", "2", "--steps",
                           "1", "--name", "ts_k3", "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=400, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "ts_k3.json").read_text())
    (run,) = result["runs"]
    model, summary = run["models"]["mlp"], run["summary"]["mlp"]  # the zoo's other models under Keras 3: test_zoo.py
    assert sorted(model["rounds"]) == ["allreduce", "allreduce@keras3", "hitopk", "hitopk@keras3", "horovod"]
    assert summary["hitopk"]["keras"] == 2 and summary["hitopk@keras3"]["keras"] == 3
    census = model["census"]  # the same collectives under either Keras
    assert census["allreduce@keras3"]["collectives"] == census["allreduce"]["collectives"] != []
    assert census["hitopk@keras3"]["collectives"] == census["hitopk"]["collectives"]
    rounds = model["rounds"]
    ratios = sorted(k3 / k2 for k3, k2 in zip(rounds["hitopk@keras3"], rounds["hitopk"]))
    assert summary["hitopk@keras3"]["vs_keras2"]["ratio"] == pytest.approx(sum(ratios) / 2)
    assert set(result["keras3_vs_keras2"]["2x1 gloo"]["mlp"]) == {"allreduce@keras3", "hitopk@keras3"}
    assert (tmp_path / "ts_k3.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- ts-k3:begin -->" in text and "| 2x1 | gloo | mlp | hvdx hitopk (HiTopKComm) (Keras 3) |" in text
    assert "Keras 3 beside Keras 2 (2x1 gloo)" in text and "| 2x1 gloo | mlp | hvdx allreduce |" in text


def test_keras3_rows_against_keras2_and_their_keys():
    """The keys of --keras 2,3 (Horovod's optimizer under Keras 2 only), and the goal: Keras
    3's median step within Keras 2's rounds, or by how much it exceeds the slowest."""
    from benchmarks import common, train_step

    assert common.keras_keys(["none", "horovod", "hitopk"], [2, 3]) == ["none", "none@keras3", "horovod", "hitopk",
                                                                        "hitopk@keras3"]
    assert common.keras_keys(["horovod", "hitopk"]) == ["horovod", "hitopk"]
    assert common.split_keras("hitopk@keras3") == ("hitopk", 3) and common.split_keras("hitopk") == ("hitopk", 2)
    assert train_step.label("hitopk@keras3") == "hvdx hitopk (HiTopKComm) (Keras 3)"
    within = train_step.keras3_against_keras2([1.1, 1.0, 1.2], [1.0, 1.2, 1.1])
    assert within["within_spread"] and within["over_by"] == 0.0 and within["keras2_spread"] == [1.0, 1.2]
    assert within["ratio"] == pytest.approx(1.2 / 1.1)
    assert within["ratio_range"] == [pytest.approx(1 / 1.2), pytest.approx(1.1)]
    over = train_step.keras3_against_keras2([1.5, 1.5, 1.5], [1.0, 1.2, 1.1])
    assert not over["within_spread"] and over["over_by"] == pytest.approx(0.25)
    summary = train_step.summarize({"mlp": {"rounds": {"horovod": [2.0, 2.0], "hitopk": [1.0, 1.0],
                                                       "hitopk@keras3": [1.0, 2.0]}}})["mlp"]
    assert summary["hitopk@keras3"]["keras"] == 3 and summary["hitopk@keras3"]["speedup_vs_horovod"] == 1.5
    assert summary["hitopk@keras3"]["vs_keras2"]["ratio"] == 1.5 and "vs_keras2" not in summary["hitopk"]
    with pytest.raises(SystemExit):
        train_step.main(["--keras", "4"])


def test_train_step_census_counts_what_a_step_runs():
    """The census counts ops into called functions, and of a tf.cond on a constant
    (Horovod's `_allreduce_cond`) only the branch taken."""
    import tensorflow as tf

    from benchmarks import train_step

    def census(predicate):
        @tf.function
        def f(x):
            return tf.cond(predicate(), lambda: tf.cast(tf.math.is_finite(x), tf.float32), lambda: x * 2.0)

        types = [op.type for op in train_step._step_ops(f.get_concrete_function(tf.TensorSpec([3])).graph)]
        return types

    taken = census(lambda: tf.constant(True))
    assert "IsFinite" in taken and "Cast" in taken and "Mul" not in taken and "If" not in taken
    computed = census(lambda: tf.reduce_sum(tf.ones([2])) > 1.0)  # computed: the If and both branches
    assert "If" in computed or "StatelessIf" in computed
    assert "IsFinite" in computed and "Mul" in computed


@pytest.mark.slow
@pytest.mark.multirank
def test_train_step_benchmark_runs_under_mpirun(tmp_path):
    """The engine axis: a tiny ResNet's step under mpirun on 2 emulated nodes x 1 rank (Open
    MPI's collectives, not Gloo's), Horovod's and hvdx's allreduce."""
    from hvdx.runner.mpi import emulation_unavailable

    why = emulation_unavailable()
    if why:
        pytest.skip(why)
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "train_step.py"), "--local",
                           "--engines", "mpi", "--topologies", "2x1", "--models", "resnet", "--scale", "0.05",
                           "--batch", "2", "--optimizers", "horovod,allreduce", "--rounds", "1", "--steps", "1",
                           "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=300, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads((tmp_path / "train_step.json").read_text())["runs"]
    assert run["engine"] == "mpi" and run["topology"] == {"nodes": 2, "ranks_per_node": 1}
    census = run["models"]["resnet"]["census"]
    assert census["horovod"]["collectives"] == census["allreduce"]["collectives"] != []
    assert "| 2x1 | mpi | resnet | hvdx allreduce |" in readme.read_text()


@pytest.mark.slow
@pytest.mark.multirank
def test_daso_benchmark_writes_json_plot_and_table(tmp_path):
    """A tiny MLP over loopback (horovodrun, 2 nodes x 1 rank), every method (DASO on Keras 3
    beside Keras 2's where Keras 3 is there), one repeat."""
    readme = tmp_path / "README.md"
    methods = ["horovod", "daso"] + (["daso_keras3"] if harness.HAS_KERAS3 else [])
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "daso.py"), "--local",
                           "--methods", ",".join(methods), "--topologies", "2x1", "--width", "32", "--epochs", "4", "--warmup-epochs", "1",
                           "--cooldown-epochs", "1", "--max-global-skips", "4", "--repeats", "1", "--target", "0.3",
                           "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=400, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "daso.json").read_text())
    (run,) = result["results"]
    assert run["topology"] == {"nodes": 2, "ranks_per_node": 1}
    assert sorted(run["runs"]) == sorted(methods)
    for method in methods:
        (repeat,) = run["runs"][method]
        assert len(repeat["epoch_seconds"]) == len(repeat["accuracy"]) == 4
        assert min(repeat["epoch_seconds"]) > 0 and repeat["accuracy"][-1] > 0.3
    summary = run["summary"]
    for method in methods[1:]:
        daso = run["runs"][method][0]
        kinds = daso["step_kinds"]
        assert len(kinds) == len(daso["step_seconds"])
        # 1 warm-up + 1 cool-down epoch blocking, 2 cycling epochs with exchanges (B = 4, W = 1)
        assert {"blocking", "start", "merge", "epoch_end"} <= set(kinds)
        # every exchange merged (at a merge step or by an epoch's drain) reports its time on the wire
        assert len(daso["exchange_seconds"]) == len(daso["merge_wait_seconds"]) >= kinds.count("merge") > 0
        assert summary[method]["less_time_to_target"] == pytest.approx(
            1 - summary[method]["time_to_target"][0] / summary["horovod"]["time_to_target"][0])
    assert (tmp_path / "daso.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- daso:begin -->" in text and "| 2x1 | hvdx.DASO |" in text
    assert "DASO: cycling, exchange in flight" in text or "DASO: cycling, merges one (eq. 1)" in text
    if harness.HAS_KERAS3:  # the Keras 3 DASO against the Keras 2 one, in the same run
        assert "| 2x1 | hvdx.DASO (Keras 3) |" in text and "against DASO on Keras 2 in the same run" in text
        assert summary["daso_keras3"]["mean_accuracy_points_vs_keras2"] == pytest.approx(
            100 * (summary["daso_keras3"]["mean_final_accuracy"] - summary["daso"]["mean_final_accuracy"]))


def test_daso_benchmark_classifies_steps_by_action():
    from benchmarks import daso
    from hvdx.daso.schedule import Action

    history = [Action(1, blocking_group=0), Action(2), Action(3, start_group=1), Action(4), Action(5, merge_group=1,
                                                                                                  staleness=2),
               Action(6)]
    assert daso.classify_steps(history) == ["blocking", "local", "start", "in_flight", "merge", "local"]
    run = {"epoch_seconds": [1.0, 2.0, 3.0], "accuracy": [0.5, 0.9, 0.95]}
    assert daso.time_to(run, 0.9) == 3.0 and daso.time_to(run, 0.99) is None


# -- throughput.py (shi2021 Table 3) -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(CLUSTER_UNAVAILABLE is not None, reason=str(CLUSTER_UNAVAILABLE))
def test_throughput_benchmark_smoke_run_on_the_emulated_cluster(tmp_path):
    """`--smoke`: every row of Table 3 (tiny stand-ins) with every configuration, one round,
    2 nodes x 2 ranks at 1 Gbit/s; JSON, plot and README section written."""
    readme = tmp_path / "README.md"
    with harness.network_lock():
        proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "throughput.py"), "--smoke",
                               "--out", str(tmp_path), "--readme", str(readme)],
                              capture_output=True, text=True, timeout=500, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from benchmarks import throughput

    result = json.loads((tmp_path / "throughput.json").read_text())
    assert result["topology"] == {"nodes": 2, "ranks_per_node": 2} and result["network"]["rate_bps"] == 10**9
    assert sorted(result["workloads"]) == sorted(throughput.WORKLOADS)
    for name, measured in result["workloads"].items():
        assert measured["workload"] == dataclasses.asdict(throughput.SMOKE_WORKLOADS[name])
        assert sorted(measured["rounds"]) == sorted(throughput.CONFIGS)
        assert all(len(t) == 1 and t[0] > 0 for t in measured["rounds"].values())
        summary = result["summary"][name]
        (alone,) = measured["rounds"]["none"]
        for key, (t,) in measured["rounds"].items():  # SE: one rank's time over this configuration's
            if key != "none":
                assert summary[key]["scaling_efficiency"] == pytest.approx(alone / t)
            assert summary[key]["samples_per_s"] == pytest.approx(4 * measured["workload"]["batch"] / t)
    assert result["verdict"]["goal"] == throughput.GOAL
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- throughput:begin -->" in text and "| resnet50_96 | tiny_cnn 16, batch 2 x 4 |" in text
    assert "MSTopK (HiTopK) over 2DTAR, throughput:" in text


def _throughput_result(times: dict) -> dict:
    """A made-up 2x2 result: {row: {configuration: [seconds per step of each round]}}."""
    workload = {"model": "resnet50", "size": 96, "batch": 4, "paper": "ResNet-50 (96*96)"}
    return {"topology": {"nodes": 2, "ranks_per_node": 2},
            "workloads": {name: {"workload": workload, "parameters": 25_557_032, "rounds": rounds}
                          for name, rounds in times.items()}}


def test_throughput_scaling_efficiency_is_one_rank_alone_over_the_configuration():
    """SE (Table 3) = P-rank throughput / (P x one rank's) = t(alone) / t, per round, median."""
    from benchmarks import throughput

    result = _throughput_result({"resnet50_96": {"none": [1.0, 1.0, 2.0], "hierarchical": [2.0, 4.0, 4.0],
                                                 "hitopk": [1.25, 2.0, 2.5]}})
    summary = throughput.summarize(result)["resnet50_96"]
    assert summary["hierarchical"]["scaling_efficiency"] == pytest.approx(0.5)
    assert summary["hitopk"]["scaling_efficiency"] == pytest.approx(0.8)
    assert summary["hitopk"]["vs_2dtar"] == pytest.approx(1.6) and summary["hitopk"]["vs_2dtar_range"] == [1.6, 2.0]
    assert summary["none"]["samples_per_s"] == pytest.approx(16.0)  # 4 ranks x batch 4 / 1 s


def test_throughput_goal_counts_communication_bound_rows_and_says_by_how_much_it_misses():
    from benchmarks import throughput

    met = throughput.summarize(_throughput_result({
        "resnet50_224": {"none": [1.0], "hierarchical": [1.1], "hitopk": [1.0]},    # compute-bound: not counted
        "resnet50_96": {"none": [1.0], "hierarchical": [3.0], "hitopk": [2.0]}}))   # 1.5x, bound 3x
    v = throughput.verdict(met)
    assert v["met_on"] == ["resnet50_96"] and not v["rows"]["resnet50_224"]["communication_bound"]
    assert "met on resnet50_96" in throughput.verdict_text(v, met)
    missed = throughput.summarize(_throughput_result({
        "resnet50_96": {"none": [1.0], "hierarchical": [3.0], "hitopk": [2.5]}}))   # 1.2x
    v = throughput.verdict(missed)
    assert v["met_on"] == [] and v["short_by"] == pytest.approx(1 - 1.2 / 1.25)
    text = throughput.verdict_text(v, missed)
    assert "missed by 4% on the best row, resnet50_96" in text and "2DTAR adds 2000 ms per step" in text
    compute_bound = throughput.summarize(_throughput_result({
        "resnet50_224": {"none": [1.0], "hierarchical": [1.2], "hitopk": [0.9]}}))
    v = throughput.verdict(compute_bound)
    assert v["met_on"] == [] and "no row was communication-bound" in throughput.verdict_text(v, compute_bound)


def test_stacks_tabulates_each_stack_side_by_side_with_the_new_over_the_old(tmp_path):
    from benchmarks import stacks

    def topk(top_k_over_mstopk, accumulate):
        return {"machine": {"tensorflow": "x"}, "distributions": [
                    {"distribution": "normal", "d": 100, "top_k_over_mstopk": top_k_over_mstopk,
                     "mstopk_over_floor": 1.5}],
                "accumulate_seconds": [{"d": 100, "sparse_accumulate": 1.0, "unsorted_segment_sum": accumulate}]}

    def train_step(speedup):
        entry = {"median_seconds": 1.0 / speedup, "speedup_vs_horovod": speedup, "speedup_range": [speedup - 0.1,
                                                                                                     speedup + 0.1]}
        return {"runs": [{"summary": {"mlp": {"horovod": {"median_seconds": 1.0}, "hitopk": entry}}}]}

    def convergence(accuracy):
        return {"summary": {"mnist": {"hitopk": {"final_accuracy": accuracy, "gap_points": -0.5}}}}

    for stack, results in (("tf2.15", (topk(8.0, 4.0), train_step(2.0), convergence(0.95))),
                           ("tf2.21", (topk(6.0, 6.0), train_step(2.5), convergence(0.96)))):
        for benchmark, result in zip(("topk", "train_step", "convergence"), results):
            (tmp_path / stack / benchmark).mkdir(parents=True)
            (tmp_path / stack / benchmark / stacks.RESULT_FILE[benchmark]).write_text(json.dumps(result))
    text = stacks.tabulate(tmp_path, ["tf2.15", "tf2.21"], ["topk", "train_step", "convergence"], {})
    assert "| input | ratio | tf2.15 | tf2.21 | tf2.21 / tf2.15 |" in text
    assert "| normal (d=100) | top_k / MSTopK | 8.00x | 6.00x | 0.75 |" in text
    assert "| accumulate (d=100) | segment_sum / ours | 4.00x | 6.00x | 1.50 |" in text
    assert "| mlp | hitopk | 2.00x (1.90-2.10) | 2.50x (2.40-2.60) | 1.25 |" in text
    assert "| mlp | Horovod's step (ms) | 1000 | 1000 | 1.00 |" in text
    assert "| mnist | hitopk | 0.950 (-0.5) | 0.960 (-0.5) |  |" in text
    with pytest.raises(SystemExit, match="run `python benchmarks/stacks.py --only topk` first"):
        stacks.tabulate(tmp_path / "none", ["tf2.15"], ["topk"], {})


def test_elastic_summary_takes_medians_and_judges_the_goals_by_how_much():
    from benchmarks import elastic

    def run(case, reached_at, seconds):
        return {"method": "hitopk", "case": case, "seconds": seconds,
                "records": [{"t": reached_at - 5, "accuracy": 0.5, "size": 4}, {"t": reached_at, "accuracy": 0.95, "size": 4}]}

    runs = [run("uninterrupted", 40, 60), run("uninterrupted", 50, 70), run("elastic", 60, 90), run("elastic", 54, 80),
            run("relaunch", 100, 120), run("relaunch", 90, 110)]
    summary = elastic.summarize(runs, 0.9)
    cases = summary["hitopk"]
    assert cases["uninterrupted"]["median_to_target"] == 45 and cases["elastic"]["median_to_target"] == 57
    assert cases["ratios"]["elastic_over_uninterrupted"] == pytest.approx(57 / 45)
    assert cases["ratios"]["relaunch_over_elastic"] == pytest.approx(95 / 57)
    (line,) = elastic.verdicts(summary)
    assert "1.27x the uninterrupted time (goal <= 1.15: missed by 0.12)" in line and "1.67x sooner" in line
    assert "(goal >= 1.3: met)" in line and "by hvdx's launcher" not in line
    cheap = [run("relaunch-hvdx", 80, 100), run("relaunch-hvdx", 70, 90)]  # the relaunch without horovodrun's start
    summary = elastic.summarize(runs + cheap, 0.9)
    assert summary["hitopk"]["ratios"]["relaunch_hvdx_over_elastic"] == pytest.approx(75 / 57)
    assert "1.67x sooner than a relaunch (goal >= 1.3: met); 1.32x sooner than a relaunch by hvdx's launcher" in (
        elastic.verdicts(summary)[0])
    assert "| hitopk | relaunch-hvdx | 75.0 | 80.0 / 70.0 |" in elastic.table(summary)
    runs.append({"method": "hitopk", "case": "relaunch", "seconds": 30, "records": [{"t": 20, "accuracy": 0.5, "size": 4}]})
    assert "did not reach the target in every repeat" in elastic.verdicts(elastic.summarize(runs, 0.9))[0]
    assert "| hitopk | relaunch | - | 100.0 / 90.0 / - |" in elastic.table(elastic.summarize(runs, 0.9))


def test_elastic_ranks_run_with_tf_datas_autotuning_only_when_asked(tmp_path):
    """The ranks' pipelines have autotuning off (TensorFlow's autotuning thread can hold a
    rank that deletes an iterator for up to 60 s): --autotune reaches every worker."""
    import argparse

    from benchmarks import elastic

    args = argparse.Namespace(epochs=3, batch=8, seed=1, mlp_scale=0.5, commit_every=5, smoke=False, autotune=False)
    assert "--autotune" not in elastic._worker_command(args, "hitopk", "elastic", tmp_path)
    args.autotune = True
    for resume in (False, True):
        assert "--autotune" in elastic._worker_command(args, "hitopk", "fixed", tmp_path, resume=resume)


def test_elastic_reset_cost_is_the_gap_at_a_size_change_less_an_epoch_of_the_new_size():
    from benchmarks import elastic

    epochs = [(10, 4), (13, 4), (16, 4), (50, 2), (55, 2), (60, 2), (100, 4), (103, 4)]
    record = {"records": [{"t": t, "size": size, "accuracy": 0.9} for t, size in epochs]}
    assert elastic.reset_costs(record) == [29.0, 37.0]  # 34 - 5 (an epoch on 2 ranks), 40 - 3


def test_daso_benchmark_over_seeds_reports_means():
    """--seeds: the time to target and the final accuracy as means over every seed's runs
    (issue 44), DASO's gain as one minus the ratio of the means; the verdict says so."""
    from benchmarks import daso

    def run(seconds, accuracy, seed):
        return {"epoch_seconds": seconds, "accuracy": accuracy, "seed": seed, "step_kinds": ["local"],
                "step_seconds": [0.1],
                "exchange_seconds": [], "merge_wait_seconds": []}

    result = {"runs": {"horovod": [run([2.0, 2.0], [0.9, 0.96], 0), run([2.0, 2.0, 2.0], [0.8, 0.9, 0.97], 1)],
                       "daso": [run([1.0, 1.0], [0.9, 0.96], 0), run([1.0, 1.0], [0.96, 0.97], 1)]}}
    summary = daso.summarize(result, 0.95)
    assert summary["horovod"]["mean_time_to_target"] == 5.0 and summary["daso"]["mean_time_to_target"] == 1.5
    assert summary["daso"]["less_mean_time_to_target"] == pytest.approx(0.7)
    assert summary["daso"]["mean_accuracy_points_vs_horovod"] == pytest.approx(0.0)
    assert daso.verdict(summary, seeds=2).startswith("over 2 seeds, DASO's mean training time to the target "
                                                     "accuracy is 70% less than Horovod's")
    assert "goal met" in daso.verdict(summary, seeds=2)


def test_recipe_keras_takes_medians_per_phase_and_keras3_over_keras2(tmp_path):
    """benchmarks/recipe_keras.py (the recipe's Table 4 form on both Keras): per Keras and
    phase the median over rounds of the recipe's own per-phase samples/s, Keras 3's over
    Keras 2's as their ratio, the rounds' accuracies and times as they were; the README table."""
    import argparse

    from benchmarks import recipe_keras

    def run(rates, accuracy, reached):
        return {"phases": [{"phase": "3x24@32", "communication": ["HiTopK"], "samples_per_s": rates[0], "step_s": 0.1,
                            "scaling_efficiency": 0.5},
                           {"phase": "2x32@32", "communication": ["Hierarchical"], "samples_per_s": rates[1],
                            "step_s": 0.2, "scaling_efficiency": 0.4}],
                "final": {"val_top1": accuracy}, "reached": reached and {"elapsed_s": reached}, "trained_s": 30.0,
                "load_average": [1.0, 1.0]}

    runs = {"2": [run((100, 50), 0.99, 20.0), run((110, 70), 0.98, None), run((90, 60), 0.99, 25.0)],
            "3": [run((120, 40), 0.99, 19.0), run((100, 45), 0.99, 21.0), run((140, 50), 0.97, 30.0)]}
    summary = recipe_keras.summarize(runs)
    assert summary["2"]["phases"]["3x24@32"]["samples_per_s"] == 100
    assert summary["3"]["phases"]["2x32@32"]["samples_per_s"] == 45
    assert summary["ratio_3_over_2"] == {"3x24@32": 1.2, "2x32@32": 0.75}
    assert summary["2"]["to_target_s"] == [20.0, None, 25.0] and summary["3"]["val_top1"] == [0.99, 0.99, 0.97]
    readme = tmp_path / "README.md"
    args = argparse.Namespace(out=tmp_path, readme=readme, rounds=3, se_steps=5, nodes=2, ranks_per_node=2,
                              cluster=False, rate="1gbit")
    recipe_keras.report(args, runs, summary)
    text = readme.read_text()
    assert "<!-- recipe_keras:begin -->" in text and "| Keras 3 (TensorFlow's tf.keras) | 3x24@32 | HiTopK |" in text
    assert "| 1.20 |" in text and (tmp_path / "recipe_keras.png").stat().st_size > 5_000


def test_link_rates_puts_each_rates_run_side_by_side_and_names_the_first_to_target(tmp_path):
    from benchmarks import link_rates

    def run(name, bps, horovod, streaming4):
        seeds = {m: {"seconds_to_target": times, "mean": acc, "gap_points": gap, "speedup_vs_horovod": speedup,
                     "mean_seconds_to_target": sum(t for t in times if t) / sum(1 for t in times if t)}
                 for m, (times, acc, gap, speedup) in (("horovod", horovod), ("streaming4", streaming4))}
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "network": {"rate_bps": bps}, "arguments": {"steps": 100},
            "seeds": {"mlp": seeds}, "summary": {"mlp": {m: {"target": 0.9} for m in seeds}}}))

    run("slow", 20e6, ([200.0, 300.0], 0.93, 0.0, 1.0), ([4.0, None], 0.91, -2.0, 50.0))  # paired seeds: 200 / 4
    run("fast", 1e9, ([8.0, 10.0], 0.93, 0.0, 1.0), ([4.0, 5.0], 0.92, -1.0, 2.0))
    runs = link_rates.load_runs(tmp_path, ["slow", "fast"])
    assert [r["name"] for r in runs] == ["fast", "slow"]  # fastest link first
    text = link_rates.tabulate(runs, "mlp")
    assert "| 1 Gbit/s | streaming4 | 4.5 | 2/2 | 2.00x | 0.920 | -1.0 | 100 |" in text
    assert "| 20 Mbit/s | streaming4 | 4.0 | 1/2 | 50.00x | 0.910 | -2.0 | 100 |" in text
    assert "- 1 Gbit/s (`fast`): **streaming4** first to 0.9, 2.00x sooner than Horovod" in text
    assert "20 Mbit/s (`slow`)" not in text  # one seed never reached it: no winner named there
    link_rates.plot(runs, "mlp", tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--name missing"):
        link_rates.load_runs(tmp_path, ["missing"])
