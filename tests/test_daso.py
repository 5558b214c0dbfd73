"""DASO (coquelin2021, sec. 3): the schedule and plateau units alone, then the whole method
on 2x2 and 3x2 ranks (tests/multirank/check_daso.py) and on the degenerate 2x1 / 1x2."""
from __future__ import annotations

import math

import pytest

from hvdx.plateau import PlateauDetector
from hvdx.daso.schedule import COOLDOWN, CYCLING, WARMUP, Schedule
from tests import harness, suite


# -- plateau detection ------------------------------------------------------------------
def test_plateau_needs_patience_plus_one_epochs_without_relative_improvement():
    detector = PlateauDetector(patience=2, threshold=0.05)
    # 1.0 sets the best; 0.96 is not 5 % better; 0.97, 0.99 neither: the third such epoch is a plateau
    assert [detector.update(x) for x in (1.0, 0.96, 0.97, 0.99)] == [False, False, False, True]
    assert detector.bad_epochs == 0 and detector.best == 1.0  # counting starts again
    assert [detector.update(x) for x in (0.94, 0.93, 0.92, 0.91)] == [False, False, False, True]
    assert detector.best == 0.94


def test_plateau_state_round_trip_and_errors():
    detector = PlateauDetector(patience=1, threshold=0.1)
    detector.update(2.0)
    detector.update(1.9)
    clone = PlateauDetector.from_state(detector.state())
    assert clone == detector and clone.update(1.85) is detector.update(1.85) is True
    assert PlateauDetector.from_state(PlateauDetector().state()).best == math.inf
    with pytest.raises(ValueError, match="patience"):
        PlateauDetector(patience=-1)
    with pytest.raises(ValueError, match="threshold"):
        PlateauDetector(threshold=1.5)
    with pytest.raises(ValueError, match="NaN"):
        PlateauDetector().update(float("nan"))


# -- the schedule -----------------------------------------------------------------------
def run_epoch(schedule: Schedule, steps: int):
    """The actions of one epoch as compact strings, the drain included."""
    trace = []
    for _ in range(steps):
        a = schedule.after_step()
        if a.merge_group is not None:
            trace.append(f"{a.step}:merge g{a.merge_group} S={a.staleness}")
        if a.start_group is not None:
            trace.append(f"{a.step}:start g{a.start_group}")
        if a.blocking_group is not None:
            trace.append(f"{a.step}:block g{a.blocking_group}")
    drained = schedule.drain()
    if drained is not None:
        trace.append(f"drain g{drained.merge_group} S={drained.staleness}")
    return trace


def test_schedule_phases_cycle_and_rotation():
    s = Schedule(total_epochs=4, warmup_epochs=1, cooldown_epochs=1, max_global_skips=4, num_groups=2)
    assert (s.phase, s.B, s.W) == (WARMUP, 4, 1)
    # warm-up: a blocking average after every step, the groups taking turns
    assert run_epoch(s, 3) == ["1:block g0", "2:block g1", "3:block g0"]
    assert s.end_epoch(1.0) == ["phase cycling B=4 W=1"]
    # cycling: start every B steps, merge W steps later with the staleness measured
    assert run_epoch(s, 10) == ["7:start g1", "8:merge g1 S=1", "11:start g0", "12:merge g0 S=1"]
    assert s.end_epoch(0.9) == []
    # an epoch ending with an exchange in flight: the drain merges it, S as measured (here 0)
    assert run_epoch(s, 8) == ["17:start g1", "18:merge g1 S=1", "21:start g0", "drain g0 S=0"]
    assert s.end_epoch(0.8) == ["phase cooldown"]
    assert s.phase == COOLDOWN and run_epoch(s, 2) == ["22:block g1", "23:block g0"]


