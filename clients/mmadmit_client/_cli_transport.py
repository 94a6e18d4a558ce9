"""Targets and transports of ``mmadmit-client``: the one place a connection is made.

``grpc://HOST:PORT`` opens an :class:`~mmadmit_client.grpc.AsyncAdmissionClient`,
``tcp://HOST:PORT`` or ``ipc://PATH`` an :class:`~mmadmit_client.zmq.AsyncZmqClient`
(reply mode). Both sit behind one small interface, :class:`CliTransport`, used by
``admit`` and ``bench`` alike; :func:`open_transport` is the only constructor, so
transport security (TLS for gRPC, CURVE for ZMQ: ``--tls-ca``, ``--tls-cert``,
``--tls-key``, ``--curve-server-key``, ``--curve-client-key`` of CLI.md, not yet
served) is added here and in :class:`TransportOptions` only.

Reachability is checked once, on open, within ``connect_timeout_s``: over gRPC a
health check (fails at once when the port refuses, after the timeout when
nothing answers), over ZMQ the socket monitor's first connection
(:meth:`~mmadmit_client.zmq.AsyncZmqClient.wait_connected`). Failing it raises
:class:`~mmadmit_client.ServerUnavailable` (the CLI's exit status 3).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from ._cli_request import (
    AdmitResult,
    LoadedRequest,
    UsageError,
    result_from_grpc,
    result_from_zmq,
)
from ._exceptions import RequestTimeout, ServerUnavailable

TransportKind = Literal["grpc", "zmq"]


@dataclass(frozen=True)
class Target:
    """A parsed TARGET: ``text`` as given, ``address`` as the client library takes it."""

    text: str
    scheme: Literal["grpc", "tcp", "ipc"]
    address: str  # HOST:PORT for gRPC; the whole endpoint for ZMQ

    @property
    def transport(self) -> TransportKind:
        return "grpc" if self.scheme == "grpc" else "zmq"


def parse_target(text: str) -> Target:
    """``grpc://HOST:PORT``, ``tcp://HOST:PORT`` or ``ipc://PATH``; :class:`UsageError` else."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("grpc", "tcp", "ipc") or not rest:
        raise UsageError(
            f"target {text!r}: expected grpc://HOST:PORT (gRPC) or tcp://HOST:PORT / "
            "ipc://PATH (ZMQ)"
        )
    if scheme in ("grpc", "tcp"):
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"target {text!r}: expected {scheme}://HOST:PORT with a port 1-65535")
    if scheme == "grpc":
        return Target(text, "grpc", rest)
    return Target(text, scheme, text)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TransportOptions:
    """How to connect. TLS / CURVE settings belong here when the server has them."""

    connect_timeout_s: float = 5.0
    request_timeout_s: float = 60.0


class CliTransport:
    """One open connection; ``admit`` returns an :class:`AdmitResult` for a loaded request."""

    kind: TransportKind
    target: Target

    async def __aenter__(self) -> CliTransport:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def open(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def admit(self, loaded: LoadedRequest, rid: str | None = None) -> AdmitResult:
        """Send one request (``rid``: another request id) and return its outcome."""
        raise NotImplementedError

    async def admit_code(self, loaded: LoadedRequest, rid: str) -> str:
        """Send one request; only its code (``MATERIALIZED`` or the abort code)."""
        raise NotImplementedError

    def prepare(self, loaded: LoadedRequest, rid: str | None = None) -> None:
        """Build what this transport sends for ``loaded`` now, so that a request this
        transport cannot carry is refused (:class:`UsageError`) before anything is sent."""
        raise NotImplementedError

    @property
    def counters(self) -> dict[str, int]:
        """Transport-level counters worth reporting (e.g. replies nobody waited for)."""
        return {}


class GrpcTransport(CliTransport):
    kind: TransportKind = "grpc"

    def __init__(self, target: Target, options: TransportOptions) -> None:
        from .grpc import AsyncAdmissionClient

        self.target = target
        self.options = options
        self.client = AsyncAdmissionClient(target.address)

    async def open(self) -> None:
        await self.client.open()
        try:
            await self.client.health(timeout=self.options.connect_timeout_s)
        except RequestTimeout as exc:  # nothing answered within the connect timeout
            raise ServerUnavailable(str(exc)) from exc

    async def aclose(self) -> None:
        await self.client.aclose()

    def prepare(self, loaded: LoadedRequest, rid: str | None = None) -> None:
        loaded.proto()

    async def admit(self, loaded: LoadedRequest, rid: str | None = None) -> AdmitResult:
        msg = loaded.proto_with_rid(rid) if rid is not None else loaded.proto()
        t0 = time.perf_counter()
        outcome = await self.client.admit(msg, timeout=self.options.request_timeout_s)
        latency_ms = (time.perf_counter() - t0) * 1e3
        sent = loaded.decoded()
        if rid is not None and rid != sent.rid:
            sent = dataclasses.replace(sent, rid=rid)
        return result_from_grpc(outcome, sent, latency_ms)

    async def admit_code(self, loaded: LoadedRequest, rid: str) -> str:
        from .grpc import Aborted

        outcome = await self.client.admit(
            loaded.proto_with_rid(rid), timeout=self.options.request_timeout_s
        )
        return outcome.code if isinstance(outcome, Aborted) else "MATERIALIZED"


class ZmqTransport(CliTransport):
    kind: TransportKind = "zmq"

    def __init__(self, target: Target, options: TransportOptions) -> None:
        from .zmq import AsyncZmqClient

        self.target = target
        self.options = options
        self.client = AsyncZmqClient(target.address, timeout_s=options.request_timeout_s)

    async def open(self) -> None:
        await self.client.open()
        await self.client.wait_connected(self.options.connect_timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    def prepare(self, loaded: LoadedRequest, rid: str | None = None) -> None:
        loaded.zmq_frames(rid)

    async def admit(self, loaded: LoadedRequest, rid: str | None = None) -> AdmitResult:
        frames = loaded.zmq_frames(rid)
        t0 = time.perf_counter()
        outcome = await self.client.admit(frames)
        return result_from_zmq(outcome, (time.perf_counter() - t0) * 1e3)

    async def admit_code(self, loaded: LoadedRequest, rid: str) -> str:
        outcome = await self.client.admit(loaded.zmq_frames(rid))
        return "MATERIALIZED" if outcome.materialized else str(outcome.abort_code)

    @property
    def counters(self) -> dict[str, int]:
        return {"unmatched_replies": self.client.unmatched_replies}


def open_transport(target: Target, options: TransportOptions) -> CliTransport:
    """The transport for ``target`` (not yet open: use ``async with``)."""
    if target.transport == "grpc":
        return GrpcTransport(target, options)
    return ZmqTransport(target, options)


__all__ = [
    "CliTransport",
    "GrpcTransport",
    "Target",
    "TransportOptions",
    "ZmqTransport",
    "open_transport",
    "parse_target",
]
