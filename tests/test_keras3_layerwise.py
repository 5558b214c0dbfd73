"""hvdx's LARS and LAMB as Keras 3 optimizers (hvdx/optimizers/keras3.py), on the default stack,
where `import keras` is Keras 3 and tf_keras (Keras 2) beside it: both Keras' classes in one
process, the same rules (hvdx/optimizers/lars.py, lamb.py on layerwise.py).

On one rank: the Keras 3 classes give the Keras 2 classes' weights on the same weights and
gradients, in every `parallel=` mode, alone and inside hvdx.DistributedOptimizer (the
aggregation's record handed over, LARS' local trust ratio and momentum correction under HiTopK);
`fit` of a Keras 3 MLP on the digits through hvdx.DistributedOptimizer learns with allreduce and
HiTopK; the config, a `.keras` archive and the wrapper's config round trip; bad arguments fail
as the Keras 2 classes'; `hvdx.optimizers.LARS` follows tf.keras. On 2 nodes x 2 ranks
(tests/multirank/check_keras3_layerwise.py's `modes`) every mode gives the weights of
parallel=None and the ranks end bitwise identical. Skipped where Keras 3 is absent (tf2.15)."""
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx import legacy_keras
from hvdx.optimizers import keras2
from tests import harness, suite
from tests.harness import HAS_KERAS3

pytestmark = harness.KERAS3

if HAS_KERAS3:
    import keras
    from hvdx.optimizers import keras3

NAMES = ["dense/kernel", "dense/bias", "batch_normalization/gamma", "dense_1/kernel"]
SHAPES = [(5, 3), (3,), (3,), (3, 2)]
MODES = (None, "pto", "slices")

RULES = {
    "lars_eq11": ("LARS", dict(learning_rate=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02, epsilon=1e-9,
                               exclude_from_weight_decay=["bias", "batch_normalization"])),
    "lars_nesterov_clipped": ("LARS", dict(learning_rate=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02,
                                           nesterov=True, exclude_from_weight_decay="bias",
                                           exclude_from_layer_adaptation=[], min_trust_ratio=1e-5,
                                           max_trust_ratio=0.05)),
    "lars_momentum_first": ("LARS", dict(learning_rate=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02,
                                         classic_momentum=False, nesterov=True, exclude_from_weight_decay="bias",
                                         exclude_from_layer_adaptation="gamma", min_trust_ratio=0.01)),
    "lamb": ("LAMB", dict(learning_rate=0.01, beta_1=0.9, beta_2=0.99, epsilon=1e-6, weight_decay=0.05,
                          exclude_from_weight_decay="bias", exclude_from_layer_adaptation="gamma",
                          max_trust_ratio=5.0)),
    "lamb_uncorrected": ("LAMB", dict(learning_rate=0.01, weight_decay=0.01, bias_correction=False)),
}


@pytest.fixture(scope="module")
def one_rank():
    return hvdx.init()


def weights_and_gradients(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    initial = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    if seed == 1:
        initial[2][:] = 0.0  # a zero-norm layer (trust ratio 1)
    grads = [[rng.standard_normal(s).astype(np.float32) * 0.1 for s in SHAPES] for _ in range(steps)]
    return initial, grads


def keras2_variables(initial):
    return [tf.Variable(w, name=n) for w, n in zip(initial, NAMES)]


def keras3_variables(initial):
    """Keras 3 variables whose paths are the Keras 2 variables' names (the patterns match alike)."""
    out = []
    for w, name in zip(initial, NAMES):
        scope, leaf = name.split("/")
        with keras.name_scope(scope):
            out.append(keras.Variable(w, name=leaf))
    assert [v.path for v in out] == NAMES
    return out


def run(optimizer, variables, grads, function: bool = False):
    def step(gradients):
        optimizer.apply_gradients(zip(gradients, variables))

    step = tf.function(step) if function else step
    for g in grads:
        step([tf.constant(x) for x in g])
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in variables]