def test_schedule_plateaus_halve_then_reset():
    s = Schedule(total_epochs=12, warmup_epochs=0, cooldown_epochs=0, max_global_skips=8, num_groups=1,
                 plateau=PlateauDetector(patience=0, threshold=0.0))
    assert (s.phase, s.B, s.W) == (CYCLING, 8, 2)
    trace = []
    for loss in (1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5):
        run_epoch(s, 16)
        trace.append((s.end_epoch(loss), s.B, s.W))
    assert trace == [([], 8, 2),
                     (["plateau", "halve B=4 W=1"], 4, 1),
                     (["plateau", "halve B=2 W=1"], 2, 1),
                     (["plateau", "halve B=1 W=1"], 1, 1),
                     (["plateau", "reset B=8 W=2"], 8, 2),   # B = W = 1 and a plateau: back to the start
                     ([], 8, 2),                              # 0.5 improves
                     (["plateau", "halve B=4 W=1"], 4, 1)]


def test_schedule_W_equal_B_merges_then_starts():
    s = Schedule(total_epochs=3, warmup_epochs=0, cooldown_epochs=0, max_global_skips=1, num_groups=3)
    assert (s.B, s.W) == (1, 1)
    assert run_epoch(s, 3) == ["1:start g0", "2:merge g0 S=1", "2:start g1", "3:merge g1 S=1", "3:start g2",
                               "drain g2 S=0"]


def test_schedule_serialises_mid_cycle_and_continues_identically():
    s = Schedule(total_epochs=6, warmup_epochs=1, cooldown_epochs=1, max_global_skips=4, num_groups=2,
                 plateau=PlateauDetector(patience=0, threshold=0.1))
    run_epoch(s, 5)
    s.end_epoch(2.0)
    for _ in range(4):
        s.after_step()  # the 4th step of this epoch started an exchange: in flight now
    assert s.in_flight
    clone = Schedule.from_json(s.to_json())
    assert clone == s
    for losses in ((1.0,), (1.0,), (1.0,)):
        assert run_epoch(clone, 9) == run_epoch(s, 9)
        assert clone.end_epoch(losses[0]) == s.end_epoch(losses[0])
    assert clone.state() == s.state()


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="total_epochs"):
        Schedule(total_epochs=0)
    with pytest.raises(ValueError, match="max_global_skips"):
        Schedule(total_epochs=3, max_global_skips=0)
    with pytest.raises(ValueError, match="exceed total_epochs"):
        Schedule(total_epochs=3, warmup_epochs=2, cooldown_epochs=2)
    with pytest.raises(ValueError, match="warmup_epochs"):
        Schedule(total_epochs=3, warmup_epochs=1.5)
    s = Schedule(total_epochs=3, warmup_epochs=0, cooldown_epochs=0, max_global_skips=1)
    s.after_step()
    with pytest.raises(RuntimeError, match="drain"):
        s.end_epoch(1.0)


def test_schedule_start_epoch_resumes_a_later_epoch():
    s = Schedule(total_epochs=5, warmup_epochs=1, cooldown_epochs=1, max_global_skips=4)
    s.start_epoch(2)
    assert (s.epoch, s.phase, s.B, s.W) == (2, CYCLING, 4, 1)
    s.start_epoch(4)
    assert s.phase == COOLDOWN and s.blocking


# -- the method on ranks (tests/multirank/check_daso.py) ----------------------------------
TOPOLOGIES = {"2x2": ("blocking", "merge", "checkpoint", "convergence", "mixed", "restore_other_topology"),
              "3x2": ("blocking", "merge", "checkpoint"),
              "2x1": ("blocking", "merge", "errors", "restore_other_topology"),
              "1x2": ("blocking", "merge")}
TIMEOUTS = {"convergence": 400}


def running(check: str):
    """The topologies that run `check` (CHECKS[check] of tests/multirank/check_daso.py)."""
    return suite.runs(*[suite.check(f"daso.{check}", t, timeout=TIMEOUTS.get(check, 300))
                        for t, checks in TOPOLOGIES.items() if check in checks])


