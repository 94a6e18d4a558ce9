"""Test-side helpers between the client (``mmadmit_client``) and what service tests send.

The service's tests send what a client library would never build: raw
``AdmitRequest`` messages edited field by field, and requests of the
service's own model (``mmadmit.model.Request``) encoded by the service's
codec. These helpers make both from the client's own model and codec
(``mmadmit_client.Item``, ``request_to_proto``), and decode a ZMQ reply with
the service's codec for checks on every field. Not shipped: the client
library itself imports nothing of the service.

Also here: ``mmadmit-client`` run as a command (:func:`run_cli`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from conftest import communicate
from mmadmit import wire
from mmadmit.model import Request as ServerRequest
from mmadmit_client import (
    Client,
    GrpcTransport,
    Item,
    Outcome,
    ShmFeature,
    Tensor,
    ZmqTransport,
    grid,
    seconds,
)
from mmadmit_client import Request as ClientRequest
from mmadmit_client import wire as client_wire
from mmadmit_client._grpc_codec import _item_to_proto, request_to_proto, tensor_to_proto
from mmadmit_client.proto import admission_pb2 as pb


def tensor_data(value: Any, dtype: str | None = None) -> pb.TensorData:
    """A ``TensorData`` of an array (``dtype``: the wire name when the array's is not it)
    or a :class:`ShmFeature`."""
    if isinstance(value, ShmFeature):
        return tensor_to_proto(value)
    return tensor_to_proto(Tensor.from_numpy(value, dtype))


def build_item(
    modality: str,
    placeholders: Sequence[tuple[int, int]] | None = None,
    *,
    offsets: Any = None,
    feature: Any = None,
    feature_dtype: str | None = None,
    content_hash: int | None = None,
    pad_value: int | None = None,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    video_second_per_grid: Any = None,
    side: Mapping[str, Any] | None = None,
    placeholder_token_id: int | None = None,
) -> pb.MultimodalItem:
    """One ``MultimodalItem`` message, made through the client's :class:`Item`."""
    tensors: dict[str, Tensor] = {}
    for key, value, make in (
        ("image_grid_thw", image_grid_thw, grid),
        ("video_grid_thw", video_grid_thw, grid),
        ("second_per_grid_ts", second_per_grid_ts, seconds),
        ("video_second_per_grid", video_second_per_grid, seconds),
    ):
        if value is not None:
            tensors[key] = make(value)
    for key, value in (side or {}).items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
            tensors[key] = Tensor.from_numpy(value[0], value[1])
        else:
            tensors[key] = Tensor.from_numpy(value)
    if isinstance(feature, np.ndarray) or (feature is not None and feature_dtype is not None):
        feature = Tensor.from_numpy(feature, feature_dtype)
    kwargs: dict[str, Any] = dict(
        feature=feature,
        hash=content_hash,
        pad_value=pad_value,
        side=tensors,
        placeholder_token_id=placeholder_token_id,
    )
    if placeholders is not None:
        item = Item.with_placeholders(modality, placeholders, **kwargs)  # type: ignore[arg-type]
    else:
        spans = np.zeros((0, 2), np.int64) if offsets is None else offsets
        item = Item(modality, spans, **kwargs)  # type: ignore[arg-type]
    return _item_to_proto(0, item)


def build_request(
    request_id: str,
    input_ids: Any,
    items: Sequence[pb.MultimodalItem] = (),
    *,
    input_ids_unpadded: Any = None,
    mrope: tuple[Any, int | None] | None = None,
    echo_features: bool = False,
    timeout_ms: int = 0,
) -> pb.AdmitRequest:
    """An ``AdmitRequest`` message, made through the client's :class:`Request`."""
    positions, delta = mrope if mrope is not None else (None, None)
    msg = request_to_proto(
        ClientRequest(
            request_id,
            input_ids,
            input_ids_unpadded=input_ids_unpadded,
            mrope_positions=positions,
            mrope_position_delta=delta,
            multimodal=bool(items),
            echo_features=echo_features,
            timeout_ms=timeout_ms,
        )
    )
    if items:
        msg.mm_inputs.items.extend(items)
    return msg


def add_frames(request: ServerRequest) -> list[Any]:
    """A request of the service's model as the ADD message its codec writes."""
    return [bytes([wire.MSG_ADD]), *wire.encode_request(request)]


def served(outcome: Outcome) -> ServerRequest:
    """A ZMQ reply (``outcome.frames``) decoded by the service's codec: every field."""
    frames = outcome.frames
    assert frames, f"no reply frames on {outcome!r}"
    return wire.decode_request(frames[1], list(frames[2:]))


def zmq_client(address: str, **kwargs: Any) -> Client:
    """A :class:`Client` over a :class:`ZmqTransport` (not yet open: ``async with``)."""
    return Client(ZmqTransport(address, **kwargs))


def grpc_client(target: str, **kwargs: Any) -> Client:
    """A :class:`Client` over a :class:`GrpcTransport` (not yet open: ``async with``)."""
    return Client(GrpcTransport(target, **kwargs))


async def zmq_admit(
    client: Client, message: ServerRequest | Sequence[Any], timeout_s: float | None = None
) -> Outcome:
    """Send a request of the service's model (its codec's frames) or raw frames, as they
    are, over the client's ZMQ transport."""
    frames = add_frames(message) if isinstance(message, ServerRequest) else list(message)
    transport = client.transport
    assert isinstance(transport, ZmqTransport), transport
    return await transport.admit_frames(frames, timeout_s)


async def grpc_admit(
    client: Client, message: pb.AdmitRequest, timeout: float | None = None
) -> Outcome:
    """Send a raw ``AdmitRequest`` over the client's gRPC transport."""
    transport = client.transport
    assert isinstance(transport, GrpcTransport), transport
    return await transport.admit_proto(message, timeout)


def proto_of(request: ServerRequest, rid: str | None = None) -> pb.AdmitRequest:
    """A request of the service's model as the client sends it over gRPC: encoded by the
    service's codec, decoded by the client's, translated by the client."""
    req = client_wire.decode_add(add_frames(request))
    return request_to_proto(req if rid is None else req.with_request_id(rid))


# --------------------------------------------------------------------------- mmadmit-client


def client_command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "mmadmit-client"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "mmadmit_client.cli"]


