"""Every rank checks the aggregation strategies of hvdx.comm (shi2021 Algorithms 1-2).

- dense strategies, and the sparse ones at density 1.0, equal hvd.allreduce's average;
- HiTopK and SparseAllgather equal a NumPy simulation of Algorithms 1-2 run on all ranks'
  buffers and residuals (gathered to every rank), step by step, residuals included. The
  window offsets MSTopK drew are read off each rank's selection, which must itself be
  exactly the reference's selection for that offset.
Buffers hold multiples of 1/8 below 2^10, so every sum is exact in any order.
"""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.node.collectives import node_slices
from hvdx.zoo import mlp
from tests import mstopk_reference as ref


def gather_rows(t: tf.Tensor, name: str) -> np.ndarray:
    """Every rank's 1-D tensor, stacked by rank."""
    return hvd.allgather(tf.reshape(t, [1, -1]), name=name).numpy()


def window_offset(expected: ref.Selection, chosen: np.ndarray) -> int:
    band_part = chosen[expected.above.size:] if expected.above.size <= chosen.size else chosen
    if band_part.size == 0:
        return 0
    return int(np.searchsorted(expected.band, band_part[0]))


def simulate_selection(acc: np.ndarray, density: float, chosen: np.ndarray):
    """Algorithm 1 on acc with the offset the op drew; returns (selected, residual)."""
    k = max(1, int(round(density * acc.size)))
    expected = ref.mstopk(acc, k, 30, offset=0)
    if expected.indices.size and expected.offset is not None:
        expected = ref.mstopk(acc, k, 30, offset=window_offset(expected, chosen))
    np.testing.assert_array_equal(np.sort(chosen), np.sort(expected.indices))
    residual = acc.copy()
    residual[expected.indices] = 0
    return expected.indices, residual


def assert_average(got: np.ndarray, want: np.ndarray, largest_addend: float, what: str = "") -> None:
    """The sparse strategies divide each (value, index) pair by the number of ranks before
    adding (one pass over the pairs instead of one over d), so their rounding error is
    bounded by the largest addend, not by the result: a few float32 ulps of it."""
    atol = 4 * np.finfo(np.float32).eps * largest_addend
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=max(atol, 1e-7), err_msg=what)


def check_dense_equivalence(topo, d: int, step: int) -> None:
    rng = np.random.default_rng(100 * step + topo.rank)
    grads = tf.constant(rng.integers(-8000, 8000, d) / 8, tf.float32)
    want = hvd.allreduce(grads, op=hvd.Average, name=f"want.{d}.{step}").numpy()
    flat = comm.Hierarchical(flat_below=4 * d + 1)  # the size rule: this buffer goes flat
    for strategy in (comm.Allreduce(), comm.Hierarchical(flat_below=0), flat, comm.HiTopK(density=1.0),
                     comm.SparseAllgather(density=1.0)):
        got = strategy(grads, name=f"dense{d}s{step}").numpy()
        assert_average(got, want, 1000.0, repr(strategy))  # |grads| <= 1000
    # 2DTAR leaves this rank's reduce-scattered slice; a bucket under flat_below leaves none,
    # as pieces or as one buffer, and its pieces come back averaged each
    assert comm.Hierarchical(flat_below=0).aggregate(grads, f"sl{d}s{step}").local_slice is not None
    assert flat.aggregate(grads, f"fl{d}s{step}").local_slice is None
    half = d // 2
    pieces, result = flat.aggregate_pieces([grads[:half], grads[half:]], f"fp{d}s{step}")
    assert result.local_slice is None and result.output is None
    assert_average(np.concatenate([p.numpy() for p in pieces]), want, 1000.0, "flat pieces")
    pieces, result = comm.Hierarchical(flat_below=4 * d).aggregate_pieces([grads[:half], grads[half:]],
                                                                           f"hp{d}s{step}")  # not under: 2DTAR
    assert result.local_slice is not None
    assert_average(np.concatenate([p.numpy() for p in pieces]), want, 1000.0, "2dtar pieces")


def gather_ragged(t: tf.Tensor, name: str) -> list:
    """Every rank's 1-D tensor (lengths may differ), by rank."""
    lengths = hvd.allgather(tf.reshape(tf.size(t), [1]), name=f"{name}.n").numpy()
    flat = hvd.allgather(tf.reshape(t, [-1]), name=name).numpy()
    return np.split(flat, np.cumsum(lengths)[:-1])


