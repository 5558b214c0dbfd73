"""PowerSGD (Vogels et al. 2019) on one rank: Algorithm 1's rank-r approximation with warm
start, Algorithm 2's error feedback, the matrices it leaves whole, and its state through
hvdx's optimizer, checkpoints and non-finite steps. Several ranks, hierarchical on two nodes,
and Keras 3: tests/multirank/check_compressors.py, tests/test_keras3.py."""
import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.comm.powersgd import PowerSGD, matrix_view
from tests import suite


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    return hvdx.init()


def low_rank(rows, cols, rank, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))).astype(np.float32)


def aggregate(strategy, grads, name="b"):
    """One call on the gradients as a bucket (with their shapes), committed: the outputs."""
    pieces = [tf.reshape(tf.constant(g), [-1]) for g in grads]
    outputs, result = strategy.aggregate_pieces(pieces, name, shapes=[g.shape for g in grads])
    comm.memory.commit(result.updates, result.finite)
    return [o.numpy().reshape(g.shape) for o, g in zip(outputs, grads)]


def test_registered_by_name_with_its_options():
    strategy = comm.get("powersgd", rank=2, start_step=5)
    assert isinstance(strategy, PowerSGD) and strategy.lossy
    assert strategy.get_config() == {"rank": 2, "start_step": 5}
    assert comm.get("powersgd").rank == 4
    for bad in ({"rank": 0}, {"rank": 1.5}, {"min_compression": 0.5}, {"start_step": -1}, {"hierarchical": "yes"},
                {"hierarchical": 1}):
        with pytest.raises(ValueError):
            PowerSGD(**bad)


def test_a_kernel_is_seen_as_inputs_by_outputs():
    assert matrix_view((3, 3, 16, 32)) == (144, 32)
    assert matrix_view((64, 10)) == (64, 10)
    assert matrix_view((10,)) is None and matrix_view(()) is None and matrix_view(None) is None


def test_a_gradient_of_rank_r_comes_back_exact_in_one_step():
    """Alg. 1: P = M Q spans M's column space when rank(M) <= r, so P^ P^T M = M."""
    grad = low_rank(96, 40, 3, seed=0)
    (out,) = aggregate(PowerSGD(rank=3), [grad])
    np.testing.assert_allclose(out, grad, atol=1e-4)


def test_error_feedback_keeps_what_was_not_sent():
    """Alg. 2 on one rank: after T steps, the sum of the outputs plus the residual is the sum
    of the gradients; the residual is M - P^ (M^T P^)^T, orthogonal to P^."""
    strategy = PowerSGD(rank=2)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((64, 48)).astype(np.float32) for _ in range(4)]
    sent = sum(aggregate(strategy, [g])[0] for g in grads)
    (residual,) = strategy.memory.variables_by_name.values()
    np.testing.assert_allclose(sent + residual.numpy().reshape(64, 48), sum(grads), atol=1e-3)
    assert np.abs(residual.numpy()).max() > 0.1  # a full-rank gradient is not sent whole


def test_warm_start_converges_to_the_best_rank_r_approximation():
    """Sec. 3: reusing Q is a power iteration over steps. Sent the same matrix every step (the
    residual cleared, so that M stays the same), the warm-started Q spans its top-r right
    singular vectors."""
    rng = np.random.default_rng(2)
    u, _ = np.linalg.qr(rng.standard_normal((80, 80)))
    v, _ = np.linalg.qr(rng.standard_normal((50, 50)))
    grad = (u[:, :50] * np.concatenate([[10.0, 8.0], np.geomspace(1.0, 0.1, 48)])) @ v.T
    strategy = PowerSGD(rank=2)
    for _ in range(12):
        aggregate(strategy, [grad.astype(np.float32)])
        for residual in strategy.memory.variables_by_name.values():
            residual.assign(tf.zeros_like(residual))
    (q,) = strategy.q_vectors.values()
    basis, _ = np.linalg.qr(q.numpy().reshape(50, 2))
    top = v[:, :2]
    assert np.linalg.norm(top - basis @ (basis.T @ top)) < 1e-2


def test_vectors_small_matrices_and_buffers_without_shapes_are_averaged_exactly():
    strategy = PowerSGD(rank=4)
    bias, small, kernel = (np.arange(7, dtype=np.float32), np.ones((6, 5), np.float32),
                           np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32))
    out = aggregate(strategy, [bias, small, kernel])
    np.testing.assert_array_equal(out[0], bias)
    np.testing.assert_array_equal(out[1], small)  # 30 elements: (6 + 5) * 4 * 2 would not pay
    assert not np.allclose(out[2], kernel)  # rank 4 of a full-rank 64 x 64
    flat = np.random.default_rng(4).standard_normal(300).astype(np.float32)
    np.testing.assert_array_equal(strategy(tf.constant(flat), "flat").numpy(), flat)


