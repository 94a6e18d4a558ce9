"""Client library for mmadmit (gRPC and ZMQ msgpack).

The transports are imported lazily, so ``import mmadmit_client`` costs nothing
and a ZMQ-only user never loads grpc (and vice versa)::

    from mmadmit_client import AsyncAdmissionClient, build_request, build_item   # gRPC
    from mmadmit_client import AsyncZmqClient, ZmqClient                         # ZMQ
"""

from __future__ import annotations

import importlib
from typing import Any

from ._exceptions import (
    ClientError,
    ClientStateError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
)
from ._state import ClientState

_LAZY = {
    "AsyncAdmissionClient": "grpc",
    "AdmissionClient": "grpc",
    "Materialized": "grpc",
    "Aborted": "grpc",
    "ModelInfo": "grpc",
    "build_request": "grpc",
    "build_item": "grpc",
    "AsyncZmqClient": "zmq",
    "ZmqClient": "zmq",
    "ZmqOutcome": "zmq",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mmadmit_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "ClientError",
    "ClientState",
    "ClientStateError",
    "ProtocolError",
    "RequestTimeout",
    "ServerUnavailable",
    "TransportError",
    *_LAZY,
]
