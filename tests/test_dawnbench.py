"""The DAWNBench recipe, examples/dawnbench.py (shi2021 sec. 5.6, Table 4): its pure parts in
one process (phases, presets, the learning-rate schedule, seeded augmentation and data,
random-resized crop from DataCache, the demo's JPEG folders read by DataCache, scaling
efficiency); on 2 nodes x 2 ranks (tests/multirank/check_dawnbench.py in the suite's 2x2
launch) the smoke run, the HiTopK -> 2DTAR switch at the configured epoch, resolution and
batch per phase, resume from a mid-run checkpoint, and Table 4's SE per phase."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import suite
from tests.multirank.check_dawnbench import load_script

dawnbench = load_script()


# -- phases and presets ----------------------------------------------------------------------

def test_phases_parse_as_epochs_resolution_and_batch():
    assert dawnbench.parse_phases("13x96@256, 11x128@256,3x224@256,1x288@128") == [
        dawnbench.Phase(13, 96, 256), dawnbench.Phase(11, 128, 256), dawnbench.Phase(3, 224, 256),
        dawnbench.Phase(1, 288, 128)]


@pytest.mark.parametrize("spec", ["", "13x96", "13x96@0", "x96@256", "13x96@256;1x288@128", "0x96@256"])
def test_bad_phases_are_refused_with_the_format(spec):
    with pytest.raises(ValueError, match="EPOCHSxRESOLUTION@BATCH"):
        dawnbench.parse_phases(spec)


def test_imagenet_preset_is_the_papers_recipe():
    """shi2021 Table 4: 13 epochs at 96 px, 11 at 128, 3 at 224 (local batch 256), 1 at 288
    (batch 128); HiTopK for the first 13 epochs, then 2DTAR; target 93 % top-5."""
    config = dawnbench.make_config(["--preset", "imagenet"])
    assert [str(p) for p in config.phases] == ["13x96@256", "11x128@256", "3x224@256", "1x288@128"]
    assert config.total_epochs == 28
    assert [config.communication_at(e) for e in (0, 12, 13, 27)] == ["hitopk", "hitopk", "hierarchical",
                                                                       "hierarchical"]
    assert config.target == ("val_top5", 0.93) and config.model == "resnet50" and config.num_classes == 1000
    assert config.phase_at(12) == (0, config.phases[0]) and config.phase_at(13) == (1, config.phases[1])
    assert config.phase_at(27) == (3, config.phases[3])
    with pytest.raises(ValueError, match="past the last phase"):
        config.phase_at(28)


def test_flags_override_the_preset():
    config = dawnbench.make_config(["--preset", "demo", "--phases", "2x16@8,1x24@4", "--switch-epoch", "1",
                                    "--lr", "3", "--synthetic", "--out", "/tmp/x"])
    assert [str(p) for p in config.phases] == ["2x16@8", "1x24@4"]
    assert (config.switch_epoch, config.lr, config.synthetic, config.out) == (1, 3.0, True, "/tmp/x")
    assert config.demo_data and config.num_classes == 10  # the rest stays the preset's
    with pytest.raises(ValueError, match="switch-epoch"):
        dawnbench.make_config(["--preset", "demo", "--switch-epoch", "99"])


def test_default_output_is_outside_the_checkout():
    config = dawnbench.make_config(["--preset", "demo"])
    assert config.out == os.path.join(os.path.expanduser("~"), ".cache", "hvdx", "dawnbench", "demo")


# -- the learning rate -------------------------------------------------------------------------

def test_schedule_warms_up_then_decays_over_phases_of_different_steps():
    """Two phases of 10 and 20 steps per epoch (the second halves the batch): warm-up from
    0.1 x peak to the peak over W = 1 epoch, then ((T - e) / (T - W))^2, halved in phase 2."""
    schedule = dawnbench.PhaseSchedule(peak=4.0, warmup_epochs=1.0, total_epochs=3, power=2.0,
                                       steps_per_epoch=[10, 20], epochs=[2, 1], batch_scale=[1.0, 0.5])
    lr = lambda step: float(schedule(step))  # noqa: E731
    assert lr(0) == pytest.approx(0.4)
    assert lr(5) == pytest.approx(4.0 * (0.1 + 0.9 * 0.5))
    assert lr(10) == pytest.approx(4.0)                               # epoch 1: the peak
    assert lr(15) == pytest.approx(4.0 * (1.5 / 2) ** 2)              # epoch 1.5
    assert lr(20) == pytest.approx(0.5 * 4.0 * (1.0 / 2) ** 2)        # epoch 2, phase 2: batch halved
    assert lr(30) == pytest.approx(0.5 * 4.0 * (0.5 / 2) ** 2)        # 10 of phase 2's 20 steps: epoch 2.5
    assert float(schedule.epoch(40)) == 3.0 and lr(40) == 0.0
    assert dawnbench.PhaseSchedule.from_config(schedule.get_config()).get_config() == schedule.get_config()


# -- data ---------------------------------------------------------------------------------------

def test_augmentation_is_a_function_of_its_seeds():
    """A resumed run draws the same crops and flips: per sample, stateless, seeded."""
    images = tf.constant(np.random.default_rng(0).integers(0, 255, [6, 16, 16, 3]), tf.uint8)
    seeds = tf.constant([[s, 7] for s in range(6)], tf.int64)
    a = dawnbench.augment_batch(images, seeds, "flip")
    assert np.array_equal(a, dawnbench.augment_batch(images, seeds, "flip"))
    assert a.shape == images.shape and a.dtype == tf.uint8
    assert not np.array_equal(a, dawnbench.augment_batch(images, seeds + 1, "flip"))
    assert np.array_equal(dawnbench.augment_batch(images, seeds, "none"), images)


def ramps(batch: int, size: int) -> tf.Tensor:
    """Images whose channel 0 is x / (size - 1) * 255 and channel 1 is y / (size - 1) * 255: a
    crop's extent in x and y can be read off its pixels."""
    ramp = np.linspace(0.0, 255.0, size)
    image = np.stack([np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size)), np.zeros((size, size))], -1)
    return tf.constant(np.repeat(image[None], batch, 0).astype(np.uint8))


