"""hvdx.phases: progressive resizing's phases (shi2021 sec. 5.6, Table 4) and the learning
rate over phases of different steps per epoch."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx.phases import Phase, PhaseSchedule, first_step, parse_phases, phase_at, phase_start, total_epochs
from tests import harness

PAPER = "13x96@256, 11x128@256,3x224@256,1x288@128"


def test_phases_parse_as_epochs_resolution_and_batch():
    assert parse_phases(PAPER) == [Phase(13, 96, 256), Phase(11, 128, 256), Phase(3, 224, 256), Phase(1, 288, 128)]
    assert [str(p) for p in parse_phases(PAPER)] == ["13x96@256", "11x128@256", "3x224@256", "1x288@128"]


@pytest.mark.parametrize("spec", ["", "13x96", "13x96@0", "x96@256", "13x96@256;1x288@128", "0x96@256"])
def test_bad_phases_are_refused_with_the_format(spec):
    with pytest.raises(ValueError, match="EPOCHSxRESOLUTION@BATCH"):
        parse_phases(spec)


def test_epochs_map_to_their_phase_and_past_the_last_is_refused():
    phases = parse_phases(PAPER)
    assert total_epochs(phases) == 28
    assert [phase_start(phases, i) for i in range(4)] == [0, 13, 24, 27]
    assert phase_at(phases, 0) == (0, phases[0]) and phase_at(phases, 12) == (0, phases[0])
    assert phase_at(phases, 13) == (1, phases[1]) and phase_at(phases, 27) == (3, phases[3])
    with pytest.raises(ValueError, match="past the last phase"):
        phase_at(phases, 28)


def test_first_step_counts_the_steps_of_every_epoch_before():
    """A run resumed at epoch e starts its step counter (and the schedule) at the steps of
    the epochs before e, phase by phase."""
    phases = parse_phases("2x8@4,1x12@2")
    steps = [10, 20]
    assert [first_step(phases, steps, e) for e in range(4)] == [0, 10, 20, 40]


def test_schedule_warms_up_then_decays_over_phases_of_different_steps():
    """Two phases of 10 and 20 steps per epoch (the second halves the batch): warm-up from
    0.1 x peak to the peak over W = 1 epoch, then ((T - e) / (T - W))^2, halved in phase 2."""
    schedule = PhaseSchedule(peak=4.0, warmup_epochs=1.0, total_epochs=3, power=2.0,
                             steps_per_epoch=[10, 20], epochs=[2, 1], batch_scale=[1.0, 0.5])
    lr = lambda step: float(schedule(step))  # noqa: E731
    assert lr(0) == pytest.approx(0.4)
    assert lr(5) == pytest.approx(4.0 * (0.1 + 0.9 * 0.5))
    assert lr(10) == pytest.approx(4.0)                               # epoch 1: the peak
    assert lr(15) == pytest.approx(4.0 * (1.5 / 2) ** 2)              # epoch 1.5
    assert lr(20) == pytest.approx(0.5 * 4.0 * (1.0 / 2) ** 2)        # epoch 2, phase 2: batch halved
    assert lr(30) == pytest.approx(0.5 * 4.0 * (0.5 / 2) ** 2)        # 10 of phase 2's 20 steps: epoch 2.5
    assert float(schedule.epoch(40)) == 3.0 and lr(40) == 0.0
    assert PhaseSchedule.from_config(schedule.get_config()).get_config() == schedule.get_config()
    over = PhaseSchedule.over(parse_phases("2x8@4,1x12@2"), [10, 20], peak=4.0, warmup_epochs=1.0, power=2.0)
    assert over.get_config() == schedule.get_config()                 # the same schedule, from the phases


def test_schedule_deserializes_by_its_registered_name():
    """Registered as "hvdx>PhaseSchedule" in tf.keras' Keras."""
    schedule = PhaseSchedule(1.0, 0.5, 2, 2.0, [3], [2], [1.0])
    config = tf.keras.optimizers.schedules.serialize(schedule)
    assert tf.keras.utils.get_registered_name(PhaseSchedule) == "hvdx>PhaseSchedule"
    assert isinstance(tf.keras.optimizers.schedules.deserialize(config), PhaseSchedule)


@harness.KERAS3
def test_a_keras3_optimizer_steps_through_the_same_schedule():
    """One rule, a schedule class per Keras: Keras 3's SGD reads the same rates at its steps
    as Keras 2's schedule gives, and the Keras 3 class goes through Keras 3's config."""
    import keras

    from hvdx import legacy_keras
    from hvdx.phases import schedule_class
    ours, theirs = schedule_class(keras), schedule_class(legacy_keras.keras2())
    assert issubclass(ours, keras.optimizers.schedules.LearningRateSchedule) and ours is not theirs
    args = (4.0, 1.0, 3, 2.0, [10, 20], [2, 1], [1.0, 0.5])
    keras3, keras2 = ours(*args), theirs(*args)
    variable = keras.Variable(np.zeros(2, np.float32))
    sgd = keras.optimizers.SGD(keras3)
    for step in range(40):
        np.testing.assert_allclose(float(sgd.learning_rate), float(keras2(step)), rtol=1e-6)
        sgd.apply_gradients([(np.ones(2, np.float32), variable)])
    again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(keras3))
    assert type(again) is ours and again.get_config() == keras2.get_config()
