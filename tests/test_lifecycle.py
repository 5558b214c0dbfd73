"""One lifecycle for every training method (hvdx/lifecycle.py) and its one Keras driver
(hvdx/callbacks/method.py), claim by claim.

In process: which classes are methods, where the old names point, the synchronous marker,
the order in which the driver calls the hooks (a recording method), the driver on DASO and
ASSM on one rank, state() round trips, close() twice. On 2x2 Horovod ranks
(tests/multirank/check_daso.py, check_adpsgd.py, check_asynchronous.py): reset() in the middle
of training, then training goes on and every rank ends with the same model.
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from tests import suite

def _data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 64), np.float32)
    return x, (x[:, :10].argmax(1)).astype(np.int64)  # a learnable rule


def _model(seed=0, width=16):
    from hvdx.zoo import mlp

    return mlp(64, (width,), seed=seed)


@pytest.fixture(scope="module")
def one_rank():
    import hvdx
    return hvdx.init()


# -- what is a method, and where the old names point -----------------------------------------------
def test_every_method_is_a_training_method():
    import hvdx
    from hvdx.lifecycle import TrainingMethod

    methods = [hvdx.DASO, hvdx.adpsgd.ADPSGD, hvdx.asynchronous.AsyncMiniBatch, hvdx.asynchronous.ASSM,
               hvdx.asynchronous.PASSM, hvdx.asynchronous.PASSMPlus, hvdx.localsgd.LocalSGD,
               hvdx.streaming_diloco.StreamingDiLoCo]
    assert all(issubclass(m, TrainingMethod) for m in methods)
    # what a driver reads: which methods count steps together, which act after every single step
    assert {m.__name__: m.same_steps_on_every_rank for m in methods} == {
        "DASO": True, "ADPSGD": False, "AsyncMiniBatch": True, "ASSM": True, "PASSM": True, "PASSMPlus": True,
        "LocalSGD": True, "StreamingDiLoCo": True}
    assert [m.__name__ for m in methods if m.replaces_train_step] == ["AsyncMiniBatch", "ASSM", "PASSM",
                                                                        "PASSMPlus"]
    assert not hvdx.adpsgd.ADPSGD.needs_every_step and hvdx.DASO.needs_every_step


def test_each_method_keeps_its_keras_glue_and_the_driver_knows_none():
    """One driver for every method (hvdx.callbacks knows no particular method); each method's
    own callback is a subclass of it in the method's package, reached from the package's face."""
    import hvdx
    import hvdx.adpsgd.keras
    import hvdx.asynchronous.keras
    import hvdx.daso.keras
    import hvdx.keras.callbacks

    assert hvdx.daso.DASOCallback is hvdx.daso.keras.DASOCallback
    assert hvdx.adpsgd.ADPSGDCallback is hvdx.adpsgd.keras.ADPSGDCallback
    assert hvdx.asynchronous.SharedModelCallback is hvdx.asynchronous.keras.SharedModelCallback
    for glue in (hvdx.daso.DASOCallback, hvdx.adpsgd.ADPSGDCallback, hvdx.asynchronous.SharedModelCallback):
        assert issubclass(glue, hvdx.callbacks.TrainingMethodCallback)
    for name in ("DASOCallback", "ADPSGDCallback", "SharedModelCallback"):
        assert not hasattr(hvdx.callbacks, name), name
    # one check_optimizer for every asynchronous method, bound to the method's label
    assert hvdx.adpsgd.ADPSGD.check_optimizer.__func__ is hvdx.asynchronous.ASSM.check_optimizer.__func__ \
        is hvdx.lifecycle.TrainingMethod.check_optimizer.__func__
    for name in ("BroadcastGlobalVariablesCallback", "CommunicationPolicy", "SwitchCommunication",
                 "check_same_steps", "switch"):
        assert getattr(hvdx.callbacks, name) is not None
    # Horovod's namespace holds tf.keras's callback (Keras 3's where tf.keras is Keras 3); hvdx.callbacks'
    # follows the model it is given
    from hvdx import legacy_keras
    from hvdx.keras import keras3_callbacks

    expected = keras3_callbacks if legacy_keras.tf_keras_is_keras3() else hvdx.callbacks
    assert hvdx.keras.callbacks.BroadcastGlobalVariablesCallback is expected.BroadcastGlobalVariablesCallback


def test_a_synchronous_optimizer_is_known_by_its_marker_not_its_name(one_rank):
    import hvdx
    from hvdx import legacy_keras

    tf = types.SimpleNamespace(keras=legacy_keras.keras2())  # a Keras 2 subclass of DASO takes Keras 2's

    class Renamed(hvdx.DASO):  # a subclass of DASO under another name: still synchronous inside the node
        pass

    class DASO(tf.keras.optimizers.SGD):  # a plain optimizer that happens to be called DASO
        pass

    renamed = Renamed(tf.keras.optimizers.SGD(0.1), total_epochs=2)
    scaled = tf.keras.mixed_precision.LossScaleOptimizer(renamed)
    for method in (hvdx.asynchronous.ASSM, hvdx.localsgd.LocalSGD):
        with pytest.raises(ValueError, match="cannot run with the synchronous Renamed"):
            method.check_optimizer(renamed)
        with pytest.raises(ValueError, match="cannot run with the synchronous Renamed"):
            method.check_optimizer(scaled)
        with pytest.raises(ValueError, match="cannot run with the synchronous"):
            method.check_optimizer(hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
        method.check_optimizer(DASO(0.1))  # the name alone says nothing
        method.check_optimizer(tf.keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="^AD-PSGD cannot run"):
        hvdx.adpsgd.ADPSGD.check_optimizer(renamed)
    assert hvdx.wrapped.is_synchronous(renamed) and not hvdx.wrapped.is_synchronous(DASO(0.1))


# -- the driver's order, with a method that records its hooks -----------------------------------------
def _recorder(**attributes):
    from hvdx.lifecycle import TrainingMethod

    class Recorder(TrainingMethod):
        label = "Recorder"
        same_steps_on_every_rank = False

        def __init__(self, fail_at=None, stop_after=None):
            self.calls, self.fail_at, self.stop_after, self.steps = [], fail_at, stop_after, 0

        def _log(self, name, *args):
            self.calls.append((name, *args))
            if name == self.fail_at:
                raise RuntimeError(f"{name} failed")

        def start(self, model, optimizer=None, *, steps_per_epoch=None, epochs=None):
            self._log("start", steps_per_epoch, epochs)
            return self

        def begin_epoch(self, epoch):
            self._log("begin_epoch", epoch)
            return False

        def after_step(self):
            self.steps += 1
            self._log("after_step")

        def end_epoch(self, epoch, logs):
            self._log("end_epoch", epoch, "loss" in logs)

        def before_evaluation(self):
            self._log("before_evaluation")

        def should_stop(self):
            return self.stop_after is not None and self.steps >= self.stop_after

        def finish(self):
            self._log("finish")

        def close(self):
            self._log("close")

        def stats(self):
            return {"steps": self.steps}

    for key, value in attributes.items():
        setattr(Recorder, key, value)
    return Recorder


class _Probe:
    """A callback placed after the driver, recording fit's events into the method's log."""

    def __new__(cls, method):
        import tensorflow as tf

        class Probe(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                method.calls.append(("probe.on_epoch_end", epoch))

            def on_test_begin(self, logs=None):
                method.calls.append(("probe.on_test_begin",))
        return Probe()


def test_the_driver_calls_the_hooks_in_the_lifecycles_order():
    import tensorflow as tf

    from hvdx.callbacks import TrainingMethodCallback
    method = _recorder()()
    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(64)
    driver = TrainingMethodCallback(method)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, validation_data=(x[:8], y[:8]),
              callbacks=[driver, _Probe(method)])
    expected = [("start", 2, 2)]  # Keras' steps per epoch and epochs
    for e in range(2):
        # the epoch ends after its last batch: before validation, and before the callbacks after the driver
        expected += [("begin_epoch", e), ("after_step",), ("after_step",), ("end_epoch", e, True),
                     ("before_evaluation",), ("probe.on_test_begin",), ("probe.on_epoch_end", e)]
    expected += [("finish",), ("close",)]
    assert method.calls == expected
    assert driver.stats == {"steps": 4}


def test_the_driver_ends_epochs_of_unknown_length_at_epoch_end_and_stops_when_asked():
    import tensorflow as tf

    from hvdx.callbacks import TrainingMethodCallback
    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(64)
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).filter(lambda a, b: True)  # length unknown
    method = _recorder()()
    model.fit(unknown, epochs=1, verbose=0, callbacks=[TrainingMethodCallback(method), _Probe(method)])
    names = [c[0] for c in method.calls]
    assert names == ["start", "begin_epoch", "after_step", "after_step", "end_epoch", "probe.on_epoch_end",
                     "finish", "close"]
    # should_stop() after the third step ends training in the middle of the second epoch: that epoch is
    # not ended (finish() is the collective that follows), the first one was
    method = _recorder()(stop_after=3)  # 2 steps per epoch
    model.fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[TrainingMethodCallback(method)])
    names = [c[0] for c in method.calls]
    assert names == ["start", "begin_epoch", "after_step", "after_step", "end_epoch", "begin_epoch", "after_step",
                     "finish", "close"]


def test_the_driver_closes_the_method_when_a_hook_fails_and_checks_steps_per_execution():
    import tensorflow as tf

    from hvdx.callbacks import TrainingMethodCallback
    x, y = _data(64)
    for hook in ("start", "after_step", "end_epoch", "finish"):
        method = _recorder()(fail_at=hook)
        model = _model()
        model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with pytest.raises(RuntimeError, match=f"{hook} failed"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[TrainingMethodCallback(method)])
        assert method.calls[-1] == ("close",), (hook, method.calls)
    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=2)
    with pytest.raises(ValueError, match="Recorder acts between steps: compile the model with steps_per_execution=1"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[TrainingMethodCallback(_recorder()())])
    lenient = _recorder(needs_every_step=False)()  # a method whose step takes whatever happened since the last
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[TrainingMethodCallback(lenient)])
    assert [c[0] for c in lenient.calls].count("after_step") == 2  # once per execution of 2 steps
    with pytest.raises(TypeError, match="drives an hvdx.lifecycle.TrainingMethod"):
        TrainingMethodCallback(tf.keras.optimizers.SGD(0.1))


def test_a_membership_change_closes_and_resets_the_methods_a_fit_left_running():
    """Elastic Horovod interrupts `fit` from inside a step or another callback (a failed
    collective, a host change): the driver's hooks see no error, the method stays running;
    the elastic reset (`hvdx.lifecycle.reset_running`) closes and resets it, and a method
    whose fit ended normally is not touched."""
    import tensorflow as tf

    from hvdx.callbacks import TrainingMethodCallback
    from hvdx.lifecycle import reset_running

    class Interrupt(tf.keras.callbacks.Callback):  # what Horovod's CommitStateCallback raises from
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("hosts updated")

    Recorder = _recorder()

    def reset(self, topology=None):
        self.calls.append(("reset", topology))
    Recorder.reset = reset
    x, y = _data(64)
    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finished, interrupted = Recorder(), Recorder()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[TrainingMethodCallback(finished)])
    with pytest.raises(RuntimeError, match="hosts updated"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                  callbacks=[TrainingMethodCallback(interrupted), Interrupt()])
    assert interrupted.calls[-1] == ("after_step",)  # neither finished nor closed
    topology = object()
    assert reset_running(topology) == ["Recorder"]
    assert interrupted.calls[-2:] == [("close",), ("reset", topology)]
    assert finished.calls[-1] == ("close",)  # its fit closed it: no reset
    assert reset_running(topology) == []  # reset once; the next fit's start() rebuilds it
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[TrainingMethodCallback(interrupted)])
    assert [c[0] for c in interrupted.calls[-2:]] == ["finish", "close"]


# -- the driver on real methods, one rank --------------------------------------------------------------
def test_the_driver_finds_daso_in_the_optimizer_and_drives_it(one_rank):
    import tensorflow as tf

    import hvdx
    from hvdx.callbacks import TrainingMethodCallback
    from hvdx import legacy_keras

    model = _model()
    scaled = tf.keras.mixed_precision.LossScaleOptimizer
    keras3 = legacy_keras.tf_keras_is_keras3()  # Keras 3's loss scaler goes inside hvdx's wrappers, Keras 2's outside
    daso = hvdx.DASO(scaled(tf.keras.optimizers.SGD(0.1)) if keras3 else tf.keras.optimizers.SGD(0.1), total_epochs=3,
                     warmup_epochs=1, cooldown_epochs=1, max_global_skips=2)
    model.compile(daso if keras3 else scaled(daso), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    driver = TrainingMethodCallback()
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[driver])
    assert driver.method is daso
    assert daso.schedule.epoch == 3 and daso.schedule.step == 12 and len(daso.history) == 12
    assert daso._sync.transport.closed                       # finish, then close
    assert history.history["loss"][-1] < history.history["loss"][0]
    # one node: nothing to average across nodes, so no synchronisation was timed
    assert driver.stats == {kind: {"count": 0, "seconds": 0.0}
                            for kind in ("blocking", "start", "merge", "merge_wait", "full", "exchange")}
    daso.close()                                             # idempotent
    daso.finish()                                            # nothing left to drain, no transport reopened
    assert daso._sync.transport.closed
    plain = _model()
    plain.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="without a method needs a model compiled with an optimizer that is"):
        plain.fit(x, y, epochs=1, verbose=0, callbacks=[TrainingMethodCallback()])


def test_the_driver_runs_a_shared_model_method_with_its_own_step(one_rank):
    import tensorflow as tf

    from hvdx.asynchronous import PASSMPlus
    from hvdx.callbacks import TrainingMethodCallback
    method = PASSMPlus([1])              # PASSM, ASSM in epoch 1, PASSM: two phase changes, two new traces
    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    traces = []
    original = method.train_step
    method.train_step = lambda m, data: (traces.append(method.full_step()), original(m, data))[1]
    driver = TrainingMethodCallback(method)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, validation_data=(x, y), callbacks=[driver])
    assert traces == [False, True, False]   # one trace per phase, each of its phase
    assert driver.stats["steps"] == 12 and driver.stats["staleness"]["updates"] == 12
    assert "train_step" not in vars(model) and method.shared is None
    method.close()                          # idempotent after finish
    method.close()


# -- state() and restore() ------------------------------------------------------------------------------
def test_daso_state_round_trips_through_json_and_refuses_an_exchange_in_flight(one_rank):
    import tensorflow as tf

    import hvdx
    opt = hvdx.DASO(tf.keras.optimizers.SGD(0.1), total_epochs=4, warmup_epochs=0, cooldown_epochs=1,
                    max_global_skips=2, plateau_patience=0)
    for loss in (1.0, 1.0):
        for _ in range(3):
            opt.schedule.after_step()
        opt.schedule.drain()
        opt.schedule.end_epoch(loss)
    state = json.loads(json.dumps(opt.state()))
    other = hvdx.DASO(tf.keras.optimizers.SGD(0.1), total_epochs=4, warmup_epochs=0, cooldown_epochs=1,
                      max_global_skips=2, plateau_patience=0)
    other.restore(state)
    assert other.state() == opt.state() and other.schedule == opt.schedule
    assert other._daso_state.numpy().decode() == opt.schedule.to_json()  # the checkpointed copy too
    opt.schedule.after_step()
    opt.schedule.after_step()                                            # B = 2: an exchange starts
    with pytest.raises(ValueError, match="taken with a global exchange in flight"):
        other.restore(opt.state())


def test_shared_model_state_round_trips_and_the_counts_go_on(one_rank):
    import tensorflow as tf

    from hvdx.asynchronous import ASSM
    model = _model()
    method = ASSM().start(model, tf.keras.optimizers.SGD(0.1))
    x, y = _data(32)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
        method.apply_gradients(tape.gradient(loss, method.variables_to_train()))
    method.set_epoch(2)
    method.finish()
    state = json.loads(json.dumps(method.state()))
    assert state == {"epoch": 2, "steps": 3, "averagings": 0}
    again = ASSM()
    again.restore(state)
    again.start(model, tf.keras.optimizers.SGD(0.1))                     # a restored run counts on
    assert again.state() == state
    again.finish()
    fresh = ASSM().start(model)                                          # a new run counts from zero
    assert fresh.state()["steps"] == 0
    fresh.close()
    fresh.close()


# -- reset() on Horovod ranks (tests/multirank/check_*.py "reset") -------------------------------------
@suite.runs(suite.check("daso.reset", "2x2"))
def test_daso_reset_drops_the_exchange_in_flight_and_training_ends_identical(ranks):
    for rank, data in ranks.items():
        assert data["in_flight_at_reset"] and data["pending_after_reset"] is None, (rank, data)
        assert data["old_transport_closed"] and data["new_transport"], (rank, data)
        assert data["groups"] == 2 and data["steps"] == data["expected_steps"], (rank, data)
        assert data["merges_after_reset"] > 0 and data["blocking_after_reset"] > 0, (rank, data)
        assert data["spread_after_start"] == 0.0 and data["final_spread"] == 0.0, (rank, data)
        assert data["closed_twice"], (rank, data)


@suite.runs(suite.check("adpsgd.reset", "2x2"))
def test_adpsgd_reset_reconnects_and_every_rank_ends_with_the_average(ranks):
    for rank, data in ranks.items():
        assert data["final_spread"] == 0.0 and data["spread_after_start"] == 0.0, (rank, data)
        # the counts go on across reset(): one average() before it, the final one after
        assert data["state"]["steps"] == data["steps_run"] and data["state"]["averages"] == 2, (rank, data)
        assert data["restored"] == data["state"], (rank, data)
        assert data["budget_after_reset"] == data["budget_left"], (rank, data)  # the steps already run are spent
        assert data["closed_twice"], (rank, data)


@suite.runs(suite.check("adpsgd.join", "2x2"))
def test_adpsgd_budget_after_a_process_joins_is_what_the_ranks_had_not_run(ranks):
    """A process Elastic Horovod added (a new ADPSGD) starts beside ranks that reset(): one
    collective, one budget: the run's less the steps run, the departed process' as last heard."""
    for rank, data in ranks.items():
        assert len(set(data["budgets"])) == 1, (rank, data)
        assert data["budget_left"] <= data["budget"] <= data["budget_left"] + data["steps"], (rank, data)
    assert [data["joined"] for _, data in sorted(ranks.items())] == [False, False, False, True]


@suite.runs(suite.check("adpsgd.callback_join", "2x2"))
def test_adpsgd_callback_goes_on_with_the_budget_left_when_a_process_joins(ranks):
    """ADPSGDCallback's next fit after a membership change: the ranks going on keep their
    reset ADPSGD, the added process makes its first; one name, one budget: the run's less
    the steps of the first fit; every rank ends with the average model."""
    for rank, data in ranks.items():
        assert len(set(data["names"])) == 1, (rank, data)
        assert data["budget"] == data["first_budget"] - data["ran"], (rank, data)
        assert data["spread"] == 0.0, (rank, data)


@suite.runs(suite.check("asynchronous.reset", "2x2"))
def test_shared_model_reset_makes_new_segments_and_every_rank_ends_with_one_model(ranks):
    for rank, data in ranks.items():
        assert data["final_spread"] == 0.0 and data["spread_after_start"] == 0.0, (rank, data)
        assert data["new_segment"] and data["segments_left"] == [], (rank, data)
        assert data["steps"] == data["expected_steps"], (rank, data)   # the counts go on across reset
        assert data["staleness_updates"] == data["expected_steps"], (rank, data)
