"""Adding a compressor touches its module and its test only. This file is both: it defines a
new lossy strategy (random-k sparsification with error feedback) with an option of its own,
`ratio=`, and defaults of its own, registers it with `hvdx.comm.register`, and uses it by
name through hvdx's optimizer and tape. No hvdx module names it: the wrappers hand its
option to the registry as one mapping (`hvdx.comm.choice`), which validates it, and the
strategy decides its own defaults for the wrapped optimizer (`Strategy.defaults_for`)."""
import json

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx import comm


@comm.register("test_randomk")
class RandomK(comm.Strategy):
    """Random-k with error feedback: every rank sends the same k = ratio * d entries of its
    accumulated buffer (drawn from the buffer's step counter, identical on every rank),
    averaged by one allreduce of k values; what was not sent stays in the residual."""

    lossy = True
    options = ("ratio",)
    quiet_defaults = {"ratio": 0.25}
    #: Its own default rule (made up for the test): an adaptive optimizer sends more.
    ADAPTIVE_RATIO = 0.5

    def __init__(self, ratio: float = 0.25, topo=None) -> None:
        super().__init__(topo)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self._memory = comm.ResidualMemory(self.key)

    @classmethod
    def defaults_for(cls, traits, options):
        return {"ratio": cls.ADAPTIVE_RATIO} if traits.adaptive and "ratio" not in options else {}

    @property
    def memory(self):
        return self._memory

    def create_state(self, name, d, shapes=None):
        self._memory.variable(name, d, tf.float32)
        self._memory.counter(name)

    def _aggregate(self, buffer, name, residual_scale=None):
        d = int(buffer.shape[0])
        k = max(1, int(round(self.ratio * d)))
        acc = buffer + self._memory.read(name, d, tf.float32, residual_scale)
        step = self._memory.counter(name)
        chosen = tf.math.top_k(tf.random.stateless_uniform([d], tf.stack([tf.constant(7, tf.int64), step])), k).indices
        mean = hvd.allreduce(tf.gather(acc, chosen), op=hvd.Average, name=f"test.randomk.{name}")
        output = tf.scatter_nd(chosen[:, None], mean, [d])
        residual = tf.tensor_scatter_nd_update(acc, chosen[:, None], tf.zeros([k]))
        updates = self._memory.updates(name, residual, residual_scale) + [(step, step + 1)]
        return comm.Aggregated(output, updates, finite=tf.reduce_all(tf.math.is_finite(mean)))

    def __repr__(self) -> str:
        return f"RandomK(ratio={self.ratio})"


@pytest.fixture(scope="module")
def one_rank():
    return hvdx.init()


def test_the_optimizer_takes_the_new_option_by_name_and_trains(one_rank):
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="test_randomk", ratio=0.5)
    assert isinstance(opt.communication, RandomK) and opt.communication.ratio == 0.5
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(opt, loss="mse")
    history = model.fit(np.ones((16, 4)), np.zeros((16, 2)), batch_size=8, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert opt.aggregator.residuals and all(r.shape[0] == 10 for r in opt.aggregator.residuals)  # 4 x 2 + 2


def test_the_tape_takes_the_new_option_by_name_and_sends_k_entries_with_error_feedback(one_rank):
    """On one rank the average is what this rank sent: k = ratio * d entries of the gradient,
    the rest kept as the residual, so output + residual is the gradient."""
    variable = tf.Variable(tf.zeros([40]))
    target = tf.constant(np.arange(1, 41, dtype=np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variable * target)
    dist = hvdx.DistributedGradientTape(tape, communication="test_randomk", ratio=0.25)
    assert isinstance(dist.aggregator.strategy, RandomK) and dist.aggregator.strategy.ratio == 0.25
    (grad,) = dist.gradient(loss, [variable])
    sent = np.flatnonzero(grad.numpy())
    assert len(sent) == 10
    np.testing.assert_array_equal(grad.numpy()[sent], target.numpy()[sent])
    (residual,) = dist.aggregator.residuals
    np.testing.assert_array_equal(grad.numpy() + residual.numpy(), target.numpy())


def test_the_option_round_trips_through_the_optimizer_config(one_rank):
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="test_randomk", ratio=0.75)
    config = json.loads(json.dumps(opt.get_config()))
    assert config["communication"] == "test_randomk" and config["ratio"] == 0.75
    again = hvdx.DistributedOptimizer.from_config(config)
    assert isinstance(again.communication, RandomK) and repr(again.communication) == repr(opt.communication)
    # a value at its quiet default, which the strategy's config omits, is kept over the
    # default the strategy would decide on reload (Adam's 0.5)
    adam = hvdx.DistributedOptimizer(tf.keras.optimizers.Adam(), communication="test_randomk", ratio=0.25)
    config = json.loads(json.dumps(adam.get_config()))
    assert hvdx.DistributedOptimizer.from_config(config).communication.ratio == 0.25
    saved_default = hvdx.DistributedOptimizer(tf.keras.optimizers.Adam(), communication="test_randomk")
    assert hvdx.DistributedOptimizer.from_config(saved_default.get_config()).communication.ratio == 0.5


def test_the_option_is_rejected_where_it_does_not_apply(one_rank):
    assert comm.registry.takers("ratio") == ["test_randomk"]
    with pytest.raises(ValueError, match=r"'hitopk' does not take ratio .*ratio by \['test_randomk'\]"):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="hitopk", ratio=0.5)
    with pytest.raises(ValueError, match=r"'allreduce' is dense and lossless and does not take ratio"):
        hvdx.DistributedGradientTape(tf.GradientTape(), communication="allreduce", ratio=0.5)
    with pytest.raises(ValueError, match=r"'test_randomk' does not take density .*density by \['hitopk', "):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="test_randomk", density=0.1)
    with pytest.raises(ValueError, match="ratio must be a number in"):
        hvdx.DistributedGradientTape(tf.GradientTape(), communication="test_randomk", ratio=2)
    with pytest.raises(TypeError, match="unexpected option ratioo=: no registered strategy takes it"):
        hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(), communication="test_randomk", ratioo=0.5)


def test_its_own_defaults_apply_for_the_wrapped_optimizer(one_rank):
    def ratio(optimizer, **kwargs):
        return hvdx.DistributedOptimizer(optimizer, communication="test_randomk", **kwargs).communication.ratio

    assert ratio(tf.keras.optimizers.Adam()) == 0.5  # its defaults_for: adaptive
    assert ratio(tf.keras.optimizers.SGD(0.1, momentum=0.9)) == 0.25  # its class default
    assert ratio(tf.keras.optimizers.Adam(), ratio=0.1) == 0.1  # given wins
    tape = hvdx.DistributedGradientTape(tf.GradientTape(), communication="test_randomk")
    assert tape.aggregator.strategy.ratio == 0.25  # the tape wraps no optimizer
    switched = hvdx.DistributedOptimizer(tf.keras.optimizers.Adam(), communication="allreduce")
    switched.set_communication("test_randomk")
    assert switched.communication.ratio == 0.5  # as if it had been the first
    given = hvdx.DistributedOptimizer(tf.keras.optimizers.Adam(), communication=RandomK(ratio=0.2))
    assert given.communication.ratio == 0.2  # an instance: as it is