def test_start_step_averages_exactly_first():
    strategy = PowerSGD(rank=1, start_step=2)
    grad = np.random.default_rng(5).standard_normal((32, 32)).astype(np.float32)
    first, second, third = (aggregate(strategy, [grad])[0] for _ in range(3))
    np.testing.assert_allclose(first, grad, atol=1e-6)
    np.testing.assert_allclose(second, grad, atol=1e-6)
    assert np.linalg.matrix_rank(third, tol=1e-3) == 1


def test_a_non_finite_step_changes_no_state():
    strategy = PowerSGD(rank=2)
    grad = np.random.default_rng(6).standard_normal((40, 30)).astype(np.float32)
    aggregate(strategy, [grad])
    before = [v.numpy().copy() for v in (*strategy.memory.variables_by_name.values(), *strategy.q_vectors.values())]
    bad = grad.copy()
    bad[3, 4] = np.inf
    pieces = [tf.reshape(tf.constant(bad), [-1])]
    _, result = strategy.aggregate_pieces(pieces, "b", shapes=[bad.shape])
    assert not bool(result.finite)
    comm.memory.commit(result.updates, result.finite)
    after = [v.numpy() for v in (*strategy.memory.variables_by_name.values(), *strategy.q_vectors.values())]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_shapes_must_match_the_pieces():
    strategy = PowerSGD()
    with pytest.raises(ValueError, match="shapes for"):
        strategy.aggregate_pieces([tf.zeros([6])], "s", shapes=[(2, 3), (3,)])
    with pytest.raises(ValueError, match="elements"):
        strategy.aggregate_pieces([tf.zeros([6])], "s", shapes=[(2, 2)])


def _model(seed):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(10)])


def _digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32)[:512], data.target[:512]


def test_the_optimizer_trains_with_it_and_a_checkpoint_resumes_the_same_steps(tmp_path):
    """model.fit with communication="powersgd": the wrapper hands it the kernels' shapes
    (state made at build: a residual per bucket, Q of 64 x 4 and 10 x 4); a checkpoint
    restores residuals and Q, and the resumed run takes the uninterrupted run's steps."""
    x, y = _digits()

    def run(model, opt, epochs):
        model.compile(opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False).history["loss"]

    model = _model(0)
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), communication="powersgd")
    losses = run(model, opt, 3)
    assert losses[-1] < 0.4 * losses[0], losses
    strategy = opt.communication
    assert [int(q.shape[0]) for q in strategy.q_vectors.values()] == [(64 + 10) * 4]
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    run(model, opt, 1)
    after = [w.copy() for w in model.get_weights()]

    resumed = _model(0)
    opt2 = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), communication="powersgd")
    resumed.compile(opt2, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tf.train.Checkpoint(model=resumed, optimizer=opt2).restore(path)
    run(resumed, opt2, 1)
    for a, b in zip(after, resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@suite.runs(suite.check("compressors.compressors", "2x2", timeout=300))
def test_powersgd_on_two_nodes_is_exact_for_low_rank_means_and_keeps_the_training_path_guarantees(ranks):
    """Every rank of 2 nodes x 2 ranks: a mean of rank <= r comes back exact, hierarchical
    (also a bucket of one matrix, a local rank with nothing to send) and flat; flat, the
    outputs times the ranks plus every rank's residual are the sum of the gradients (Alg. 2);
    Q is the same everywhere; model.fit under mixed_float16 with backward_passes_per_step=2
    keeps identical weights, lowers the loss, and a checkpoint per rank restores its state."""
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        assert all(data["powersgd"].values()), (rank, data["powersgd"])
        fit = data["fit"]["powersgd"]
        assert fit["same_weights"] and fit["finite"] and fit["restored"], (rank, fit)
        assert any("_q" in key for key in fit["state"]), (rank, fit)
        assert fit["loss"][-1] < 0.6 * fit["loss"][0], (rank, fit)
    # the one compressed kernel (64 x 32) is one local rank's share on each node: its residual
    assert sum(data["fit"]["powersgd"]["nonzero_residuals"] > 0 for data in ranks.values()) == 2
