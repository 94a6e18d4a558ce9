"""Targets and transports of ``mmadmit-client``: the one place a connection is made.

``grpc://HOST:PORT`` makes a :class:`~mmadmit_client.Client` over a
:class:`~mmadmit_client.GrpcTransport`, ``tcp://HOST:PORT`` or ``ipc://PATH``
one over a :class:`~mmadmit_client.ZmqTransport` (reply mode). ``admit`` and
``bench`` use it through :class:`CliTransport` (a loaded request file in, an
:class:`AdmitResult` out), made only by :func:`open_transport`; ``health`` and
``model-info`` take a :class:`~mmadmit_client.BlockingClient` from
:func:`grpc_client`. Transport security lives here and in
:class:`TransportOptions` only:

* **TLS** (gRPC): ``--tls-ca`` verifies the server (default: the system's
  roots), ``--tls-cert`` with ``--tls-key`` presents a client certificate
  (mutual TLS). Any of the three turns TLS on.
* **CURVE** (ZMQ): ``--curve-server-key`` is the server's public key file
  (``zmq.auth`` format) and turns CURVE on; ``--curve-client-key`` is this
  client's ``NAME.key_secret`` (for a server with an allow-list), else a fresh
  keypair is made per run.

An option of the other transport, half a client keypair, or a file that cannot
be read is a :class:`UsageError` (exit 2) before anything connects.

Reachability is checked once, on open, within ``connect_timeout_s``: over gRPC a
health check (fails at once when the port refuses, after the timeout when
nothing answers), over ZMQ the socket monitor's first connection
(:meth:`~mmadmit_client.Client.wait_ready`). Failing it raises
:class:`~mmadmit_client.ServerUnavailable` (the CLI's exit status 3), and so does
a failed TLS or CURVE handshake; :func:`explain_unavailable` adds what can be
told about why.

Over ZMQ the same ``connect_timeout_s`` bounds how long each later request waits
for a connection, so a server that goes away mid-``bench`` ends the requests it
held ``ServerUnavailable`` at once and the ones after it within that time, none
of them sent later (:mod:`mmadmit_client._transports.zmq`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._cli_usage import UsageError
from ._client import BlockingClient, Client
from ._models import Outcome
from ._transports.base import AsyncTransport

if TYPE_CHECKING:  # the request side (the codec) loads only for admit and bench
    import grpc

    from ._cli_request import AdmitResult, LoadedRequest

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
    """How to connect: timeouts, and the files of TLS (gRPC) or CURVE (ZMQ)."""

    connect_timeout_s: float = 5.0
    request_timeout_s: float = 60.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    curve_server_key: str | None = None
    curve_client_key: str | None = None

    @property
    def tls(self) -> bool:
        return any(f is not None for f in (self.tls_ca, self.tls_cert, self.tls_key))

    @property
    def curve(self) -> bool:
        return self.curve_server_key is not None or self.curve_client_key is not None

    def check(self, target: Target) -> None:
        """:class:`UsageError` for options that do not fit ``target`` or each other."""
        if target.transport == "grpc" and self.curve:
            raise UsageError(
                f"target {target.text!r}: --curve-server-key / --curve-client-key are for ZMQ "
                "targets (gRPC uses --tls-ca, --tls-cert, --tls-key)"
            )
        if target.transport == "zmq" and self.tls:
            raise UsageError(
                f"target {target.text!r}: --tls-ca / --tls-cert / --tls-key are for gRPC "
                "targets (ZMQ uses --curve-server-key, --curve-client-key)"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("--tls-cert", "--tls-key") if self.tls_cert else ("--tls-key", "--tls-cert")
            )
            raise UsageError(f"{given} needs {missing} too")
        if self.curve_client_key is not None and self.curve_server_key is None:
            raise UsageError("--curve-client-key needs --curve-server-key (the server's key)")

    def grpc_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials from the files, or None for plaintext."""
        if not self.tls:
            return None
        from ._transports.grpc import tls_credentials

        try:
            return tls_credentials(self.tls_ca, self.tls_cert, self.tls_key)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc

    def curve_keys(self) -> dict[str, Any]:
        """``curve_server_key`` / ``curve_keypair`` for the ZMQ client (empty: plain)."""
        if self.curve_server_key is None:
            return {}
        from ._transports.zmq import curve_keypair_from_file, curve_server_key_from_file

        try:
            keys: dict[str, Any] = {
                "curve_server_key": curve_server_key_from_file(self.curve_server_key)
            }
            if self.curve_client_key is not None:
                keys["curve_keypair"] = curve_keypair_from_file(self.curve_client_key)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        return keys


