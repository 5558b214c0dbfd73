"""The shared-memory engine of the node-local collectives under its former path: it is
`hvdx.node.shm_engine` (ENGINES and check_engine: `hvdx.node.collectives`)."""
from hvdx.node.collectives import ENGINES, check_engine
from hvdx.node.shm_engine import (ALLGATHER, ALLTOALL, CHANNELS, DEFAULT_SLOT_BYTES, DEFAULT_TIMEOUT_S,
                                  LAYOUT_VERSION, MAGIC, MAX_RANKS, NODE, PREFIX, SHM_DIR, NodeCommunicator,
                                  NodeShmError, Segment, communicator, node_allgather, node_alltoall, sweep)

__all__ = ["ALLGATHER", "ALLTOALL", "ENGINES", "NodeCommunicator", "NodeShmError", "PREFIX", "SHM_DIR", "Segment",
           "check_engine", "communicator", "node_allgather", "node_alltoall", "sweep"]
