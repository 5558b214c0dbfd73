"""Streaming DiLoCo (hvdx/streaming_diloco.py; Douillard et al. 2025, arXiv 2501.18512): the
fragments' staggered schedule (sec. 2.2), the overlapped exchange and the merge (sec. 2.3), the
low-bit outer gradients (sec. 2.4); with one fragment, no overlap and 32 bits it is DiLoCo
(LocalSGD). In process on one rank: the arithmetic, the schedule, the checks, state(), fit
through the one callback; on 2x2 Horovod ranks (tests/multirank/check_streaming_diloco.py):
the hierarchical mean, bitwise the same on every rank, and fit on the digits.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests import suite


@pytest.fixture(scope="module")
def one_rank():
    import hvdx
    return hvdx.init()


def _variables(*shapes):
    import tensorflow as tf
    return [tf.Variable(np.zeros(shape, np.float32)) for shape in shapes]


def test_fragments_are_dealt_by_size_and_never_empty():
    from hvdx.streaming_diloco import plan_fragments
    assert plan_fragments([10, 400, 20, 300, 5], 2) == [[1], [0, 2, 3, 4]]   # 400 / 335 elements
    assert plan_fragments([10, 400, 20, 300, 5, 390], 2) == [[0, 1, 2, 4], [3, 5]]   # 435 / 690
    assert plan_fragments([7, 7, 7], 3) == [[0], [1], [2]]
    assert plan_fragments([1, 2], 1) == [[0, 1]]
    with pytest.raises(ValueError, match="fragments=3 needs at least as many trainable variables"):
        plan_fragments([1, 2], 3)


def test_one_fragment_without_overlap_in_32_bits_is_diloco(one_rank):
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD
    from hvdx.streaming_diloco import StreamingDiLoCo
    streaming, blocking = _variables((3,), (2, 2)), _variables((3,), (2, 2))
    outer = dict(learning_rate=0.7, momentum=0.9, nesterov=True)
    a = StreamingDiLoCo(sync_every=3, fragments=1, overlap=0,
                        outer_optimizer=tf.keras.optimizers.SGD(**outer)).start(streaming)
    b = LocalSGD(sync_every=3, outer_optimizer=tf.keras.optimizers.SGD(**outer)).start(blocking)
    rng = np.random.default_rng(0)
    for _ in range(9):
        for x, y in zip(streaming, blocking):
            step = rng.normal(size=x.shape).astype(np.float32)
            x.assign_add(step)
            y.assign_add(step)
        a.after_step()
        b.after_step()
    assert (a.outer_steps, b.outer_steps) == (3, 3)
    for x, y in zip(streaming, blocking):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-6)
    a.close()


def test_fragments_take_turns_and_merge_tau_steps_later(one_rank):
    """H = 6, P = 3, tau = 1, alpha = 0.5, outer SGD(1.0) on one rank (the mean is the rank's
    own model): fragment p is sent after the steps s with s mod 6 = 2 (p = 0), 4, 0, and one
    step later x_p <- 0.5 x_p + 0.5 x_p(at the send)."""
    import tensorflow as tf

    from hvdx.streaming_diloco import StreamingDiLoCo
    variables = _variables((12,), (5,), (2,))
    method = StreamingDiLoCo(sync_every=6, fragments=3, overlap=1,
                             outer_optimizer=tf.keras.optimizers.SGD(1.0)).start(variables)
    assert method.groups == [[0], [1], [2]] and [method.offset(p) for p in range(3)] == [2, 4, 0]
    sent = {}
    history = []
    for step in range(1, 9):
        for v in variables:
            v.assign_add(tf.ones_like(v))                      # every local step adds 1
        launches = [p for p in range(3) if step % 6 == method.offset(p)]
        for p in launches:
            sent[p] = float(variables[p][0])
        method.after_step()
        history.append([float(v[0]) for v in variables])
        for p in launches:
            assert method.inflight and method.inflight[-1].fragments == [p]
    # fragment 0: sent at 2 (value 2), merged at 3: 0.5 * 3 + 0.5 * 2; then +1 per step
    assert [h[0] for h in history] == [1, 2, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5]
    # fragment 1: sent at 4 (value 4), merged at 5: 0.5 * 5 + 0.5 * 4
    assert [h[1] for h in history] == [1, 2, 3, 4, 4.5, 5.5, 6.5, 7.5]
    # fragment 2: sent at 6 (value 6), merged at 7: 0.5 * 7 + 0.5 * 6
    assert [h[2] for h in history] == [1, 2, 3, 4, 5, 6, 6.5, 7.5]
    assert method.outer_steps == 3 and [i.fragments for i in method.inflight] == [[0]]  # sent again at 8
    method.finish()                                            # that one merged, then every fragment, alpha = 0
    for v, a in zip(variables, method.anchor):
        np.testing.assert_array_equal(v.numpy(), a.numpy())
    assert method.pending == 0 and method.outer_steps == 7
    method.close()


def test_low_bit_outer_gradients_stay_within_the_wires_bound(one_rank):
    import tensorflow as tf

    from hvdx.streaming_diloco import StreamingDiLoCo
    rng = np.random.default_rng(1)
    for bits, level in ((8, 127), (4, 7)):
        variables = _variables((300,), (50,))
        method = StreamingDiLoCo(sync_every=1, fragments=1, overlap=0, bits=bits, chunk=64,
                                 outer_optimizer=tf.keras.optimizers.SGD(1.0)).start(variables)
        local = [rng.normal(size=v.shape).astype(np.float32) for v in variables]
        for v, x in zip(variables, local):
            v.assign(x)
        method.after_step()                                    # anchor <- 0 - (0 - x) quantized
        flat = np.concatenate(local)
        got = np.concatenate([v.numpy() for v in variables])
        padded = np.concatenate([flat, np.zeros(-flat.size % 64, np.float32)]).reshape(-1, 64)
        bound = np.repeat(np.abs(padded).max(1) / level / 2, 64)[:flat.size]
        assert np.all(np.abs(got - flat) <= bound * (1 + 1e-5)), bits
        assert not np.array_equal(got, flat)                   # it did go through the wire
        method.close()


def test_error_feedback_carries_the_rounding_to_the_fragments_next_exchange(one_rank):
    from hvdx.streaming_diloco import OuterExchange
    from hvdx.topology import topology
    rng = np.random.default_rng(2)
    x1, x2 = rng.normal(size=40).astype(np.float32), rng.normal(size=40).astype(np.float32)
    for feedback in (True, False):
        exchange = OuterExchange.create(topology(), bits=4, chunk=8, hierarchical=True, timeout=30.0,
                                        name="test.ef", error_feedback=feedback)
        m1 = exchange.submit(x1, key=(0,)).result(30)
        other = exchange.submit(x2 * 5, key=(1,)).result(30)        # another fragment: its own residual
        m2 = exchange.submit(x2, key=(0,)).result(30)
        assert not np.array_equal(m1, x1) and not np.array_equal(other, x2 * 5)
        carried = (x1 - m1) + x2                                      # what the second exchange quantized
        bound = np.repeat(np.abs(carried.reshape(-1, 8)).max(1) / 7 / 2, 8)
        if feedback:  # the two exchanges sum to the inputs but for the second's rounding
            assert np.all(np.abs((m1 + m2) - (x1 + x2)) <= bound * (1 + 1e-5))
            assert set(exchange.residuals) == {(0,), (1,)}
        else:
            assert exchange.residuals == {}
        exchange.close()


def test_epochs_end_with_every_fragment_synchronised_and_finish_is_idempotent(one_rank):
    import tensorflow as tf

    from hvdx.streaming_diloco import StreamingDiLoCo
    variables = _variables((4,), (4,))
    method = StreamingDiLoCo(sync_every=4, fragments=2, overlap=1,
                             outer_optimizer=tf.keras.optimizers.SGD(1.0)).start(variables)
    for _ in range(3):                                         # fragment 0 sent at 2, applied at 3
        for v in variables:
            v.assign_add(tf.ones_like(v))
        method.after_step()
    method.end_epoch(0, None)
    assert (method.pending, len(method.inflight), method.outer_steps) == (0, 0, 3)
    for v, a in zip(variables, method.anchor):
        np.testing.assert_array_equal(v.numpy(), a.numpy())
    method.end_epoch(1, None)
    assert method.outer_steps == 3                             # nothing pending: no exchange
    lazy = StreamingDiLoCo(sync_every=4, fragments=2, overlap=1, sync_every_epoch=False).start(_variables((2,), (2,)))
    for _ in range(2):
        lazy.after_step()
    lazy.end_epoch(0, None)
    assert (lazy.pending, len(lazy.inflight)) == (2, 1)        # the exchange stays in flight
    lazy.finish()
    lazy.finish()
    assert (lazy.pending, len(lazy.inflight), lazy.outer_steps) == (0, 0, 3)
    lazy.close()
    lazy.close()
    with pytest.raises(RuntimeError, match="needs start"):
        lazy.after_step()
    lazy.start(lazy.variables)
    lazy.after_step()                                          # step 3 of the count
    lazy.after_step()                                          # step 4: fragment 1 goes
    assert [i.fragments for i in lazy.inflight] == [[1]]
    lazy.start(lazy.variables)                                 # started again: that exchange is dropped
    assert not lazy.inflight and np.array_equal(lazy.variables[1].numpy(), lazy.anchor[1].numpy())
    lazy.reset()                                               # an elastic reset: no collective
    lazy.start(lazy.variables)                                 # the transport built again
    lazy.after_step()                                          # step 5
    lazy.after_step()                                          # step 6: fragment 0 goes
    assert [i.fragments for i in lazy.inflight] == [[0]] and lazy.exchange is not None
    lazy.close()
    method.close()


def test_bad_arguments_are_refused_naming_them(one_rank):
    import tensorflow as tf

    import hvdx
    from hvdx.streaming_diloco import StreamingDiLoCo
    with pytest.raises(ValueError, match=r"fragments must be an int in \[1, sync_every=4\]"):
        StreamingDiLoCo(sync_every=4, fragments=5)
    with pytest.raises(ValueError, match="overlap must be an int in"):
        StreamingDiLoCo(sync_every=4, overlap=4)
    with pytest.raises(ValueError, match="mixing"):
        StreamingDiLoCo(mixing=1.5)
    with pytest.raises(ValueError, match="bits must be None"):
        StreamingDiLoCo(bits=2)
    with pytest.raises(ValueError, match="chunk must be an even int"):
        StreamingDiLoCo(bits=8, chunk=7)
    with pytest.raises(ValueError, match="hierarchical must be"):
        StreamingDiLoCo(hierarchical="yes")
    with pytest.raises(ValueError, match="timeout"):
        StreamingDiLoCo(timeout=0)
    with pytest.raises(ValueError, match="cannot run with the synchronous"):
        StreamingDiLoCo().start(_variables((2,)), hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
    with pytest.raises(ValueError, match="fragments=3 needs at least as many trainable variables"):
        StreamingDiLoCo(fragments=3).start(_variables((2,), (2,)))


def test_state_round_trips_and_a_different_wire_is_refused(one_rank):
    import tensorflow as tf

    from hvdx.streaming_diloco import StreamingDiLoCo
    method = StreamingDiLoCo(sync_every=4, fragments=2, overlap=1, bits=4,
                             outer_optimizer=tf.keras.optimizers.SGD(0.5, momentum=0.5))
    method.start(_variables((3,), (3,)))
    for _ in range(5):
        method.after_step()
    method.finish()
    state = json.loads(json.dumps(method.state()))
    assert (state["steps"], state["fragments"], state["overlap"], state["bits"], state["mixing"],
            state["error_feedback"]) == (5, 2, 1, 4, 0.5, True)
    other = StreamingDiLoCo(sync_every=9, fragments=2, overlap=0, bits=4)
    other.restore(state)
    assert other.state() == state
    with pytest.raises(ValueError, match="bits=4, this run bits=8: build StreamingDiLoCo"):
        StreamingDiLoCo(sync_every=4, fragments=2, bits=8).restore(state)
    method.close()


def test_fit_through_the_one_callback_trains_and_ends_on_the_anchor(one_rank):
    """The digits MLP, 256 training images, under mixed float16 (the variables stay float32)."""
    import tensorflow as tf

    from hvdx.callbacks import TrainingMethodCallback
    from hvdx.streaming_diloco import StreamingDiLoCo
    from tests.multirank import digits
    x_train, _, y_train, _ = digits.split()
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = digits.mlp(seed=0, width=32)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    model.compile(tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9)),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    method = StreamingDiLoCo(sync_every=4, fragments=2, overlap=1, bits=8, sync_every_epoch=False)
    driver = TrainingMethodCallback(method)
    history = model.fit(x_train[:256], y_train[:256], batch_size=32, epochs=4, verbose=0, callbacks=[driver])
    assert history.history["loss"][-1] < history.history["loss"][0]
    # 32 steps, 2 fragments every 4: 16 exchanges on schedule, then finish() synchronises both
    assert (driver.stats["steps"], driver.stats["outer_steps"], driver.stats["inflight"]) == (32, 18, 0)
    for v, a in zip(model.trainable_variables, method.anchor):
        np.testing.assert_array_equal(v.numpy(), a.numpy())


# -- on Horovod ranks (tests/multirank/check_streaming_diloco.py) ----------------------------------------
@suite.runs(suite.check("streaming_diloco.mean", "2x2"))
def test_the_exchange_is_the_mean_over_ranks_bitwise_the_same_on_every_rank(ranks):
    n = ranks[0]["size"]
    expected = np.mean([np.arange(40, dtype=np.float64) * (r + 1) - r for r in range(n)], axis=0)
    for rank, data in ranks.items():
        for wire in ("hierarchical", "flat"):
            np.testing.assert_allclose(data[wire]["32"], expected, rtol=1e-6, err_msg=f"rank {rank} {wire}")
            for bits, level in (("8", 127), ("4", 7)):
                # each node's sum quantized once: the mean is off by at most half a step per node
                bound = data[wire]["max_node_sum"] / level / 2 * data["nodes" if wire == "hierarchical" else "size"]
                assert np.max(np.abs(np.asarray(data[wire][bits]) - expected)) <= bound / n * 1.0001, (rank, wire, bits)
        assert data["spread"] == 0.0, rank                                   # the same bits on every rank
        assert data["bytes"]["cross"] > 0 and data["bytes"]["node"] > 0, (rank, data["bytes"])


@suite.runs(suite.check("streaming_diloco.fit", "2x2", timeout=400))
def test_fit_on_the_digits_with_4_bit_outer_gradients_trains_and_ends_with_one_model(ranks):
    for rank, data in ranks.items():
        assert data["accuracy"] >= 0.8, (rank, data["accuracy"])
        assert data["spread"] == 0.0, rank
        assert data["stats"]["inflight"] == 0 and data["stats"]["outer_steps"] > data["epochs"], (rank, data["stats"])
