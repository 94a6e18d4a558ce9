"""Client library for mmadmit (gRPC and ZMQ msgpack)."""

from ._exceptions import (
    ClientError,
    ClientStateError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
)

__all__ = [
    "ClientError",
    "ClientStateError",
    "ProtocolError",
    "RequestTimeout",
    "ServerUnavailable",
    "TransportError",
]
