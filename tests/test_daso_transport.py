"""DASO's group transport: the ring that carries the global averaging while training goes on
(coquelin2021, section 3, Figures 1, 3, 5; hvdx/transport/ring.py).

Unit tests run rings of threads inside this process (the address exchange passed in, no
Horovod); the multirank tests run tests/multirank/check_daso_transport.py on 3x2 and 2x2 ranks
and on the emulated cluster.
"""
import json
import subprocess
import sys
import time
from typing import List, Sequence

import ml_dtypes
import numpy as np
import pytest

from hvdx.transport.ring import GroupTransport, Request, TransportError, listen_address
from tests import harness, suite


def ring(groups: Sequence[Sequence[int]], timeout: float = 30.0) -> List[GroupTransport]:
    """One transport per rank of `groups`, all in this process (one thread per rank sets up)."""
    world = sum(len(g) for g in groups)
    allgather = harness.thread_allgather(world, timeout=30)
    return harness.on_threads(lambda rank: GroupTransport._create(groups, rank, "test", timeout, world, allgather),
                              world, join_timeout=60)


@pytest.fixture
def ring_3_2():
    """Ranks 0, 1, 2 in one ring, 3 and 4 in another."""
    transports = ring([(0, 1, 2), (3, 4)])
    yield transports
    for t in transports:
        t.close()


# -------------------------------------------------------------------- a group of one
def test_group_of_one_completes_immediately_with_copies():
    # a 1 x n job: no exchange, no Horovod (create's path when Horovod is not initialized,
    # whatever other tests of this process did)
    transport = GroupTransport._create([[0], [1], [2]], 0, "test", 300.0, world=None, allgather=None)
    assert transport.members == (0,) and transport.index == 0
    x = np.arange(5, dtype=np.float32)
    request = transport.allreduce_sum(x)
    assert request.done() and request.finished is not None and request.started <= request.finished
    out = request.wait(0)
    np.testing.assert_array_equal(out, x)
    assert out is not x and not np.shares_memory(out, x)
    bf16 = x.astype(ml_dtypes.bfloat16)
    (only,) = transport.allgather(bf16).wait(0)
    assert only.dtype == bf16.dtype and only.tobytes() == bf16.tobytes() and not np.shares_memory(only, bf16)
    transport.close()
    transport.close()
    with pytest.raises(TransportError, match="closed"):
        transport.allreduce_sum(x)


# -------------------------------------------------------------------- argument errors
@pytest.mark.parametrize("groups,rank,match", [
    ([[0, 1], [1, 2]], 0, "not disjoint: rank 1"),
    ([[0, 1], [2]], 3, "do not cover rank 3"),
    ([], 0, "groups must be a non-empty"),
    ([[0], []], 0, r"groups\[1\] must be a non-empty"),
    ([[0, -1]], 0, r"groups\[0\] holds -1"),
    ([[0, "1"]], 0, r"groups\[0\] holds '1'"),
])
def test_bad_groups_are_refused_naming_the_problem(groups, rank, match):
    with pytest.raises(ValueError, match=match):  # without Horovod (create's path before hvd.init)
        GroupTransport._create(groups, rank, "test", 300.0, world=None, allgather=None)


def test_groups_must_cover_the_whole_job():
    with pytest.raises(ValueError, match=r"missing \[2\]"):
        GroupTransport._create([[0, 1]], 0, "test", 1.0, world=3, allgather=None)


@pytest.mark.parametrize("kwargs,match", [({"timeout": 0}, "timeout"), ({"name": ""}, "name")])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupTransport.create([[0]], 0, **kwargs)


def test_bad_arrays_are_refused():
    transport = GroupTransport.create([[0]], 0)
    with pytest.raises(ValueError, match="float32 or float64"):
        transport.allreduce_sum(np.ones(3, np.int32))
    with pytest.raises(ValueError, match="float32 or float64"):
        transport.allreduce_sum(np.ones(3, ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="numpy array"):
        transport.allgather([1.0, 2.0])


def test_listen_address_follows_the_launcher(monkeypatch):
    for var in ("HOROVOD_GLOO_IFACE", "HVDX_TRANSPORT_IFACE", "HOROVOD_HOSTNAME"):
        monkeypatch.delenv(var, raising=False)
    assert listen_address() == "127.0.0.1"
    monkeypatch.setenv("HOROVOD_HOSTNAME", "localhost")
    assert listen_address() == "127.0.0.1"
    monkeypatch.setenv("HVDX_TRANSPORT_IFACE", "lo")
    assert listen_address() == "127.0.0.1"
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "no-such-iface0")
    with pytest.raises(TransportError, match="no-such-iface0"):
        listen_address()