def assert_close(got, want, rtol=1e-6, atol=1e-7):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


# -- the same rules as the Keras 2 classes ------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_keras3_updates_equal_keras2s_in_every_mode(one_rank, rule, mode, seed):
    name, kwargs = RULES[rule]
    initial, grads = weights_and_gradients(5, seed)
    want = run(getattr(keras2, name)(parallel=mode, **kwargs), keras2_variables(initial), grads)
    mine = getattr(keras3, name)(parallel=mode, **kwargs)
    got = run(mine, keras3_variables(initial), grads, function=seed == 0)  # traced too
    assert_close(got, want)
    assert not any(np.allclose(g, x) for g, x in zip(got, initial))  # every layer moved
    assert mine.last_mode is None  # one rank: the norms are computed locally whatever the mode
    assert int(mine.iterations.numpy()) == 5


@pytest.mark.parametrize("communication, options", [
    ("allreduce", {}), ("hierarchical", {}),
    ("hitopk", dict(density=1.0, local_trust_ratio=True, momentum_correction=True)),
    ("hitopk", dict(density=0.3, local_trust_ratio=True, trust_norms="rank")),
], ids=["allreduce", "hierarchical", "hitopk_trust_corrected", "hitopk_trust_rank"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_wrapped_in_distributed_optimizer_keras3_lars_equals_keras2s(one_rank, communication, options, mode):
    """Through hvdx.DistributedOptimizer's Keras 3 adapter: the record handed over (parallel=
    "slices"), LARS' trust ratio before the strategy and its momentum zeroed in the step under
    momentum correction, as the Keras 2 adapter does."""
    _, kwargs = RULES["lars_eq11"]
    initial, grads = weights_and_gradients(5)
    theirs = hvdx.DistributedOptimizer(keras2.LARS(parallel=mode, **kwargs), communication=communication, **options)
    want = run(theirs, keras2_variables(initial), grads, function=True)
    mine = hvdx.DistributedOptimizer(keras3.LARS(parallel=mode, **kwargs), communication=communication, **options)
    assert type(mine).__module__ == "hvdx.keras3_optimizer" and isinstance(mine, keras3.LARS)
    assert mine.local_trust_ratio == theirs.local_trust_ratio == bool(options.get("local_trust_ratio"))
    got = run(mine, keras3_variables(initial), grads, function=True)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert mine.inner_optimizer.momentum == 0.9  # restored after the step


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_wrapped_keras3_lamb_equals_keras2s(one_rank, mode):
    _, kwargs = RULES["lamb"]
    initial, grads = weights_and_gradients(4)
    want = run(hvdx.DistributedOptimizer(keras2.LAMB(parallel=mode, **kwargs), communication="hierarchical"),
               keras2_variables(initial), grads, function=True)
    got = run(hvdx.DistributedOptimizer(keras3.LAMB(parallel=mode, **kwargs), communication="hierarchical"),
              keras3_variables(initial), grads, function=True)
    assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_strategies_default_aids_read_the_keras3_classes_traits(one_rank):
    lars = hvdx.DistributedOptimizer(keras3.LARS(0.1), communication="hitopk")  # density 0.01
    assert lars.local_trust_ratio and lars.communication.momentum == 0.9
    config = lars.get_config()
    assert config["local_trust_ratio"] is True and config["momentum_correction"] is True
    step = hvdx.DistributedOptimizer(keras3.LARS(0.1, classic_momentum=False), communication="hitopk")
    assert not step.local_trust_ratio and not getattr(step.communication, "momentum", 0.0)
    lamb = hvdx.DistributedOptimizer(keras3.LAMB(0.01), communication="hitopk")
    assert lamb.communication.warmup_steps == 100 and lamb.communication.warmup_density == 0.25
    with pytest.raises(ValueError, match="classic_momentum=True"):
        hvdx.DistributedOptimizer(keras3.LARS(0.1, classic_momentum=False), communication="hitopk",
                                  local_trust_ratio=True)


# -- training with fit ------------------------------------------------------------------

def digits_fit(optimizer, epochs: int):
    from tests.multirank import digits

    x_train, x_test, y_train, y_test = digits.split()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x_train, y_train, batch_size=32, epochs=epochs, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return float(accuracy), history.history["loss"], model


@pytest.mark.parametrize("rule, communication", [("LARS", "allreduce"), ("LARS", "hitopk"), ("LAMB", "allreduce"),
                                                 ("LAMB", "hitopk")])
def test_fit_on_the_digits_through_distributed_optimizer_learns(one_rank, rule, communication):
    inner = keras3.LARS(0.5, momentum=0.9, weight_decay=1e-4, eeta=0.02, exclude_from_weight_decay="bias",
                        parallel="slices") if rule == "LARS" else \
        keras3.LAMB(0.01, weight_decay=0.01, exclude_from_weight_decay="bias", parallel="pto")
    density = {"density": 0.1} if communication == "hitopk" else {}
    optimizer = hvdx.DistributedOptimizer(inner, communication=communication, **density)
    accuracy, losses, model = digits_fit(optimizer, epochs=4)
    print(f"{rule} {communication}: test accuracy {accuracy:.3f}, losses {losses}")
    assert model.optimizer is optimizer and isinstance(optimizer, type(inner))
    if communication == "hitopk" and rule == "LARS":
        assert optimizer.local_trust_ratio  # eq. 11 before the strategy (density 0.1)
    assert losses[-1] < 0.5 * losses[0]
    assert accuracy > 0.85


# -- saving -------------------------------------------------------------------------------

EVERY_OPTION = {
    "LARS": dict(learning_rate=0.3, momentum=0.8, weight_decay=5e-4, eeta=0.002, epsilon=1e-8, nesterov=True,
                 classic_momentum=False, exclude_from_weight_decay=["bias", "_bn/"],
                 exclude_from_layer_adaptation=["_bn/"], min_trust_ratio=1e-5, max_trust_ratio=1.0,
                 parallel="slices"),
    "LAMB": dict(learning_rate=0.002, beta_1=0.8, beta_2=0.98, epsilon=1e-7, weight_decay=0.01,
                 bias_correction=False, exclude_from_weight_decay=["bias"], exclude_from_layer_adaptation=None,
                 min_trust_ratio=0.1, max_trust_ratio=10.0, parallel="pto"),
}


@pytest.mark.parametrize("rule", ["LARS", "LAMB"])
def test_config_round_trip_keeps_every_option(one_rank, rule):
    cls = getattr(keras3, rule)
    optimizer = cls(**EVERY_OPTION[rule])
    config = optimizer.get_config()
    for key, value in EVERY_OPTION[rule].items():
        assert config[key] == pytest.approx(value) if isinstance(value, float) else config[key] == value, key
    assert keras.saving.get_registered_name(cls) == f"hvdx>Keras3{rule}"
    assert keras2.LARS is not keras3.LARS
    assert legacy_keras.keras2().utils.get_registered_name(getattr(keras2, rule)) == f"hvdx>{rule}"
    serialized = json.loads(json.dumps(keras.optimizers.serialize(optimizer)))
    restored = keras.optimizers.deserialize(serialized)
    assert type(restored) is cls and restored.get_config() == config
    assert type(cls.from_config(config)) is cls
    wrapped = hvdx.DistributedOptimizer(cls(**EVERY_OPTION[rule]), communication="hierarchical")
    again = keras.optimizers.deserialize(json.loads(json.dumps(keras.optimizers.serialize(wrapped))))
    assert type(again.inner_optimizer) is cls and again.inner_optimizer.get_config() == config
    assert again.get_config() == wrapped.get_config()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.5)
    scheduled = keras.optimizers.deserialize(keras.optimizers.serialize(cls(learning_rate=schedule)))
    assert isinstance(scheduled._learning_rate, keras.optimizers.schedules.ExponentialDecay)


def small_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                             keras.layers.Dense(2)])


