"""Client library of the mmadmit admission service (its own distribution, ``mmadmit-client``).

One request and outcome model, one async :class:`Client` over pluggable
transports, a thin :class:`BlockingClient`, one exception tree::

    from mmadmit_client import Client, GrpcTransport, Item, Request, grid

    request = Request("r1", ids, items=[
        Item.with_placeholders("image", [(10, 256)], feature=pixels,
                               side={"image_grid_thw": grid([1, 32, 32])}),
    ])
    async with Client(GrpcTransport("127.0.0.1:50051")) as client:
        outcome = await client.admit(request)       # Materialized | Aborted

Transports: :class:`GrpcTransport` (the admission API), :class:`ZmqTransport`
(the msgpack reply mode, docs/spec/WIRE.md), :class:`MemoryTransport` (a function of
yours, for tests). The gRPC and ZMQ ones are imported lazily, so
``import mmadmit_client`` loads neither grpc nor zmq, and a ZMQ-only user never
loads grpc (and the other way round). Nothing here imports the service
(``mmadmit``), torch or a C extension of the service.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._client import BlockingClient, Client
from ._exceptions import (
    ClientError,
    ClientStateError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
    UnsupportedOperation,
)
from ._models import (
    Aborted,
    Item,
    Materialized,
    MaterializedItem,
    ModelInfo,
    Outcome,
    Request,
    ShmFeature,
    Tensor,
    grid,
    seconds,
)
from ._state import ClientState
from ._transports.base import AsyncTransport
from ._transports.memory import MemoryTransport

_LAZY = {
    "GrpcTransport": "._transports.grpc",
    "tls_credentials": "._transports.grpc",
    "ZmqTransport": "._transports.zmq",
    "curve_keypair_from_file": "._transports.zmq",
    "curve_server_key_from_file": "._transports.zmq",
    "request_to_proto": "._grpc_codec",
    "outcome_from_proto": "._grpc_codec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mmadmit_client' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


__all__ = [
    "Aborted",
    "AsyncTransport",
    "BlockingClient",
    "Client",
    "ClientError",
    "ClientState",
    "ClientStateError",
    "Item",
    "Materialized",
    "MaterializedItem",
    "MemoryTransport",
    "ModelInfo",
    "Outcome",
    "ProtocolError",
    "Request",
    "RequestTimeout",
    "ServerUnavailable",
    "ShmFeature",
    "Tensor",
    "TransportError",
    "UnsupportedOperation",
    "grid",
    "seconds",
    *_LAZY,
]
