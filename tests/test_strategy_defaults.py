"""The strategies decide their own defaults from declared optimizer traits, and the strategy
choice is resolved once into one validated mapping (hvdx/comm/traits.py, hvdx/comm/choice.py,
`Strategy.defaults_for`). The measured rules themselves are checked end to end in
tests/test_dgc.py and tests/test_lars_sparse.py; here: the traits, the rules as a function
of traits and density, one resolution per construction, and the one mapping through every
wrapper."""
import pytest
import tensorflow as tf

import hvdx
import hvdx.tensorflow
from hvdx import comm, legacy_keras
from hvdx.comm import choice as choice_module
from hvdx.comm.choice import StrategyChoice
from hvdx.comm.sparse import TopKStrategy
from hvdx.comm.traits import OptimizerTraits, traits_of
from hvdx.optimizer_v1 import DistributedOptimizerV1
from hvdx.optimizers import LAMB, LARS


@pytest.fixture(scope="module")
def one_rank():
    return hvdx.init()


class Declared(tf.keras.optimizers.SGD):
    """A user's optimizer that declares its traits as a class attribute."""

    hvdx_traits = OptimizerTraits(name="Declared", momentum=0.8)


def test_traits_are_declared_or_described_from_keras_classes():
    assert traits_of(tf.keras.optimizers.SGD(0.1, momentum=0.9)) == OptimizerTraits(name="SGD", momentum=0.9)
    assert traits_of(tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)).nesterov
    assert traits_of(legacy_keras.keras2().optimizers.SGD(0.1, momentum=0.9)).momentum == 0.9  # Keras 2's too
    # the legacy SGD's momentum is a hyper-parameter the wrapper cannot set to 0 in its step
    legacy = legacy_keras.keras2().optimizers.legacy  # Keras 2's (tf_keras beside Keras 3)
    assert traits_of(legacy.SGD(0.1, momentum=0.9)).momentum is None
    for adam in (tf.keras.optimizers.Adam(), tf.keras.optimizers.AdamW(), legacy.Nadam()):
        assert traits_of(adam).adaptive and traits_of(adam).momentum is None
    assert traits_of(tf.keras.optimizers.RMSprop(momentum=0.5)) == OptimizerTraits(name="RMSprop")
    assert traits_of(LARS(momentum=0.9)) == OptimizerTraits(name="LARS", momentum=0.9, trust_ratio="gradient")
    assert traits_of(LARS(classic_momentum=False, nesterov=True)).trust_ratio == "step"
    assert traits_of(LAMB()) == OptimizerTraits(name="LAMB", adaptive=True, trust_ratio="step")
    assert traits_of(Declared(0.1)) == OptimizerTraits(name="Declared", momentum=0.8)  # asked, not described
    wrong = type("Wrong", (tf.keras.optimizers.SGD,), {"hvdx_traits": lambda self: {"momentum": 0.9}})
    with pytest.raises(TypeError, match="must be .*OptimizerTraits"):
        traits_of(wrong(0.1))
    with pytest.raises(ValueError, match="trust_ratio must be one of"):
        OptimizerTraits(trust_ratio="layer")


SGD = OptimizerTraits(momentum=0.9)
CLASSIC_LARS = OptimizerTraits(momentum=0.9, trust_ratio="gradient")
ADAM = OptimizerTraits(adaptive=True)


