"""The multi-rank harness names the rank that failed, and times out instead of hanging."""
import time

import pytest

from tests import harness

pytestmark = pytest.mark.multirank


def test_reports_which_rank_failed_and_why():
    job = harness.launch("check_harness.py", "--fail-rank", "1", np=2, hosts=harness.hosts(1, 2))
    with pytest.raises(AssertionError) as info:
        job.check()
    message = str(info.value)
    assert "rank 1 failed" in message and "deliberate failure on rank 1" in message
    assert "rank 0" not in message.replace("rank 0/", "")  # rank 0 succeeded
    assert job.results[0]["ok"] and job.results[0]["data"] == {"size_seen": 2}


def test_times_out_instead_of_hanging():
    start = time.monotonic()
    job = harness.launch("check_harness.py", "--hang-rank", "0", np=2, hosts=harness.hosts(1, 2),
                         timeout=30)
    assert time.monotonic() - start < 30 + 30
    assert job.timed_out
    with pytest.raises(AssertionError, match="rank 0 timed out"):
        job.check()
    assert not harness.leftover_processes(job), "ranks survived the timeout"
