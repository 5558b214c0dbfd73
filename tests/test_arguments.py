"""NumPy integers are accepted everywhere an int is (hvdx/arguments.py): the one check's
contract, then every public entry point that takes a count, a size, a rank or a number of
epochs, given NumPy integers, doing what it does with Python ints and storing Python ints
(nothing NumPy reaches a config, a JSON state or a tf.function signature). In process, one
rank."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hvdx.arguments import integer, is_integer, real

NUMPY_INTS = (np.int8(3), np.int32(3), np.int64(3), np.uint8(3), np.uint64(3))


# -- the checks -------------------------------------------------------------------------
@pytest.mark.parametrize("value", (3, *NUMPY_INTS), ids=lambda v: type(v).__name__)
def test_an_integer_of_any_kind_is_accepted_and_returned_as_a_python_int(value):
    out = integer(value, "count", 1)
    assert out == 3 and type(out) is int
    assert is_integer(value)


@pytest.mark.parametrize("value", (True, False, np.bool_(True), 2.5, 3.0, np.float64(3.0), "3", None, [3], 1j),
                         ids=repr)
def test_anything_but_an_integer_is_refused_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"^count must be an int, got "):
        integer(value, "count")
    assert not is_integer(value)


def test_the_bounds_are_inclusive_and_named_in_the_error():
    assert integer(np.int64(0), "patience", 0) == 0
    assert integer(np.uint8(7), "rank", 0, 7) == 7
    with pytest.raises(ValueError, match=r"^patience must be an int >= 0, got -1$"):
        integer(np.int64(-1), "patience", 0)
    with pytest.raises(ValueError, match=r"^rank must be an int in \[0, 7\], got 8$"):
        integer(8, "rank", 0, 7)
    with pytest.raises(ValueError, match=r"^level must be an int <= 2, got 3$"):
        integer(3, "level", maximum=2)


def test_none_only_where_optional_and_the_callers_own_words():
    assert integer(None, "seed", optional=True) is None
    with pytest.raises(ValueError, match=r"^step_budget must be an int >= 1 or None, got 0$"):
        integer(0, "step_budget", 1, optional=True)
    with pytest.raises(ValueError, match=r"^parts must be a positive int, got 0$"):
        integer(np.int64(0), "parts", 1, expected="a positive int")


@pytest.mark.parametrize("value", (0.5, 1, np.float32(0.5), np.float64(0.5), np.float16(0.5), np.int64(1)),
                         ids=lambda v: f"{type(v).__name__}({v})")
def test_a_real_number_of_any_kind_is_accepted_and_returned_as_a_python_float(value):
    out = real(value, "density", 0, 1, low_open=True)
    assert out == float(value) and type(out) is float


def test_real_refuses_non_numbers_nan_and_values_outside_the_interval():
    for bad in (True, "0.5", None, float("nan"), np.float32("nan")):
        with pytest.raises(ValueError, match=r"^density must be a number, got "):
            real(bad, "density", 0, 1)
    with pytest.raises(ValueError, match=r"^density must be in \(0, 1\], got 0$"):
        real(0, "density", 0, 1, low_open=True)
    with pytest.raises(ValueError, match=r"^beta must be in \[0.0, 1.0\), got 1.0$"):
        real(np.float32(1.0), "beta", 0.0, 1.0, high_open=True)
    with pytest.raises(ValueError, match=r"^eps must be in \(-inf, 0\], got 1$"):
        real(1, "eps", high=0)
    assert real(None, "clip", optional=True) is None
    with pytest.raises(ValueError, match=r"^density must be a number in \(0, 1\], got 2$"):
        real(2, "density", 0, 1, low_open=True, expected="a number in (0, 1]")


def test_the_strategies_old_checks_are_the_new_ones():
    from hvdx.comm.base import check_density, check_positive_int
    assert check_positive_int(np.int64(5), "num_samplings") == 5
    assert type(check_positive_int(np.int64(5), "num_samplings")) is int
    assert check_density(np.float32(0.25)) == 0.25
    with pytest.raises(ValueError, match="num_samplings must be an int >= 1, got 0"):
        check_positive_int(np.int64(0), "num_samplings")
    with pytest.raises(ValueError, match="density must be a number in"):
        check_density(np.float64(0.0))


# -- the entry points -------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank():
    import hvdx
    return hvdx.init()


def test_mstopk_takes_a_numpy_num_samplings_and_selects_what_the_int_selects():
    import tensorflow as tf

    import hvdx
    x = tf.constant(np.random.default_rng(0).standard_normal(4096).astype(np.float32))
    seed = tf.constant([3, 4], tf.int64)
    for n in (np.int64(5), np.int32(5), np.uint8(5)):
        tf.random.set_seed(1)
        values, indices = hvdx.mstopk(x, 100, num_samplings=n, seed=7)
        tf.random.set_seed(1)
        expected_values, expected_indices = hvdx.mstopk(x, 100, num_samplings=5, seed=7)
        np.testing.assert_array_equal(indices.numpy(), expected_indices.numpy())
        np.testing.assert_array_equal(values.numpy(), expected_values.numpy())
        stateless = hvdx.ops.stateless_mstopk(x, np.int64(100), seed, num_samplings=n)[1]
        np.testing.assert_array_equal(stateless.numpy(),
                                      hvdx.ops.stateless_mstopk(x, 100, seed, num_samplings=5)[1].numpy())
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="mstopk: num_samplings must be an int >= 1"):
            hvdx.mstopk(x, 10, num_samplings=bad)


def _fit(one_rank, **options):
    """The weights after 4 steps of a one-layer model under hvdx.DistributedOptimizer(SGD, **options)."""
    import tensorflow as tf

    import hvdx
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4), tf.keras.layers.Dense(2)])
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, name="sgd"), **options)  # Keras 3 numbers names
    model.compile(opt, "mse")
    rng = np.random.default_rng(1)
    model.fit(rng.standard_normal((32, 8)).astype(np.float32), rng.standard_normal((32, 2)).astype(np.float32),
              batch_size=8, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights], opt


def test_the_optimizer_takes_numpy_bucket_bytes_passes_and_groups_and_trains_as_with_ints(one_rank):
    given = dict(bucket_bytes=np.int64(64), backward_passes_per_step=np.int32(2), num_groups=np.int64(2))
    weights, opt = _fit(one_rank, **given)
    expected, reference = _fit(one_rank, bucket_bytes=64, backward_passes_per_step=2, num_groups=2)
    for w, e in zip(weights, expected):
        np.testing.assert_array_equal(w, e)
    config = opt.get_config()
    assert config == reference.get_config()
    for key in ("bucket_bytes", "backward_passes_per_step", "num_groups"):
        assert type(config[key]) is int, key
    json.dumps({k: v for k, v in config.items() if k != "optimizer"})
    assert opt.aggregator.effective_bucket_bytes == 64 and type(opt.aggregator.bucket_bytes) is int


def test_the_aggregator_takes_numpy_groups_and_refuses_what_it_refused(one_rank):
    import hvdx
    aggregator = hvdx.GradientAggregator(groups=np.uint8(3), bucket_bytes=np.int32(1 << 20))
    assert aggregator.num_groups == 3 and type(aggregator.num_groups) is int
    assert aggregator.config["bucket_bytes"] == 1 << 20 and type(aggregator.config["bucket_bytes"]) is int
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, None"):
        hvdx.GradientAggregator(bucket_bytes=np.int64(0))
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, None"):
        hvdx.GradientAggregator(bucket_bytes=True)
    with pytest.raises(ValueError, match="groups must be an int >= 0"):
        hvdx.GradientAggregator(groups=np.int64(-1))
    with pytest.raises(ValueError, match="groups must be an int"):
        hvdx.GradientAggregator(groups=2.5)
    with pytest.raises(ValueError, match="gradient_predivide_factor must be a positive number"):
        hvdx.GradientAggregator(gradient_predivide_factor=np.float32(0))


def test_backward_passes_per_step_is_checked_before_it_is_used(one_rank):
    import tensorflow as tf

    import hvdx
    from hvdx.accumulation import LocalAccumulator, local_accumulator
    assert local_accumulator(np.int64(1)) is None
    assert local_accumulator(np.int32(3)).passes == 3 and type(LocalAccumulator(np.int64(3)).passes) is int
    for bad in (True, 0, 1.0, "2"):  # True used to pass as one pass per step
        with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1"):
            hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=bad)


def test_the_tape_shares_one_aggregator_for_numpy_and_python_options(one_rank):
    import hvdx
    first = hvdx.DistributedGradientTape(bucket_bytes=np.int64(4096), num_groups=np.int32(0))
    second = hvdx.DistributedGradientTape(bucket_bytes=4096, num_groups=0)
    assert first.aggregator is second.aggregator  # a tape made anew each step keeps its residuals


def test_2dtar_flat_below_takes_a_numpy_int(one_rank):
    from hvdx import comm
    strategy = comm.Hierarchical(flat_below=np.int64(1024))
    assert strategy.flat_below == 1024 and type(strategy.flat_below) is int
    assert json.loads(json.dumps(strategy.get_config()))["flat_below"] == 1024
    assert comm.get("2dtar", flat_below=np.uint8(0)).flat_below == 0


def test_sparse_strategies_take_numpy_counts_and_densities(one_rank):
    from hvdx import comm
    strategy = comm.get("hitopk", density=np.float32(0.125), num_samplings=np.int64(5), warmup_steps=np.int32(10),
                        warmup_density=np.float64(0.5), momentum=np.float32(0.5))
    assert (strategy.density, strategy.num_samplings, strategy.warmup_steps) == (0.125, 5, 10)
    assert type(strategy.num_samplings) is int and type(strategy.warmup_steps) is int
    json.dumps(strategy.get_config())
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        comm.get("hitopk", density=0.125, warmup_steps=np.int64(-1))


def test_the_plateau_detector_takes_numpy_patience_and_threshold():
    from hvdx.plateau import PlateauDetector
    detector = PlateauDetector(patience=np.int64(1), threshold=np.float32(0.5))
    assert type(detector.patience) is int and type(detector.threshold) is float
    assert [detector.update(x) for x in (1.0, 0.9, 0.8)] == [False, False, True]
    json.dumps(detector.state())
    for bad in (True, 1.5, -1):
        with pytest.raises(ValueError, match="patience must be an int >= 0"):
            PlateauDetector(patience=bad)


def test_the_daso_schedule_takes_numpy_epochs_and_skips():
    from hvdx.daso.schedule import Schedule
    given = Schedule(total_epochs=np.int64(6), warmup_epochs=np.int32(1), cooldown_epochs=np.uint8(1),
                     max_global_skips=np.int64(8), num_groups=np.int64(2))
    expected = Schedule(total_epochs=6, warmup_epochs=1, cooldown_epochs=1, max_global_skips=8, num_groups=2)
    assert given == expected and (given.B, given.W) == (8, 2)
    assert given.to_json() == expected.to_json()
    with pytest.raises(ValueError, match="total_epochs must be an int >= 1"):
        Schedule(total_epochs=np.int64(0))


def test_daso_takes_numpy_arguments_and_saves_python_ones(one_rank):
    import tensorflow as tf

    import hvdx
    opt = hvdx.DASO(tf.keras.optimizers.SGD(0.1), total_epochs=np.int64(4), warmup_epochs=np.int32(1),
                    cooldown_epochs=np.int64(1), max_global_skips=np.int64(4), plateau_patience=np.int64(3),
                    plateau_threshold=np.float32(0.25), timeout=np.float32(30))
    config = opt.get_config()
    for key in ("total_epochs", "warmup_epochs", "cooldown_epochs", "max_global_skips", "plateau_patience"):
        assert type(config[key]) is int, key
    assert (config["plateau_threshold"], config["timeout"]) == (0.25, 30.0)
    json.dumps({k: v for k, v in config.items() if k != "optimizer"})


def test_the_adpsgd_graph_takes_a_numpy_size():
    from hvdx.adpsgd.graph import build_graph
    assert build_graph("exponential", np.int64(8)) == build_graph("exponential", 8)
    assert type(build_graph("ring", np.uint8(4)).size) is int
    with pytest.raises(ValueError, match="size must be an int"):
        build_graph("ring", 4.0)


def test_localsgd_takes_a_numpy_sync_every(one_rank):
    import tensorflow as tf

    from hvdx.localsgd import LocalSGD
    var = tf.Variable(np.zeros(2, np.float32))
    method = LocalSGD(sync_every=np.int64(2), outer_optimizer=tf.keras.optimizers.SGD(1.0)).start([var])
    assert type(method.sync_every) is int
    for _ in range(2):
        var.assign_add(np.ones(2, np.float32))
        method.after_step()
    assert (method.steps, method.outer_steps) == (2, 1)
    json.dumps(method.state())


def test_the_shared_model_methods_take_numpy_counts():
    from hvdx.asynchronous import PASSMPlus
    method = PASSMPlus([np.int64(0), np.int32(3)], average_every=np.int64(10), staleness_bins=np.int64(16),
                       timeout=np.float32(5))
    assert (method.average_every, method.staleness_bins, method.timeout) == (10, 16, 5.0)
    assert method.full_epochs == {0, 3} and all(type(e) is int for e in method.full_epochs)
    assert PASSMPlus.paper_schedule(np.int64(8)) == PASSMPlus.paper_schedule(8)
    with pytest.raises(ValueError, match="average_every must be a positive number of steps"):
        PASSMPlus([0], average_every=np.int64(0))
    with pytest.raises(ValueError, match="full_epochs must be epoch indices"):
        PASSMPlus([-1])


def test_pto_partition_takes_numpy_parts():
    from hvdx import pto
    sizes = [100, 7, 4000, 250, 33]
    assert pto.partition(sizes, np.int64(3)) == pto.partition(sizes, 3)
    with pytest.raises(ValueError, match="parts must be a positive int"):
        pto.partition(sizes, np.int64(0))


def test_the_communication_policy_takes_numpy_epochs(one_rank):
    from hvdx.callbacks import CommunicationPolicy
    policy = CommunicationPolicy([("allreduce", np.int64(2)), ("hitopk", np.int32(5)), ("2dtar", None)])
    assert [end for _, end in policy.phases] == [2, 5, None] and type(policy.phases[0][1]) is int
    with pytest.raises(ValueError, match="ends at epoch 1, not after"):
        CommunicationPolicy([("allreduce", np.int64(2)), ("hitopk", np.int64(1)), ("2dtar", None)])


def test_the_transports_take_numpy_ranks():
    from hvdx.transport.peer import _check_peers
    from hvdx.transport.ring import GroupTransport, _validate_groups
    assert _check_peers([np.int64(2), np.uint8(1)], np.int64(0), 3) == (1, 2)
    assert _validate_groups([[np.int64(0), np.int32(1)]], np.int64(1), 2) == ((0, 1),)
    transport = GroupTransport.create([[np.int64(0)]], np.int64(0), name="npints", timeout=np.float32(1))
    try:
        assert transport.rank == 0 and type(transport.rank) is int
    finally:
        transport.close()
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        _check_peers([1], True, 3)


def test_the_data_pipeline_takes_numpy_sizes():
    from hvdx.data.decode import normalize_resolution
    from hvdx.data.pipeline import check_batch_size, steps_per_epoch
    assert normalize_resolution(np.int64(32)) == (32, 32)
    assert check_batch_size(np.int32(8)) == 8 and type(check_batch_size(np.int64(8))) is int
    assert steps_per_epoch(100, np.int64(32)) == 4
    for bad in (0, True, 8.0):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            check_batch_size(bad)


def test_lars_and_lamb_take_numpy_hyperparameters():
    from hvdx.optimizers import LAMB, LARS
    lars = LARS(np.float32(0.1), momentum=np.float64(0.9), eeta=np.float32(0.001))
    lamb = LAMB(np.float32(0.01), beta_1=np.float32(0.9), weight_decay=np.float64(0.01))
    assert type(lars.momentum) is float and type(lamb.beta_1) is float
    with pytest.raises(ValueError, match=r"momentum must be in \[0.0, 1.0\)"):
        LARS(0.1, momentum=np.float32(1.0))


def test_the_zoo_takes_a_numpy_seed_and_strides():
    from hvdx import zoo
    given = zoo.cnn((8, 8, 1), (4, 4), strides=np.int64(2), seed=np.int64(3))
    expected = zoo.cnn((8, 8, 1), (4, 4), strides=2, seed=3)
    assert given.output_shape == expected.output_shape
    for w, e in zip(given.get_weights(), expected.get_weights()):
        np.testing.assert_array_equal(w, e)
    with pytest.raises(ValueError, match="seed must be an int or None"):
        zoo.mlp(seed=1.5)


def test_sparse_defaults_and_traits_read_numpy_numbers():
    from hvdx.comm.traits import OptimizerTraits, plain_number
    assert plain_number(np.float32(0.5)) == 0.5 and plain_number(True) is None
    assert type(OptimizerTraits(momentum=np.float32(0.5)).momentum) is float
    with pytest.raises(ValueError, match="OptimizerTraits.momentum must be a number or None"):
        OptimizerTraits(momentum="0.9")
