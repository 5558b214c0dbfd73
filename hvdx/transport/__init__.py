"""hvdx's own transport: TCP connections between ranks, bootstrapped through one Horovod
collective, whose exchanges progress on threads of their own while TensorFlow computes.

- `hvdx.transport.ring.GroupTransport`: a ring per group; `allreduce_sum`, `allgather`
  (DASO's global averaging, AD-PSGD's final average);
- `hvdx.transport.peer.PeerTransport`: connections to chosen peers; `exchange(peer, x)`
  (send mine, take theirs, in the transport's thread), handlers that answer a peer's
  exchange atomically, notices (AD-PSGD's gossip);
- `hvdx.transport.base`: `TransportError` (names the failed peer), `Request`, `listen_address`.

Why not Horovod or mpi4py: docs/transport.md.
"""
from hvdx.transport.base import Request, TransportError, listen_address
from hvdx.transport.peer import PeerTransport
from hvdx.transport.ring import GroupTransport

__all__ = ["GroupTransport", "PeerTransport", "Request", "TransportError", "listen_address"]
