"""The multi-rank suite (tests/suite.py, tests/multirank/suite.py): one launch runs many
checks, each test gets its own check's result and output, and a check that fails or hangs
fails only its own tests, naming the rank and the check."""
import json
import time

import pytest

from tests import suite


def test_topologies_parse_and_bad_ones_say_what_to_write():
    assert suite.Topology.parse("3x2").sizes == (2, 2, 2) and suite.Topology.parse("3x2").np == 6
    assert suite.Topology.parse("1+2").sizes == (1, 2)
    cluster = suite.Topology.parse("cluster:2x2")
    assert (cluster.nodes, cluster.per_node, cluster.cluster_rate) == (2, 2, "1gbit")
    assert suite.Topology.parse("cluster:2x1@100mbit").cluster_rate == "100mbit"
    for bad in ("2by2", "x2", "cluster:1+2"):
        with pytest.raises(ValueError, match="give 'NODESxRANKS'"):
            suite.Topology.parse(bad)
    with pytest.raises(ValueError, match="different sizes"):
        suite.Topology.parse("1+2").per_node


def test_output_is_split_by_check_and_rank_stream():
    output = "\n".join(["[0]<stdout>:hvdx-suite: begin 00-a", "[1]<stdout>:hvdx-suite: begin 00-a",
                        "[0]<stdout>:a on 0", "[1]<stderr>:before any marker", "[1]<stdout>:a on 1",
                        "[0]<stdout>:hvdx-suite: end 00-a ok", "[0]<stdout>:hvdx-suite: begin 01-b",
                        "horovodrun's own line", "[0]<stdout>:b on 0", "[1]<stdout>:a on 1, later"])
    assert suite.split_output(output) == {"00-a": "[0]<stdout>:a on 0\n[1]<stdout>:a on 1\n[1]<stdout>:a on 1, later",
                                          "01-b": "[0]<stdout>:b on 0"}


def test_only_the_selected_tests_checks_are_planned():
    class Item:
        def __init__(self, check):
            self.callspec = type("CallSpec", (), {"params": {"ranks": check}})()

    a, b = suite.check("suite.echo", "1x2", value="a"), suite.check("suite.echo", "2x1", value="b", timeout=20)
    assert [suite.needed(i) for i in (Item(a), Item(b), Item("other"))] == [a, b, None]
    assert suite.budget([a, b]) == suite.STARTUP + 300 + 20
    assert str(b) == "suite.echo(value='b') on 2x1"


def test_a_launch_whose_ranks_stop_reporting_is_stopped_saying_where(tmp_path):
    """The host's watch for what the ranks' own watchdogs cannot end (a hung start-up)."""
    watch = suite._StallWatch(tmp_path, tmp_path / "plan.json", {"00-a": 10}, np=2)
    assert watch._why(elapsed=suite.STARTUP - 1) is None
    (tmp_path / "progress-0.json").write_text(json.dumps({"check": "00-a", "phase": "check", "since": time.time()}))
    assert watch._why(elapsed=suite.STARTUP + 1) == \
        f"rank(s) [1] did not begin their checks within {suite.STARTUP} s of the launch"
    (tmp_path / "progress-1.json").write_text(json.dumps({"check": "00-a", "phase": "barrier after it",
                                                          "since": time.time() - 10 - suite.GRACE - 1}))
    assert watch._why(elapsed=suite.STARTUP + 1) == \
        f"rank 1 was in 00-a (barrier after it) for more than {10 + suite.GRACE} s"


@pytest.mark.multirank
def test_one_launch_runs_every_check_and_failures_stay_with_their_check(tmp_path):
    """On 1x2: a check fails on rank 1, the next hangs on rank 0 (5 s timeout): each fails
    with its rank and why; the checks before run in the first launch, the one after in a second."""
    before, failing = suite.check("suite.echo", "1x2", value="before"), suite.check("suite.fail_on", "1x2", rank=1)
    hanging = suite.check("suite.hang_on", "1x2", rank=0, timeout=5)
    after = suite.check("suite.echo", "1x2", value="after")
    runs = suite.Suite(lambda: tmp_path)
    runs.launch("1x2", [before, failing, hanging, after])
    assert [(r.checks, r.failed) for r in runs.launches] == [(4, ["01-suite.fail_on", "02-suite.hang_on"]), (1, [])]
    whole = runs.launches[1]  # its ranks all ended: the launch's CPU, each rank's, their start-up
    assert whole.cpu_seconds > whole.ranks_cpu > whole.start_up_cpu + sum(whole.check_cpu.values()) > 0
    for echoed, value in ((runs.outcome(before), "before"), (runs.outcome(after), "after")):
        assert echoed == {0: {"value": value, "size_seen": 2}, 1: {"value": value, "size_seen": 2}}
        assert f"[1]<stdout>:echo {value} from rank 1" in echoed.output and "deliberate" not in echoed.output
    with pytest.raises(AssertionError) as failed:
        runs.outcome(failing)
    assert "failed on 1 of 2 ranks" in str(failed.value) and "rank 1 failed" in str(failed.value)
    assert "ValueError: deliberate failure on rank 1" in str(failed.value)
    with pytest.raises(AssertionError) as hung:
        runs.outcome(hanging)
    assert "rank 0 timed out after 5 s in it (check)" in str(hung.value), str(hung.value)
    assert "in hang_on" in str(hung.value)  # the stack of the hanging rank


def test_a_launch_is_measured_by_its_parent_with_every_descendant(tmp_path):
    """tests/cpu_meter.py: a grandchild's CPU seconds count (a launch's ranks are horovodrun's
    children), and the job's exit status comes back."""
    import subprocess
    import sys

    from tests import harness

    burn = ("import subprocess, sys, time; subprocess.run([sys.executable, '-c', "
            "'import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass']); sys.exit(3)")
    out = tmp_path / "cpu.json"
    proc = subprocess.run([sys.executable, str(harness.CPU_METER), str(out), "--", sys.executable, "-c", burn],
                          timeout=60)
    measured = json.loads(out.read_text())
    assert proc.returncode == 3 and measured["returncode"] == 3
    assert measured["cpu_seconds"] >= 0.5


def test_a_tests_cost_leaves_out_the_session_suites_launches_that_ended_meanwhile(request, tmp_path):
    """The session's launches run in a thread of this process: one reaped while a test runs is
    not that test's; a launch a test makes itself (a Suite of its own, harness.launch) is."""
    from tests import conftest

    session_suite = request.getfixturevalue("multirank_suite")
    before = conftest._cpu(request.config)
    session_suite.ledger.add(1000.0)
    suite.Suite(lambda: tmp_path).ledger.add(500.0)
    after = conftest._cpu(request.config)
    session_suite.ledger.add(-1000.0)
    assert 999 < before - after < 1001


def test_a_launch_line_splits_its_cpu_by_where_it_went():
    record = suite.LaunchRecord("2x2", 2, 30.0, [], cpu_seconds=100.0, check_seconds={"00-a": 5.0, "01-b": 9.0},
                                check_cpu={"00-a": 20.0, "01-b": 40.0}, start_up_cpu=16.0, ranks_cpu=80.0)
    assert str(record).startswith("2x2: 2 check(s) in 30 s (100 CPU s = start-up 16 + checks 60 + "
                                  "between checks 4 + launcher and exit 20) (slowest: 01-b 9 s, 40 CPU s")
