"""Horovod's Keras API (`horovod.tensorflow.keras`, every public name, re-exported from it)
with hvdx's init, optimizer, callbacks and load_model: a Horovod script switches to hvdx by
changing its import alone,

    import hvdx.keras as hvd          # instead of: import horovod.tensorflow.keras as hvd

and then runs with dense averaging (what Horovod does), or with a sparse strategy chosen
in the script (`hvd.DistributedOptimizer(opt, communication="hitopk")`) or from the
environment ($HVDX_COMMUNICATION=hitopk, $HVDX_DENSITY=0.01). hvdx's own names: init,
shutdown (`hvdx.init`), elastic (`hvdx.elastic`: Horovod's, resetting hvdx too), DistributedOptimizer (an instance of the wrapped optimizer's class,
as Horovod's), PartialDistributedOptimizer, callbacks (`hvdx.keras.callbacks`), load_model,
horovod.tensorflow's Adasum, allgather_object, broadcast_object, and broadcast_variables
(`hvdx.broadcast_variables`: Horovod's, for the variables of either Keras).
"""
import horovod.tensorflow.keras as _horovod
from horovod.tensorflow import Adasum, allgather_object, broadcast_object

from hvdx import elastic
from hvdx.keras import callbacks
from hvdx.loading import load_model
from hvdx.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hvdx.tensorflow import _horovod_api
from hvdx.topology import init, shutdown
from hvdx.variables import broadcast_variables

_EXPORTED = _horovod_api.reexport(_horovod, globals(), own=(
    "Adasum", "DistributedOptimizer", "PartialDistributedOptimizer", "allgather_object", "broadcast_object",
    "broadcast_variables", "callbacks", "elastic", "init", "load_model", "shutdown"))
__getattr__ = _horovod_api.late(_horovod, __name__, exported=_EXPORTED)  # and __all__