@pytest.mark.parametrize("wrapped", [False, True], ids=["alone", "wrapped"])
@pytest.mark.parametrize("rule", ["LARS", "LAMB"])
def test_a_keras_archive_keeps_the_optimizer(one_rank, rule, wrapped, tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 6)).astype(np.float32), rng.standard_normal((64, 2)).astype(np.float32)
    model = small_model()
    optimizer = getattr(keras3, rule)(**EVERY_OPTION[rule])
    if wrapped:
        optimizer = hvdx.DistributedOptimizer(optimizer, communication="hitopk", density=0.5)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    inner = loaded.optimizer.inner_optimizer if wrapped else loaded.optimizer
    assert type(inner) is getattr(keras3, rule)
    assert inner.get_config() == (model.optimizer.inner_optimizer if wrapped else model.optimizer).get_config()
    saved = [np.asarray(v) for v in model.optimizer.variables]
    assert len(saved) > 2 and any(np.any(s != 0) for s in saved[2:])
    restored = [np.asarray(v) for v in loaded.optimizer.variables]
    assert len(restored) == len(saved)
    for mine, theirs in zip(saved, restored):
        np.testing.assert_array_equal(mine, theirs)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # both go on identically
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert_close(loaded.get_weights(), model.get_weights(), rtol=1e-6, atol=1e-7)


