"""Node-local collectives: what the ranks of one node exchange among themselves, below the
strategies of `hvdx.comm` (on `hvdx.topology` and `hvdx.ops` only).

- `collectives.py`: the node slices of a buffer, the node-local reduce-scatter and
  all-gather over Horovod's node-local process set or the shared-memory engine.
- `shm_engine.py`: that engine (`node_engine="shm"`): one shared-memory segment per node
  (`hvdx.shm`) and the ops of csrc/kernels/node_shm.{h,cc} (docs/comm.md).
"""
from hvdx.node.collectives import (ENGINES, SLICE_ALIGN, check_engine, node_allgather, node_reduce_scatter,
                                   node_reduce_scatter_parts, node_slices, padded_length)
from hvdx.node.shm_engine import NodeCommunicator, NodeShmError, communicator

__all__ = ["ENGINES", "NodeCommunicator", "NodeShmError", "SLICE_ALIGN", "check_engine", "communicator",
           "node_allgather", "node_reduce_scatter", "node_reduce_scatter_parts", "node_slices", "padded_length"]
