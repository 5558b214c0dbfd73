"""DASO's group transport (hvdx/transport/ring.py) across real processes, launched by
tests/test_daso_transport.py on m nodes x n ranks: one ring per cross set (coquelin2021, Figure 1).

Each rank returns digests of its results; the test compares them across the members of a group.
"""
import hashlib
import time

import ml_dtypes
import numpy as np
import tensorflow as tf

import hvdx
from hvdx.transport.ring import GroupTransport, TransportError, listen_address

SUM_SIZES = (1, 7, 1000, 3_000_001)  # uneven segments and chunks for groups of 2 and 3
OVERLAP_SIZE = 4_000_000             # 16 MB float32: long enough to overlap a matmul loop


def member_array(rank: int, n: int, dtype=np.float32, integral: bool = False) -> np.ndarray:
    """What rank `rank` contributes; every rank can rebuild any member's array."""
    rng = np.random.default_rng([rank, n])
    if integral:  # small integers: every summation order gives the exact same float sum
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def check_sums(transport: GroupTransport) -> dict:
    """Sums equal numpy's (exactly for integral values), bit-identical on every member (digests)."""
    digests = {}
    for dtype in (np.float32, np.float64):
        for n in SUM_SIZES if dtype == np.float32 else (1000,):
            for integral in (False, True):
                out = transport.allreduce_sum(member_array(transport.rank, n, dtype, integral)).wait(120)
                reference = np.sum([member_array(r, n, dtype, integral) for r in transport.members], axis=0)
                assert out.dtype == dtype and out.shape == (n,), (out.dtype, out.shape)
                if integral:
                    np.testing.assert_array_equal(out, reference)
                else:
                    np.testing.assert_allclose(out, reference, rtol=1e-5 if dtype == np.float32 else 1e-12,
                                               atol=1e-5 if dtype == np.float32 else 1e-12)
                digests[f"{np.dtype(dtype).name}-{n}-{'int' if integral else 'normal'}"] = digest(out)
    return digests


def check_allgather(transport: GroupTransport) -> None:
    """16-bit and 32-bit arrays come back bit for bit, in member order."""
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
        out = transport.allgather(member_array(transport.rank, 1001, dtype)).wait(60)
        assert len(out) == len(transport.members)
        for member, got in zip(transport.members, out):
            assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
            assert got.tobytes() == member_array(member, 1001, dtype).tobytes(), (member, dtype)


def check_in_flight(transport: GroupTransport) -> None:
    """Several requests submitted at once run in submission order and each gets its own result."""
    sizes = (1000, 3_000_001, 7, 20_000, 1)
    requests = []
    for k, n in enumerate(sizes):
        if k % 2:
            requests.append(transport.allgather(member_array(transport.rank, n, np.float16)))
        else:
            requests.append(transport.allreduce_sum(member_array(transport.rank, n, integral=True)))
    for k, (n, request) in reversed(list(enumerate(zip(sizes, requests)))):
        out = request.wait(120)
        if k % 2:
            assert [o.tobytes() for o in out] == [member_array(m, n, np.float16).tobytes()
                                                  for m in transport.members], (k, n)
        else:
            reference = np.sum([member_array(m, n, integral=True) for m in transport.members], axis=0)
            np.testing.assert_array_equal(out, reference)
    for earlier, later in zip(requests, requests[1:]):
        assert earlier.started <= later.started and earlier.finished <= later.began <= later.finished, \
            (earlier.started, earlier.finished, later.began, later.finished)


#: Matmuls a member runs with its allreduce in flight before the group's held member submits.
HELD_ITERATIONS = 5


def check_overlap(transport: GroupTransport) -> dict:
    """While an allreduce is in flight the main thread keeps computing, and the exchange
    completes on the transport's threads while it does (coquelin2021 Figure 5: the next
    forward-backward passes run while the parameters travel). Deterministic, not timed: the
    group's first member (the held one) submits only after the others have run
    HELD_ITERATIONS matmuls with their request in flight, which cannot finish without it;
    then every member computes until its request is done, without ever calling wait().
    How much of an exchange overlaps computation is measured by benchmarks/daso_transport.py."""
    mine = member_array(transport.rank, OVERLAP_SIZE)
    a = tf.random.normal([192, 192])
    held = transport.index == 0
    request, in_flight = None, 0
    if not held:
        request = transport.allreduce_sum(mine)
        for _ in range(HELD_ITERATIONS):
            tf.matmul(a, a).numpy()
            in_flight += not request.done()
    hvdx.barrier()  # a Horovod collective, beside the transport: the held member submits now
    if held:
        request = transport.allreduce_sum(mine)
    computed = 0
    deadline = time.monotonic() + 120
    while not request.done():
        assert time.monotonic() < deadline, "the exchange made no progress in 120 s while the main thread computed"
        tf.matmul(a, a).numpy()
        computed += 1
    out = request.wait(0)
    reference = np.sum([member_array(m, OVERLAP_SIZE) for m in transport.members], axis=0)
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-4)
    return {"held": held, "in_flight_iterations": in_flight, "held_iterations": HELD_ITERATIONS,
            "computed_until_done": computed}


def check_mismatch(transport: GroupTransport) -> str:
    """Members that submit different sizes all get TransportError naming both sides."""
    n = 10 if transport.index == 0 else 11
    request = transport.allreduce_sum(np.ones(n, np.float32))
    try:
        request.wait(60)
    except TransportError as exc:
        message = str(exc)
    else:
        raise AssertionError("a size mismatch between members went unnoticed")
    assert "mismatched requests" in message and "10 x float32" in message and "11 x float32" in message, message
    assert f"rank {transport.members[0]} submitted" in message, message  # the odd one out, named
    # The broken transport refuses further work with the same error, immediately.
    try:
        transport.allgather(np.ones(3)).wait(5)
    except TransportError:
        pass
    else:
        raise AssertionError("a broken transport accepted a new request")
    return message


def check_peer_closes(transport: GroupTransport) -> str:
    """When one member closes, the others' next request fails naming it (no hang)."""
    gone = transport.members[1]
    if transport.rank == gone:
        transport.close()
        transport.close()  # idempotent
    hvdx.barrier()
    if transport.rank == gone:
        return ""
    request = transport.allreduce_sum(np.ones(1000, np.float32))
    try:
        request.wait(60)
    except TransportError as exc:
        assert f"rank {gone}" in str(exc), str(exc)
        return str(exc)
    raise AssertionError(f"rank {gone} closed, yet the exchange succeeded")


def check_rings(topo) -> dict:
    groups = [tuple(node[l] for node in topo.node_ranks) for l in range(topo.local_size)]
    transport = GroupTransport.create(groups, topo.rank, timeout=60)
    assert transport.members == topo.cross_ranks and transport.index == topo.node, (transport, topo)
    result = {"members": list(transport.members), "listen": listen_address(), "digests": check_sums(transport)}
    check_allgather(transport)
    check_in_flight(transport)
    result["overlap"] = check_overlap(transport)
    result["mismatch"] = check_mismatch(transport)
    transport.close()
    fresh = GroupTransport.create(groups, topo.rank, name="hvdx.daso.fresh", timeout=60)
    out = fresh.allreduce_sum(np.full(5, topo.rank, np.float32)).wait(60)
    np.testing.assert_array_equal(out, np.full(5, sum(fresh.members), np.float32))
    result["peer_closed"] = check_peer_closes(fresh)
    fresh.close()
    return result


CHECKS = {"rings": check_rings}
