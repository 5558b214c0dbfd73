"""LARS and LAMB (shi2021 sec. 4.2, eq. 11): their update rules, options and persistence in
one process; on 2 nodes x 2 ranks (tests/multirank/check_lars.py in the suite's 2x2 launch) the parallel
modes, the compositions with hvdx's and Horovod's DistributedOptimizer and with hvdx.DASO
(node-local aggregation, also on 2x1), and training."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx.optimizers import LAMB, LARS
from tests import harness, suite

NAMES = ["dense/kernel", "dense/bias", "batch_normalization/gamma", "dense_1/kernel"]
SHAPES = [(5, 3), (3,), (3,), (3, 2)]


def variables_and_gradients(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    initial = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    initial[2][:] = 0.0 if seed == 1 else initial[2]  # seed 1: a zero-norm layer (trust ratio 1)
    grads = [[rng.standard_normal(s).astype(np.float32) * 0.1 for s in SHAPES] for _ in range(steps)]
    variables = [tf.Variable(w, name=n) for w, n in zip(initial, NAMES)]
    return initial, grads, variables


def run_optimizer(optimizer, variables, grads):
    for step in grads:
        optimizer.apply_gradients(zip([tf.constant(g) for g in step], variables))
    return [v.numpy() for v in variables]


def matches(patterns, name):
    return any(re.search(p, name) for p in patterns)


def clip(ratio, low, high):
    ratio = ratio if low is None else max(ratio, low)
    return ratio if high is None else min(ratio, high)


def lars_reference(initial, grads, lr, momentum, weight_decay, eeta, epsilon, nesterov, classic, exclude_decay,
                   exclude_adaptation, low, high):
    """LARS in float64, written from eq. 11 and the update rules in hvdx/optimizers/lars.py's docstring."""
    w = [x.astype(np.float64) for x in initial]
    v = [np.zeros_like(x) for x in w]
    adaptation = exclude_decay if exclude_adaptation is None else exclude_adaptation
    for step in grads:
        for i, (name, g) in enumerate(zip(NAMES, step)):
            g = g.astype(np.float64)
            decay = weight_decay if not matches(exclude_decay, name) else 0.0
            decayed = g + decay * w[i]
            if classic:
                direction = g
            else:
                v[i] = momentum * v[i] + decayed
                direction = momentum * v[i] + decayed if nesterov else v[i]
            w_norm, d_norm = np.linalg.norm(w[i]), np.linalg.norm(direction)
            trust = 1.0
            if not matches(adaptation, name):
                if w_norm > 0 and d_norm > 0:
                    trust = eeta * w_norm / (d_norm + (decay if classic else 0.0) * w_norm + epsilon)
                trust = clip(trust, low, high)
            if classic:
                v[i] = momentum * v[i] + lr * trust * decayed
                w[i] = w[i] - (momentum * v[i] + lr * trust * decayed if nesterov else v[i])
            else:
                w[i] = w[i] - lr * trust * direction
    return w


def lamb_reference(initial, grads, lr, beta_1, beta_2, epsilon, weight_decay, bias_correction, exclude_decay,
                   exclude_adaptation, low, high):
    """LAMB in float64 (You et al. 2020, Algorithm 2)."""
    w = [x.astype(np.float64) for x in initial]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    adaptation = exclude_decay if exclude_adaptation is None else exclude_adaptation
    for t, step in enumerate(grads, start=1):
        for i, (name, g) in enumerate(zip(NAMES, step)):
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            v[i] = beta_2 * v[i] + (1 - beta_2) * g.astype(np.float64) ** 2
            m_hat, v_hat = (m[i] / (1 - beta_1 ** t), v[i] / (1 - beta_2 ** t)) if bias_correction else (m[i], v[i])
            r = m_hat / (np.sqrt(v_hat) + epsilon)
            if weight_decay and not matches(exclude_decay, name):
                r = r + weight_decay * w[i]
            trust = 1.0
            if not matches(adaptation, name):
                w_norm, r_norm = np.linalg.norm(w[i]), np.linalg.norm(r)
                trust = clip(w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0, low, high)
            w[i] = w[i] - lr * trust * r
    return w