@pytest.mark.parametrize("traits, options, want", [
    (SGD, {}, {"momentum": 0.9}),
    (SGD, {"density": 0.1}, {"momentum": 0.9}),
    (SGD, {"density": 0.11}, {}),
    (OptimizerTraits(momentum=0.9, nesterov=True), {}, {}),
    (OptimizerTraits(momentum=0.0), {}, {}),
    (SGD, {"momentum_correction": False}, {}),
    (SGD, {"momentum": 0.5}, {}),
    (CLASSIC_LARS, {}, {"local_trust_ratio": True, "momentum": 0.9}),
    (CLASSIC_LARS, {"density": 0.05}, {"local_trust_ratio": True}),
    (CLASSIC_LARS, {"density": 0.5}, {}),
    (CLASSIC_LARS, {"local_trust_ratio": False}, {}),
    (CLASSIC_LARS, {"density": 0.05, "local_trust_ratio": True}, {}),
    (CLASSIC_LARS, {"density": 0.005, "local_trust_ratio": True}, {"momentum": 0.9}),
    (OptimizerTraits(momentum=0.9, trust_ratio="step"), {}, {}),
    (ADAM, {}, {"warmup_steps": 200, "warmup_density": 1.0}),  # the Adam family: from dense
    (ADAM, {"density": 0.25}, {"warmup_steps": 200, "warmup_density": 1.0}),
    (ADAM, {"density": 1.0}, {}),  # dense already: nothing to warm up
    (ADAM, {"warmup_steps": 0}, {}),
    (ADAM, {"warmup_density": 0.5}, {"warmup_steps": 200}),  # the user's start, the rule's length
    (ADAM, {"warmup_density": 0.5, "density": 0.5}, {}),
    (OptimizerTraits(adaptive=True, trust_ratio="step"), {}, {"warmup_steps": 100, "warmup_density": 0.25}),
    (OptimizerTraits(adaptive=True, trust_ratio="step"), {"density": 0.25}, {}),  # LAMB: from 25 %
    (OptimizerTraits(), {}, {}),
    (SGD, {"density": "dense"}, {}),  # a bad density: the constructor says so
])
def test_the_sparse_strategies_rules_are_a_function_of_traits_and_density(traits, options, want):
    assert TopKStrategy.defaults_for(traits, options) == want
    assert comm.HiTopK.defaults_for(traits, options) == want == comm.SparseAllgather.defaults_for(traits, options)


def test_dense_strategies_apply_no_aid():
    for cls in (comm.Allreduce, comm.Hierarchical):
        assert cls.defaults_for(CLASSIC_LARS, {}) == {} and cls.defaults_for(ADAM, {}) == {}


def test_the_constants_moved_with_the_rules_and_stay_importable_from_the_optimizer():
    from hvdx.comm import sparse
    from hvdx.optimizer import ADAM_WARMUP_STEPS, AUTO_MOMENTUM_CORRECTION_DENSITY, LARS_MOMENTUM_CORRECTION_DENSITY

    assert (AUTO_MOMENTUM_CORRECTION_DENSITY, LARS_MOMENTUM_CORRECTION_DENSITY, ADAM_WARMUP_STEPS) == (0.1, 0.01, 200)
    assert sparse.ADAM_WARMUP_STEPS == ADAM_WARMUP_STEPS
    from hvdx.aggregator import default_communication

    assert default_communication is choice_module.environment_default


def test_the_environment_is_read_once_per_construction(one_rank, monkeypatch):
    monkeypatch.setenv("HVDX_COMMUNICATION", "hitopk")
    monkeypatch.setenv("HVDX_DENSITY", "0.05")
    reads = []
    real = choice_module.environment_default
    monkeypatch.setattr(choice_module, "environment_default", lambda: reads.append(1) or real())
    opt = hvdx.DistributedOptimizer(LARS(momentum=0.9))
    assert len(reads) == 1
    assert opt.communication.density == 0.05 and opt.local_trust_ratio and opt.communication.momentum == 0
    # the choice holds what was resolved: the environment changing later does not change it
    choice = opt.aggregator.choice
    assert choice.communication == "hitopk" and dict(choice.options) == {"density": 0.05}
    monkeypatch.setenv("HVDX_COMMUNICATION", "allreduce")
    assert repr(choice.build()) == repr(opt.communication) and len(reads) == 1


