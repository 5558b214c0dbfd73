"""LARS and LAMB under a sparse strategy (issue 21): LARS' trust ratio (eq. 11 of "Large
Batch Training of Convolutional Networks", You, Gitman, Ginsburg 2017, arXiv:1708.03888;
shi2021 eq. 11) applied to each rank's gradient before the strategy accumulates it, with
Deep Gradient Compression's momentum correction (Lin et al., ICLR 2018, arXiv:1712.01887),
gives classic LARS' step; the defaults choose it for LARS and the Adam family's density
warm-up for LAMB. Checked against NumPy on one rank here and on 2 x 2 ranks (each rank's own
trust ratio; mixed precision, backward_passes_per_step, checkpoints) with
tests/multirank/check_lars_sparse.py."""
import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx import comm
from hvdx.optimizers import LAMB, LARS
from hvdx.zoo import mlp
from tests import suite


@pytest.fixture(scope="module")
def one_rank():
    return hvdx.init()


def lars(**kwargs):
    options = dict(learning_rate=0.5, momentum=0.9, weight_decay=1e-3, eeta=0.01)
    return LARS(**dict(options, **kwargs))


def test_local_trust_ratio_is_eq_11_on_the_rank_own_gradient():
    """trust (g + wd w) with trust = eeta ||w|| / (||g|| + wd ||w||); 1 and no decay for an
    excluded layer; 1 where the gradient is zero; None stays None; clipped to the maximum."""
    rng = np.random.default_rng(0)
    w = [tf.Variable(rng.standard_normal((6, 5)).astype(np.float32), name="kernel"),
         tf.Variable(rng.standard_normal(5).astype(np.float32), name="bias"),
         tf.Variable(rng.standard_normal(4).astype(np.float32), name="other"),
         tf.Variable(rng.standard_normal(3).astype(np.float32), name="unused")]
    g = [rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32),
         np.zeros(4, np.float32), None]
    opt = lars(exclude_from_weight_decay=["bias"])
    got = opt.local_trusted([None if x is None else tf.constant(x) for x in g], w, norms="rank")
    wn = np.linalg.norm(w[0].numpy())
    want = 0.01 * wn / (np.linalg.norm(g[0]) + 1e-3 * wn) * (g[0] + 1e-3 * w[0].numpy())
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), g[1], rtol=1e-6)  # excluded: ratio 1, no decay
    np.testing.assert_allclose(got[2].numpy(), 1e-3 * w[2].numpy(), rtol=1e-6)  # ||g|| = 0: ratio 1
    assert got[3] is None
    clipped = lars(max_trust_ratio=1e-4).local_trusted([tf.constant(g[0])], w[:1], norms="rank")[0].numpy()
    np.testing.assert_allclose(clipped, 1e-4 * (g[0] + 1e-3 * w[0].numpy()), rtol=1e-5)
    with pytest.raises(ValueError, match="classic_momentum"):
        lars(classic_momentum=False).local_trusted([tf.constant(g[0])], w[:1])


def test_count_sketch_is_linear_and_its_squared_norm_estimates_the_norm():
    """S(a + b) = S(a) + S(b) (so the average of the ranks' sketches is the sketch of their
    average); E ||S(g)||^2 = ||g||^2 over the signs, relative spread about sqrt(2 / width)
    whatever the entries' distribution, also for a convolution's gradient whose energy sits in
    a few output channels (the prime width mixes them; 256 buckets would not); a layer of at
    most `width` entries is itself."""
    from hvdx.optimizers import sketch

    rng = np.random.default_rng(0)
    a, b = (tf.constant(rng.standard_normal((300, 100)), tf.float32) for _ in range(2))
    np.testing.assert_allclose(sketch.count_sketch(a + b, 64, layer=3).numpy(),
                               (sketch.count_sketch(a, 64, layer=3) + sketch.count_sketch(b, 64, layer=3)).numpy(),
                               rtol=1e-4, atol=1e-4)
    small = tf.constant(rng.standard_normal((4, 8)), tf.float32)
    np.testing.assert_array_equal(sketch.count_sketch(small, 32).numpy(), small.numpy().ravel())
    inputs = np.abs(rng.standard_normal((3, 3, 64, 1)))  # after a ReLU: every row of the kernel's gradient alike
    channels = rng.standard_normal((1, 1, 1, 256)) * np.exp(rng.standard_normal((1, 1, 1, 256)))
    conv = inputs * channels + 0.1 * rng.standard_normal((3, 3, 64, 256))
    for entries in (rng.standard_normal(30000), rng.standard_t(2, 30000), np.eye(1, 30000, 17)[0] * 3.0, conv):
        g = tf.constant(entries, tf.float32)
        ratios = [float(tf.reduce_sum(tf.square(sketch.count_sketch(g, seed=seed)))) / np.sum(entries ** 2)
                  for seed in range(100)]
        assert abs(np.mean(ratios) - 1.0) < 0.05 and np.std(ratios) < 0.13, (np.mean(ratios), np.std(ratios))
    with pytest.raises(ValueError, match="width"):
        sketch.count_sketch(a, 0)
    unknown = tf.function(lambda x: sketch.averaged_squared_norms([x]),
                          input_signature=[tf.TensorSpec([None], tf.float32)])
    with pytest.raises(ValueError, match="static size"):
        unknown.get_concrete_function()