LARS_CASES = {
    "eq11": dict(nesterov=False, classic=True, exclude_decay=["bias", "batch_normalization"],
                 exclude_adaptation=None, low=None, high=None),
    "eq11_nesterov_clipped": dict(nesterov=True, classic=True, exclude_decay=["bias"], exclude_adaptation=[],
                                  low=1e-5, high=0.05),
    "momentum_first": dict(nesterov=False, classic=False, exclude_decay=["bias"], exclude_adaptation=["gamma"],
                           low=None, high=None),
    "momentum_first_nesterov": dict(nesterov=True, classic=False, exclude_decay=[], exclude_adaptation=None,
                                    low=0.01, high=1.0),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(LARS_CASES))
def test_lars_follows_its_update_rule(case, seed):
    c = LARS_CASES[case]
    hyper = dict(lr=0.5, momentum=0.9, weight_decay=0.01, eeta=0.02, epsilon=1e-9)
    initial, grads, variables = variables_and_gradients(6, seed)
    optimizer = LARS(hyper["lr"], momentum=hyper["momentum"], weight_decay=hyper["weight_decay"], eeta=hyper["eeta"],
                     epsilon=hyper["epsilon"], nesterov=c["nesterov"], classic_momentum=c["classic"],
                     exclude_from_weight_decay=c["exclude_decay"],
                     exclude_from_layer_adaptation=c["exclude_adaptation"], min_trust_ratio=c["low"],
                     max_trust_ratio=c["high"])
    got = run_optimizer(optimizer, variables, grads)
    want = lars_reference(initial, grads, **hyper, **c)
    for g, w, x in zip(got, want, initial):
        assert not np.allclose(w, x)  # every layer moved
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_lamb_follows_algorithm_2(bias_correction, seed):
    hyper = dict(lr=0.01, beta_1=0.9, beta_2=0.99, epsilon=1e-6, weight_decay=0.05)
    options = dict(exclude_decay=["bias"], exclude_adaptation=["gamma"], low=None, high=5.0)
    initial, grads, variables = variables_and_gradients(6, seed)
    optimizer = LAMB(hyper["lr"], beta_1=hyper["beta_1"], beta_2=hyper["beta_2"], epsilon=hyper["epsilon"],
                     weight_decay=hyper["weight_decay"], bias_correction=bias_correction,
                     exclude_from_weight_decay="bias", exclude_from_layer_adaptation="gamma", max_trust_ratio=5.0)
    got = run_optimizer(optimizer, variables, grads)
    want = lamb_reference(initial, grads, **hyper, bias_correction=bias_correction, **options)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_lamb_equals_tensorflow_addons_lamb():
    """tensorflow-addons' LAMB is an outside reference (same formulas: bias-corrected Adam
    direction plus decoupled weight decay, ratio ||w|| / ||r||, no clipping)."""
    tfa = pytest.importorskip("tensorflow_addons", reason="tensorflow-addons is not installed for this TensorFlow")
    initial, grads, ours = variables_and_gradients(8)
    theirs = [tf.Variable(w, name=n) for w, n in zip(initial, NAMES)]
    kwargs = dict(learning_rate=0.01, beta_1=0.9, beta_2=0.99, epsilon=1e-6, weight_decay=0.05,
                  exclude_from_weight_decay=["bias"], exclude_from_layer_adaptation=["gamma"])
    got = run_optimizer(LAMB(**kwargs), ours, grads)
    want = run_optimizer(tfa.optimizers.LAMB(**kwargs), theirs, grads)
    for g, w, x in zip(got, want, initial):
        assert not np.allclose(w, x)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_a_single_string_is_one_pattern_not_a_list_of_characters():
    optimizer = LARS(exclude_from_weight_decay="bias")
    assert optimizer.exclude_from_weight_decay_patterns == ("bias",)
    assert optimizer.exclude_from_layer_adaptation_patterns == ("bias",)  # defaults to the decay exclusions
    assert optimizer.get_config()["exclude_from_weight_decay"] == ["bias"]
    gamma = tf.Variable([1.0], name="bn/gamma")  # holds 'b' and 'a', letters of "bias"
    bias = tf.Variable([1.0], name="dense/bias")
    assert optimizer._decays(gamma) and optimizer._adapts(gamma)
    assert not optimizer._decays(bias) and not optimizer._adapts(bias)
    assert LAMB(exclude_from_layer_adaptation="gamma$").exclude_from_layer_adaptation_patterns == ("gamma$",)