def check_hitopk_simulation(topo, d: int, density: float, steps: int) -> None:
    """HiTopK against a NumPy simulation of Algorithm 2 on the node slices of
    `node_slices` (aligned, the last shorter; a small buffer zero-padded)."""
    strategy = comm.HiTopK(density=density)
    n, size = topo.local_size, topo.size
    slices = node_slices(d, n)
    padded_d = slices[-1][0] + slices[-1][1]
    for step in range(steps):
        rng = np.random.default_rng(1000 * step + topo.rank)
        grads = rng.integers(-8000, 8000, d) / 8
        all_grads = gather_rows(tf.constant(grads, tf.float32), f"hg{d}.{step}")
        residual = strategy.variables.get("h") if step else None
        stored = slices[0][1]  # every rank's residual has the longest slice's length
        before = gather_rows(residual.value() if residual is not None else tf.zeros([stored]), f"hr{d}.{step}")
        got = strategy(tf.constant(grads, tf.float32), name="h").numpy()
        chosen = gather_ragged(strategy.last_indices, f"hi{d}.{step}")
        after = gather_rows(strategy.variables["h"].value(), f"ha{d}.{step}")
        padded = np.zeros((size, padded_d))
        padded[:, :d] = all_grads
        total = np.zeros(padded_d)
        largest = 0.0
        for node, ranks in enumerate(topo.node_ranks):
            for j, r in enumerate(ranks):  # local rank j owns slice j (Alg. 2 line 1)
                offset, length = slices[j]
                piece = slice(offset, offset + length)
                assert not after[r][length:].any(), f"rank {r}'s residual past its slice is not zero"
                acc = padded[list(ranks), piece].sum(axis=0) + before[r][:length]
                selected, residual_sim = simulate_selection(acc, density, chosen[r])
                np.testing.assert_array_equal(after[r][:length], residual_sim, err_msg=f"residual of rank {r}")
                total[piece][selected] += acc[selected]
                largest = max(largest, np.abs(acc).max())
        assert_average(got, total[:d] / size, largest)


def check_naiveag_simulation(topo, d: int, density: float, steps: int) -> None:
    strategy = comm.SparseAllgather(density=density)
    for step in range(steps):
        rng = np.random.default_rng(2000 * step + topo.rank)
        grads = rng.integers(-8000, 8000, d) / 8
        residual = strategy.variables.get("s") if step else None
        before = gather_rows(residual.value() if residual is not None else tf.zeros([d]), f"sr{d}.{step}")
        all_grads = gather_rows(tf.constant(grads, tf.float32), f"sg{d}.{step}")
        got = strategy(tf.constant(grads, tf.float32), name="s").numpy()
        chosen = gather_rows(strategy.last_indices, f"si{d}.{step}")
        after = gather_rows(strategy.variables["s"].value(), f"sa{d}.{step}")
        total = np.zeros(d)
        largest = 0.0
        for r in range(topo.size):
            acc = all_grads[r] + before[r]
            selected, residual_sim = simulate_selection(acc, density, chosen[r])
            np.testing.assert_array_equal(after[r], residual_sim, err_msg=f"residual of rank {r}")
            np.add.at(total, selected, acc[selected])
            largest = max(largest, np.abs(acc).max())
        assert_average(got, total / topo.size, largest)


def check_wire_fp16(topo, d: int) -> None:
    """16-bit values on the wire: the result is the fp16-rounded sum, the rounding error
    stays in the residual."""
    rng = np.random.default_rng(topo.rank)
    grads = tf.constant(rng.standard_normal(d), tf.float32)
    exact = comm.HiTopK(density=1.0)(grads, name="w32").numpy()
    half = comm.HiTopK(density=1.0, wire_dtype=tf.float16)
    got = half(grads, name="w16").numpy()
    np.testing.assert_allclose(got, exact, rtol=2e-3, atol=2e-3)
    assert np.abs(half.variables["w16"].numpy()).max() < 1e-2  # only rounding errors kept


def check_quantized_values(topo, d: int) -> None:
    """Top-k values as 8- and 4-bit codes across the slow exchange (`value_bits`), density 1:
    the average is within the codes' rounding of the exact one (HiTopK rounds each node's sum,
    NaiveAG each rank's gradient, at most half a step of a scale of max|x| / L), and each
    rank's residual holds what its codes rounded away (none sent: the output is zero)."""
    rng = np.random.default_rng(topo.rank + 7)
    grads = tf.constant(rng.standard_normal(d), tf.float32)
    exact = comm.HiTopK(density=1.0)(grads, name="q32").numpy()
    largest = float(hvd.allreduce(tf.reduce_max(tf.abs(grads)), op=hvd.Max, name="q.max"))
    for cls, rounded in ((comm.HiTopK, topo.local_size * largest), (comm.SparseAllgather, largest)):
        for bits in (8, 4):
            strategy = cls(density=1.0, value_bits=bits)
            name = f"q{bits}{cls.__name__}"
            got = strategy(grads, name=name).numpy()
            step = rounded / (2 ** (bits - 1) - 1)  # the largest scale any code had
            senders = topo.num_nodes if cls is comm.HiTopK else topo.size
            np.testing.assert_allclose(got, exact, atol=senders * step / 2 / topo.size + 1e-6,
                                       err_msg=f"{cls.__name__} {bits} bits")
            residual = strategy.variables[name].numpy()
            assert 0 < np.abs(residual).max() <= step / 2 + 1e-6, (cls.__name__, bits)


