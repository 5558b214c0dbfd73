"""Low-bit gradients on one rank: the 8- and 4-bit wire with a scale per chunk, error
feedback that keeps what the wire rounded away, and training through hvdx's optimizer.
Several ranks, hierarchical on two nodes, and Keras 3: tests/multirank/check_compressors.py,
tests/test_keras3.py."""
import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.comm.lowbit import LowBit
from hvdx.comm.wire import dequantize, quantize
from tests import suite


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    return hvdx.init()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_wire_rounds_each_value_to_half_a_step_of_its_chunks_scale(bits):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal(4096) * np.repeat([1e-3, 1.0, 50.0, 0.0], 1024)).astype(np.float32)
    packed, sent = quantize(tf.constant(x), bits, 1024)
    assert packed.dtype == tf.uint8 and int(packed.shape[0]) == 4096 * bits // 8 + 4 * 4
    np.testing.assert_array_equal(dequantize(packed, 4096, bits, 1024).numpy(), sent.numpy())
    levels = 2 ** (bits - 1) - 1
    for c in range(4):
        chunk = slice(c * 1024, (c + 1) * 1024)
        step = np.abs(x[chunk]).max() / levels
        assert np.abs(sent.numpy()[chunk] - x[chunk]).max() <= step / 2 + 1e-6 * step
    assert np.abs(sent.numpy()).max() == pytest.approx(np.abs(x).max())  # the largest value is sent exactly


def test_registered_by_name_with_its_options():
    strategy = comm.get("lowbit", bits=4)
    assert isinstance(strategy, LowBit) and strategy.lossy and strategy.get_config() == {"bits": 4}
    assert comm.get("int8").bits == 8
    for bad in ({"bits": 2}, {"bits": 8.5}, {"chunk": 3}, {"chunk": 0}, {"hierarchical": 1}):
        with pytest.raises(ValueError):
            LowBit(**bad)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_keeps_what_the_wire_rounded_away(bits):
    """After T steps on one rank, the outputs plus the residual sum to the gradients."""
    strategy = LowBit(bits=bits, chunk=64)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]
    sent = sum(strategy(tf.constant(g), "b").numpy() for g in grads)
    (residual,) = strategy.memory.variables_by_name.values()
    np.testing.assert_allclose(sent + residual.numpy(), sum(grads), atol=1e-4)
    assert 0 < np.abs(residual.numpy()).max() < (0.2 if bits == 8 else 1.0)


def test_a_non_finite_gradient_is_reported_and_leaves_the_residual():
    strategy = LowBit()
    strategy(tf.constant(np.linspace(-1, 1, 100, dtype=np.float32)), "b")
    (residual,) = strategy.memory.variables_by_name.values()
    before = residual.numpy().copy()
    bad = np.ones(100, np.float32)
    bad[7] = np.nan
    out = strategy(tf.constant(bad), "b").numpy()
    assert not np.isfinite(out).all()
    np.testing.assert_array_equal(residual.numpy(), before)


def test_the_optimizer_trains_with_it():
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32)[:512], data.target[:512]
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), communication="lowbit", bits=4)
    model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False).history["loss"]
    assert losses[-1] < 0.4 * losses[0], losses
    assert opt.aggregator.residuals and all(np.isfinite(r.numpy()).all() for r in opt.aggregator.residuals)


@suite.runs(suite.check("compressors.compressors", "2x2", timeout=300))
def test_lowbit_on_two_nodes_stays_within_the_wires_rounding_and_keeps_the_training_path_guarantees(ranks):
    """Every rank of 2 nodes x 2 ranks: the hierarchical 8-bit mean is within half a
    quantization step per node of the exact mean, the same on every rank; flat 4-bit, the
    outputs times the ranks plus every rank's residual are the sum of the gradients;
    model.fit under mixed_float16 with backward_passes_per_step=2 keeps identical weights,
    lowers the loss, and a checkpoint per rank restores its residuals."""
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        assert all(data["lowbit"].values()), (rank, data["lowbit"])
        fit = data["fit"]["lowbit"]
        assert fit["same_weights"] and fit["finite"] and fit["restored"] and fit["nonzero_residuals"] > 0, (rank, fit)
        assert fit["loss"][-1] < 0.6 * fit["loss"][0], (rank, fit)
