"""The progress watchdog (hvdx.watchdog, hvdx.progress, hvdx.stall): a job that stops making
progress in hvdx's collectives names the rank and the call and ends non-zero within the bound
plus a few seconds; a slow but progressing job runs to the end.

The launched scenarios are tests/multirank/stall_worker.py's, one horovodrun job each (a stall
ends its job); the bound is 4 s, so that they stay short."""
import re
import time

import pytest
import tensorflow as tf

from hvdx import progress, stall, watchdog
from tests import harness

BOUND = 4  # seconds, the launched jobs' $HVDX_STALL_TIMEOUT_SECONDS
SLACK = 6  # seconds the report may come after the bound on a loaded machine


# -- the report, from the ranks' states ---------------------------------------------------

def _state(rank, entered, left, where="train.py:10 in main", exited=False, waited=None):
    return {"rank": rank, "counts": [["hitopk", "v0_b0", entered, left]], "where": where, "exited": exited,
            "waited": waited}


def test_a_stall_report_names_the_rank_the_call_and_the_counts():
    states = {0: _state(0, 3, 3, "train.py:40 in main > topology.py:221 in barrier"),
              1: _state(1, 4, 3, waited=4.2), 2: _state(2, 3, 3), 3: None}
    report = stall.stall_report(states, 4, 4.0, reporter=1)
    first = report.splitlines()[0]
    assert "rank 1 waited 4.2 s in collective 'hitopk' on buffer 'v0_b0' (call 4)" in first
    assert "longer than the bound of 4 s" in first and "HVDX_STALL_TIMEOUT_SECONDS" in first
    assert "rank 1 waits in call 4; ranks 0, 2 completed 3 calls and are not in it" in report
    assert "Rank 1 ran 4 calls, the others 3" in report
    assert "rank 0: in no hvdx collective, at train.py:40 in main > topology.py:221 in barrier" in report
    assert "rank 2: in no hvdx collective, at train.py:10 in main" in report
    assert "rank 3: did not answer" in report
    assert "same number of steps on every rank" in report


def test_a_rank_that_stopped_is_named_as_the_one_behind():
    states = {0: _state(0, 3, 2, waited=5.0), 1: _state(1, 2, 2, "train.py:12 in main"), 2: _state(2, 3, 2)}
    report = stall.stall_report(states, 3, 4.0, reporter=0)
    assert "ranks 0, 2 wait in call 3; rank 1 completed 2 calls and is not in it" in report
    assert "Rank 1 ran 2 calls, the others 3" in report
    assert "rank 1: in no hvdx collective, at train.py:12 in main" in report


def test_ranks_at_the_same_place_share_a_line():
    states = {r: _state(r, 3, 3, "train.py:40 in main > topology.py:221 in barrier") for r in (0, 2, 3)}
    states[1] = _state(1, 4, 3, waited=4.0)
    report = stall.stall_report(states, 4, 4.0, reporter=1)
    assert "  ranks 0, 2, 3: in no hvdx collective, at train.py:40 in main > topology.py:221 in barrier" in report
    assert "  rank 1: waiting for 4.0 s in collective 'hitopk' on buffer 'v0_b0'" in report


def test_the_place_is_the_users_frame_also_in_a_checkout_named_hvdx(tmp_path):
    """hvdx's own frames are told by its package's folder, not by a folder named hvdx: in a
    checkout named hvdx the user's script and the venv's libraries are not hvdx's (a CI clone
    named hvdx reported TensorFlow's frames where the ranks waited, and no user frame)."""
    def compiled(source, path):
        namespace = {}
        exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - frames with these file names
        return namespace

    library = compiled("def run(f):\n    return f()\n",
                       tmp_path / "hvdx" / ".venv" / "lib" / "python3" / "site-packages" / "tensorflow" / "ops.py")
    user = compiled("def main(run, f):\n    return run(f)\n", tmp_path / "hvdx" / "examples" / "train.py")
    place = user["main"](library["run"], watchdog._main_thread_place)
    assert place == "train.py:2 in main", place