# -- arguments ----------------------------------------------------------------------------

BAD = [
    ("LARS", dict(learning_rate=-0.1), "learning_rate"),
    ("LARS", dict(momentum=-0.5), "momentum"),
    ("LARS", dict(momentum=1.0), "momentum"),
    ("LARS", dict(weight_decay=-1e-4), "weight_decay"),
    ("LARS", dict(eeta=0.0), "eeta"),
    ("LARS", dict(epsilon=-1.0), "epsilon"),
    ("LARS", dict(min_trust_ratio=1.0, max_trust_ratio=0.5), "min_trust_ratio"),
    ("LARS", dict(min_trust_ratio=-1.0), "min_trust_ratio"),
    ("LARS", dict(max_trust_ratio=0.0), "max_trust_ratio"),
    ("LARS", dict(parallel="allgather"), "parallel"),
    ("LARS", dict(exclude_from_weight_decay=[3]), "exclude_from_weight_decay"),
    ("LARS", dict(exclude_from_layer_adaptation="(unclosed"), "exclude_from_layer_adaptation"),
    ("LARS", dict(nesterov="no"), "nesterov must be True or False"),
    ("LARS", dict(classic_momentum=1), "classic_momentum must be True or False"),
    ("LAMB", dict(learning_rate=-1e-3), "learning_rate"),
    ("LAMB", dict(beta_1=1.5), "beta_1"),
    ("LAMB", dict(beta_2=-0.1), "beta_2"),
    ("LAMB", dict(epsilon=0.0), "epsilon"),
    ("LAMB", dict(weight_decay=float("nan")), "weight_decay"),
    ("LAMB", dict(parallel="slice"), "parallel"),
    ("LAMB", dict(bias_correction=None), "bias_correction must be True or False"),
]


@pytest.mark.parametrize("rule, kwargs, argument", BAD)
def test_bad_arguments_fail_as_the_keras2_classes(rule, kwargs, argument):
    with pytest.raises(ValueError, match=argument) as mine:
        getattr(keras3, rule)(**kwargs)
    with pytest.raises(ValueError, match=argument) as theirs:
        getattr(keras2, rule)(**kwargs)
    assert str(mine.value) == str(theirs.value)