def explain_unavailable(message: str, options: TransportOptions, kind: TransportKind) -> str:
    """``message`` of a ServerUnavailable, with a hint when a handshake is the likely cause.

    gRPC says "handshake failed" when this side refused the server's certificate
    (or found no TLS at the port); when the server refuses this side (no client
    certificate, a wrong CA, or a plaintext client at a TLS port) this side only
    sees the socket close, so the hint names the candidates. ZMQ's client already
    says what its handshake did.
    """
    if kind != "grpc":
        return message
    low = message.lower()
    if "handshake" in low:
        if "wrong_version_number" in low:
            why = "the server does not speak TLS (a plaintext port?)"
        elif "certificate_verify_failed" in low:
            why = "the server's certificate was not accepted (check --tls-ca)"
        else:
            why = "see the cause"
        return f"TLS handshake failed: {why}; {message}"
    if "socket closed" in low or "connection reset" in low:
        if options.tls:
            hint = (
                "the server closed the connection during the TLS handshake: it may require "
                "a client certificate (--tls-cert, --tls-key) signed by its CA, or not speak TLS"
            )
        else:
            hint = "the server closed the connection: if it serves TLS, give --tls-ca"
        return f"{hint}; {message}"
    return message


def _transport(target: Target, options: TransportOptions) -> AsyncTransport:
    options.check(target)
    if target.transport == "grpc":
        from ._transports.grpc import GrpcTransport

        return GrpcTransport(target.address, credentials=options.grpc_credentials())
    from ._transports.zmq import ZmqTransport

    return ZmqTransport(
        target.address,
        timeout_s=options.request_timeout_s,
        connect_timeout_s=options.connect_timeout_s,
        **options.curve_keys(),
    )


def grpc_client(target: Target, options: TransportOptions) -> BlockingClient:
    """The blocking gRPC client of ``health`` and ``model-info`` (not yet open)."""
    return BlockingClient(_transport(target, options))


class CliTransport:
    """One open client; ``admit`` returns an :class:`AdmitResult` for a loaded request.

    A captured frames file goes out over ZMQ exactly as captured (unless given
    another request id); everything else is the file's :class:`~mmadmit_client.Request`
    through :meth:`~mmadmit_client.Client.admit`.
    """

    def __init__(self, target: Target, options: TransportOptions) -> None:
        self.target = target
        self.options = options
        self.kind: TransportKind = target.transport
        self.client = Client(_transport(target, options), timeout_s=options.request_timeout_s)

    async def __aenter__(self) -> CliTransport:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        await self.client.open()
        await self.client.wait_ready(self.options.connect_timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    def prepare(self, loaded: LoadedRequest, rid: str | None = None) -> None:
        """Build what this transport sends for ``loaded`` now, so that a request this
        transport cannot carry is refused (:class:`UsageError`) before anything is sent."""
        if self.kind == "grpc":
            loaded.proto(rid)
        else:
            loaded.zmq_frames(rid)

    async def _send(self, loaded: LoadedRequest, rid: str | None) -> Outcome:
        transport = self.client.transport
        if loaded.frames is not None and (rid is None or rid == loaded.rid):
            admit_frames = getattr(transport, "admit_frames", None)
            if admit_frames is not None:  # ZMQ: the captured message as it is
                return await admit_frames(loaded.frames)  # type: ignore[no-any-return]
        return await self.client.admit(loaded.decoded(rid))

    async def admit(self, loaded: LoadedRequest, rid: str | None = None) -> AdmitResult:
        """Send one request (``rid``: another request id) and return its outcome."""
        t0 = time.perf_counter()
        outcome = await self._send(loaded, rid)
        latency_ms = (time.perf_counter() - t0) * 1e3
        if self.kind == "grpc":
            from . import wire

            frames = wire.encode_reply(outcome, loaded.decoded(rid))
        else:
            frames = list(outcome.frames)
        from ._cli_request import result_from_outcome

        return result_from_outcome(self.kind, outcome, frames, latency_ms)

    async def admit_code(self, loaded: LoadedRequest, rid: str) -> str:
        """Send one request; only its code (``MATERIALIZED`` or the abort code)."""
        return (await self._send(loaded, rid)).code

    @property
    def counters(self) -> dict[str, int]:
        """Transport-level counters worth reporting (e.g. replies nobody waited for)."""
        return self.client.transport.counters


def open_transport(target: Target, options: TransportOptions) -> CliTransport:
    """The transport for ``target`` (not yet open: use ``async with``); :class:`UsageError`
    for security options that do not fit it, or files that cannot be read."""
    return CliTransport(target, options)


__all__ = [
    "CliTransport",
    "Target",
    "TransportOptions",
    "explain_unavailable",
    "grpc_client",
    "open_transport",
    "parse_target",
]