def test_a_mismatch_report_only_where_the_counts_disagree():
    level = {0: _state(0, 3, 3), 1: _state(1, 3, 3)}
    assert stall.mismatch_report(level, 2, "Mismatched data types: int32 vs float32") is None
    states = {0: _state(0, 3, 3, exited=True), 1: _state(1, 4, 3)}
    message = stall.mismatch_report(states, 2, "Mismatched data types: int32 vs float32")
    assert "Horovod's error (Mismatched data types: int32 vs float32)" in message
    assert "rank 1 failed in call 4; rank 0 completed 3 calls and exited. Rank 1 ran 4 calls, rank 0 3" in message


# -- the bound --------------------------------------------------------------------------

def test_the_bound_comes_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(watchdog.ENV, raising=False)
    assert watchdog.resolve_timeout() == watchdog.DEFAULT_TIMEOUT
    monkeypatch.setenv(watchdog.ENV, "12.5")
    assert watchdog.resolve_timeout() == 12.5
    assert watchdog.resolve_timeout(3) == 3.0  # the argument wins
    monkeypatch.setenv(watchdog.ENV, "0")
    assert watchdog.resolve_timeout() == 0.0  # off
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv(watchdog.ENV, bad)
        with pytest.raises(ValueError, match="HVDX_STALL_TIMEOUT_SECONDS.*0 to turn the watchdog off"):
            watchdog.resolve_timeout()
    with pytest.raises(ValueError, match="stall_timeout"):
        watchdog.resolve_timeout(-2)


# -- the marks and the table --------------------------------------------------------------

@pytest.fixture
def marks_on():
    was = progress.enabled()
    progress.enable(True)
    yield
    progress.enable(was)


def test_marks_count_calls_in_functions_even_on_constants(marks_on):
    @tf.function
    def call():
        (x,) = progress.mark([tf.constant([1.0, 2.0])], "test", "constants", "enter")
        (y,) = progress.mark([x * 2], "test", "constants", "leave")
        return y

    before = progress.snapshot().get(("test", "constants"), (0, 0))
    generation = progress.generation()
    for _ in range(3):
        assert call().numpy().tolist() == [2.0, 4.0]
    after = progress.snapshot()[("test", "constants")]
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3)
    assert progress.generation() >= generation + 6 and progress.open_calls() == 0


def test_marks_in_a_tf1_graph_leave_later_functions_working(marks_on, monkeypatch):
    """A strategy called in a TF1 graph first (Horovod's v1 optimizer) must not leave the
    marks' token in that graph: functions traced afterwards still run."""
    monkeypatch.setattr(progress, "_token", None)  # as in a fresh process
    with tf.Graph().as_default():
        progress.mark([tf.constant([1.0])], "test", "tf1", "enter")

    @tf.function
    def call():
        (x,) = progress.mark([tf.constant([1.0])], "test", "tf1", "enter")
        (y,) = progress.mark([x + 1], "test", "tf1", "leave")
        return y

    assert call().numpy().tolist() == [2.0]


def test_marks_off_leave_the_graph_alone():
    progress.enable(False)
    graph = tf.function(lambda x: progress.mark([x], "test", "off", "enter")[0]).get_concrete_function(
        tf.TensorSpec([2])).graph
    assert not [op for op in graph.get_operations() if op.type == "HvdxProgressMark"]


def test_calls_made_from_python_are_counted_beside_the_marks(marks_on):
    before = progress.snapshot().get(("test", "python"), (0, 0))
    generation = progress.generation()
    with progress.waiting("test", "python"):
        assert progress.open_calls() >= 1
        assert progress.snapshot()[("test", "python")] == (before[0] + 1, before[1])
    with pytest.raises(ZeroDivisionError):
        with progress.waiting("test", "python"):
            1 / 0  # a failed call is left, not waited in
    assert progress.snapshot()[("test", "python")] == (before[0] + 2, before[1] + 2)
    assert progress.generation() == generation + 4 and progress.open_calls() == 0


