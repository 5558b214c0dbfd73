"""hvdx's operations in Horovod's timeline (hvdx/timeline.py): the marks' times, their pairing
into spans, the file Horovod wrote extended with them, and a 2x2 HiTopK + DASO job whose
timeline shows hvdx's steps beside Horovod's tensors."""
import json
import os

import pytest
import tensorflow as tf

from hvdx import progress, timeline
from tests import harness


def test_spans_pair_in_order_per_call_and_step_and_name_their_process():
    rows = [("hitopk", "grads", "enter", 1000, 1), ("hitopk", "grads|mstopk", "begin", 1100, 1),
            ("hitopk", "grads|mstopk", "end", 1400, 1), ("hitopk", "grads", "leave", 2000, 1),
            ("hitopk", "grads", "enter", 3000, 2), ("daso", "global synchronisation (blocking)", "begin", 3500, 3),
            ("daso", "global synchronisation (blocking)", "end", 3900, 3), ("hitopk", "grads", "enter", 5000, 2)]
    records = timeline.events(rows, origin=500, rank=2)
    spans = [r for r in records if r["ph"] == "X"]
    assert [(s["name"], s["ts"], s["dur"]) for s in spans] == [
        ("mstopk", 600, 300), ("hitopk", 500, 1000), ("daso", 3000, 400)]  # the unclosed calls are dropped
    names = {r["pid"]: r["args"]["name"] for r in records if r["name"] == "process_name"}
    assert names[spans[0]["pid"]] == "hvdx hitopk 'grads' (rank 2)" == names[spans[1]["pid"]]
    assert names[spans[2]["pid"]] == "hvdx daso 'global synchronisation (blocking)' (rank 2)"
    assert all(pid >= timeline.PID_BASE for pid in names)


def test_spans_are_appended_to_horovods_file_on_its_clock(tmp_path):
    path = tmp_path / "timeline.json"
    horovod = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 10_000}},
               {"ph": "B", "name": "ALLREDUCE", "ts": 5, "pid": 1}, {"ph": "E", "ts": 9, "pid": 1}]
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in horovod) + "]")  # Horovod ends each record with ]
    assert timeline._horovod_origin(path.read_text()) == 10_000
    records = timeline.events([("hitopk", "g|mstopk", "begin", 10_100, 0), ("hitopk", "g|mstopk", "end", 10_300, 0)],
                              origin=10_000, rank=0)
    timeline._append(str(path), records, 0)
    merged = json.loads(path.read_text())
    assert merged[:3] == horovod and merged[-1]["ts"] == 100 and merged[-1]["dur"] == 200


def test_another_ranks_file_merges_onto_rank_0s_clock(tmp_path):
    path = str(tmp_path / "timeline.json")
    timeline._append(path, [], 1_000)  # rank 0: clock from 1,000 us
    other = timeline.rank_file(path, 1)
    timeline._append(other, timeline.events([("a", "b", "enter", 1_500, 0), ("a", "b", "leave", 1_700, 0)],
                                            origin=1_400, rank=1), 1_400)
    timeline.merge(path, [1])
    merged = json.loads(open(path).read())
    assert not os.path.exists(other)
    assert [r["ts"] for r in merged if r.get("ph") == "X"] == [500]  # 1,500 us on rank 0's clock


def test_horovods_dynamic_timeline_is_not_a_file_to_write(monkeypatch):
    """HOROVOD_TIMELINE=DYNAMIC (hvd.start_timeline later) names no file: hvdx records nothing
    (it wrote a file called DYNAMIC into the working directory)."""
    monkeypatch.setenv("HOROVOD_TIMELINE", timeline.DYNAMIC)
    assert timeline.start(1) is False and not timeline.active() and timeline.write() is None


def test_the_library_records_marks_with_wall_clock_times():
    was = progress.enabled()
    progress.enable(True)
    lib = timeline._library()
    lib.hvdx_timeline_record(1)
    try:
        timeline._drain()
        x = tf.constant([1.0])
        (x,) = progress.mark([x], "test", "timeline|step", "begin")
        (x,) = progress.mark([x], "test", "timeline|step", "end")
        rows = [r for r in timeline._drain() if r[0] == "test"]
    finally:
        lib.hvdx_timeline_record(0)
        progress.enable(was)
    assert [r[2] for r in rows] == ["begin", "end"] and rows[0][3] <= rows[1][3]
    assert abs(rows[0][3] / 1e6 - __import__("time").time()) < 60  # microseconds since the epoch
    assert progress.snapshot().get(("test", "timeline|step"), (0, 0)) == (0, 0)  # spans count no call


@pytest.mark.multirank
def test_a_hitopk_and_daso_job_on_2x2_shows_hvdxs_steps_in_horovods_timeline(tmp_path):
    path = tmp_path / "timeline.json"
    job = harness.launch("stall_worker.py", "timeline", "hitopk", np=4, hosts=harness.hosts(2, 2), timeout=150,
                         env={"HOROVOD_TIMELINE": str(path), "STALL_STEPS": "3"})
    assert job.returncode == 0 and not job.timed_out, job.output[-4000:]
    records = json.loads(path.read_text())  # still valid JSON with hvdx's records added
    horovod = [r for r in records if r.get("pid", 0) < timeline.PID_BASE and r.get("ph") in ("B", "E", "X")]
    ours = [r for r in records if r.get("pid", 0) >= timeline.PID_BASE and r.get("ph") == "X"]
    assert horovod and ours
    names = {r["name"] for r in ours}
    assert {"hitopk", "reduce_scatter", "mstopk + error feedback", "inter_allgather",
            "intra_allgather + accumulate", "daso"} <= names, names
    assert sum(r["name"] == "mstopk + error feedback" for r in ours) >= 3  # one per step (two buffers may fuse)
    first, last = min(r["ts"] for r in horovod), max(r["ts"] for r in horovod)
    assert all(first - 60e6 < r["ts"] < last + 60e6 for r in ours)  # on Horovod's clock
    for rank in (1, 2, 3):
        theirs = json.loads(open(timeline.rank_file(str(path), rank)).read())
        assert any(r.get("name") == "mstopk + error feedback" and r["args"]["rank"] == rank for r in theirs)
    timeline.merge(str(path), [1, 2, 3])
    merged = json.loads(path.read_text())
    assert {r["args"]["rank"] for r in merged if r.get("pid", 0) >= timeline.PID_BASE and r.get("ph") == "X"} == \
        {0, 1, 2, 3}