def test_random_resized_crop_takes_a_seeded_box_of_at_least_the_minimum_area():
    """ImageNet's augmentation: a box of area fraction in [min_area, 1] and aspect ratio in
    [3/4, 4/3] of the (larger, cached) image, resized to the phase's resolution; a function
    of its seeds (a resumed run draws the same crops)."""
    images, seeds = ramps(64, 41), tf.constant([[s, 3] for s in range(64)], tf.int64)
    out = dawnbench.random_resized_crop(images, seeds, 24, min_area=0.3, flip=False)
    assert out.shape == (64, 24, 24, 3) and out.dtype == tf.uint8
    assert np.array_equal(out, dawnbench.random_resized_crop(images, seeds, 24, min_area=0.3, flip=False))
    assert not np.array_equal(out, dawnbench.random_resized_crop(images, seeds + 1, 24, min_area=0.3, flip=False))
    x = out.numpy().astype(float)
    width = (x[:, 0, -1, 0] - x[:, 0, 0, 0]) / 255    # the box's sides, as fractions of the image's
    height = (x[:, -1, 0, 1] - x[:, 0, 0, 1]) / 255
    area = width * height
    assert np.all(area >= 0.3 - 0.02) and np.all(area <= 1.0 + 1e-6)
    assert area.min() < 0.6 < area.max()              # areas spread over the range
    unclipped = (width < 0.98) & (height < 0.98)
    ratio = width[unclipped] / height[unclipped]
    assert np.all(ratio >= 0.75 - 0.03) and np.all(ratio <= 4 / 3 + 0.03)


def test_random_resized_crop_mirrors_about_half_the_samples():
    images, seeds = ramps(64, 32), tf.constant([[s, 5] for s in range(64)], tf.int64)
    x = dawnbench.augment_batch(images, seeds, "rrc", 16, 0.5).numpy().astype(int)
    mirrored = x[:, 0, 0, 0] > x[:, 0, -1, 0]          # the x ramp runs right to left
    assert 16 < mirrored.sum() < 48
    assert not (dawnbench.augment_batch(images, seeds, "rrc-noflip", 16, 0.5).numpy()[:, 0, 0, 0] >
                dawnbench.augment_batch(images, seeds, "rrc-noflip", 16, 0.5).numpy()[:, 0, -1, 0]).any()


