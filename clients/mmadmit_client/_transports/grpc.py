"""gRPC transport: the admission API ``mmadmit.v1.Admission`` over ``grpc.aio``.

Requests are encoded by ``_grpc_codec.py``. gRPC errors are mapped to the
client's exceptions, chained with ``from`` (:func:`map_grpc_errors`):
UNAVAILABLE is :class:`~mmadmit_client.ServerUnavailable` (a failed TLS
handshake too: gRPC reports it so, with the TLS error in the message when this
side refused the server's certificate, as a closed socket when the server
refused ours), DEADLINE_EXCEEDED :class:`~mmadmit_client.RequestTimeout`,
anything else :class:`~mmadmit_client.TransportError`.

Nothing is delivered after the caller gave up: a call that is cancelled (its
timeout, a cancelled await, :meth:`GrpcTransport.aclose`) before its channel
has a connection is dropped from the channel's queue, never sent to a server
that comes up later; one already sent is cancelled on the server too (an
HTTP/2 ``RST_STREAM``). A call the client's close cut short raises
:class:`~mmadmit_client.ClientStateError`, not ``CancelledError``.

TLS: ``credentials=tls_credentials(ca="ca.pem")`` opens a TLS channel (add
``cert=`` and ``key=`` for a server that requires client certificates).

Message size: responses for long prompts are large (a 128K-token response
carries about 4 MB of ids and positions, above gRPC's default 4 MB receive
limit), so both directions default to ``DEFAULT_MAX_MESSAGE_BYTES`` (1 GiB,
the server's default). A message over a limit fails its whole call; on
``admit_many`` that ends the stream (outcomes not yet received are lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .._exceptions import (
    ClientStateError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
)
from .._grpc_codec import model_info_from_proto, outcome_from_proto, request_to_proto
from .._models import ModelInfo, Outcome, Request
from ..proto import admission_pb2 as pb
from ..proto import admission_pb2_grpc as pb_grpc
from .base import AsyncTransport

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1

LoadBalancing = Literal["pick_first", "round_robin"]


@contextlib.contextmanager
def map_grpc_errors(what: str) -> Iterator[None]:
    """Map ``grpc.RpcError`` to the client's exceptions, chained."""
    try:
        yield
    except grpc.RpcError as exc:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        name = code.name if code is not None else "UNKNOWN"
        message = f"{what}: {name}: {details}"
        if code == grpc.StatusCode.UNAVAILABLE:
            raise ServerUnavailable(message) from exc
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise RequestTimeout(message) from exc
        raise TransportError(message) from exc


def build_channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    load_balancing: LoadBalancing | None = None,
    extra: Sequence[tuple[str, Any]] = (),
) -> list[tuple[str, Any]]:
    """Channel options: message limits, the load-balancing policy, then ``extra``.

    ``round_robin`` spreads calls over every address the target resolves to
    (a headless Kubernetes Service ``dns:///mmadmit.NS.svc:50051``, or
    ``ipv4:HOST:PORT,HOST:PORT``); gRPC's default, ``pick_first``, sends every
    call to one replica.
    """
    limit = min(max_message_bytes, _GRPC_MAX_MESSAGE_BYTES)
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ]
    if load_balancing is not None:
        config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
        options.append(("grpc.service_config", json.dumps(config)))
    options.extend(extra)
    return options


_PEM_CERT = b"-----BEGIN CERTIFICATE-----"
_PEM_KEY = b"PRIVATE KEY-----"


def _read_pem(path: str | os.PathLike[str], what: str, mark: bytes) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ValueError(
            f"{what} {os.fspath(path)}: cannot read it: {exc.strerror or exc}"
        ) from exc
    if mark not in data:  # gRPC would only fail the handshake later, obscurely
        label = "certificate" if mark == _PEM_CERT else "private key"
        raise ValueError(f"{what} {os.fspath(path)}: no PEM {label} in it")
    return data