def check_bad_input() -> None:
    for bad in (0, -0.1, 1.5, "0.1", True):
        try:
            comm.HiTopK(density=bad)
        except ValueError as exc:
            assert "density" in str(exc)
        else:
            raise AssertionError(f"density={bad!r} accepted")
    try:
        comm.get("ring")
    except ValueError as exc:
        assert "unknown communication strategy 'ring'" in str(exc)
    else:
        raise AssertionError("unknown strategy accepted")
    assert isinstance(comm.get("2dtar"), comm.Hierarchical)
    assert isinstance(comm.get("hitopk", density=0.5), comm.HiTopK)


def check_strategies(topo) -> dict:
    check_bad_input()
    for d in (13, 64 * topo.local_size, 1000 * topo.local_size + 1):  # padded, even slices, a shorter last slice
        for step in range(2):
            check_dense_equivalence(topo, d, step)
        check_hitopk_simulation(topo, d, density=0.05, steps=3)
        check_naiveag_simulation(topo, d, density=0.05, steps=3)
    check_wire_fp16(topo, 999)
    check_quantized_values(topo, 999)
    return {"topology": str(topo)}


def mismatch(call) -> str:
    """The RankMismatchError message `call` raises (on every rank alike); AssertionError if none."""
    try:
        call()
    except hvdx.RankMismatchError as exc:
        return str(exc)
    raise AssertionError("the ranks disagreed, but no RankMismatchError was raised")


def check_disagreement(topo) -> dict:
    """Strategies called directly on buffers (issue 27, item 11), rank 0 unlike the others:
    every case must end in RankMismatchError on every rank, not a hang or a wrong average.
    Returns the message of each case, and the number of agreement collectives made by
    calls on which the ranks agree."""
    odd = topo.rank == 0
    ones = lambda d, dtype=tf.float32: tf.ones([d], dtype)  # noqa: E731
    sparse = lambda density=0.05: comm.SparseAllgather(density=density)  # noqa: E731
    found = {
        "strategy": mismatch(lambda: (comm.HiTopK(density=0.05) if odd else sparse())(ones(1000), "a")),
        "elements": mismatch(lambda: sparse()(ones(1000 if odd else 1200), "b")),
        "density": mismatch(lambda: sparse(0.1 if odd else 0.05)(ones(1000), "c")),
        "dtype": mismatch(lambda: comm.Allreduce()(ones(100, tf.float64 if odd else tf.float32), "d")),
        "wire_dtype": mismatch(lambda: comm.HiTopK(wire_dtype=tf.float16 if odd else tf.float32).aggregate(
            ones(1000), "e")),
        "pieces": mismatch(lambda: comm.Hierarchical().aggregate_pieces(
            [ones(400), ones(600)] if odd else [ones(500), ones(500)], "f")),
        "name": mismatch(lambda: sparse()(ones(1000), "g" if odd else "h")),
        # a matrix compressor given the same elements as other matrices (issue 66): factors of
        # other shapes would meet in its all-reduces
        "shapes": mismatch(lambda: comm.PowerSGD().aggregate_pieces(
            [ones(4096)], "s", shapes=[(128, 32) if odd else (32, 128)])),
    }
    # A rank in a tape step meets the others' direct call at the same check (one name).
    variable = tf.Variable(tf.ones([1000]))

    def tape_or_direct():
        if odd:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(variable * variable)
            return hvdx.DistributedGradientTape(tape, communication="sparse_allgather").gradient(loss, [variable])
        return sparse()(ones(1000), "v0_b0")

    found["tape_vs_direct"] = mismatch(tape_or_direct)
    # Agreeing ranks: one check per layout, whoever calls, never one per step.
    before = hvdx.agreement.checks_made()
    agreed = comm.HiTopK(density=0.05)
    outputs = [agreed(ones(1000) * float(topo.rank + 1), "ok").numpy() for _ in range(3)]
    direct_checks = hvdx.agreement.checks_made() - before
    net = mlp(8, (600,), 4, activation=None)
    aggregator = hvdx.GradientAggregator("hitopk", density=0.05, bucket_bytes=4096)
    x = tf.ones([2, 8]) * float(topo.rank + 1)
    before = hvdx.agreement.checks_made()
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(net(x) ** 2)
        aggregator(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
    tape_checks = hvdx.agreement.checks_made() - before
    buckets = len(aggregator.last_aggregation.buckets)
    # Ranks of a new membership whose step counters differ (an elastic job's returning node: its
    # new processes at step 0, the survivors on): the density warm-up's stage would differ, and
    # with it the exchange. The first call's check makes them agree on the largest.
    warming = comm.HiTopK(density=0.05, warmup_steps=100)  # 4 stages of 25 steps
    warming.memory.counter("warm").assign(0 if odd else 90)
    warm = warming(ones(1000) * float(topo.rank + 1), "warm").numpy()
    return {"messages": found, "direct_checks": direct_checks, "tape_checks": tape_checks, "buckets": buckets,
            "finite": bool(all(np.isfinite(o).all() for o in [*outputs, warm])),
            "warm_step": int(warming.memory.counter("warm").numpy())}


CHECKS = {"strategies": check_strategies, "disagreement": check_disagreement}