@dataclass
class CliRun:
    """One finished ``mmadmit-client`` run."""

    args: tuple[str, ...]
    rc: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        assert self.stdout.strip(), f"no stdout; rc={self.rc} stderr:\n{self.stderr}"
        return json.loads(self.stdout)

    def __str__(self) -> str:
        return f"mmadmit-client {' '.join(self.args)} -> {self.rc}\n{self.stdout}\n{self.stderr}"


async def run_cli(
    *args: str,
    columns: int | None = None,
    timeout_s: float = 60.0,
    argv0: Sequence[str] | None = None,
) -> CliRun:
    """``mmadmit-client ARGS`` (``argv0 ARGS`` when given) as a subprocess, awaited, so the
    in-process servers keep serving. No terminal: stdin empty, stdout and stderr read;
    this environment less ``MMADMIT_*`` (flags only), ``COLUMNS`` and ``LINES``, with
    ``COLUMNS`` set only when ``columns`` is given. Fails after ``timeout_s``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MMADMIT_") and k not in ("COLUMNS", "LINES")
    }
    if columns is not None:
        env["COLUMNS"] = str(columns)
    proc = await asyncio.create_subprocess_exec(
        *(argv0 or client_command()),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await communicate(proc, timeout_s, f"mmadmit-client {' '.join(args)}")
    assert proc.returncode is not None
    return CliRun(args, proc.returncode, out.decode(), err.decode())


async def run_cli_many(
    *commands: tuple[str, ...], parallel: int = 4, columns: int | None = None
) -> list[CliRun]:
    """:func:`run_cli` of each command, ``parallel`` at a time; the runs in order."""
    gate = asyncio.Semaphore(parallel)

    async def one(args: tuple[str, ...]) -> CliRun:
        async with gate:
            return await run_cli(*args, columns=columns)

    return list(await asyncio.gather(*(one(c) for c in commands)))