@pytest.mark.parametrize("cls,kwargs,argument", [
    (LARS, dict(learning_rate=-0.1), "learning_rate"),
    (LARS, dict(momentum=-0.5), "momentum"),
    (LARS, dict(momentum=1.0), "momentum"),
    (LARS, dict(weight_decay=-1e-4), "weight_decay"),
    (LARS, dict(eeta=0.0), "eeta"),
    (LARS, dict(epsilon=-1.0), "epsilon"),
    (LARS, dict(min_trust_ratio=1.0, max_trust_ratio=0.5), "min_trust_ratio"),
    (LARS, dict(min_trust_ratio=-1.0), "min_trust_ratio"),
    (LARS, dict(max_trust_ratio=0.0), "max_trust_ratio"),
    (LARS, dict(parallel="allgather"), "parallel"),
    (LARS, dict(exclude_from_weight_decay=[3]), "exclude_from_weight_decay"),
    (LARS, dict(exclude_from_layer_adaptation="(unclosed"), "exclude_from_layer_adaptation"),
    (LAMB, dict(learning_rate=-1e-3), "learning_rate"),
    (LAMB, dict(beta_1=1.5), "beta_1"),
    (LAMB, dict(beta_2=-0.1), "beta_2"),
    (LAMB, dict(epsilon=0.0), "epsilon"),
    (LAMB, dict(weight_decay=float("nan")), "weight_decay"),
    (LAMB, dict(parallel="slice"), "parallel"),
])
def test_bad_hyperparameters_name_the_argument(cls, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        cls(**kwargs)


EVERY_OPTION = {
    LARS: dict(learning_rate=0.3, momentum=0.8, weight_decay=5e-4, eeta=0.002, epsilon=1e-8, nesterov=True,
               classic_momentum=False, exclude_from_weight_decay=["bias", "_bn/"],
               exclude_from_layer_adaptation=["_bn/"], min_trust_ratio=1e-5, max_trust_ratio=1.0, parallel="slices"),
    LAMB: dict(learning_rate=0.002, beta_1=0.8, beta_2=0.98, epsilon=1e-7, weight_decay=0.01, bias_correction=False,
               exclude_from_weight_decay=["bias"], exclude_from_layer_adaptation=None, min_trust_ratio=0.1,
               max_trust_ratio=10.0, parallel="pto"),
}


@pytest.mark.parametrize("cls", [LARS, LAMB], ids=lambda c: c.__name__)
def test_config_round_trip_keeps_every_option(cls):
    optimizer = cls(**EVERY_OPTION[cls])
    config = optimizer.get_config()
    for key, value in EVERY_OPTION[cls].items():
        assert config[key] == pytest.approx(value) if isinstance(value, float) else config[key] == value, key
    restored = tf.keras.optimizers.deserialize(json.loads(json.dumps(tf.keras.optimizers.serialize(optimizer))))
    assert type(restored) is cls and restored.get_config() == config
    wrapped = hvdx.DistributedOptimizer(cls(**EVERY_OPTION[cls]), communication="hierarchical")
    again = hvdx.DistributedOptimizer.from_config(json.loads(json.dumps(wrapped.get_config())))
    assert type(again.inner_optimizer) is cls and again.inner_optimizer.get_config() == config
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.5)
    scheduled = tf.keras.optimizers.deserialize(tf.keras.optimizers.serialize(cls(learning_rate=schedule)))
    assert isinstance(scheduled._learning_rate, tf.keras.optimizers.schedules.ExponentialDecay)


def small_model():  # not a zoo model: batch norm (non-trainable moving statistics) between the Dense layers
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.layers.Input(shape=(6,)), tf.keras.layers.Dense(8),
                                tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(2)])


