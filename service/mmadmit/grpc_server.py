"""The gRPC server: binds the port and wires the services; no request logic.

On one ``grpc.aio`` server and port: ``mmadmit.v1.Admission``
(:class:`~mmadmit.servicer.AdmissionServicer`; its handlers are registered
here rather than by the generated ``add_AdmissionServicer_to_server``, with
the same method names and serializers except for the request deserializer of
``Admit`` and ``AdmitStream``: :func:`~mmadmit.pbwire.parse_admit_request`,
which leaves large inline tensors in the received bytes), the standard
``grpc.health.v1.Health`` service, server reflection, and any ``extra_handlers``
(a benchmark adds an echo method this way).

Health starts NOT_SERVING for both the empty service name and
``mmadmit.v1.Admission`` (the aio ``HealthServicer`` itself starts ""
SERVING, so this is set before the port accepts calls); :meth:`set_serving`
after the warm-up, :meth:`enter_drain` at shutdown (permanent NOT_SERVING).
Service names come from the descriptors, never from literals.

Transport security: with ``credentials`` (TLS, optionally requiring client
certificates: :mod:`mmadmit.security`) the port is bound with
``add_secure_port``; a client that fails the handshake never reaches a handler.

Message-size limits: what is received is held to ``max_message_bytes``
(``--max-message-bytes``), clamped to gRPC's ceiling of ``2**31 - 1``; that
sits far above the per-request limits on purpose: a message gRPC refuses fails
the whole call, which on ``AdmitStream`` ends the stream (docs/spec/GRPC.md).
What is sent has no limit of ours: a materialized reply carries positions, so
it is often larger than its request.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from mmadmit_client.proto import admission_pb2

from .admission import until_quiet
from .pbwire import (
    RefusedRequest,
    StrippedRequest,
    Undecodable,
    parse_admit_request,
    parse_or_undecodable,
)
from .pool import MaterializerPool
from .profile import ModelProfile
from .servicer import AdmissionServicer, Response, ServicerStats
from .telemetry import Telemetry

logger = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's limits are C ints
ADMISSION_SERVICE = admission_pb2.DESCRIPTOR.services_by_name["Admission"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def clamp_message_bytes(max_message_bytes: int) -> int:
    """The gRPC message-size option for ``max_message_bytes`` (clamped, logged once here)."""
    if max_message_bytes > GRPC_MAX_MESSAGE_BYTES:
        logger.warning(
            "--max-message-bytes %d exceeds gRPC's maximum; using %d for the gRPC limits",
            max_message_bytes,
            GRPC_MAX_MESSAGE_BYTES,
        )
        return GRPC_MAX_MESSAGE_BYTES
    return max_message_bytes


def admission_handlers(servicer: AdmissionServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers of ``mmadmit.v1.Admission`` (the generated ones but for the
    request deserializer of ``Admit`` and ``AdmitStream``, and byte counting on both)."""
    pb = admission_pb2
    stats = servicer.stats
    serialize = pb.AdmitResponse.SerializeToString

    limits = servicer.limits

    def parse(data: bytes) -> admission_pb2.AdmitRequest | StrippedRequest | RefusedRequest:
        return parse_admit_request(data, limits=limits)

    def deserialize_admit(
        data: bytes,
    ) -> admission_pb2.AdmitRequest | StrippedRequest | RefusedRequest | Undecodable:
        stats.received_bytes += len(data)
        result: admission_pb2.AdmitRequest | StrippedRequest | RefusedRequest | Undecodable = (
            parse_or_undecodable(parse, data)
        )
        return result

    def serialize_admit(response: Response) -> bytes:
        data = response if type(response) is bytes else serialize(response)
        stats.sent_bytes += len(data)
        return data

    return {
        "Admit": grpc.unary_unary_rpc_method_handler(
            servicer.Admit,
            request_deserializer=deserialize_admit,
            response_serializer=serialize_admit,
        ),
        "AdmitStream": grpc.stream_stream_rpc_method_handler(
            servicer.AdmitStream,
            request_deserializer=deserialize_admit,
            response_serializer=serialize_admit,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=pb.AbortRequest.FromString,
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.GetModelInfoResponse.SerializeToString,
        ),
    }


