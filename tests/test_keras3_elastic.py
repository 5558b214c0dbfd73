"""hvdx.elastic's Keras states over a Keras 3 model (hvdx/keras3_elastic.py), on one rank of
the default stack, where `import keras` is Keras 3 and tf_keras (Keras 2) is beside it.

The state's class follows the model given (a Keras 2 model keeps Horovod's Keras 2 path); a
commit saves the model's and the optimizer's variables (hvdx's Keras 3 wrapper: the wrapped
optimizer's) and a restore puts them back bitwise, never hvdx's residuals (per rank, as on the
Keras 2 path); the sync builds an unbuilt optimizer (a process Elastic Horovod added never
trained), never rebuilds a built one, and broadcasts the model's and the optimizer's variables
without the residuals; a reset drops the traced step and the next `fit` traces it again;
Horovod's Keras elastic callbacks commit and count in a Keras 3 `fit`. On 2 nodes x 2 ranks
with tf.keras as Keras 3, through a node that leaves and comes back:
tests/test_elastic.py's `test_a_keras3_model_trains_on_when_a_node_leaves_and_comes_back`.
Skipped where Keras 3 is absent (the tf2.15 stack)."""

import numpy as np
import pytest
import tensorflow as tf

import hvdx
from hvdx import elastic, legacy_keras
from hvdx.variables import tf_variable
from tests import harness
from tests.harness import HAS_KERAS3

pytestmark = harness.KERAS3

if HAS_KERAS3:
    import keras

    from hvdx import keras3_elastic

from tests.test_keras3_optimizer import data, make_model, one_rank  # noqa: E402,F401  (one rank, data, model)


def compiled(optimizer):
    model = make_model()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def wrapped_sgd():
    """hvdx's Keras 3 wrapper with HiTopK below density 1: it keeps residuals."""
    return hvdx.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), communication="hitopk", density=0.25)


def train(model, epochs: int = 1):
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)