# -------------------------------------------------------------------- rings of threads
def test_ring_sums_are_bit_identical_and_allgather_keeps_member_order(ring_3_2):
    for n in (1, 7, 1000, 3_000_001):
        arrays = [np.random.default_rng([r, n]).standard_normal(n).astype(np.float32) for r in range(5)]
        results = [r.wait(60) for r in [t.allreduce_sum(arrays[t.rank]) for t in ring_3_2]]
        for group in ((0, 1, 2), (3, 4)):
            reference = np.sum([arrays[r] for r in group], axis=0)
            for r in group:
                assert results[r].tobytes() == results[group[0]].tobytes(), (n, r)
                np.testing.assert_allclose(results[r], reference, rtol=1e-5, atol=1e-6)
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
        arrays = [(np.arange(11) * (r + 1)).astype(dtype) for r in range(5)]
        results = [r.wait(60) for r in [t.allgather(arrays[t.rank]) for t in ring_3_2]]
        for group in ((0, 1, 2), (3, 4)):
            for r in group:
                assert [a.tobytes() for a in results[r]] == [arrays[m].tobytes() for m in group]
                assert all(a.dtype == np.dtype(dtype) for a in results[r])


def test_shapes_are_kept(ring_3_2):
    group = ring_3_2[3:]
    results = [r.wait(30) for r in [t.allreduce_sum(np.full((2, 3), t.rank, np.float64)) for t in group]]
    for out in results:
        assert out.shape == (2, 3)
        np.testing.assert_array_equal(out, np.full((2, 3), 7.0))


def test_mismatched_requests_fail_on_every_member_naming_both_sides(ring_3_2):
    group = ring_3_2[:3]
    requests = [t.allreduce_sum(np.ones(11 if t.rank == 1 else 10, np.float32)) for t in group]
    messages = []
    for request in requests:
        with pytest.raises(TransportError, match="mismatched requests") as info:
            request.wait(30)
        messages.append(str(info.value))
    for message in messages:
        assert "rank 1 submitted allreduce_sum #1 of 11 x float32" in message, message
        assert "10 x float32" in message, message


def test_a_dtype_mismatch_is_caught_too(ring_3_2):
    group = ring_3_2[3:]
    requests = [group[0].allgather(np.ones(4, np.float16)), group[1].allgather(np.ones(4, ml_dtypes.bfloat16))]
    for request in requests:
        with pytest.raises(TransportError, match="float16.*bfloat16|bfloat16.*float16"):
            request.wait(30)


def test_a_closed_peer_fails_the_others_naming_it(ring_3_2):
    group = ring_3_2[:3]
    group[1].close()
    requests = [group[0].allreduce_sum(np.ones(1000, np.float32)), group[2].allreduce_sum(np.ones(1000, np.float32))]
    for request in requests:
        with pytest.raises(TransportError, match="rank 1"):
            request.wait(30)
    # and later requests fail at once
    with pytest.raises(TransportError):
        group[0].allreduce_sum(np.ones(3, np.float32)).wait(5)


def test_a_stalled_peer_times_out_instead_of_hanging():
    transports = ring([(0, 1, 2)], timeout=1.0)
    try:
        start = time.perf_counter()
        # rank 1 never submits: its neighbours see no data within the timeout
        requests = [transports[0].allreduce_sum(np.ones(100, np.float32)),
                    transports[2].allreduce_sum(np.ones(100, np.float32))]
        with pytest.raises(TransportError, match="no data from rank 1 for 1.0 s"):
            requests[1].wait(30)  # rank 2 waits on its left neighbour, rank 1
        with pytest.raises(TransportError, match="for 1.0 s"):
            requests[0].wait(30)  # rank 0 on rank 2 (or hears from rank 2 that rank 1 stalled)
        assert time.perf_counter() - start < 20
    finally:
        for t in transports:
            t.close()


