"""hvdx.data.batches: resumable training batches, synthetic or from DataCache with seeded
augmentation; hvdx.data.demo: the demo's digits as JPEG class folders that DataCache reads."""
import os

import numpy as np
import tensorflow as tf

import hvdx
from hvdx.data.augment import source_resolution
from hvdx.data.batches import datacache_batches, synthetic_batches, to_model_input
from hvdx.data.demo import write_demo_dataset
from hvdx.data.store import parse_key


def test_random_resized_crop_reads_datacache_at_the_source_resolution_and_resumes(tmp_path):
    """Training batches come from DataCache at crop_source x the phase's resolution and are
    cropped to the phase's; a run resumed at epoch 1 reads and draws what the uninterrupted
    run read and drew in its epoch 1."""
    train, _ = write_demo_dataset(str(tmp_path / "digits"), copies=1, size=16)
    resolution, batch = 8, 64                             # a phase 2x8@64, crop source 1.5, area >= 0.4
    options = dict(seed=0, num_classes=10, train=True, augment="rrc-noflip", crop_area=0.4,
                   source_resolution=source_resolution(resolution, "rrc-noflip", 1.5))
    cache = hvdx.data.DataCache(train, resolution=12, cache_dir=str(tmp_path / "disk"),
                                store_dir=str(tmp_path / "store"), memory_bytes=2**26)
    try:
        steps = cache.steps_per_epoch(batch, drop_remainder=True)
        run = iter(datacache_batches(cache, batch, resolution, first_epoch=0, first_step=0, **options))
        batches = [next(run) for _ in range(steps + 2)]
        x, y = batches[0]
        assert x.shape == (64, 8, 8, 3) and y.shape == (64, 10)
        assert {parse_key(k)[1] for k in cache.store.keys()} == {(12, 12)}   # stored at 1.5 x 8 px
        resumed = iter(datacache_batches(cache, batch, resolution, first_epoch=1, first_step=steps, **options))
        for (xa, ya), (xb, yb) in zip(batches[steps:], [next(resumed) for _ in range(2)]):
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    finally:
        cache.close()


def test_validation_batches_are_the_phase_resolution_unaugmented(tmp_path):
    _, val = write_demo_dataset(str(tmp_path / "digits"), copies=1, size=16)
    cache = hvdx.data.DataCache(val, resolution=12, cache_dir=str(tmp_path / "disk"),
                                store_dir=str(tmp_path / "store"), memory_bytes=2**26, remainder="pad")
    try:
        ds = datacache_batches(cache, 32, 12, first_epoch=0, first_step=0, seed=0, num_classes=10, train=False,
                               augment="rrc", source_resolution=15)
        x, y = next(iter(ds))
        images, labels = next(iter(cache.dataset(32, resolution=12, epochs=None, first_epoch=0)))
        expected_x, expected_y = to_model_input(images, labels, 10)
        assert np.array_equal(x, expected_x) and np.array_equal(y, expected_y)
        assert x.shape == (32, 12, 12, 3) and float(tf.reduce_min(x)) >= -1.0 and float(tf.reduce_max(x)) <= 1.0
    finally:
        cache.close()


def test_synthetic_data_is_a_function_of_step_and_rank():
    first = lambda step, rank: next(iter(synthetic_batches(4, 8, 4, seed=0, first_step=step, rank=rank)))  # noqa
    x, y = first(5, 1)
    assert x.shape == (4, 8, 8, 3) and y.shape == (4, 4)
    assert np.array_equal(x, first(5, 1)[0])          # resuming at step 5 gives step 5's batch
    assert not np.array_equal(x, first(5, 2)[0])      # every rank its own data
    assert not np.array_equal(x, first(6, 1)[0])


def test_demo_data_is_jpeg_class_folders_that_datacache_reads(tmp_path):
    """The demo's data set: scikit-learn's digits as JPEG class folders (train: augmented
    copies; val: held out), decoded by DataCache at a phase's resolution."""
    train, val = write_demo_dataset(str(tmp_path / "digits"), copies=1, size=16)
    assert sorted(os.listdir(train)) == [str(c) for c in range(10)] == sorted(os.listdir(val))
    n_train = sum(len(os.listdir(os.path.join(train, c))) for c in os.listdir(train))
    n_val = sum(len(os.listdir(os.path.join(val, c))) for c in os.listdir(val))
    assert (n_train, n_val) == (1347, 450)  # 75 % / 25 % of the 1797 digits
    assert write_demo_dataset(str(tmp_path / "digits")) == (train, val)  # written once
    cache = hvdx.data.DataCache(train, resolution=12, cache_dir=str(tmp_path / "disk"),
                                store_dir=str(tmp_path / "store"), memory_bytes=2**24)
    try:
        images, labels = next(iter(cache.dataset(32, resolution=12)))
        assert images.shape == (32, 12, 12, 3) and images.dtype == tf.uint8
        assert set(labels.numpy()) <= set(range(10))
    finally:
        cache.close()