@running("blocking")
def test_blocking_float32_every_step_equals_synchronous_horovod(ranks):
    for result in ranks.every():
        exact = result["float32"]
        assert exact["max_error"] < 1e-6 * max(1.0, exact["max_update"]) * 10, exact
        for wire in ("float32", "bfloat16", "float16"):
            assert result[wire]["spread"] == 0.0  # every rank holds the very same parameters
        # 16 bits on the wire round each step's change (bfloat16: 8 significant bits, float16 scaled: 11),
        # not the weights: after 6 steps the parameters stay within a few roundings of the change
        assert result["bfloat16"]["max_error"] < 6 * 2 ** -8 * result["bfloat16"]["max_update"], result["bfloat16"]
        assert result["float16"]["max_error"] < 6 * 2 ** -11 * result["float16"]["max_update"], result["float16"]
        # ... and the float32 master weights are not rounded to bfloat16
        assert result["bfloat16"]["off_bf16_grid"] > 0
        # the groups take turns: the ranks of local rank 0, then 1, ...
        assert exact["groups"] == [i % ranks.per_node for i in range(len(exact["groups"]))]


@running("blocking")
def test_a_dropped_optimizer_closes_its_transport(ranks):
    # three DASO models one after another in one process, in a custom loop that never calls close():
    # collecting each optimizer closes its sockets and threads (a second model leaks nothing)
    for result in ranks.every():
        assert [result[w]["earlier_transports_open"] for w in ("float32", "bfloat16", "float16")] == [0, 0, 0]
        assert result["transports_open_when_dropped"] == 0


@running("blocking")
def test_optimizer_slots_stay_node_local(ranks):
    nodes = ranks.nodes
    for result in ranks.every():
        # parameters are averaged, momenta are not: they differ between nodes, never inside one
        assert (result["float32"]["momentum_spread"] > 0) == (nodes > 1)


@running("merge")
def test_stale_merge_is_eq1_with_measured_staleness_and_rotating_groups(ranks):
    results = ranks.every()
    assert all(r["actions"] == results[0]["actions"] and r["drains"] == results[0]["drains"] for r in results)
    first = results[0]
    for result in results:  # every rank matches a float64 simulation of every rank, step by step
        assert result["max_error"] < 1e-6 * max(1.0, result["scale"]), result
    n = ranks.per_node
    # B = 8, W = 2: starts every 8 steps of an epoch (17 and 13 steps), merged 2 steps later (S = 2) ...
    assert first["actions"] == [["start", 8, 0], ["merge", 10, 0, 2], ["start", 16, 1 % n],
                                ["start", 25, 2 % n], ["merge", 27, 2 % n, 2]]
    # ... or at the end of the epoch, with the staleness measured there
    assert first["drains"] == [["drain", 17, 1 % n, 1]]
    for result in results:  # every drain leaves every rank with bitwise the same parameters
        assert result["drain_spreads"] == [0.0, 0.0]


@running("checkpoint")
def test_checkpoint_in_the_middle_of_a_cycle_continues_identically(ranks):
    for result in ranks.every():
        assert result["in_flight_before_drain"] and result["phase_at_save"] == "cycling"
        assert result["state_restored"] and result["state_continues"]
        assert result["max_difference"] == 0.0


@running("convergence")
def test_converges_on_digits_within_one_point_of_horovod(ranks):
    results = ranks.every()
    accuracy = {m: results[0][m]["accuracy"] for m in ("horovod", "daso")}
    print("digits test accuracy:", accuracy, "DASO events:", results[0]["daso"]["events"])
    assert all(r[m]["accuracy"] == accuracy[m] for r in results for m in accuracy)
    assert accuracy["horovod"] > 0.95
    assert accuracy["daso"] >= accuracy["horovod"] - 0.01
    daso = results[0]["daso"]
    assert daso["starts"] > 0 and daso["blocking"] > 0  # both kinds of synchronisation ran
    assert all(r["daso"]["spread"] == 0.0 for r in results)  # training ends drained
    assert all(r["daso"]["transport_closed_after_fit"] for r in results)  # ... and closes DASO's transport