def _preflight_bind(host: str, listen: str) -> None:
    """Bind-test a fixed port with a plain socket first.

    gRPC reports a busy port only as a ``RuntimeError`` after its core has
    already written an error line to stderr; this check gives one clear
    ``OSError`` (with its errno) instead. gRPC's own failure still maps to
    ``OSError`` should the port be taken in between.
    """
    _, _, port_text = listen.rpartition(":")
    if not port_text.isdigit() or int(port_text) == 0:
        return
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(
            bare or None, int(port_text), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(f"cannot bind gRPC to {listen}: {exc}") from exc
    family, _, _, _, address = infos[0]
    try:
        # create_server sets SO_REUSEADDR as gRPC does: only a real listener conflicts.
        socket.create_server(address, family=family).close()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot bind gRPC to {listen}: {exc.strerror}") from exc


class GrpcPort:
    """One ``grpc.aio`` server on one port serving ``services`` (full service name ->
    method handlers), with health and reflection; create and use it on the
    service's event loop. Health names "" and every service."""

    def __init__(
        self,
        services: Mapping[str, Mapping[str, grpc.RpcMethodHandler]],
        *,
        listen: str,
        max_message_bytes: int,
        max_streams: int | None = None,
        extra_handlers: Sequence[grpc.GenericRpcHandler] = (),
        credentials: grpc.ServerCredentials | None = None,
        security: str = "plaintext",
        activity: Callable[[], int] | None = None,
    ) -> None:
        if max_streams is not None and max_streams < 1:
            raise ValueError("max_streams must be positive")
        self.services = dict(services)
        # A count of the requests received (calls, stream messages): quiesce()
        # waits until it stops moving.
        self.activity = activity
        self.max_streams = max_streams
        self.health = health_aio.HealthServicer()
        self.listen = listen
        self.max_message_bytes = clamp_message_bytes(max_message_bytes)
        self.address: str | None = None
        self._extra_handlers = tuple(extra_handlers)
        # TLS (security.GrpcTls.server_credentials): add_secure_port instead of
        # add_insecure_port; ``security`` only names it in the log line.
        self._credentials = credentials
        self.security = security if credentials is not None else "plaintext"
        self._server: grpc.aio.Server | None = None
        self._stopped = False
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._health_names = ("", *self.services)

    async def start(self) -> str:
        """Bind ``listen`` and start serving; return the bound ``HOST:PORT``.

        Port 0 binds an ephemeral port. Health is NOT_SERVING until
        :meth:`set_serving`. Raises ``OSError`` (a bind problem is the
        operator's, like any other listener's) when the address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("the gRPC server was already started")
        host, sep, _ = self.listen.rpartition(":")
        if not sep:
            raise ValueError(f"listen address must be HOST:PORT, got {self.listen!r}")
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # Replies are not held to the receive limit: a materialized reply
            # (positions, echoed features) is often larger than its request.
            ("grpc.max_send_message_length", -1),
            # Refuse a port another process already serves instead of sharing it.
            ("grpc.so_reuseport", 0),
        ]
        if self.max_streams is not None:
            # one connection opens no more HTTP/2 streams than that (the client
            # waits for one to end); the whole server runs no more calls (beyond:
            # RESOURCE_EXHAUSTED, from gRPC itself)
            options.append(("grpc.max_concurrent_streams", self.max_streams))
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=self.max_streams)
        for name, handlers in self.services.items():
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(name, dict(handlers)),)
            )
            server.add_registered_method_handlers(name, dict(handlers))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (*self.services, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        if self._extra_handlers:
            server.add_generic_rpc_handlers(self._extra_handlers)
        _preflight_bind(host, self.listen)
        try:
            if self._credentials is not None:
                port = server.add_secure_port(self.listen, self._credentials)
            else:
                port = server.add_insecure_port(self.listen)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC to {self.listen}: {exc}") from exc
        if port == 0:  # older grpcio reports a failed bind this way
            raise OSError(f"cannot bind gRPC to {self.listen}")
        for name in self._health_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = server
        await server.start()
        self.address = f"{host}:{port}"
        logger.info(
            "gRPC listening on %s (%s, message limit %d bytes)",
            self.address,
            self.security,
            self.max_message_bytes,
        )
        return self.address

    def _schedule(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)
        return task

    def set_serving(self) -> asyncio.Task[None]:
        """Health SERVING for "" and every service (after the warm-up).

        Callable without ``await`` from the lifecycle code; the returned task
        can be awaited to know the status is visible.
        """

        async def run() -> None:
            for name in self._health_names:
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

        return self._schedule(run())

    def enter_drain(self) -> asyncio.Task[None]:
        """Health NOT_SERVING for every service, for good (the server is draining)."""
        return self._schedule(self.health.enter_graceful_shutdown())

    async def quiesce(self, until: float) -> None:
        """Shutdown: keep serving (every new request is answered ``SHUTTING_DOWN``)
        until none has arrived for :data:`~mmadmit.admission.INTAKE_QUIET_S`, or
        ``until`` (loop time). A call that arrives after :meth:`stop` is refused by
        gRPC itself (``UNAVAILABLE``); one caught mid-way by it would end ``CANCELLED``."""
        if self.activity is not None and self._server is not None and not self._stopped:
            if not await until_quiet(self.activity, until):
                logger.warning("[shutdown] gRPC on %s still receiving; stopping it", self.address)

    async def stop(self, grace_s: float | None) -> None:
        """Stop accepting calls; let running calls finish for ``grace_s`` seconds (idempotent)."""
        if self._server is None or self._stopped:
            return
        self._stopped = True
        if self._health_tasks:
            await asyncio.gather(*list(self._health_tasks), return_exceptions=True)
        await self._server.stop(grace_s)
        logger.info("[shutdown] gRPC server on %s stopped", self.address)


class GrpcServer(GrpcPort):
    """The gRPC admission API (``mmadmit.v1.Admission``) on its port."""

    def __init__(
        self,
        pool: MaterializerPool,
        profile: ModelProfile,
        *,
        listen: str,
        max_message_bytes: int,
        max_streams: int | None = None,
        max_stream_inflight: int | None = None,
        extra_handlers: Sequence[grpc.GenericRpcHandler] = (),
        telemetry: Telemetry | None = None,
        credentials: grpc.ServerCredentials | None = None,
        security: str = "plaintext",
    ) -> None:
        self.servicer = AdmissionServicer(
            pool, profile, telemetry, max_stream_inflight=max_stream_inflight
        )
        super().__init__(
            {ADMISSION_SERVICE: admission_handlers(self.servicer)},
            listen=listen,
            max_message_bytes=max_message_bytes,
            max_streams=max_streams,
            activity=self.servicer.requests_received,
            extra_handlers=extra_handlers,
            credentials=credentials,
            security=security,
        )

    @property
    def stats(self) -> ServicerStats:
        """The gRPC transport's counters (``metrics.py`` exports them)."""
        return self.servicer.stats


__all__ = [
    "ADMISSION_SERVICE",
    "GRPC_MAX_MESSAGE_BYTES",
    "GrpcPort",
    "GrpcServer",
    "admission_handlers",
    "clamp_message_bytes",
]
