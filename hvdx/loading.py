"""Loading a saved Keras model with hvdx's optimizer (Horovod's `load_model`).

A model saved with an hvdx.DistributedOptimizer loads with `tf.keras.models.load_model`
once hvdx is imported (the optimizer is registered as "hvdx>DistributedOptimizer"), or
with `hvdx.load_model`, which also restores the optimizer's state from a SavedModel (Keras
rebuilds the optimizer of a SavedModel but leaves its state behind, for its own optimizers
too). A model saved with a plain Keras optimizer (e.g. by a Horovod job) loads with
`hvdx.load_model` with that optimizer, its state kept, wrapped in a DistributedOptimizer.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.optimizer import DistributedOptimizer

__all__ = ["load_model"]


def load_model(filepath, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression=hvd.Compression.none,
               legacy_opts: bool = False, **options) -> tf.keras.Model:
    """Horovod's load_model: a saved model whose optimizer is an hvdx.DistributedOptimizer.

    Arguments as Horovod's (`legacy_opts` is accepted for compatibility: both kinds of
    Keras optimizer load); `options` (communication=, density=, ...) configure the
    DistributedOptimizer that wraps a plain saved optimizer (one saved with hvdx keeps its
    own configuration).
    """
    objects: Dict[str, Any] = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects["DistributedOptimizer"] = DistributedOptimizer
    objects.update(custom_objects or {})
    model = tf.keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return model
    variables = os.path.join(str(filepath), "variables", "variables")
    if tf.io.gfile.exists(variables + ".index"):  # a SavedModel: restore the optimizer's state
        optimizer.build(model.trainable_variables)
        tf.train.Checkpoint(model).restore(variables).expect_partial()
    if not isinstance(optimizer, DistributedOptimizer) and not hasattr(optimizer, "inner_optimizer"):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression, **options)
        model.make_train_function(force=True)
    return model
