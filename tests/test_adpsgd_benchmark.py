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
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "adpsgd.py"), "--smoke",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "adpsgd.json").read_text())
    (run,) = result["results"]
    assert run["topology"] == {"nodes": 2, "ranks_per_node": 1}
    for scenario in ("homogeneous", "slow_rank"):
        for method in ("allreduce", "dpsgd", "adpsgd"):
            (one,) = run["runs"][scenario][method]
            assert len(one["curve"]) >= 2 and one["accuracy"] > 0.3, (scenario, method, one)
            assert (one["exchanges"] > 0) == (method != "allreduce")
            # the same samples in total: synchronous methods run the budget exactly, AD-PSGD's
            # ranks stop once they know it is spent (never before: known counts lag the true ones).
            # The overshoot, the steps made while the news travels, depends on how loaded the
            # cores are (1.3-1.8x the budget here with two busy cores, before and after issue 39):
            # tests/test_adpsgd.py bounds it tightly; here only what holds under any load, no rank
            # running more than the whole budget on its own
            if method == "adpsgd":
                assert one["budget"] <= sum(one["rank_steps"]) <= len(one["rank_steps"]) * one["budget"], \
                    one["rank_steps"]
            else:
                assert sum(one["rank_steps"]) == one["budget"], one["rank_steps"]
        assert run["summary"][scenario]["allreduce"]["median_ratio"] in (None, 1.0)
    fast, slow = run["runs"]["slow_rank"]["adpsgd"][0]["rank_steps"]
    assert fast > 2 * slow, (fast, slow)  # the fast rank did the slowed rank's share (4x slower)
    assert (tmp_path / "adpsgd.png").stat().st_size > 10_000