@pytest.mark.parametrize("fmt", ["keras", pytest.param("savedmodel", marks=pytest.mark.keras2)])  # Keras 2 saves one
@pytest.mark.parametrize("cls", [LARS, LAMB], ids=lambda c: c.__name__)
def test_model_save_and_load_keep_the_optimizer(cls, fmt, tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 6)).astype(np.float32), rng.standard_normal((64, 2)).astype(np.float32)
    model = small_model()
    model.compile(optimizer=cls(**EVERY_OPTION[cls]), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / ("model.keras" if fmt == "keras" else "saved"))
    model.save(path)
    if fmt == "keras":
        loaded = tf.keras.models.load_model(path)
        optimizer = loaded.optimizer
    else:  # Keras rebuilds a SavedModel's optimizer without its state; hvdx.load_model restores it
        loaded = hvdx.load_model(path)
        optimizer = loaded.optimizer.inner_optimizer
    assert type(optimizer) is cls
    assert optimizer.get_config() == model.optimizer.get_config()
    saved_state = [v.numpy() for v in model.optimizer.variables]
    assert len(saved_state) > 1 and any(np.any(s != 0) for s in saved_state[1:])
    restored = [v.numpy() for v in optimizer.variables]
    assert len(restored) == len(saved_state)
    for mine, theirs in zip(saved_state, restored):
        np.testing.assert_array_equal(mine, theirs)
    if fmt == "keras":  # both go on identically (the SavedModel's is wrapped for Horovod now)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        for a, b in zip(model.get_weights(), loaded.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_trust_ratios_are_one_for_excluded_and_zero_norm_layers_and_clipped():
    w = [tf.Variable(np.full((4,), 2.0, np.float32), name="a/kernel"), tf.Variable(np.zeros(3, np.float32),
                                                                                    name="b/kernel"),
         tf.Variable(np.ones(3, np.float32), name="c/bias")]
    g = [tf.constant(np.full((4,), 0.5, np.float32)), tf.constant(np.ones(3, np.float32)),
         tf.constant(np.ones(3, np.float32))]
    optimizer = LARS(eeta=0.1, weight_decay=0.0, exclude_from_weight_decay="bias")
    ratios = [float(r) for r in optimizer.trust_ratios(w, g)]
    assert ratios == pytest.approx([0.1 * 4.0 / 1.0, 1.0, 1.0])  # eq. 11; ||w|| = 0; excluded
    clipped = LARS(eeta=0.1, weight_decay=0.0, max_trust_ratio=0.25, min_trust_ratio=0.1)
    assert [float(r) for r in clipped.trust_ratios(w, g)] == pytest.approx([0.25, 0.25, 0.1])  # 1 clipped too


def test_single_process_modes_are_the_replicated_computation():
    initial, grads, _ = variables_and_gradients(4)
    results = {}
    for mode in (None, "pto", "slices"):
        variables = [tf.Variable(w, name=n) for w, n in zip(initial, NAMES)]
        results[mode] = run_optimizer(LARS(0.5, eeta=0.02, parallel=mode), variables, grads)
    for mode in ("pto", "slices"):
        for a, b in zip(results[None], results[mode]):
            np.testing.assert_array_equal(a, b)


# -- 2 nodes x 2 ranks (tests/multirank/check_lars.py) ------------------------------------

@suite.runs(suite.check("lars.pto", "2x2"))
def test_pto_is_bit_exact_on_2x2(ranks):
    for data in ranks.values():
        assert data["topology"] == [2, 2]
        assert data["counts"] == [1, 2, 3, 5, 8, 13, 161, 300]


@suite.runs(suite.check("lars.modes", "2x2", full=True, timeout=400))
def test_every_parallel_mode_gives_the_same_weights_on_2x2(ranks):
    modes = ranks[0]
    print(json.dumps(modes, indent=1))
    for key in ("lars.hierarchical", "lamb.hierarchical", "lars.sized"):
        assert modes[key]["modes"] == {"None": None, "pto": "pto", "slices": "slices"}, key
    for key in ("lars.hierarchical", "lamb.hierarchical"):  # (lars.sized: Horovod fuses as tensors get ready)
        assert modes[key]["pto_error"] == 0.0, key  # pto's norms are the replicated ones, bit for bit
    assert modes["lars_nesterov_step.hitopk"]["modes"] == {"None": None, "slices": "slices"}
    for key in ("lars.hierarchical", "lamb.hierarchical", "lars_nesterov_step.hitopk", "lars.sized"):
        assert modes[key]["slices_error"] < 1e-4, key
    assert modes["lars.allreduce"]["modes"]["slices"] == "pto"  # no slices under a dense allreduce
    assert modes["loss_scale_slices_error"] < 1e-4
    assert modes["horovod_pto_vs_hvdx_replicated"] < 1e-4