def test_counts_restart_at_a_rebase_and_an_abandoned_call_is_not_waited_in(marks_on):
    """A new membership (hvdx.shutdown(), Elastic Horovod's reset) rebases the counters: a
    call entered under the old one and never left no longer counts as waited in."""
    abandoned = progress.waiting("test", "abandoned")
    abandoned.__enter__()  # a step that failed inside its collective call
    assert progress.open_calls() >= 1 and progress.snapshot()[("test", "abandoned")][0] >= 1
    progress.rebase()
    assert progress.open_calls() == 0 and ("test", "abandoned") not in progress.snapshot()
    with progress.waiting("test", "abandoned"):
        assert progress.snapshot()[("test", "abandoned")] == (1, 0) and progress.open_calls() == 1
    assert progress.snapshot()[("test", "abandoned")] == (1, 1) and progress.open_calls() == 0
    abandoned.__exit__(None, None, None)  # left after the rebase: counts below the base
    progress.rebase()
    assert progress.open_calls() == 0


def test_a_strategy_call_is_marked(marks_on):
    import hvdx

    hvdx.init()  # one rank: no watchdog of its own
    strategy = hvdx.comm.get("allreduce")
    before = progress.snapshot().get(("allreduce", "marked"), (0, 0))
    strategy(tf.constant([1.0, 2.0]), "marked")
    assert progress.snapshot()[("allreduce", "marked")] == (before[0] + 1, before[1] + 1)


# -- the side channel and the monitor, in one process --------------------------------------

def test_the_side_channel_answers_states_and_ends_a_rank_on_request(marks_on):
    ended = []
    peer = watchdog.Watchdog(60, exit=ended.append)
    address = peer.listen()
    peer.rank, peer.size = 1, 2
    me = watchdog.Watchdog(60)
    me.rank, me.size, me.peers = 0, 2, [None, address]
    try:
        states = me.gather()
        assert states[1]["rank"] == 1 and states[0]["rank"] == 0 and "where" in states[1]
        me._abort_all()  # returns once the peer acknowledged (wrote why it ends), then hangs up
        for _ in range(100):
            if ended:
                break
            time.sleep(0.05)
        assert ended == [watchdog.EXIT_CODE]
    finally:
        peer.stop()


def test_the_monitor_ends_a_rank_that_waits_without_progress(marks_on, capsys):
    ended = []
    dog = watchdog.Watchdog(0.5, poll=0.05, exit=ended.append)
    dog.listen()
    progress.mark([tf.constant(1.0)], "test", "stuck", "enter")  # a call that never leaves
    try:
        dog.start(0, 1, [None])
        for _ in range(100):
            if ended:
                break
            time.sleep(0.05)
    finally:
        dog.stop()
        progress.mark([tf.constant(1.0)], "test", "stuck", "leave")
    assert ended == [watchdog.EXIT_CODE]
    err = capsys.readouterr().err
    assert "rank 0 waited" in err and "collective 'test' on buffer 'stuck'" in err


# -- launched jobs ------------------------------------------------------------------------

def _stalled(*args, np, hosts, expect_rank, call, counts):
    """Launches a stalling scenario; checks it ended non-zero, before the launch timeout, with
    the report naming the rank, the call and the counts, and every rank that could speak
    saying why it ended."""
    job = harness.launch("stall_worker.py", *args, np=np, hosts=hosts, timeout=120,
                         env={watchdog.ENV: str(BOUND)})
    out = job.output
    assert not job.timed_out and job.returncode != 0, out[-4000:]
    match = re.search(r"rank (\d+) waited ([\d.]+) s in (collective '[^']+' on buffer '[^']+') \(call (\d+)\)", out)
    assert match, out[-4000:]
    assert float(match.group(2)) <= BOUND + SLACK, match.group(0)
    assert call in out and counts in out, out[-4000:]
    assert f"rank {expect_rank}" in out
    reporter = int(match.group(1))
    for rank in range(np):
        if rank != reporter:  # the others say why they end (or report the stall themselves)
            assert re.search(rf"\[{rank}\]<stderr>:hvdx watchdog: (rank {rank} ends|the job stopped)", out), \
                job.rank_output(rank)
    return out


