"""hvdx.data.augment: seeded batch augmentation (a resumed run draws what the uninterrupted
run drew), ImageNet's random-resized crop among it, written without the CropAndResize op."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx.data.augment import augment_batch, crop_boxes, random_resized_crop, resize_boxes, source_resolution


def test_augmentation_is_a_function_of_its_seeds():
    """A resumed run draws the same crops and flips: per sample, stateless, seeded."""
    images = tf.constant(np.random.default_rng(0).integers(0, 255, [6, 16, 16, 3]), tf.uint8)
    seeds = tf.constant([[s, 7] for s in range(6)], tf.int64)
    a = augment_batch(images, seeds, "flip")
    assert np.array_equal(a, augment_batch(images, seeds, "flip"))
    assert a.shape == images.shape and a.dtype == tf.uint8
    assert not np.array_equal(a, augment_batch(images, seeds + 1, "flip"))
    assert np.array_equal(augment_batch(images, seeds, "none"), images)
    with pytest.raises(ValueError, match="unknown augmentation 'mirror'"):
        augment_batch(images, seeds, "mirror")
    with pytest.raises(ValueError, match="needs the output size"):
        augment_batch(images, seeds, "rrc")


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
    out = random_resized_crop(images, seeds, 24, min_area=0.3, flip=False)
    assert out.shape == (64, 24, 24, 3) and out.dtype == tf.uint8
    assert np.array_equal(out, random_resized_crop(images, seeds, 24, min_area=0.3, flip=False))
    assert not np.array_equal(out, random_resized_crop(images, seeds + 1, 24, min_area=0.3, flip=False))
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
    x = augment_batch(images, seeds, "rrc", 16, 0.5).numpy().astype(int)
    mirrored = x[:, 0, 0, 0] > x[:, 0, -1, 0]          # the x ramp runs right to left
    assert 16 < mirrored.sum() < 48
    assert not (augment_batch(images, seeds, "rrc-noflip", 16, 0.5).numpy()[:, 0, 0, 0] >
                augment_batch(images, seeds, "rrc-noflip", 16, 0.5).numpy()[:, 0, -1, 0]).any()


@pytest.mark.parametrize("height,width,size", [(41, 41, 24), (12, 12, 8), (50, 40, 1), (20, 30, 32)])
def test_resize_boxes_is_crop_and_resize(height, width, size):
    """The boxes resized bilinearly as tf.image.crop_and_resize resizes them, to float32
    rounding, for boxes whose sample points crop_and_resize places inside the image."""
    images = tf.constant(np.random.default_rng(1).integers(0, 256, [32, height, width, 3]), tf.uint8)
    boxes, _ = crop_boxes(tf.constant([[s, 9] for s in range(32)], tf.int64), 0.3)
    reference = tf.image.crop_and_resize(tf.cast(images, tf.float32), boxes, tf.range(32), [size, size]).numpy()
    inside = ~(reference == 0).all(axis=(2, 3)).any(axis=1)   # no row of crop_and_resize's 0 past an edge
    assert inside.sum() >= 16
    np.testing.assert_allclose(resize_boxes(images, boxes, size).numpy()[inside], reference[inside], atol=1e-3)


def test_a_box_reaching_the_edge_keeps_the_edge_pixels():
    """The whole image resized from 30 to 24 px: crop_and_resize's last sample point is
    29.000002 > 29 after rounding, so it writes a row and a column of zeros (a third of the
    demo's crops had one); resize_boxes takes the image's last row and column."""
    images = tf.constant(np.random.default_rng(2).integers(1, 256, [1, 30, 30, 3]), tf.uint8)
    whole = tf.constant([[0.0, 0.0, 1.0, 1.0]])
    out = resize_boxes(images, whole, 24).numpy()[0]
    assert np.array_equal(out[-1, -1], images.numpy()[0, -1, -1]) and np.array_equal(out[0, 0], images.numpy()[0, 0, 0])
    assert (out > 0).all()


def test_the_crop_traces_no_crop_and_resize_op():
    """TensorFlow's graph optimizer has no cost model for CropAndResize and logs an error for
    it in every tf.data function holding one: the crop is gathers and arithmetic."""
    crop = tf.function(lambda x, s: augment_batch(x, s, "rrc", 16, 0.5))
    graph = crop.get_concrete_function(tf.TensorSpec([None, 20, 20, 3], tf.uint8),
                                       tf.TensorSpec([None, 2], tf.int64)).graph
    ops = {op.type for op in graph.get_operations()}
    for function in graph.as_graph_def().library.function:  # map_fn's loop body
        ops |= {node.op for node in function.node_def}
    assert "CropAndResize" not in ops and "GatherV2" in ops


def test_random_resized_crop_reads_a_larger_source():
    """Random-resized crop reads crop_source x the resolution (rounded); the other kinds the
    resolution itself."""
    assert [source_resolution(r, "rrc", 1.25) for r in (96, 128, 224, 288)] == [120, 160, 280, 360]
    assert source_resolution(24, "rrc-noflip", 1.25) == 30
    assert source_resolution(24, "shift", 1.25) == 24 and source_resolution(24, "rrc", 1.0) == 24