def test_wait_times_out_while_the_exchange_goes_on(ring_3_2):
    group = ring_3_2[3:]
    first = group[0].allreduce_sum(np.ones(10, np.float32))
    with pytest.raises(TimeoutError):
        first.wait(0.2)  # its peer has not submitted yet
    second = group[1].allreduce_sum(np.ones(10, np.float32))
    np.testing.assert_array_equal(first.wait(30), np.full(10, 2.0, np.float32))
    np.testing.assert_array_equal(second.wait(30), np.full(10, 2.0, np.float32))
    assert isinstance(first, Request) and first.began >= first.started


def test_close_does_not_hang_with_requests_in_flight(ring_3_2):
    group = ring_3_2[:3]
    request = group[0].allreduce_sum(np.ones(1_000_000, np.float32))  # the others never join
    start = time.perf_counter()
    group[0].close()
    assert time.perf_counter() - start < 10
    with pytest.raises(TransportError):
        request.wait(5)


# -------------------------------------------------------------------- real processes
@suite.runs(suite.check("daso_transport.rings", "3x2", timeout=180),
            suite.check("daso_transport.rings", "2x2", timeout=180))
def test_transport_across_processes(ranks):
    """Rings of the cross sets on a real m x n Horovod job: sums bit-identical on all members,
    allgather in member order, requests in order, the exchange in flight (and finishing) while
    the main thread runs a TF matmul loop,
    a size mismatch raising on every member, a fresh transport after it, a closed peer named."""
    data, nodes, per_node = ranks, ranks.nodes, ranks.per_node
    assert sorted(data) == list(range(nodes * per_node))
    groups = {tuple(d["members"]) for d in data.values()}
    assert groups == {tuple(range(l, nodes * per_node, per_node)) for l in range(per_node)}
    for group in groups:
        digests = [data[r]["digests"] for r in group]
        assert all(d == digests[0] for d in digests), group  # bit-identical on every member
        for r in group:
            overlap = data[r]["overlap"]
            assert overlap["held"] == (r == group[0]), (r, overlap)
            if not overlap["held"]:  # it computed while its request waited for the held member
                assert overlap["in_flight_iterations"] == overlap["held_iterations"] > 0, (r, overlap)
            assert "mismatched requests" in data[r]["mismatch"], data[r]["mismatch"]
        gone = group[1]
        for r in group:
            if r != gone:
                assert f"rank {gone}" in data[r]["peer_closed"], (r, data[r]["peer_closed"])


CLUSTER_UNAVAILABLE = harness.cluster_unavailable()


@pytest.mark.skipif(CLUSTER_UNAVAILABLE is not None, reason=str(CLUSTER_UNAVAILABLE))
@suite.runs(suite.check("daso_transport.rings", "cluster:2x2@1gbit", timeout=240))
def test_transport_on_the_emulated_cluster(ranks):
    """The same checks across network namespaces: ranks listen on their node's eth0
    ($HOROVOD_GLOO_IFACE), and the rings cross the 1 Gbit/s links."""
    data = ranks
    assert sorted(data) == [0, 1, 2, 3]
    for group in ((0, 2), (1, 3)):
        assert data[group[0]]["digests"] == data[group[1]]["digests"]
        assert data[group[0]]["listen"] != data[group[1]]["listen"]
        assert all(data[r]["listen"].startswith("10.77.0.") for r in group), [data[r]["listen"] for r in group]


@pytest.mark.slow
@pytest.mark.multirank
def test_benchmark_runs_end_to_end(tmp_path):
    """benchmarks/daso_transport.py on 2 x 1 ranks over loopback, tiny sizes (no timing asserted)."""
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "daso_transport.py"), "--sizes", "1000",
                           "100003", "--rounds", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "daso_transport.json").read_text())
    assert result["topology"] == {"nodes": 2, "ranks_per_node": 1}
    assert [row["d"] for row in result["rows"]] == [1000, 100003]
    for row in result["rows"]:
        assert row["group_size"] == 2
        assert all(len(times) == 1 and times[0] > 0 for times in row["rounds_seconds"].values())
        assert row["overlap_ratio"] > 0 and row["throughput_MBps"]["transport"] > 0