@pytest.mark.multirank
def test_an_extra_step_with_the_hitopk_tape_ends_the_job_on_2x2():
    out = _stalled("extra-step", "hitopk", np=4, hosts=harness.hosts(2, 2), expect_rank=1,
                   call="collective 'hitopk' on buffer", counts="Rank 1 ran 4 calls, the others 3")
    assert "rank 1 waits in call 4; ranks 0, 2, 3 completed 3 calls and are not in it" in out
    assert "topology.py" in out and "in barrier" in out  # where the others wait


@pytest.mark.multirank
def test_an_extra_step_with_the_hierarchical_tape_ends_the_job():
    _stalled("extra-step", "hierarchical", np=2, hosts=harness.hosts(2, 1), expect_rank=1,
             call="collective 'hierarchical' on buffer", counts="Rank 1 ran 4 calls, rank 0 3")


@pytest.mark.multirank
def test_a_strategy_called_once_more_on_one_rank_ends_the_job():
    _stalled("direct-extra", np=2, hosts=harness.hosts(2, 1), expect_rank=1,
             call="collective 'hitopk' on buffer 'direct'", counts="Rank 1 ran 4 calls, rank 0 3")


@pytest.mark.multirank
def test_a_rank_that_stops_issuing_collectives_is_named():
    out = _stalled("sleep", np=2, hosts=harness.hosts(2, 1), expect_rank=1,
                   call="collective 'hitopk' on buffer", counts="Rank 0 ran 3 calls, rank 1 2")
    assert "rank 1: in no hvdx collective, at stall_worker.py" in out


@pytest.mark.multirank
def test_a_daso_peer_that_stalls_without_dying_is_named():
    out = _stalled("daso-sleep", np=2, hosts=harness.hosts(2, 1), expect_rank=1,
                   call="collective 'daso' on buffer 'global synchronisation (blocking)'",
                   counts="Rank 0 ran 3 calls, rank 1 2")
    assert "rank 1: in no hvdx collective, at stall_worker.py" in out and "in blocking" in out


@pytest.mark.multirank
def test_horovods_error_after_a_rank_exits_is_explained_in_steps():
    job = harness.launch("stall_worker.py", "extra-exit", "allreduce", np=2, hosts=harness.hosts(2, 1), timeout=120,
                         env={watchdog.ENV: str(BOUND)})
    out = job.output
    assert not job.timed_out and job.returncode != 0, out[-4000:]
    assert "hvdx: the ranks did not make the same collective calls" in out, out[-4000:]
    assert "rank 1 failed in call 4; rank 0 completed 3 calls and exited. Rank 1 ran 4 calls, rank 0 3" in out, \
        out[-4000:]


@pytest.mark.multirank
def test_horovods_mismatched_data_types_is_explained_in_steps():
    # eager steps: rank 1's extra gradient allreduce meets rank 0's barrier under Horovod's one eager name
    job = harness.launch("stall_worker.py", "extra-step", "allreduce", np=2, hosts=harness.hosts(2, 1), timeout=120,
                         env={watchdog.ENV: str(BOUND), "STALL_EAGER": "1"})
    out = job.output
    assert not job.timed_out and job.returncode != 0, out[-4000:]
    assert "Horovod's error (Mismatched data types: One rank had type" in out, out[-4000:]
    assert "rank 1 failed in call 4; rank 0 completed 3 calls and is not in it. Rank 1 ran 4 calls, rank 0 3" in out, \
        out[-4000:]


@pytest.mark.multirank
def test_a_15x_straggler_runs_to_the_end():
    # the fast rank waits about 1.4 s per step for the straggler: 6 waits, each under the
    # bound, together more than it
    job = harness.launch("stall_worker.py", "straggler", np=2, hosts=harness.hosts(2, 1), timeout=180,
                         env={watchdog.ENV: str(BOUND), "STALL_STEPS": "6", "STRAGGLER_STEP": "0.1"})
    out = job.output
    assert job.returncode == 0 and not job.timed_out, out[-4000:]
    assert "hvdx watchdog" not in out
    for rank in range(2):
        assert f"rank {rank} finished" in out, job.rank_output(rank)
