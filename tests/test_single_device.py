"""hvdx.data.single_device: `map` and `flat_map` whose functions a new iterator instantiates
as single-device functions (no Grappler, no graph optimization passes), element for element
what tf.data's own transformations give; DataCache's pipeline is built of them."""
import numpy as np
import pytest
import tensorflow as tf

from hvdx.data import single_device
from tests.test_datacache import digits_root, make_cache  # noqa: F401 (fixture)


def elements(ds):
    return [tf.nest.map_structure(np.asarray, e) for e in ds.as_numpy_iterator()]


def function_defs(ds):
    """The FunctionDefs of `ds`'s transformations and of their inputs', outermost first."""
    out, todo = [], [ds]
    while todo:
        d = todo.pop()
        out += [f.function.function_def for f in d._functions()]  # pylint: disable=protected-access
        todo += d._inputs()  # pylint: disable=protected-access
    return out


def single(fdef):
    attr = fdef.attr.get(single_device.ATTRIBUTE)
    return attr is not None and attr.b


def test_this_tensorflow_has_what_it_builds_on():
    assert single_device.available(), f"TensorFlow {tf.__version__}: tf.data internals moved; update single_device"


@pytest.mark.parametrize("parallel", [None, 3])
def test_map_gives_what_dataset_map_gives_in_order(parallel):
    ds = tf.data.Dataset.range(20).map(lambda x: (x, tf.strings.as_string(x)))

    def fn(x, s):  # a tuple element is unpacked into arguments, as by Dataset.map
        return {"square": x * x, "text": s}

    ours = single_device.map(ds, fn, parallel)
    assert ours.element_spec == ds.map(fn).element_spec
    assert [(e["square"], e["text"]) for e in elements(ours)] == [(e["square"], e["text"]) for e in elements(ds.map(fn))]
    assert [single(f) for f in function_defs(ours)] == [True, False]  # ours, then the plain map below it


def test_flat_map_gives_what_dataset_flat_map_gives_with_inner_maps_capturing_outer_tensors():
    def fn(n):
        return single_device.map(tf.data.Dataset.range(n), lambda i: tf.fill([2], n * 10 + i))

    ours = single_device.flat_map(tf.data.Dataset.range(4), fn)
    theirs = tf.data.Dataset.range(4).flat_map(lambda n: tf.data.Dataset.range(n).map(lambda i: tf.fill([2], n * 10 + i)))
    assert ours.element_spec == theirs.element_spec
    assert [e.tolist() for e in elements(ours)] == [e.tolist() for e in elements(theirs)]
    assert all(single(f) for f in function_defs(ours))
    assert ours.cardinality() == tf.data.UNKNOWN_CARDINALITY


def test_flat_map_of_something_not_a_dataset_is_a_type_error():
    with pytest.raises(TypeError, match="must return a tf.data.Dataset"):
        single_device.flat_map(tf.data.Dataset.range(3), lambda x: x)


def test_map_errors_reach_the_iterator_like_dataset_map_s():
    ds = single_device.map(tf.data.Dataset.range(3), lambda x: tf.debugging.check_numerics(
        1.0 / tf.cast(2 - x, tf.float32), "one over 2 - x"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="one over 2 - x"):
        elements(ds)


def test_datacache_s_pipeline_functions_are_single_device_and_a_user_s_augmentation_is_not(digits_root, tmp_path):  # noqa: F811
    cache = make_cache(digits_root, tmp_path)
    try:
        ds = cache.dataset(8, augment=lambda x: tf.image.flip_left_right(x))
        # outermost first: the augmentation's map, then DataCache's gather, flat_map and plan
        assert [single(f) for f in function_defs(ds)] == [False, True, True, True]
        assert ds.options().experimental_optimization.apply_default_optimizations is False
        for _ in range(2):  # epoch 1 fills the slab, epoch 2 gathers from it
            assert sum(int(x.shape[0]) for x, _ in ds) == 48
    finally:
        cache.close()
