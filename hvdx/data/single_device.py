"""`map` and `flat_map` whose functions run as single-device functions: a new iterator
instantiates them without a graph optimization pass.

tf.data instantiates a transformation's function once per iterator (Model.fit makes one per
epoch), each iterator on a fresh function library. A multi-device function, tf.data's
default, runs Grappler's meta-optimizer and the graph optimization passes (oneDNN's layout
rewrite among them) at every instantiation (what that costs DataCache's pipeline:
benchmarks/README.md). A function marked `experimental_ints_on_device`
is instantiated by the single-device function library runtime instead, which runs neither
(TensorFlow's own `prefetch_to_device` marks its functions so). On a CPU the attribute
changes nothing else: int32 tensors stay in host memory, which is the device's.

For DataCache's own functions (Python calls, index slicing, `tf.gather`), which have
nothing to optimize. Not for a user's function (augmentation compiled with XLA, arithmetic
Grappler can fold): those keep `Dataset.map`. Built on tf.data's internal dataset classes;
where they are missing (another TensorFlow), plain `Dataset.map` / `flat_map`.
"""
from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

__all__ = ["ATTRIBUTE", "available", "flat_map", "map"]

#: The function attribute that selects the single-device path (tensorflow/core/data/
#: captured_function.cc: FunctionMetadata::Create).
ATTRIBUTE = "experimental_ints_on_device"

try:
    from tensorflow.python.data.ops import dataset_ops, structured_function
    from tensorflow.python.ops import gen_dataset_ops

    _UnaryDataset = dataset_ops.UnaryDataset
    _Wrapper = structured_function.StructuredFunctionWrapper
    # the ops _Mapped makes: a TensorFlow without one of them takes the fallback
    _OPS = (gen_dataset_ops.map_dataset, gen_dataset_ops.parallel_map_dataset_v2, gen_dataset_ops.flat_map_dataset)
except (ImportError, AttributeError):  # pragma: no cover - another TensorFlow's internals
    _UnaryDataset = None


def available() -> bool:
    """Whether this TensorFlow has the internals `map` and `flat_map` build on."""
    return _UnaryDataset is not None


if _UnaryDataset is not None:

    class _Mapped(_UnaryDataset):
        """`input_dataset` mapped (`kind` "map") or flat-mapped ("flat_map") by `fn`, a
        single-device function; "map" with `parallel` calls at once when given."""

        def __init__(self, input_dataset: tf.data.Dataset, fn: Callable, kind: str,
                     parallel: Optional[int] = None) -> None:
            self._input_dataset = input_dataset
            self._name = None  # (read by _common_args)
            self._fn = _Wrapper(fn, f"hvdx.data.single_device.{kind}", dataset=input_dataset,
                                defun_kwargs={ATTRIBUTE: True})
            out = self._fn.output_structure
            if kind == "flat_map":
                if not isinstance(out, dataset_ops.DatasetSpec):
                    raise TypeError(f"flat_map's function must return a tf.data.Dataset, not {out!r}")
                out = out._element_spec  # pylint: disable=protected-access
            self._structure = out
            args = (input_dataset._variant_tensor, self._fn.function.captured_inputs)  # pylint: disable=protected-access
            if kind == "flat_map":
                variant = gen_dataset_ops.flat_map_dataset(*args, f=self._fn.function, **self._common_args)
            elif parallel is None:
                variant = gen_dataset_ops.map_dataset(*args, f=self._fn.function, use_inter_op_parallelism=True,
                                                      preserve_cardinality=True, **self._common_args)
            else:
                variant = gen_dataset_ops.parallel_map_dataset_v2(
                    *args, f=self._fn.function, num_parallel_calls=tf.constant(parallel, tf.int64),
                    deterministic="true", use_inter_op_parallelism=True, preserve_cardinality=True,
                    **self._common_args)
            super().__init__(input_dataset, variant)

        def _functions(self):
            return [self._fn]

        @property
        def element_spec(self):
            return self._structure


def map(ds: tf.data.Dataset, fn: Callable, parallel: Optional[int] = None) -> tf.data.Dataset:  # noqa: A001
    """`ds.map(fn)` (in order, `parallel` calls at once when given) with `fn` a single-device
    function; `ds.map` itself where this TensorFlow lacks the internals."""
    if _UnaryDataset is None:
        return ds.map(fn) if parallel is None else ds.map(fn, num_parallel_calls=parallel, deterministic=True)
    return _Mapped(ds, fn, "map", parallel)


def flat_map(ds: tf.data.Dataset, fn: Callable) -> tf.data.Dataset:
    """`ds.flat_map(fn)` with `fn` (returning a tf.data.Dataset) a single-device function;
    `ds.flat_map` itself where this TensorFlow lacks the internals. Raises TypeError if `fn`
    does not return a dataset."""
    if _UnaryDataset is None:
        return ds.flat_map(fn)
    return _Mapped(ds, fn, "flat_map")