def test_the_sketch_signs_are_murmur3s_finaliser_on_every_platform():
    """The signs every rank must agree on: TensorFlow's int32 arithmetic (modulo 2^32) gives
    what NumPy computes in unsigned 64-bit integers, and about half are negative."""
    from hvdx.optimizers import sketch

    mask = np.uint64(0xFFFFFFFF)
    for layer, seed in ((0, 0), (5, 7)):
        a, b = (np.uint64(np.int32(x).view(np.uint32)) for x in sketch._start(layer, seed))
        x = (np.arange(50000, dtype=np.uint64) * a + b) & mask
        for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            x = ((x ^ (x >> np.uint64(shift))) * np.uint64(factor)) & mask
        want = ((x ^ (x >> np.uint64(16))) >> np.uint64(31)).astype(bool)
        got = sketch.negative_signs(50000, layer, seed).numpy()
        np.testing.assert_array_equal(got, want)
        assert 0.49 < got.mean() < 0.51


def test_average_norms_on_one_rank_are_the_rank_norms_for_layers_within_the_sketch(one_rank):
    """On one rank the average is the rank's own gradient: for layers of at most `width`
    entries (sent whole) the sketched trust ratio is eq. 11's exactly, and for a larger layer
    within the sketch's spread of it."""
    rng = np.random.default_rng(1)
    w = [tf.Variable(rng.standard_normal((6, 5)).astype(np.float32), name="kernel"),
         tf.Variable(rng.standard_normal((200, 50)).astype(np.float32), name="big")]
    g = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in w]
    opt = lars()
    own = opt.local_trusted(g, w, norms="rank")
    average = opt.local_trusted(g, w, norms="average", width=64)
    np.testing.assert_allclose(average[0].numpy(), own[0].numpy(), rtol=1e-5)
    ratio = np.linalg.norm(average[1].numpy()) / np.linalg.norm(own[1].numpy())
    assert 0.7 < ratio < 1.3 and ratio != 1.0, ratio
    with pytest.raises(ValueError, match="norms must be one of 'average', 'rank'"):
        opt.local_trusted(g, w, norms="mean")
    with pytest.raises(ValueError, match="trust_norms must be one of"):
        hvdx.DistributedOptimizer(lars(), communication="hitopk", trust_norms="global")


