"""Horovod's TensorFlow API (`horovod.tensorflow`, every public name, re-exported from it)
with hvdx's init, optimizer and tape: a Horovod script switches to hvdx by changing its
import alone,

    import hvdx.tensorflow as hvd     # instead of: import horovod.tensorflow as hvd

`hvd.DistributedGradientTape(tape)` and `hvd.DistributedOptimizer(opt)` then aggregate with
dense averaging (Horovod's), or with the strategy given to them (communication=...) or in
$HVDX_COMMUNICATION. hvdx's own names: elastic (`hvdx.elastic`), init, shutdown (`hvdx.init`: Horovod's plus hvdx's
topology), DistributedOptimizer, DistributedGradientTape, PartialDistributedGradientTape,
PartialDistributedOptimizer, broadcast_variables (`hvdx.broadcast_variables`: Horovod's, for
the variables of either Keras), keras (`hvdx.tensorflow.keras` is `hvdx.keras`).
"""
from typing import Optional as _Optional, Union as _Union

import horovod.tensorflow as _horovod
import tensorflow as _tf

from hvdx import comm as _comm
from hvdx import elastic
from hvdx import optimizer as _keras_optimizer
from hvdx.optimizer import PartialDistributedOptimizer
from hvdx.optimizer_v1 import DistributedOptimizerV1 as _DistributedOptimizerV1
from hvdx.tape import DistributedGradientTape
from hvdx.tensorflow import _horovod_api
from hvdx.topology import init, shutdown
from hvdx.variables import broadcast_variables


def DistributedOptimizer(optimizer, name: _Optional[str] = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression=_horovod.Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op=_horovod.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                         process_set: _horovod.ProcessSet = _horovod.global_process_set,
                         scale_local_gradients: bool = True, *,
                         communication: _Union[str, _comm.Strategy, None] = None, **options):
    """Horovod's `horovod.tensorflow.DistributedOptimizer` (its arguments, in its order), then
    hvdx's keyword options (communication, bucket_bytes, and the strategy's options: density,
    num_samplings, wire_dtype, Deep Gradient Compression's aids, ...; `hvdx.comm.choice`).

    Returns a `hvdx.optimizer_v1.DistributedOptimizerV1` for a tf.compat.v1.train optimizer
    (Horovod's delta-based `_DistributedAdasumOptimizer` for op=Adasum, as Horovod does),
    else `hvdx.DistributedOptimizer(optimizer, ...)` (use_locking does not apply to it).
    Raises ValueError for op=Adasum with a tf.compat.v1.train optimizer and an hvdx strategy
    other than "allreduce".
    """
    horovod_args = dict(name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
                        sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step, op=op,
                        gradient_predivide_factor=gradient_predivide_factor,
                        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    if isinstance(optimizer, _tf.compat.v1.train.Optimizer):
        if op is _horovod.Adasum:
            if options or communication not in (None, "allreduce"):
                raise ValueError("op=Adasum with a tf.compat.v1.train optimizer is Horovod's Adasum of model "
                                 "deltas: it takes Horovod's options only (communication='allreduce')")
            return _horovod.DistributedOptimizer(optimizer, use_locking=use_locking, **horovod_args)
        return _DistributedOptimizerV1(optimizer, use_locking=use_locking, communication=communication,
                                       **horovod_args, **options)
    return _keras_optimizer.DistributedOptimizer(optimizer, communication=communication, **horovod_args, **options)


def _is_layer(obj) -> bool:
    """Whether `obj` is a Keras layer, of Keras 2 or Keras 3 (both have trainable_weights)."""
    return not isinstance(obj, type) and hasattr(obj, "trainable_weights") and callable(getattr(obj, "add_weight", None))


def PartialDistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",
                                   compression=_horovod.Compression.none, sparse_as_dense: bool = False,
                                   op=_horovod.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups=None, process_set: _horovod.ProcessSet = _horovod.global_process_set,
                                   local_layers=None, scale_local_gradients: bool = True,
                                   **options) -> DistributedGradientTape:
    """Horovod's PartialDistributedGradientTape (its arguments, in its order, then hvdx's
    keyword options as in DistributedGradientTape): the gradients of the trainable weights
    of `local_layers` (a Keras layer or a list of them) stay local; the others are
    aggregated. Raises ValueError if an entry of `local_layers` is not a Keras layer."""
    if local_layers is None:
        local_layers = []
    elif _is_layer(local_layers):
        local_layers = [local_layers]
    elif not all(_is_layer(layer) for layer in local_layers):
        raise ValueError("every entry of local_layers must be a Keras layer (tf.keras.layers.Layer, or "
                         "keras.layers.Layer of either Keras)")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
                                   **options)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape


_LAZY = ("keras",)  # hvdx.tensorflow.keras imports this package: imported on first use
_EXPORTED = _horovod_api.reexport(_horovod, globals(), lazy=_LAZY, own=(
    "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape", "PartialDistributedOptimizer",
    "broadcast_variables", "elastic", "init", "shutdown"))
__getattr__ = _horovod_api.late(_horovod, __name__, lazy=_LAZY, exported=_EXPORTED)  # and __all__
