"""The benchmark scripts run end to end (tiny sizes; timings are never asserted)."""
import json
import subprocess
import sys

import pytest

from tests import harness

CLUSTER_UNAVAILABLE = harness.cluster_unavailable()


def test_topk_benchmark_writes_json_plot_and_table(tmp_path):
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "topk.py"), "--sizes", "65536",
                           "100003", "--repeats", "1", "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=300, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "topk.json").read_text())
    assert [row["d"] for row in result["topk_seconds"]] == [65536, 100003]
    assert all(row["mstopk"] > 0 and row["tf_top_k"] > 0 for row in result["topk_seconds"])
    assert (tmp_path / "topk.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- topk:begin -->" in text and "| 100,003 | 100 |" in text


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