def train(optimizer, steps_per_epoch_batch=16):
    model = mlp(8, (), 4, seed=3)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.random.default_rng(4).standard_normal((64, 8)), np.random.default_rng(5).standard_normal((64, 4))
    model.fit(x, y, batch_size=steps_per_epoch_batch, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def test_with_everything_sent_local_trust_and_momentum_correction_is_classic_lars(one_rank):
    """At density 1 without masking nothing is held back: the velocity the strategy
    accumulates, u <- m u + trust (g + wd w), applied as w <- w - lr u, is classic LARS
    (eq. 11). The trust ratio measured after the strategy instead normalises the
    accumulated velocity, and the weights differ (a step about 1 - m of LARS')."""
    want = train(lars())
    everything = lambda: comm.HiTopK(density=1.0, momentum=0.9, momentum_masking=False)  # noqa: E731
    got = train(hvdx.DistributedOptimizer(lars(), communication=everything(), local_trust_ratio=True))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    after = train(hvdx.DistributedOptimizer(lars(), communication=everything(), local_trust_ratio=False))
    assert max(np.abs(a - b).max() for a, b in zip(after, want)) > 0.01


def test_local_trust_without_momentum_correction_is_lars_momentum_on_the_aggregate(one_rank):
    """Without momentum correction the wrapped LARS keeps its momentum and applies the
    aggregate with ratio 1: at density 1 that is classic LARS too."""
    want = train(lars())
    got = train(hvdx.DistributedOptimizer(lars(), communication=comm.HiTopK(density=1.0), local_trust_ratio=True))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lars_under_a_sparse_strategy_gets_local_trust_and_momentum_correction_by_default(one_rank):
    """The default benchmarks/convergence.py measured (--optimizer lars, 3 seeds; small
    ResNet: no aid 0.550, momentum correction alone 0.142, both 0.829, Horovod 0.938; MLP:
    both 0.930, Horovod 0.922). Momentum correction comes with the local trust ratio only."""
    opt = hvdx.DistributedOptimizer(lars(), communication="hitopk")
    assert opt.local_trust_ratio and opt.communication.momentum == pytest.approx(0.9)
    assert hvdx.DistributedOptimizer(lars(), communication="sparse_allgather").local_trust_ratio
    off = hvdx.DistributedOptimizer(lars(), communication="hitopk", local_trust_ratio=False)
    assert not off.local_trust_ratio and off.communication.momentum == 0  # LARS' worst case: not a default
    mc = hvdx.DistributedOptimizer(lars(), communication="hitopk", local_trust_ratio=False, momentum_correction=True)
    assert mc.communication.momentum == pytest.approx(0.9)
    plain = hvdx.DistributedOptimizer(lars(), communication="hitopk", momentum_correction=False)
    assert plain.local_trust_ratio and plain.communication.momentum == 0
    assert not hvdx.DistributedOptimizer(lars(), communication="hitopk", density=0.5).local_trust_ratio
    # above density 0.01 momentum correction hurts LARS (0.05: 0.391 with it, 0.900 without, 3 seeds)
    denser = hvdx.DistributedOptimizer(lars(), communication="hitopk", density=0.05)
    assert denser.local_trust_ratio and denser.communication.momentum == 0
    assert hvdx.DistributedOptimizer(lars(), communication="hitopk", density=0.01).communication.momentum == \
        pytest.approx(0.9)
    assert not hvdx.DistributedOptimizer(lars(), communication="allreduce").local_trust_ratio
    assert not hvdx.DistributedOptimizer(lars(), communication=comm.HiTopK()).local_trust_ratio  # an instance: as given
    simclr = hvdx.DistributedOptimizer(lars(classic_momentum=False), communication="hitopk")
    assert not simclr.local_trust_ratio and simclr.communication.momentum == 0
    nesterov = hvdx.DistributedOptimizer(lars(nesterov=True), communication="hitopk")
    assert nesterov.local_trust_ratio and nesterov.communication.momentum == 0
    assert not hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                         communication="hitopk").local_trust_ratio


def test_lamb_under_a_sparse_strategy_gets_a_density_warmup_from_a_quarter_by_default(one_rank):
    opt = hvdx.DistributedOptimizer(LAMB(0.01), communication="hitopk")
    assert (opt.communication.warmup_steps, opt.communication.warmup_density) == (100, 0.25)
    assert not opt.local_trust_ratio
    assert hvdx.DistributedOptimizer(LAMB(0.01), communication="hitopk", warmup_steps=0).communication.warmup_steps == 0


def test_local_trust_ratio_is_refused_where_it_cannot_apply(one_rank):
    with pytest.raises(ValueError, match="dense"):
        hvdx.DistributedOptimizer(lars(), communication="allreduce", local_trust_ratio=True)
    with pytest.raises(ValueError, match="LARS"):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk", local_trust_ratio=True)
    with pytest.raises(ValueError, match="classic_momentum"):
        hvdx.DistributedOptimizer(lars(classic_momentum=False), communication="hitopk", local_trust_ratio=True)
    with pytest.raises(ValueError, match="True, False or None"):
        hvdx.DistributedOptimizer(lars(), communication="hitopk", local_trust_ratio=1)


def test_the_aid_survives_config_round_trip_and_follows_switches(one_rank):
    on = hvdx.DistributedOptimizer(lars(), communication="hitopk")
    again = type(on).from_config(on.get_config())
    assert again.local_trust_ratio and repr(again.communication) == repr(on.communication)
    off = hvdx.DistributedOptimizer(lars(), communication="hitopk", local_trust_ratio=False, momentum_correction=True)
    again = type(off).from_config(off.get_config())
    assert not again.local_trust_ratio and again.communication.momentum == pytest.approx(0.9)
    dense_first = hvdx.DistributedOptimizer(lars(), communication="allreduce")
    dense_first.set_communication("hitopk")
    assert dense_first.local_trust_ratio and dense_first.communication.momentum == pytest.approx(0.9)
    dense_first.set_communication("hierarchical")
    assert not dense_first.local_trust_ratio
    kept_off = hvdx.DistributedOptimizer(lars(), communication="allreduce", local_trust_ratio=False)
    kept_off.set_communication("hitopk")
    assert not kept_off.local_trust_ratio