def test_a_choice_is_frozen_and_a_switch_keeps_the_given_options_and_applies_the_new_defaults():
    choice = StrategyChoice.resolve("hitopk", {"density": 0.05, "clip_norm": None}, traits=ADAM)
    assert dict(choice.options) == {"density": 0.05}  # None: not given
    with pytest.raises(TypeError):
        choice.options["density"] = 0.1
    with pytest.raises(AttributeError):
        choice.communication = "allreduce"
    built = choice.build()
    assert built.density == 0.05 and built.warmup_steps == 200 and built.warmup_density == 1.0
    dense = choice.switch("2dtar").build(strict=False)
    assert repr(dense) == "Hierarchical()"
    with pytest.raises(ValueError, match="does not take density"):
        choice.switch("2dtar").build()
    again = choice.switch("naiveag")
    assert again.communication == "sparse_allgather" and again.build(strict=False).warmup_steps == 200
    assert choice.switch("hitopk", traits=OptimizerTraits()).build().warmup_steps == 0  # the optimizer's traits now
    with pytest.raises(ValueError, match="unknown communication strategy"):
        choice.switch("ring")


def test_options_beside_an_instance_and_unknown_options_are_refused_in_one_place():
    with pytest.raises(ValueError, match="configure the instance itself"):
        StrategyChoice.resolve(comm.HiTopK(), {"density": 0.1})
    with pytest.raises(TypeError, match="unexpected option densty=: no registered strategy takes it"):
        StrategyChoice.resolve("hitopk", {"densty": 0.1})
    with pytest.raises(TypeError, match="unknown aids"):
        StrategyChoice.resolve("hitopk", aids={"momentum": True})


def test_the_tape_and_the_v1_wrapper_take_the_same_strategy_options(one_rank):
    aids = dict(clip_norm=1.0, warmup_steps=10, warmup_density=0.5, residual_decay=0.9, momentum_masking=False)
    tape = hvdx.DistributedGradientTape(tf.GradientTape(), communication="hitopk", momentum=0.9, **aids)
    strategy = tape.aggregator.strategy
    assert strategy.momentum == 0.9 and not strategy.momentum_masking and strategy.clip_norm == 1.0
    v1 = hvdx.tensorflow.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                              communication="hitopk", density=0.05, momentum=0.9, **aids)
    assert isinstance(v1, DistributedOptimizerV1)
    assert repr(v1.aggregator.strategy) == repr(comm.HiTopK(density=0.05, momentum=0.9, **aids))
    # a tf.compat.v1 optimizer has no traits: no defaults, as with the tape
    adam_v1 = DistributedOptimizerV1(tf.compat.v1.train.AdamOptimizer(), communication="hitopk")
    assert adam_v1.aggregator.strategy.warmup_steps == 0
    with pytest.raises(ValueError, match="MomentumOptimizer would apply momentum again"):
        DistributedOptimizerV1(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), communication="hitopk", momentum=0.9)
    with pytest.raises(ValueError, match="dense and lossless and does not take clip_norm"):
        DistributedOptimizerV1(tf.compat.v1.train.GradientDescentOptimizer(0.1), clip_norm=1.0)


def test_the_optimizer_wrapper_aids_are_the_optimizer_wrappers(one_rank):
    """momentum_correction= and local_trust_ratio= apply to a wrapped Keras optimizer: the tape
    and the V1 wrapper refuse them, saying what to pass; the optimizer refuses the strategy's
    momentum= (it moves the wrapped optimizer's own)."""
    with pytest.raises(TypeError, match="momentum_correction= is an option of hvdx.DistributedOptimizer.*momentum=m"):
        hvdx.DistributedGradientTape(tf.GradientTape(), communication="hitopk", momentum_correction=True)
    with pytest.raises(TypeError, match="local_trust_ratio= is an option of hvdx.DistributedOptimizer"):
        DistributedOptimizerV1(tf.compat.v1.train.GradientDescentOptimizer(0.1), communication="hitopk",
                               local_trust_ratio=True)
    with pytest.raises(ValueError, match="takes momentum_correction=True, not momentum="):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), communication="hitopk", momentum=0.9)
    # False asks for nothing, so it goes with any strategy, and is kept for a later switch
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), communication="allreduce",
                                    momentum_correction=False, local_trust_ratio=False)
    opt.set_communication("hitopk")
    assert opt.communication.momentum == 0 and not opt.local_trust_ratio
    # options other than hvdx's DGC aids reach the strategy by name too
    shm = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="2dtar", flat_below=0)
    assert shm.communication.flat_below == 0
    assert type(shm).from_config(shm.get_config()).communication.flat_below == 0