# 8 epochs, the rate decayed linearly to 0. Test accuracy on the four ranks (TensorFlow 2.21,
# 2026-12-07), seeds 0-5: SGD 0.964-0.993 and LARS 0.967-0.993, LARS at most 1.6 points under
# SGD on any rank. At a constant rate 0.1 the end point was noise: at seed 0 LARS 0.938-0.953
# against SGD 0.964-0.982 on this machine and 0.916-0.936 against 0.951-0.987 on CI's (failed),
# and over seeds 1-5 LARS up to 13 points under SGD on a rank.
@suite.runs(suite.check("lars.digits", "2x2", epochs=8, timeout=400))
def test_resnet_with_lars_and_hitopk_trains_like_momentum_sgd(ranks):
    for r in sorted(ranks):  # each rank evaluates with its own batch-norm statistics
        accuracy = ranks[r]
        print(f"rank {r}: digits test accuracy {accuracy}")
        assert accuracy["sgd"] > 0.9
        assert accuracy["lars"] >= accuracy["sgd"] - 0.05


# -- the benchmark, tiny -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multirank
def test_lars_benchmark_writes_json_plot_and_table(tmp_path):
    readme = tmp_path / "README.md"
    proc = subprocess.run([sys.executable, str(harness.ROOT / "benchmarks" / "lars.py"), "--scale", "0.01",
                           "--limit", "8", "--repeats", "1", "--out", str(tmp_path), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=300, env=harness.test_env(str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "lars.json").read_text())
    assert result["topology"] == {"nodes": 2, "ranks_per_node": 2}
    assert [m["model"] for m in result["models"]] == ["resnet50", "transformer_base"]
    resnet = result["models"][0]
    assert resnet["tensors"] == 8 and result["models"][1]["tensors"] == 8
    for part in ("rates", "step"):
        assert sorted(resnet[part]["median_seconds"]) == ["fused", "naive", "pto", "slices"]
        assert all(t > 0 for t in resnet[part]["median_seconds"].values())
    assert (tmp_path / "lars.png").stat().st_size > 10_000
    text = readme.read_text()
    assert "<!-- lars:begin -->" in text and "| resnet50 |" in text


def test_benchmark_verdict_says_whether_and_by_how_much_the_goal_is_missed():
    from benchmarks import lars as bench

    def result(pto, slices):
        return {"models": [{"model": "resnet50", "rates": {"speedup_over_fused": {"pto": pto, "slices": slices}},
                            "parts_seconds": {"allgather_global": 0.01, "fused_reduction": 0.05}}]}

    assert bench.verdict(result(2.5, 1.8)).endswith("(pto) is 2.50x faster than the fused replicated computation; "
                                                    "goal 2x: met.**")
    missed = bench.verdict(result(1.2, 1.5))
    assert "(slices) is 1.50x" in missed and "missed by 25%" in missed and "10.0 ms" in missed


@suite.runs(suite.check("lars.under_daso", "2x2"), suite.check("lars.under_daso", "2x1"))
def test_under_daso_every_mode_follows_eq11_on_its_nodes_averaged_gradients(ranks):
    """hvdx.DASO averages gradients inside each node only: LARS' norms must come from this
    node's gradients in every mode (shared inside the node), never from another node's."""
    for data in ranks.every():
        for mode in ("None", "pto"):
            lars = data["lars"][mode]
            assert lars["eq11_error"] < 1e-5, (mode, lars)  # relative to the largest update
            assert lars["node_spread"] == 0.0, (mode, lars)  # a node's ranks agree bit for bit
            assert lars["between_nodes"] > 0.0, (mode, lars)  # each node followed its own gradients
        # the norms are shared inside the node where it has several ranks, computed locally otherwise
        assert data["modes"] == {"None": None, "pto": "pto" if ranks.per_node > 1 else None}
        assert data["lamb_pto_equal_replicated"] and data["lamb_between_nodes"] > 0.0
        # "slices" has no reduce-scattered slices under DASO: refused when DASO is built, not run as "pto"
        assert data["slices"].startswith("ValueError: LARS(parallel='slices')") and "parallel='pto'" in data["slices"]


@pytest.mark.parametrize("cls, argument", [(LARS, "classic_momentum"), (LARS, "nesterov"), (LAMB, "bias_correction")])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_boolean_options_must_be_booleans(cls, argument, value):
    with pytest.raises(ValueError, match=f"{argument} must be True or False"):
        cls(**{argument: value})
    assert getattr(cls(**{argument: np.bool_(False)}), argument) is False