def test_imagenet_preset_crops_from_a_cache_larger_than_the_phase():
    config = dawnbench.make_config(["--preset", "imagenet"])
    assert config.augment == "rrc" and config.crop_area == 0.08
    assert [config.source_resolution(p) for p in config.phases] == [120, 160, 280, 360]  # 1.25 x
    demo = dawnbench.make_config(["--preset", "demo"])   # digits: no mirror, at least half the image
    assert (demo.augment, demo.crop_area, demo.source_resolution(dawnbench.Phase(1, 24, 8))) == ("rrc-noflip", 0.5, 30)
    assert dawnbench.make_config(["--preset", "demo", "--augment", "shift"]).source_resolution(
        dawnbench.Phase(1, 24, 8)) == 24                 # pad-and-crop reads the phase's resolution
    with pytest.raises(ValueError, match="crop-source"):
        dawnbench.make_config(["--preset", "imagenet", "--crop-source", "0.5"])


def test_random_resized_crop_reads_datacache_at_the_source_resolution_and_resumes(tmp_path):
    """Training batches come from DataCache at crop_source x the phase's resolution and are
    cropped to the phase's; a run resumed at epoch 1 reads and draws what the uninterrupted
    run read and drew in its epoch 1."""
    import hvdx
    from hvdx.data.store import parse_key

    train, _ = dawnbench.write_demo_dataset(str(tmp_path / "digits"), copies=1, size=16)
    config = dawnbench.make_config(["--preset", "demo", "--augment", "rrc-noflip", "--crop-source", "1.5",
                                    "--crop-area", "0.4"])
    phase = dawnbench.Phase(2, 8, 64)
    cache = hvdx.data.DataCache(train, resolution=12, cache_dir=str(tmp_path / "disk"),
                                store_dir=str(tmp_path / "store"), memory_bytes=2**26)
    try:
        steps = cache.steps_per_epoch(phase.batch_size, drop_remainder=True)
        run = iter(dawnbench.datacache_batches(cache, config, phase, 0, 0, train=True))
        batches = [next(run) for _ in range(steps + 2)]
        x, y = batches[0]
        assert x.shape == (64, 8, 8, 3) and y.shape == (64, 10)
        assert {parse_key(k)[1] for k in cache.store.keys()} == {(12, 12)}   # stored at 1.5 x 8 px
        resumed = iter(dawnbench.datacache_batches(cache, config, phase, 1, steps, train=True))
        for (xa, ya), (xb, yb) in zip(batches[steps:], [next(resumed) for _ in range(2)]):
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    finally:
        cache.close()


def test_synthetic_data_is_a_function_of_step_and_rank():
    config = dawnbench.make_config(["--preset", "smoke"])
    phase = dawnbench.Phase(1, 8, 4)
    first = lambda step, rank: next(iter(dawnbench.synthetic_batches(config, phase, step, rank, 0)))  # noqa: E731
    x, y = first(5, 1)
    assert x.shape == (4, 8, 8, 3) and y.shape == (4, config.num_classes)
    assert np.array_equal(x, first(5, 1)[0])          # resuming at step 5 gives step 5's batch
    assert not np.array_equal(x, first(5, 2)[0])      # every rank its own data
    assert not np.array_equal(x, first(6, 1)[0])


def test_demo_data_is_jpeg_class_folders_that_datacache_reads(tmp_path):
    """The demo's data set: scikit-learn's digits as JPEG class folders (train: augmented
    copies; val: held out), decoded by DataCache at a phase's resolution."""
    import hvdx

    train, val = dawnbench.write_demo_dataset(str(tmp_path / "digits"), copies=1, size=16)
    assert sorted(os.listdir(train)) == [str(c) for c in range(10)] == sorted(os.listdir(val))
    n_train = sum(len(os.listdir(os.path.join(train, c))) for c in os.listdir(train))
    n_val = sum(len(os.listdir(os.path.join(val, c))) for c in os.listdir(val))
    assert (n_train, n_val) == (1347, 450)  # 75 % / 25 % of the 1797 digits
    assert dawnbench.write_demo_dataset(str(tmp_path / "digits")) == (train, val)  # written once
    cache = hvdx.data.DataCache(train, resolution=12, cache_dir=str(tmp_path / "disk"),
                                store_dir=str(tmp_path / "store"), memory_bytes=2**24)
    try:
        images, labels = next(iter(cache.dataset(32, resolution=12)))
        assert images.shape == (32, 12, 12, 3) and images.dtype == tf.uint8
        assert set(labels.numpy()) <= set(range(10))
    finally:
        cache.close()