def tls_credentials(
    ca: str | os.PathLike[str] | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files, for ``GrpcTransport(credentials=)``.

    ``ca``: the CA bundle that verifies the server (default: the system's
    roots). ``cert`` and ``key`` (both or neither): this client's certificate
    chain and private key, for a server that requires client certificates
    (mutual TLS). The server's certificate must name the host of the target
    (an IP target needs an IP SAN); the channel option
    ``grpc.ssl_target_name_override`` checks another name instead. A file that
    cannot be read raises ``ValueError`` naming it.
    """
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(ca, "CA bundle", _PEM_CERT) if ca is not None else None,
        private_key=_read_pem(key, "client key", _PEM_KEY) if key is not None else None,
        certificate_chain=(
            _read_pem(cert, "client certificate", _PEM_CERT) if cert is not None else None
        ),
    )


_HEALTH_NAMES = {v: k for k, v in health_pb2.HealthCheckResponse.ServingStatus.items()}


class GrpcTransport(AsyncTransport):
    """One ``grpc.aio`` channel to ``target`` (``HOST:PORT`` or any gRPC target string).

    ``credentials`` (:func:`tls_credentials`) opens a TLS channel; without them
    the channel is plaintext. Use it on one event loop.
    """

    kind: ClassVar[str] = "grpc"

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        load_balancing: LoadBalancing | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.credentials = credentials
        self.max_message_bytes = max_message_bytes
        self._options = build_channel_options(max_message_bytes, load_balancing, channel_options)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.AdmissionStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._closed = False

    async def open(self) -> None:
        if self.credentials is not None:
            self._channel = grpc.aio.secure_channel(
                self.target, self.credentials, options=self._options
            )
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.AdmissionStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def aclose(self) -> None:
        self._closed = True
        if self._channel is not None:
            await self._channel.close()  # cancels every call still in flight or queued
        self._channel = self._stub = self._health = None

    @contextlib.contextmanager
    def _calling(self, what: str) -> Iterator[None]:
        """:func:`map_grpc_errors`, and a call that :meth:`aclose` cancelled (grpc.aio
        raises ``CancelledError`` in its caller) as :class:`ClientStateError`."""
        try:
            with map_grpc_errors(what):
                yield
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and (task is None or not task.cancelling()):
                raise ClientStateError(f"{what}: the client was closed") from None
            raise

    @property
    def stub(self) -> pb_grpc.AdmissionStub:
        """The generated stub, for calls the typed API does not cover (tests, tools)."""
        if self._stub is None:
            raise ClientStateError(f"the gRPC transport to {self.target} is not open")
        return self._stub

    async def wait_ready(self, timeout_s: float) -> None:
        """A health check within ``timeout_s`` (fails at once when the port refuses)."""
        try:
            await self.health(timeout_s=timeout_s)
        except RequestTimeout as exc:  # nothing answered within the timeout
            raise ServerUnavailable(str(exc)) from exc

    async def admit(self, request: Request, timeout_s: float | None = None) -> Outcome:
        return await self.admit_proto(request_to_proto(request), timeout_s)

    async def admit_proto(
        self, message: pb.AdmitRequest, timeout_s: float | None = None
    ) -> Outcome:
        """Send a ready-made ``AdmitRequest`` (any content: the server judges it)."""
        stub = self.stub
        with self._calling(f"Admit {message.request_id!r}"):
            resp = await stub.Admit(message, timeout=timeout_s)
        return outcome_from_proto(resp)

    async def admit_many(
        self,
        requests: Iterable[Request] | AsyncIterable[Request],
        timeout_s: float | None = None,
    ) -> AsyncIterator[Outcome]:
        """One ``AdmitStream`` call; outcomes in completion order."""
        if isinstance(requests, AsyncIterable):
            messages: Any = _aprotos(requests)
        else:
            messages = (request_to_proto(r) for r in requests)
        async for outcome in self.admit_proto_stream(messages, timeout_s):
            yield outcome

    async def admit_proto_stream(
        self,
        messages: Iterable[pb.AdmitRequest] | AsyncIterable[pb.AdmitRequest],
        timeout_s: float | None = None,
    ) -> AsyncIterator[Outcome]:
        """Ready-made ``AdmitRequest`` messages on one ``AdmitStream`` call."""
        call = self.stub.AdmitStream(messages, timeout=timeout_s)
        try:
            with self._calling("AdmitStream"):
                async for resp in call:
                    yield outcome_from_proto(resp)
        finally:
            call.cancel()  # no-op once the call has ended; stops it if the caller broke off

    async def abort(self, request_ids: tuple[str, ...], reason: str = "") -> bool:
        """One ``Abort`` call per id; True when the server had any of them in flight."""
        stub = self.stub
        found = False
        for rid in request_ids:
            with self._calling(f"Abort {rid!r}"):
                resp = await stub.Abort(pb.AbortRequest(request_id=rid, reason=reason))
            found = found or resp.success
        return found

    async def health(self, service: str = "", timeout_s: float | None = None) -> str:
        if self._health is None:
            raise ClientStateError(f"the gRPC transport to {self.target} is not open")
        try:
            with self._calling(f"Health.Check {service!r}"):
                resp = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
                )
        except TransportError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
        return _HEALTH_NAMES.get(resp.status, str(resp.status))

    async def model_info(self, timeout_s: float | None = None) -> ModelInfo:
        with self._calling("GetModelInfo"):
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)
        return model_info_from_proto(info)


async def _aprotos(requests: AsyncIterable[Request]) -> AsyncIterator[pb.AdmitRequest]:
    async for r in requests:
        yield request_to_proto(r)


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "GrpcTransport",
    "LoadBalancing",
    "build_channel_options",
    "map_grpc_errors",
    "tls_credentials",
]
