"""DASO's transport is hvdx's ring transport (`hvdx.transport.ring`); this name stays for the
code that imported it from here."""
from hvdx.transport.ring import CHUNK_BYTES, GroupTransport, Request, TransportError, listen_address

__all__ = ["CHUNK_BYTES", "GroupTransport", "Request", "TransportError", "listen_address"]
