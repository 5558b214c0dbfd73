"""Variables of either Keras as TensorFlow's: the tf.Variable behind a Keras 3 variable.

Keras 3 (tf.keras from TensorFlow 2.16 on, unless TF_USE_LEGACY_KERAS=1: hvdx/legacy_keras.py)
holds a model's and an optimizer's state in `keras.Variable`s. On the TensorFlow backend one
wraps a tf.Variable (its `.value`), which a tf.GradientTape watches, but it has no `ref()`
(what the aggregator keys residuals, fusion groups and local variables by) and Horovod's
`broadcast_variables` cannot assign it (horovod#4290). `tf_variable` gives the tf.Variable
behind it; the aggregator (every variable it is given) and `broadcast_variables` take either.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

import horovod.tensorflow as hvd
import tensorflow as tf

__all__ = ["broadcast_variables", "build_optimizer", "slot_variables", "tf_variable"]


def tf_variable(variable: Any) -> Any:
    """The tf.Variable behind `variable`.

    Returns:
        The tf.Variable a Keras 3 variable holds (`.value`, TensorFlow backend); anything
        else (a tf.Variable, a Keras 2 variable, a tensor, None) as it is.
    """
    if variable is None or hasattr(variable, "ref"):  # tf.Variable, tensors: their own identity
        return variable
    value = getattr(variable, "value", None)
    return value if isinstance(value, tf.Variable) else variable


def build_optimizer(optimizer: Any, variables: Iterable[Any]) -> None:
    """Creates now the state `optimizer` creates at its first update of `variables` (its step
    count, SGD's momentum, Adam's moments): afterwards `optimizer.variables()` lists what it
    lists after training, so that a process that never trained (a worker Elastic Horovod
    added) broadcasts as many optimizer variables as one that did. Idempotent.

    Args:
        optimizer: a Keras 2 legacy (`_create_all_weights`), Keras 2.11+ or Keras 3 (`build`)
            optimizer, or one wrapping it (hvdx's DistributedOptimizer, a LossScaleOptimizer).
        variables: the model variables it updates (`model.trainable_variables`).
    """
    variables = list(variables)
    if hasattr(optimizer, "_create_all_weights"):  # Keras 2 legacy (OptimizerV2)
        optimizer._create_all_weights(variables)
    else:
        optimizer.build(variables)


def slot_variables(optimizer: Any, variable: Any) -> List[Any]:
    """The state `optimizer` keeps for `variable` (SGD's momentum, Adam's two moments, ...).

    Args:
        optimizer: a Keras 2 legacy (`get_slot`), Keras 2.11+ or Keras 3 optimizer, or one
            wrapping it (`inner_optimizer`, e.g. a LossScaleOptimizer).
        variable: one of the model variables it updates.
    Returns:
        The optimizer's variables of `variable`'s shape kept for it alone; [] when it keeps
        none, is not built, or does not update `variable`.
    """
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    if hasattr(optimizer, "get_slot_names"):  # Keras 2's legacy OptimizerV2
        slots = []
        for name in optimizer.get_slot_names():
            try:
                slots.append(optimizer.get_slot(variable, name))
            except KeyError:
                pass
        return slots
    index, count = None, 0
    try:
        if hasattr(optimizer, "_get_variable_index"):  # Keras 3
            index, count = optimizer._get_variable_index(variable), len(optimizer._trainable_variables)
        elif hasattr(optimizer, "_index_dict"):  # Keras 2.11+
            index, count = optimizer._index_dict.get(optimizer._var_key(variable)), len(optimizer._index_dict)
    except (KeyError, AttributeError, ValueError):
        return []
    if index is None:
        return []
    mine = tf_variable(variable)
    slots = []
    for value in list(vars(optimizer).values()):  # its per-variable lists: momentums, _velocities, ...
        if not isinstance(value, (list, tuple)) or len(value) != count:
            continue
        candidate = value[index]
        if (hasattr(candidate, "assign") and tf_variable(candidate) is not mine
                and tuple(candidate.shape) == tuple(variable.shape)
                and not any(tf_variable(v) is mine for v in value)):  # not the list of model variables
            slots.append(candidate)
    return slots


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0,
                        process_set: Optional[hvd.ProcessSet] = None) -> None:
    """Horovod's `broadcast_variables` for variables of either Keras: every rank's
    `variables` take root_rank's values (collective: every rank of `process_set` calls it
    with the same variables, in the same order).

    Args:
        variables: tf.Variables or Keras variables (of Keras 3 too: a model's
            `model.variables`, a built optimizer's `optimizer.variables`).
        root_rank: the rank whose values every rank takes.
        process_set: Horovod's process set (None: every rank).
    """
    hvd.broadcast_variables([tf_variable(v) for v in variables], root_rank,
                            process_set=process_set if process_set is not None else hvd.global_process_set)