def test_a_saved_model_reloads_with_the_aid(one_rank, tmp_path):
    model = mlp(8, (), 4, seed=0)
    model.compile(hvdx.DistributedOptimizer(lars(), communication="hitopk", local_trust_ratio=False,
                                            momentum_correction=True), loss="mse")
    model.fit(np.ones((16, 8)), np.zeros((16, 4)), batch_size=8, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = hvdx.load_model(str(tmp_path / "m.keras"))
    assert not loaded.optimizer.local_trust_ratio and loaded.optimizer.communication.momentum == pytest.approx(0.9)


@suite.runs(suite.check("lars_sparse.training", "2x2", timeout=300))
def test_on_two_nodes_each_rank_trust_ratio_then_the_average_and_training_keeps_its_guarantees(ranks):
    """Every rank: the weights follow NumPy's rule (eq. 11 with the norm of the ranks' average
    gradient, sketched, or each rank's own, then averaged, the velocity of the average);
    model.fit with LARS' defaults under HiTopK, mixed precision and backward_passes_per_step=2
    keeps the same finite weights on every rank and each rank's velocities and residuals
    through a checkpoint."""
    for rank, data in ranks.items():
        for norms in ("rank", "average"):
            assert data[norms]["rule_matches"] and data[norms]["rule_same_on_every_rank"], (rank, norms)
        assert data["defaults"] == [True, pytest.approx(0.9)], rank
        assert data["weights_same"] and data["finite"], rank
        assert data["restored_own_state"], rank


def test_convergence_benchmark_names_the_aid_and_spreads_the_seeds():
    """benchmarks/convergence.py: `lt` is local_trust_ratio (`ltr` with each rank's own
    norms); with several seeds the table reads the mean, min and max of the final accuracies (made-up numbers)."""
    from benchmarks import convergence

    args = convergence.main.__globals__["argparse"].Namespace(density=0.01, clip_norm=5.0, warmup_steps=0, steps=100)
    assert convergence.method_options("hitopk+mc+lt", "resnet", args)["local_trust_ratio"] is True
    assert convergence.method_options("hitopk+plain", "resnet", args)["local_trust_ratio"] is False
    assert "trust_norms" not in convergence.method_options("hitopk+mc+lt", "resnet", args)  # the default: average
    own = convergence.method_options("hitopk+mc+ltr+nomask", "resnet", args)
    assert own["local_trust_ratio"] is True and own["trust_norms"] == "rank" and own["momentum_masking"] is False
    run = lambda *acc: {"steps": [10, 20], "accuracy": list(acc), "seconds": [1.0, 2.0]}  # noqa: E731
    by_seed = {"1": {"t": {"horovod": run(0.5, 0.90), "hitopk": run(0.4, 0.80)}},
               "2": {"t": {"horovod": run(0.5, 0.94), "hitopk": run(0.6, 0.90)}}}
    spread = convergence.seed_spread(by_seed)["t"]
    assert spread["hitopk"]["mean"] == pytest.approx(0.85) and spread["hitopk"]["min"] == 0.80
    assert spread["hitopk"]["max"] == 0.90 and spread["hitopk"]["gap_points"] == pytest.approx(-7.0)
    mean = convergence.mean_curves(by_seed)["t"]["hitopk"]
    assert mean["accuracy"] == pytest.approx([0.5, 0.85]) and mean["steps"] == [10, 20]
    text = convergence.table(convergence.summarize(convergence.mean_curves(by_seed), {"t": 0.9}), 20,
                             convergence.seed_spread(by_seed))
    assert "| t | hitopk | 0.850 (0.800-0.900) | -7.0 |" in text
    # time to 0.9 per seed: Horovod 2.0 s and 2.0 s, HiTopK never and 2.0 s: its mean over the one
    # seed that reached it, the speed-up over that seed only
    timed = convergence.seed_spread(by_seed, {"t": 0.9})
    hitopk, horovod = timed["t"]["hitopk"], timed["t"]["horovod"]
    assert hitopk["seconds_to_target"] == [None, 2.0] and hitopk["mean_seconds_to_target"] == 2.0
    assert horovod["mean_seconds_to_target"] == 2.0 and hitopk["speedup_vs_horovod"] == 1.0
    text = convergence.table(convergence.summarize(convergence.mean_curves(by_seed), {"t": 0.9}), 20, timed)
    assert "| 2.0 (1/2, 1.00x) |" in text and "| 2.0 (2/2, 1.00x) |" in text
    with pytest.raises(ValueError, match="unknown optimizer"):
        convergence.inner_optimizer("resnet", 4, "adagrad")