@pytest.mark.parametrize("rule", ["LARS", "LAMB"])
def test_both_keras_classes_take_the_same_arguments_and_an_integer_rate(rule):
    two, three = inspect.signature(getattr(keras2, rule)), inspect.signature(getattr(keras3, rule))
    assert [(p.name, p.default) for p in two.parameters.values()] == \
        [(p.name, p.default) for p in three.parameters.values()]
    assert float(getattr(keras3, rule)(learning_rate=1).learning_rate.numpy()) == 1.0  # Keras 3 itself wants a float
    assert getattr(keras3, rule)(learning_rate=np.float32(0.5)).get_config()["learning_rate"] == 0.5


def test_hvdx_optimizers_follows_tf_keras():
    """Where tf.keras is Keras 2 (TF_USE_LEGACY_KERAS=1), the Keras 2 classes; with tf.keras left
    to TensorFlow (Keras 3, as in this process unless the variable is set), the Keras 3 ones, and
    a tf.keras model trains with them."""
    import hvdx.optimizers

    follows = keras3 if legacy_keras.tf_keras_is_keras3() else keras2
    assert hvdx.optimizers.LARS is follows.LARS and hvdx.optimizers.LAMB is follows.LAMB
    code = ("import numpy as np, tensorflow as tf\n"
            "import hvdx, hvdx.optimizers\n"
            "hvdx.init()\n"
            "model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(3)])\n"
            "opt = hvdx.DistributedOptimizer(hvdx.optimizers.LARS(0.5, eeta=0.05), communication='hierarchical')\n"
            "model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
            "loss = model.fit(np.eye(32, 8, dtype=np.float32), np.arange(32) % 3, epochs=3, verbose=0)"
            ".history['loss']\n"
            "print(hvdx.optimizers.LARS.__module__, hvdx.optimizers.LAMB.__module__, type(opt).__module__, "
            "loss[-1] < loss[0])\n")
    env = {k: v for k, v in os.environ.items() if k != legacy_keras.ENV}
    proc = subprocess.run([sys.executable, "-c", code], cwd=harness.ROOT, capture_output=True, text=True,
                          env=dict(env, TF_CPP_MIN_LOG_LEVEL="3"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["hvdx.optimizers.keras3", "hvdx.optimizers.keras3", "hvdx.keras3_optimizer",
                                   "True"], proc.stdout


# -- 2 nodes x 2 ranks (tests/multirank/check_keras3_layerwise.py) ----------------------------

#: On a stack without Keras 3 no launch is asked for this check (its test is skipped there).
MODES_CHECKS = [suite.check("keras3_layerwise.modes", "2x2", timeout=420)] if HAS_KERAS3 else []


@suite.runs(*MODES_CHECKS)
def test_every_parallel_mode_gives_the_same_weights_on_2x2(ranks):
    """Keras 3 LARS and LAMB through hvdx.DistributedOptimizer on 2 nodes x 2 ranks, each rank on
    its own data: "pto" and "slices" give parallel=None's weights (pto bit for bit under 2DTAR),
    "slices" runs on the slices where the strategy leaves them (as "pto" under a dense allreduce),
    and every rank ends bitwise identical."""
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        assert data["keras"].startswith("3."), data
        print(rank, json.dumps(data["runs"]))
        for key, run_ in data["runs"].items():
            assert run_["spread"] == 0.0, (rank, key, run_)  # bitwise identical over the ranks, every mode
            assert run_["moved"] > 1e-3, (rank, key, run_)
            assert run_["slices_error"] < 1e-4, (rank, key, run_)
            if "pto_error" in run_:
                assert run_["pto_error"] < 1e-4, (rank, key, run_)
        runs = data["runs"]
        assert runs["lars.hierarchical"]["modes"] == {"None": None, "pto": "pto", "slices": "slices"}
        assert runs["lamb.hierarchical"]["modes"] == {"None": None, "pto": "pto", "slices": "slices"}
        assert runs["lars.hierarchical"]["pto_error"] == 0.0 and runs["lamb.hierarchical"]["pto_error"] == 0.0
        assert runs["lars.hitopk"]["modes"] == {"None": None, "slices": "slices"}
        assert runs["lars.allreduce"]["modes"] == {"None": None, "slices": "pto"}  # no slices there