@running("mixed")
def test_mixed_precision_and_the_keras_format(ranks):
    results = ranks.every()
    nodes = ranks.nodes
    for result in results:
        assert result["finite"] and result["spread"] == 0.0
        assert result["loaded_type"] == "DASO" and result["state_round_trip"] and result["weights_round_trip"]
        # two fits (2 epochs, then the third): each closes its transport at its end, the second opens its own
        assert result["transports"] == {"first_closed": True, "second_closed": True, "new": True, "epochs": 3}
    scales = results[0]["loss_scales"]
    by_node = [scales[i:i + ranks.per_node] for i in range(0, len(scales), ranks.per_node)]
    # the overflowing rank 1 lowered its node's loss scale only: node-local gradient averaging
    assert all(len(set(node)) == 1 for node in by_node) and len({node[0] for node in by_node}) == nodes


@running("errors")
def test_bad_arguments_and_disagreeing_ranks_fail_clearly(ranks):
    for result in ranks.every():
        assert result["total_epochs"].startswith("ValueError: total_epochs must be an int >= 1")
        assert "exceed total_epochs" in result["phases"]
        assert result["skips"].startswith("ValueError: max_global_skips")
        assert result["wire"].startswith("ValueError: blocking_wire_dtype must be one of")
        assert result["optimizer"].startswith("ValueError: hvdx.DistributedOptimizer wraps a Keras optimizer")
        assert result["timeout"].startswith("ValueError: timeout")
        assert result["after_step_first"].startswith("RuntimeError: after_step() comes after")
        assert "compiled with hvdx.DASO" in result["callback_without_daso"]
        assert "steps_per_execution=1" in result["steps_per_execution"]
        assert result["disagree"].startswith("RankMismatchError") and "max_global_skips" in result["disagree"]


@running("errors")
def test_model_fit_without_the_callback_fails_instead_of_training_each_node_alone(ranks):
    for result in ranks.every():
        message = result["fit_without_callback"]
        assert message.startswith("InvalidArgumentError") and "callbacks=[hvdx.daso.DASOCallback()]" in message


@running("errors")
def test_an_optimizer_already_wrapped_for_data_parallelism_is_refused(ranks):
    for result in ranks.every():
        # Horovod's would average every step over all ranks: synchronous training plus DASO's traffic
        for key in ("horovod_keras", "horovod_tf"):
            assert result[key].startswith("ValueError: hvdx.DASO wraps a plain tf.keras optimizer"), result[key]
            assert "Horovod's DistributedOptimizer" in result[key]
        assert result["hvdx"] == "ValueError: the optimizer is already an hvdx.DistributedOptimizer"


@running("restore_other_topology")
def test_a_checkpoint_restores_onto_another_number_of_ranks_per_node(ranks):
    for result in ranks.every():
        # 2x2 -> 2x1 (2 groups saved, 1 now) and 2x1 -> 2x2: the groups are planned for this job's ranks per node
        assert result["groups_after"] == result["from_config_groups"] == ranks.per_node != result["saved_groups"]
        assert result["groups_used"] == list(range(ranks.per_node))  # the rotation covers every group, no other
        assert result["starts"] > 0 and result["merges"] > 0
        assert result["spread"] == 0.0  # trained through merges and blocking averages, drained: identical
        assert result["in_flight_refused"].startswith("ValueError: this DASO checkpoint was saved with a global "
                                                      "exchange in flight") and "drain()" in result["in_flight_refused"]


# -- on Keras 3, one rank (a Keras 3 job on ranks: tests/test_keras3.py, check_keras3_methods `daso`) --------
@pytest.fixture(scope="module")
def keras3_rank():
    import hvdx

    return hvdx.init()


