"""benchmarks/adpsgd.py's smoke mode (lian2018 Figs. 3-6 in miniature): the script runs all
three methods and both scenarios, and writes its JSON and plot (no timing asserted)."""
import json
import subprocess
import sys

import pytest

from tests import harness


@pytest.mark.slow
@pytest.mark.multirank
def test_adpsgd_benchmark_smoke_writes_json_and_plot(tmp_path):
    methods = ["allreduce", "dpsgd", "adpsgd"] + (["adpsgd_keras3"] if harness.HAS_KERAS3 else [])
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "adpsgd.py"), "--smoke",
                           "--out", str(tmp_path), "--methods", ",".join(methods)],
                          capture_output=True, text=True, timeout=600, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "adpsgd.json").read_text())
    (run,) = result["results"]
    assert run["topology"] == {"nodes": 2, "ranks_per_node": 1}
    for scenario in ("homogeneous", "slow_rank"):
        for method in methods:  # AD-PSGD on Keras 3 too, where it is there
            (one,) = run["runs"][scenario][method]
            assert len(one["curve"]) >= 2 and one["accuracy"] > 0.3, (scenario, method, one)
            assert (one["exchanges"] > 0) == (method != "allreduce")
            # the same samples in total: synchronous methods run the budget exactly, AD-PSGD's
            # ranks stop once they know it is spent (never before: known counts lag the true ones).
            # The overshoot, the steps made while the news travels, depends on how loaded the
            # cores are (1.3-1.8x the budget here with two busy cores, before and after issue 39):
            # tests/test_adpsgd.py bounds it tightly; here only what holds under any load, no rank
            # running more than the whole budget on its own
            if method.startswith("adpsgd"):
                assert one["budget"] <= sum(one["rank_steps"]) <= len(one["rank_steps"]) * one["budget"], \
                    one["rank_steps"]
            else:
                assert sum(one["rank_steps"]) == one["budget"], one["rank_steps"]
        assert run["summary"][scenario]["allreduce"]["median_ratio"] in (None, 1.0)
    fast, slow = run["runs"]["slow_rank"]["adpsgd"][0]["rank_steps"]
    assert fast > 2 * slow, (fast, slow)  # the fast rank did the slowed rank's share (4x slower)
    assert (tmp_path / "adpsgd.png").stat().st_size > 10_000


def test_over_seeds_the_ratio_is_of_the_mean_times():
    """--seeds (issue 44): each method's mean time to the loss target over the seeds, its
    ratio to AllReduce-SGD's mean; None where a round never reached it."""
    from benchmarks import adpsgd

    def run(times_losses):
        return {"curve": times_losses, "accuracy": 0.95, "exchanges": 0}

    result = {"runs": {"homogeneous": {"allreduce": [run([[1.0, 0.5], [2.0, 0.2]]), run([[4.0, 0.2]])],
                                       "adpsgd": [run([[0.5, 0.2]]), run([[1.0, 0.5]])],
                                       "dpsgd": [run([[1.5, 0.2]]), run([[1.5, 0.2]])]}}}
    summary = adpsgd.summarize(result, 0.25)["homogeneous"]
    assert summary["allreduce"]["mean_time"] == 3.0 and summary["allreduce"]["mean_ratio"] == 1.0
    assert summary["dpsgd"]["mean_ratio"] == 0.5 and summary["dpsgd"]["ratio_to_allreduce"] == [0.75, 0.375]
    assert summary["adpsgd"]["mean_time"] is None and summary["adpsgd"]["mean_ratio"] is None  # seed 2 never
    from benchmarks.common import time_cells

    adpsgd_cells = time_cells(summary["adpsgd"]["time_to_target"],
                              {**summary["adpsgd"], "ratios": summary["adpsgd"]["ratio_to_allreduce"]}, True)
    assert adpsgd_cells == ("0.50 (1 not reached)", "- (rounds that reached it: 0.25-0.25)")
    assert time_cells(summary["dpsgd"]["time_to_target"],
                      {**summary["dpsgd"], "ratios": summary["dpsgd"]["ratio_to_allreduce"]}, True) == \
        ("1.50", "0.50 (0.38-0.75)")