# -- scaling efficiency (Table 4) ---------------------------------------------------------------

def test_scaling_efficiency_is_throughput_over_ranks_times_one_ranks():
    """Table 4's SE: samples/s on P ranks / (P x samples/s of one rank), per phase; phases
    the 1-rank figures do not cover get none."""
    phases = [{"phase": "3x24@32", "samples_per_s": 300.0}, {"phase": "1x40@16", "samples_per_s": 90.0}]
    dawnbench.scaling_efficiency(phases, 4, {"3x24@32": 100.0}, "test")
    assert phases[0]["scaling_efficiency"] == pytest.approx(0.75) and phases[0]["single_samples_per_s"] == 100.0
    assert "scaling_efficiency" not in phases[1]


def test_baseline_json_is_a_one_rank_runs_summary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"ranks": 1, "phases": [{"phase": "3x24@32", "samples_per_s": 120.0}]}))
    assert dawnbench.load_baseline(str(path)) == {"3x24@32": 120.0}
    path.write_text(json.dumps({"ranks": 4, "phases": []}))
    with pytest.raises(ValueError, match="1-rank run"):
        dawnbench.load_baseline(str(path))
    config = dawnbench.make_config(["--preset", "demo", "--baseline-json", str(path), "--se-steps", "0"])
    assert config.baseline_json == str(path) and config.se_steps == 0


# -- 2 nodes x 2 ranks (tests/multirank/check_dawnbench.py) --------------------------------

@suite.runs(suite.check("dawnbench.resume", "2x2", timeout=400))
def test_recipe_switches_resizes_and_resumes_exactly_on_2x2(ranks):
    print(json.dumps(ranks[0], indent=1))
    for rank, data in ranks.items():
        expected = [  # smoke: phases 2x8@4, 1x12@2, switch at epoch 2
            {"epoch": 0, "phase": 0, "resolution": 8, "batch_size": 4, "communication": "HiTopK", "steps": 2},
            {"epoch": 1, "phase": 0, "resolution": 8, "batch_size": 4, "communication": "HiTopK", "steps": 2},
            {"epoch": 2, "phase": 1, "resolution": 12, "batch_size": 2, "communication": "Hierarchical",
             "steps": 2}]
        assert data["full"] == expected, rank
        assert data["stopped"] == expected[:1], rank     # pre-empted after epoch 1
        assert data["resumed"] == expected, rank         # the resumed run's history continues the first's
        # the checkpoint carried HiTopK's error-feedback residuals (non-zero: they matter) ...
        assert data["residuals_at_checkpoint"] and all(v > 0 for v in data["residuals_at_checkpoint"].values())
        # ... and the resumed run's checkpoint after the last HiTopK epoch (one it trained after the
        # resume) is the uninterrupted run's, bit for bit: weights, LARS' momenta, residuals, steps
        assert data["checkpoint_differences"] == [], f"rank {rank}: {data['checkpoint_differences']}"
        # After the switch to 2DTAR the weights agree to rounding: Horovod's fused allreduce over the
        # 4 ranks (its flat path for small buckets) sums in an order that depends on what its cycle
        # fused. Rounding is ~1e-9 of the weights; the last epoch moved them by far more than 1e-3,
        # the scale a lost piece of state would show at.
        assert data["weights_relative_difference"] <= 1e-6, (rank, data["weights_relative_difference"])
        assert data["last_epoch_relative_change"] > 1e-3, (rank, data["last_epoch_relative_change"])
    # Table 4's SE per phase: the run's samples/s over 4 x one rank's, timed on every rank alone
    for p in ranks[0]["phases"]:
        assert p["single_samples_per_s"] > 0
        assert p["scaling_efficiency"] == pytest.approx(p["samples_per_s"] / (4 * p["single_samples_per_s"]))
    # every rank the same trainable weights (batch-norm's moving statistics are each rank's own)
    assert len({d["trainable_norm"] for d in ranks.values()}) == 1
