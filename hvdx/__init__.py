"""hvdx: Horovod + TensorFlow extensions for clusters whose nodes are well connected inside
and poorly connected between each other.

    import hvdx
    topo = hvdx.init()          # hvd.init() + node-local and cross-node process sets
    print(topo)                 # rank, node, local rank, and the members of both sets
    opt = hvdx.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), communication="hitopk")
    opt = hvdx.DASO(tf.keras.optimizers.SGD(0.1), total_epochs=20)   # + hvdx.daso.DASOCallback()
    model.fit(..., callbacks=[hvdx.adpsgd.ADPSGDCallback(topology="exponential")])   # AD-PSGD

`hvdx.keras` and `hvdx.tensorflow` are Horovod's APIs with hvdx's optimizer and tape.
tf.keras is what TensorFlow makes it (Keras 3 from TensorFlow 2.16 on, tf_keras with
$TF_USE_LEGACY_KERAS=1): importing hvdx changes nothing there, in any import order.
`hvdx.DistributedOptimizer` takes the path of the optimizer it is given: a Keras 3 one
(`keras.optimizers.*`) the Keras 3 adapter (hvdx/keras3_optimizer.py), a Keras 2 one the
Keras 2 adapter (hvdx/optimizer.py); docs/keras3.md says what works on each.

The package is lazy: `import hvdx` imports no TensorFlow and no Horovod; each name below is
imported on first use (PEP 562), so the parts that need neither (the launchers of
`hvdx.runner`, the shared-memory kit `hvdx.shm`) start in a fraction of a second.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Dict, List

from hvdx.topology import Topology, TopologyError, barrier, init, shutdown, topology
from hvdx.version import __version__

#: Public names of submodules: name -> (module, attribute).
_NAMES: Dict[str, tuple] = {
    "DASO": ("hvdx.daso.optimizer", "DASO"),
    "DistributedGradientTape": ("hvdx.tape", "DistributedGradientTape"),
    "DistributedOptimizer": ("hvdx.optimizer", "DistributedOptimizer"),
    "GradientAggregator": ("hvdx.aggregator", "GradientAggregator"),
    "PartialDistributedOptimizer": ("hvdx.optimizer", "PartialDistributedOptimizer"),
    "RankMismatchError": ("hvdx.agreement", "RankMismatchError"),
    "broadcast_variables": ("hvdx.variables", "broadcast_variables"),
    "load_model": ("hvdx.loading", "load_model"),
    "mstopk": ("hvdx.ops", "mstopk"),
    "sparse_accumulate": ("hvdx.ops", "sparse_accumulate"),
}
#: Subpackages and modules reachable as attributes (`hvdx.comm.HiTopK`) without an import of their own.
_SUBMODULES = ("adpsgd", "asynchronous", "buckets", "callbacks", "comm", "daso", "data", "localsgd", "ops",
               "optimizers", "pto", "streaming_diloco", "transport")

__all__ = sorted(["Topology", "TopologyError", "barrier", "init", "shutdown", "topology", *_NAMES, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first use; any other submodule (`hvdx.keras`) too.

    Raises AttributeError for a name that is neither."""
    if name in _NAMES:
        module, attribute = _NAMES[name]
        value = getattr(importlib.import_module(module), attribute)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'hvdx' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
