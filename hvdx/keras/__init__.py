"""Horovod's Keras API (`horovod.tensorflow.keras`) with hvdx's optimizer: a Horovod
script switches to hvdx by changing its import alone,

    import hvdx.keras as hvd          # instead of: import horovod.tensorflow.keras as hvd

and then runs with dense averaging (what Horovod does), or with a sparse strategy chosen
in the script (`hvd.DistributedOptimizer(opt, communication="hitopk")`) or from the
environment ($HVDX_COMMUNICATION=hitopk, $HVDX_DENSITY=0.01). `hvd.init()` is `hvdx.init()`.
"""
from horovod.tensorflow import (Average, Adasum, Compression, ProcessSet, Sum, add_process_set, allgather,
                                allgather_object, allreduce, broadcast, broadcast_object, broadcast_variables,
                                ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                global_process_set, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                                mpi_threads_supported, nccl_built, rank, reducescatter, remove_process_set,
                                rocm_built, size, start_timeline, stop_timeline)
from horovod.tensorflow.keras import broadcast_global_variables, elastic

from hvdx.keras import callbacks
from hvdx.loading import load_model
from hvdx.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hvdx.topology import init, shutdown

__all__ = ["Adasum", "Average", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "ProcessSet",
           "Sum", "add_process_set", "allgather", "allgather_object", "allreduce", "broadcast", "broadcast_object",
           "broadcast_global_variables", "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size",
           "cuda_built", "ddl_built", "elastic", "gloo_built", "gloo_enabled", "global_process_set", "init",
           "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built",
           "shutdown", "size", "start_timeline", "stop_timeline"]