def values(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


def assert_bitwise(got, want):
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("name", ["KerasState", "TensorFlowKerasState"])
def test_the_state_follows_the_model_given(one_rank, name):
    cls = getattr(elastic, name)
    model = compiled(keras.optimizers.SGD(0.1))
    state = cls(model, epoch=0)
    assert isinstance(state, cls) and isinstance(state, keras3_elastic.Keras3State) and state.epoch == 0
    assert type(state).__name__ == name and keras3_elastic.keras3_state(cls) is type(state)
    from hvdx.zoo import mlp

    keras2 = mlp(8, (4,), seed=0, keras=legacy_keras.keras2())  # Keras 2: Horovod's path as it was
    keras2.compile(optimizer=legacy_keras.keras2().optimizers.SGD(0.1), loss="mse")
    assert type(cls(keras2, epoch=0)) is cls


@pytest.mark.parametrize("optimizer", ["wrapped", "plain"])
def test_a_restore_puts_back_the_committed_model_and_optimizer_but_never_the_residuals(one_rank, optimizer):
    opt = wrapped_sgd() if optimizer == "wrapped" else keras.optimizers.Adam(0.01)
    model = compiled(opt)
    train(model)
    state = elastic.KerasState(model, batch=0, epoch=0)
    state.epoch, state.batch = 1, 3
    state.commit()
    committed_model, committed_opt = values(model.variables), values(opt.variables)
    residuals = opt.aggregator.residuals if optimizer == "wrapped" else []
    assert len(committed_opt) > 2  # built: its slots are in the commit
    train(model)  # moves every variable, and the residuals
    state.epoch = 2
    moved = values(residuals)
    assert not np.array_equal(values(model.variables)[0], committed_model[0])
    state.restore()
    assert_bitwise(values(model.variables), committed_model)
    assert_bitwise(values(opt.variables), committed_opt)
    assert (state.epoch, state.batch) == (1, 3)
    if optimizer == "wrapped":  # per rank: left as the last step wrote them, as on the Keras 2 path
        assert residuals and any(np.any(m != 0) for m in moved)
        assert_bitwise(values(residuals), moved)
        assert len(state._saved_optimizer_state) == len(opt.inner_optimizer.variables)  # no residual saved


def test_the_sync_builds_an_unbuilt_optimizer_and_broadcasts_no_residual(one_rank, monkeypatch):
    """A process Elastic Horovod added never trained: its sync builds the optimizer first, so
    that it broadcasts as many variables as one that trained; the broadcast is the model's and
    the wrapped optimizer's variables, never hvdx's residuals (per rank)."""
    trained, added = compiled(wrapped_sgd()), compiled(wrapped_sgd())
    train(trained)
    sent = []
    real = keras3_elastic.broadcast_variables
    monkeypatch.setattr(keras3_elastic, "broadcast_variables",
                        lambda variables, root_rank: (sent.append(list(variables)), real(variables, root_rank)))
    for model in (trained, added):
        state = elastic.KerasState(model, epoch=0)
        state.sync()
        state.sync()  # a built optimizer is never built again
    opt = added.optimizer
    assert opt.built and len(opt.variables) == len(trained.optimizer.variables) > 2
    assert [len(s) for s in sent] == [len(trained.variables) + len(trained.optimizer.variables)] * 2 + \
        [len(added.variables) + len(opt.variables)] * 2
    want = [id(tf_variable(v)) for v in list(added.variables) + list(opt.inner_optimizer.variables)]
    assert [id(tf_variable(v)) for v in sent[-1]] == want
    for model, variables in ((trained, sent[0]), (added, sent[-1])):
        residuals = {id(r) for r in model.optimizer.aggregator.residuals}
        assert residuals and not residuals & {id(tf_variable(v)) for v in variables}
    # the sync saved: a restore gives back the synced values
    before = values(added.variables)
    train(added)
    state.restore()
    assert_bitwise(values(added.variables), before)


def test_a_sync_never_builds_a_loss_scale_optimizer_again(one_rank):
    """Keras 3's LossScaleOptimizer makes new variables at every build: the state builds it
    only while unbuilt, so that every sync broadcasts the same variables."""
    model = compiled(keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)))
    state = elastic.TensorFlowKerasState(model, epoch=0)
    state.sync()
    count = len(model.optimizer.variables)
    state.sync()
    train(model)
    state.sync()
    assert len(model.optimizer.variables) == count > 3


def test_a_reset_drops_the_keras3_step_and_the_next_fit_traces_it_again(one_rank):
    model = compiled(wrapped_sgd())
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, validation_data=(x, y), verbose=0)
    assert model.train_function is not None
    model._eval_epoch_iterator = object()  # as a fit interrupted by the reset leaves it
    state = elastic.KerasState(model, epoch=0)
    state.reset()
    assert model.train_function is None and model._eval_epoch_iterator is None
    model.fit(x, y, batch_size=16, epochs=1, validation_data=(x, y), verbose=0)
    assert model.train_function is not None


def test_horovods_elastic_callbacks_commit_and_count_in_a_keras3_fit(one_rank):
    """Horovod's Keras elastic callbacks (tf.keras's classes): Keras 3's `fit` calls
    them by name, a commit after every batch and at every epoch's end, the batch and epoch
    counted in the state (as where tf.keras is Keras 3: the 2x2 elastic test)."""
    model = compiled(wrapped_sgd())
    state = elastic.KerasState(model, batch=0, epoch=0)
    commits = []
    real = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), real())
    callbacks = [elastic.CommitStateCallback(state), elastic.UpdateBatchStateCallback(state),
                 elastic.UpdateEpochStateCallback(state)]
    train(model, epochs=2)  # built and traced before: the callbacks' first fit below
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    # (epoch, batch) at each commit: the batch counted after the commit of its end, the epoch after the epoch's
    assert commits == [(0, 0), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 0), (1, 1), (1, 2), (1, 3)], commits
    assert (state.epoch, state.batch) == (2, 0)
    assert_bitwise(state._saved_model_state, values(model.variables))  # the last commit is the model now