def _keras3_fit(optimizer, epochs: int = 2, callbacks=()):
    """A Keras 3 MLP (the same initial weights every time) trained by `optimizer` on 64 fixed
    samples without shuffling: (its weights, the model)."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 8)).astype(np.float32), np.arange(64) % 3
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.set_weights([np.random.default_rng(1).standard_normal(w.shape).astype(np.float32) * 0.3
                       for w in model.get_weights()])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return [w.copy() for w in model.get_weights()], model


@harness.KERAS3
def test_hvdx_daso_of_a_keras3_optimizer_is_the_keras3_daso_and_on_one_rank_steps_as_the_wrapped_one(keras3_rank):
    import keras
    import numpy as np

    import hvdx
    from hvdx.daso import DASOCallback, DASOMethod

    want, _ = _keras3_fit(keras.optimizers.SGD(0.1, momentum=0.9))
    opt = hvdx.DASO(keras.optimizers.SGD(0.1, momentum=0.9), total_epochs=2)
    got, model = _keras3_fit(opt, callbacks=[DASOCallback()])
    assert type(opt).__module__ == "hvdx.daso.keras3_optimizer" and isinstance(opt, DASOMethod)
    assert isinstance(opt, keras.optimizers.SGD) and model.optimizer is opt
    assert opt.schedule.epoch == 2 and opt.schedule.step == 8 and opt._sync.transport.closed
    for g, w in zip(got, want):  # one node of one rank: nothing to average, DASO's step is the SGD's
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    from hvdx.optimizers.keras3 import LARS  # ... and hvdx's Keras 3 LARS', its norms this rank's own

    want, _ = _keras3_fit(LARS(0.1, momentum=0.9))
    got, _ = _keras3_fit(hvdx.DASO(LARS(0.1, momentum=0.9, parallel="pto"), total_epochs=2), callbacks=[DASOCallback()])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


@harness.KERAS3
def test_keras3_daso_keeps_its_schedule_in_the_config_the_keras_archive_and_checkpoints(keras3_rank, tmp_path):
    import keras
    import tensorflow as tf

    import hvdx
    from hvdx.daso import DASOCallback

    opt = hvdx.DASO(keras.optimizers.SGD(0.1), total_epochs=5, warmup_epochs=1, cooldown_epochs=1, max_global_skips=2)
    _, model = _keras3_fit(opt, epochs=2, callbacks=[DASOCallback()])
    state = opt.schedule.state()
    assert state["epoch"] == 2 and state["syncs"] > 0
    again = type(opt).from_config(opt.get_config())
    assert type(again) is type(opt) and again.schedule.state() == state
    path = str(tmp_path / "daso.keras")
    model.save(path)
    loaded = keras.models.load_model(path).optimizer
    assert type(loaded).__name__ == "DASO" and loaded.schedule.state() == state
    checkpoint = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh = hvdx.DASO(keras.optimizers.SGD(0.1), total_epochs=5, warmup_epochs=1, cooldown_epochs=1,
                      max_global_skips=2)
    tf.train.Checkpoint(optimizer=fresh).restore(checkpoint)
    fresh.start_epoch(2)  # a restored checkpoint brings its schedule with it
    assert fresh.schedule.state() == {**state, "epoch": 2}


@harness.KERAS3
def test_keras3_daso_fails_clearly_without_its_callback_and_for_wrong_optimizers(keras3_rank):
    import keras
    import tensorflow as tf

    import hvdx
    from hvdx.optimizers.keras3 import LARS

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"callbacks=\[hvdx.daso.DASOCallback\(\)\]"):
        _keras3_fit(hvdx.DASO(keras.optimizers.SGD(0.1), total_epochs=2))
    with pytest.raises(ValueError, match="already an hvdx.DistributedOptimizer"):
        hvdx.DASO(hvdx.DistributedOptimizer(keras.optimizers.SGD(0.1)), total_epochs=2)
    with pytest.raises(ValueError, match=r"parallel='slices'.*parallel='pto'"):
        hvdx.DASO(LARS(0.1, parallel="slices"), total_epochs=2)
    with pytest.raises(ValueError, match="total_epochs must be an int >= 1"):
        hvdx.DASO(keras.optimizers.SGD(0.1), total_epochs=0)
