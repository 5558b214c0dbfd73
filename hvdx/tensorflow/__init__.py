"""Horovod's TensorFlow API (`horovod.tensorflow`) with hvdx's tape and optimizer: a
custom-loop Horovod script switches to hvdx by changing its import alone,

    import hvdx.tensorflow as hvd     # instead of: import horovod.tensorflow as hvd

`hvd.DistributedGradientTape(tape)` then aggregates with dense averaging (Horovod's), or
with the strategy given to it or in $HVDX_COMMUNICATION. `hvd.init()` is `hvdx.init()`.
"""
from horovod.tensorflow import (Average, Adasum, Compression, ProcessSet, Sum, add_process_set, allgather,
                                allgather_object, allreduce, alltoall, broadcast, broadcast_object,
                                broadcast_variables, cross_rank, cross_size, gloo_built, gloo_enabled,
                                global_process_set, grouped_allgather, grouped_allreduce, grouped_reducescatter,
                                is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled, nccl_built,
                                rank, reducescatter, remove_process_set, size, start_timeline, stop_timeline)

from hvdx.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hvdx.tape import DistributedGradientTape
from hvdx.topology import init, shutdown

__all__ = ["Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
           "PartialDistributedOptimizer", "ProcessSet", "Sum", "add_process_set", "allgather", "allgather_object",
           "allreduce", "alltoall", "broadcast", "broadcast_object", "broadcast_variables", "cross_rank",
           "cross_size", "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather",
           "grouped_allreduce", "grouped_reducescatter", "init", "is_initialized", "join", "local_rank",
           "local_size", "mpi_built", "mpi_enabled", "nccl_built", "rank", "reducescatter", "remove_process_set",
           "shutdown", "size", "start_timeline", "stop_timeline"]
