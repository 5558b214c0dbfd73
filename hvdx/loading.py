"""Loading a saved Keras model with hvdx's optimizer (Horovod's `load_model`), of either Keras.

`load_model(filepath)` follows the file: a `.keras` archive written by Keras 3 (its
metadata.json says so) or an `.h5` file written by Keras 3 loads with Keras 3
(`keras.saving.load_model`); a SavedModel directory, and archives and `.h5` files of Keras 2,
with Keras 2 (`keras2().models.load_model`); a path that says neither, with tf.keras.

A model saved with an hvdx.DistributedOptimizer comes back with it: its config (strategy
pinned) and this rank's residuals (both Keras register the wrapper as
"hvdx>DistributedOptimizer"). Keras 2 leaves a SavedModel's optimizer state behind, for its
own optimizers too: it is restored here from the SavedModel's variables. A model saved with a
plain Keras optimizer (by a Horovod job, or without hvdx) comes back with that optimizer, its
state kept, wrapped in hvdx.DistributedOptimizer with `options`.
"""
from __future__ import annotations

import json
import os
import zipfile
from typing import Any, Dict, Optional, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx import legacy_keras

__all__ = ["load_model", "saved_by_keras3"]


def saved_by_keras3(filepath) -> bool:
    """Whether Keras 3 wrote `filepath`: a `.keras` zip whose metadata.json has a 3.x
    keras_version, or an `.h5` file whose root attribute keras_version is 3.x. A SavedModel
    directory is Keras 2's; any other path follows tf.keras (`tf_keras_is_keras3`).

    Raises:
        ValueError: a path that does not exist, or a `.keras` file that is not a Keras archive.
    """
    path = os.fspath(filepath)
    if not os.path.exists(path):
        raise ValueError(f"hvdx.load_model: no file or directory {path!r}")
    if os.path.isdir(path):
        return False
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if "metadata.json" not in archive.namelist():
                raise ValueError(f"hvdx.load_model: {path!r} is a zip without metadata.json, not a .keras archive")
            version = json.loads(archive.read("metadata.json")).get("keras_version", "")
        return str(version).startswith("3.")
    if path.endswith((".h5", ".hdf5")):
        import h5py

        with h5py.File(path, "r") as h5:
            version = h5.attrs.get("keras_version", b"")
        return (version.decode() if isinstance(version, bytes) else str(version)).startswith("3.")
    return legacy_keras.tf_keras_is_keras3()


def load_model(filepath, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression=hvd.Compression.none,
               legacy_opts: bool = False, **options):
    """Horovod's load_model: the saved model, its optimizer an hvdx.DistributedOptimizer.

    Args (Horovod's): filepath; custom_optimizers (classes the file names); custom_objects;
      compression (for the wrapper of a plain saved optimizer); legacy_opts (accepted for
      Horovod's scripts: both kinds of Keras 2 optimizer load). `options` (communication=,
      density=, ...) configure the wrapper of a plain saved optimizer; one saved with hvdx
      keeps its own configuration.

    Returns:
      The Keras 3 or Keras 2 model, as the file was written (`saved_by_keras3`).

    Raises:
      ValueError: as `saved_by_keras3`, and Keras' own errors for a file it cannot read.
    """
    objects: Dict[str, Any] = {cls.__name__: cls for cls in custom_optimizers or ()}
    if saved_by_keras3(filepath):
        import keras

        from hvdx import keras3_optimizer

        objects["DistributedOptimizer"] = keras3_optimizer.DistributedOptimizer
        objects.update(custom_objects or {})
        model = keras.saving.load_model(filepath, custom_objects=objects)
        return _wrapped(model, keras3_optimizer.DistributedOptimizer, compression, options)
    from hvdx.optimizer import DistributedOptimizer

    objects["DistributedOptimizer"] = DistributedOptimizer
    objects.update(custom_objects or {})
    model = legacy_keras.keras2().models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    variables = os.path.join(str(filepath), "variables", "variables")
    if optimizer is not None and tf.io.gfile.exists(variables + ".index"):  # a SavedModel: its optimizer's state
        optimizer.build(model.trainable_variables)
        tf.train.Checkpoint(model).restore(variables).expect_partial()
    return _wrapped(model, DistributedOptimizer, compression, options)


def _wrapped(model, wrapper: type, compression, options: Dict[str, Any]):
    """`model`, its plain optimizer (if any) wrapped in `wrapper` (hvdx.DistributedOptimizer
    of its Keras) with its state kept, and its train function made again for it."""
    from hvdx.wrapped import is_synchronous

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or isinstance(optimizer, wrapper) or is_synchronous(optimizer):
        return model  # hvdx's wrapper (or Horovod's, DASO: they aggregate already)
    from hvdx.optimizer import DistributedOptimizer  # dispatches on the optimizer's Keras

    model.optimizer = DistributedOptimizer(optimizer, compression=compression, **options)
    if hasattr(model, "make_train_function"):
        model.make_train_function(force=True)
    return model
