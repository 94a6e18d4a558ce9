"""The SMG gRPC face: SMG's ``TokenSpeedScheduler`` worker contract in front of a scheduler.

The RPCs (the service from the ``smg-grpc-proto`` package, never a hand copy)
and each call's state, over the shared pool and a headless scheduler reached
through ``face.link`` (:class:`~mmadmit.scheduler_link.SchedulerLink`)::

    SMG --Generate--> face --ADD / ABORT (msgpack)--> scheduler
        <--chunks, Complete--  <--BatchTokenIDOutSlim--

The request's translation is :mod:`mmadmit.smg_request`, the outputs' decoding
:mod:`mmadmit.smg_outputs`; the contract (refusal statuses, abort, death, drain,
non-goals) is docs/spec/SMG_GRPC.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version
from typing import Any, ClassVar

import grpc
import msgspec
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
from smg_grpc_proto.generated import common_pb2

from . import wire
from .admission import Admissions
from .errors import Abort, AbortCode, AdmissionError, ShuttingDown, abort_from_exception
from .model import Materialized, Modality, Request
from .pbwire import (
    RefusedRequest,
    StrippedRequest,
    Undecodable,
    message_and_payloads,
    parse_or_undecodable,
)
from .pool import MaterializerPool
from .profile import ModelProfile
from .scheduler_link import SchedulerLink
from .smg_outputs import Call, Fault, Outputs, Piece, Responses
from .smg_request import parse_generate, request_from_generate
from .telemetry import (
    RECEIVED_BYTES,
    UNDELIVERABLE,
    Sample,
    Telemetry,
    counter,
    counters,
    gauge,
)
from .zsock import WATCHDOG_S, OrderedSender, SocketReader

logger = logging.getLogger(__name__)

TRANSPORT = "smg_grpc"
try:
    _VERSION = "mmadmit " + _package_version("mmadmit")
except PackageNotFoundError:  # pragma: no cover - run from a source tree
    _VERSION = "mmadmit"
SERVICE = ts.DESCRIPTOR.services_by_name["TokenSpeedScheduler"].full_name

# mmadmit's abort code -> the status a refused Generate ends with (docs/spec/SMG_GRPC.md).
STATUS_OF: dict[AbortCode, grpc.StatusCode] = {
    AbortCode.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.TEXT_ONLY_MODEL: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.UNSUPPORTED: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AbortCode.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    AbortCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortCode.CANCELLED: grpc.StatusCode.CANCELLED,
    AbortCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

# The sender's pending bound for ADD / ABORT messages that libzmq has not taken
# yet (a scheduler that stops reading). Nothing pauses on it: what queues is
# bounded by the calls gRPC lets in (--max-grpc-streams), each waiting for its
# outputs.
MAX_PENDING_ADDS = 4096

_ADD = bytes([wire.MSG_ADD])
_ABORT = bytes([wire.MSG_ABORT])
_ENC = msgspec.msgpack.Encoder()
_MODALITIES = {
    Modality.IMAGE: common_pb2.IMAGE,
    Modality.VIDEO: common_pb2.VIDEO,
    Modality.AUDIO: common_pb2.AUDIO,
}
_DEAD = object()  # the scheduler went away
_ABORTED = object()  # an Abort call ended it
_STOPPED = object()  # the face stopped (drain deadline)


@dataclass
class SmgStats:
    """The face's counters (``SmgGrpcFace.stats``); outcomes are its admission path's,
    the scheduler side its link's."""

    generate_calls: int = 0  # Generate calls received
    adds_sent: int = 0  # ADDs handed to the scheduler's input
    aborts_sent: int = 0  # ABORTs handed to the scheduler's input
    abort_calls: int = 0  # Abort RPCs that ended a request
    calls_cancelled: int = 0  # Generate calls the client cancelled
    completes: int = 0  # GenerateComplete sent
    chunks: int = 0  # GenerateStreamChunk sent
    output_messages: int = 0  # scheduler outputs read
    outputs_untracked: int = 0  # rids' parts of outputs for no open call
    outputs_bad: int = 0  # calls ended INTERNAL: their part of an output was unusable
    outputs_undecodable: int = 0  # unusable outputs naming no open call (logged)
    undeliverable: int = 0  # ADD / ABORT messages libzmq refused
    received_bytes: int = 0  # bytes of GenerateRequest messages
    open_calls: int = 0  # forwarded requests without a finished output yet
    wakeups: int = 0  # output reader callbacks run
    watchdog_reads: int = 0  # output reads started by the watchdog

    # exported as mmadmit_smg_grpc_<field>_total, with this help (metrics())
    COUNTERS: ClassVar[dict[str, str]] = {
        "generate_calls": "Generate calls received.",
        "adds_sent": "ADD messages handed to the scheduler's input.",
        "aborts_sent": "ABORT messages handed to the scheduler's input.",
        "abort_calls": "Abort RPCs that ended a request.",
        "calls_cancelled": "Generate calls the client cancelled.",
        "completes": "GenerateComplete messages sent.",
        "chunks": "GenerateStreamChunk messages sent.",
        "output_messages": "Scheduler output messages read.",
        "outputs_untracked": "Requests' parts of scheduler outputs for no open call.",
        "outputs_bad": "Calls ended INTERNAL: their part of a scheduler output was unusable.",
        "outputs_undecodable": "Unusable scheduler outputs naming no open call (logged).",
        "wakeups": "Scheduler output reader callbacks run.",
        "watchdog_reads": "Scheduler output reads started by the watchdog: output waited unseen.",
    }

    def metrics(self) -> Iterator[Sample]:
        yield from counters(self, TRANSPORT, self.COUNTERS)
        doc = "Generate calls forwarded to the scheduler without a finished output yet."
        yield gauge(f"{TRANSPORT}_open_calls", doc, self.open_calls)
        t = TRANSPORT
        yield counter("undeliverable_replies", UNDELIVERABLE, self.undeliverable, transport=t)
        yield counter("received_bytes", RECEIVED_BYTES, self.received_bytes, transport=t)


class SmgGrpcFace:
    """The RPCs of ``TokenSpeedScheduler`` over the shared pool and one scheduler.

    Lifecycle (``mmadmit.server``; ``link`` bound, its ``on_death`` is the face's)::

        face = SmgGrpcFace(pool, profile, link, served_model_name=..., model_path=...)
        await link.handshake()       # the scheduler's
        await face.start()           # then HealthCheck is healthy
        ...                          # the gRPC server serves face.handlers()
        await face.drain(deadline)   # SIGTERM: forwarded requests finish
        await face.stop()            # every open call ends; idempotent
        await link.close()
    """

    def __init__(
        self,
        pool: MaterializerPool,
        profile: ModelProfile,
        link: SchedulerLink,
        *,
        served_model_name: str,
        model_path: str,
        telemetry: Telemetry | None = None,
        watchdog_s: float | None = WATCHDOG_S,
    ) -> None:
        self.link = link
        link.on_death = self._on_death
        self.stats = SmgStats()
        self.pool = pool
        self.profile = profile
        self.limits = pool.materializer.limits
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.admissions = Admissions(pool, transport=TRANSPORT, telemetry=telemetry)
        self.ready = False  # the scheduler's handshake is done
        self.draining = False
        self.started_at = time.time()
        self._watchdog_s = watchdog_s
        self._calls: dict[str, Call] = {}
        self.outputs = Outputs(self._calls, self.stats, link.died)
        self._sender: OrderedSender | None = None
        self._reader: SocketReader | None = None
        self._ready_info: dict[str, Any] = {}
        self._stop_task: asyncio.Future[None] | None = None

    def calls_received(self) -> int:
        """``Generate`` calls received so far (the port's sign of activity at shutdown)."""
        return self.stats.generate_calls

    def metrics(self) -> Iterator[Sample]:
        """The face's series and its link's (telemetry's ``Exports``)."""
        yield from self.stats.metrics()
        yield from self.link.stats.metrics(TRANSPORT)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """After the scheduler's handshake (``link.handshake()``): the request and
        output paths start."""
        link = self.link
        assert link.ready_response is not None and link.input is not None
        assert link.output is not None
        try:
            info = msgspec.msgpack.decode(link.ready_response.bytes)
            self._ready_info = info if isinstance(info, dict) else {}
        except msgspec.DecodeError:  # validated by the handshake; keep going without it
            self._ready_info = {}
        self._sender = OrderedSender(
            link.input,
            max_pending=MAX_PENDING_ADDS,
            on_sent=_ignore,
            on_failed=self._send_failed,
            prefix=[link.scheduler_identity],
            name="smg-grpc-scheduler-input",
        )
        self._sender.start()
        self._reader = SocketReader(
            link.output,
            self.outputs,
            stats=self.stats,
            name="scheduler output",
            watchdog_s=self._watchdog_s,
        )
        self._reader.start()
        self.ready = True
        logger.info("SMG gRPC face: serving %s for the scheduler", self.served_model_name)

    def _on_death(self, why: str) -> None:
        self.ready = False
        for call in self._calls.values():
            call.queue.put_nowait(_DEAD)

    def begin_drain(self) -> None:
        """SIGTERM: HealthCheck turns unhealthy, new calls end UNAVAILABLE
        (``SHUTTING_DOWN``); forwarded requests go on."""
        self.draining = True
        self.admissions.closing = True

    async def drain(self, deadline: float) -> int:
        """Wait until every forwarded request has finished or ``deadline`` (loop
        time), new calls refused meanwhile; return how many had not finished."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        while self._calls and not self.link.gone and loop.time() < deadline:
            await asyncio.sleep(min(0.01, max(0.0, deadline - loop.time())))
        left = len(self._calls)
        if left and not self.link.gone:
            logger.warning(
                "[shutdown] %d forwarded request(s) without a finished output at the drain "
                "deadline; their calls end UNAVAILABLE",
                left,
            )
        return left

    async def stop(self) -> None:
        """End every open call, stop the scheduler's paths (idempotent); the link's
        sockets are its own to close."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stop_task)

    async def _stop(self) -> None:
        self.link.stopping = True
        self.ready = False
        for call in self._calls.values():
            call.queue.put_nowait(_STOPPED)
        await asyncio.sleep(0)  # let the calls see it before the sockets go
        if self._sender is not None:
            await self._sender.stop()
        if self._reader is not None:
            self._reader.stop()
        logger.info("[shutdown] SMG gRPC face stopped (%s, %s)", self.stats, self.link.stats)

    # ------------------------------------------------------------------ to the scheduler

    def _send(self, frames: list[Any]) -> None:
        sender = self._sender
        assert sender is not None
        sender.add_pending()
        sender.put(frames)

    def _send_failed(self, msg: list[Any], exc: BaseException) -> None:
        self.stats.undeliverable += 1
        logger.warning("SMG gRPC face: a message could not reach the scheduler (%s)", exc)

    def _send_abort(self, rid: str) -> None:
        self.stats.aborts_sent += 1
        self._send([_ABORT, _ENC.encode([rid])])

    # ------------------------------------------------------------------ RPCs

    async def Generate(  # noqa: N802 - the contract's method name
        self,
        request: ts.GenerateRequest | StrippedRequest | RefusedRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ts.GenerateResponse]:
        t0 = time.perf_counter()
        self.stats.generate_calls += 1
        if isinstance(request, RefusedRequest):
            await self._refuse(
                context, request.request_id, None, Abort(request.code, request.message), t0
            )
            return
        if isinstance(request, Undecodable):
            why = f"the message does not parse as a GenerateRequest ({request.message})"
            await self._refuse(context, "", None, Abort(AbortCode.INVALID_REQUEST, why), t0)
            return
        msg = message_and_payloads(request)[0]
        rid = msg.request_id
        if not self.ready or self.link.gone or self.draining:
            why = (
                "the service is shutting down; retry on another replica"
                if self.draining or self.link.stopping
                else "the scheduler is not connected"
            )
            await self._refuse(context, rid, None, Abort(AbortCode.SHUTTING_DOWN, why), t0)
            return
        req: Request | None = None
        try:
            req = request_from_generate(request, self.profile, self.limits)
            if rid in self._calls:  # forwarded, still generating
                raise self.admissions.duplicate(rid)
        except AdmissionError as exc:
            await self._refuse(context, rid, req, exc.to_abort(), t0)
            return
        except Exception as exc:  # noqa: BLE001 - a bug must still end the call with a status
            logger.exception("rid=%s: unexpected error while translating", rid)
            await self._refuse(context, rid, req, abort_from_exception(exc), t0)
            return
        try:
            frames = await self.admissions.admit((b"", rid), req, self._add_frames, t0)
        except asyncio.CancelledError:
            self.stats.calls_cancelled += 1
            raise
        if isinstance(frames, Abort):
            await self._end(context, rid, frames)
            return
        # No await since the outcome was encoded: a twin of this rid was refused at
        # submit, and the scheduler was there (see _add_frames).
        call = self._calls[rid] = Call(msg.stream)
        self.stats.open_calls = len(self._calls)
        self.stats.adds_sent += 1
        self._send(frames)
        try:
            async for response in self._responses(rid, call, context):
                yield response
        except asyncio.CancelledError:
            self.stats.calls_cancelled += 1
            logger.info("rid=%s: Generate cancelled by the client; ABORT to the scheduler", rid)
            raise
        finally:
            if not (call.finished or call.aborted or self.link.gone or self.link.stopping):
                call.aborted = True
                self._send_abort(rid)  # after its ADD: one FIFO
            if self._calls.get(rid) is call:
                del self._calls[rid]
            self.stats.open_calls = len(self._calls)

    def _add_frames(self, outcome: Materialized | Abort) -> list[Any] | Abort:
        """The ladder's ``encode``: the scheduler's ADD for a materialized request
        (an abort stays itself, for :meth:`_end`)."""
        if isinstance(outcome, Abort):
            return outcome
        if not self.ready:  # the scheduler went while this request materialized
            raise ShuttingDown("the scheduler went away")
        return [_ADD, *wire.encode_request(outcome.request)]

    async def _responses(
        self, rid: str, call: Call, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ts.GenerateResponse]:
        responses = Responses(rid, call.stream)
        while True:
            piece = await call.queue.get()
            if piece is _ABORTED:
                await context.abort(
                    grpc.StatusCode.CANCELLED,
                    f"CANCELLED: request {rid!r} aborted by an Abort call",
                )
            if piece is _DEAD:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN: the scheduler went away"
                )
            if piece is _STOPPED:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "SHUTTING_DOWN: the service stopped before this request finished",
                )
            if type(piece) is Fault:
                await self._end(context, rid, Abort(AbortCode.INTERNAL, piece.message))
            assert isinstance(piece, Piece)
            chunk = complete = None
            try:  # checked when read (smg_outputs): a failure here is a bug of ours
                chunk, complete = responses.of(piece)
            except (TypeError, ValueError, OverflowError) as exc:
                self.stats.outputs_bad += 1
                logger.exception(
                    "rid=%s: a scheduler output passed the checks but not protobuf", rid
                )
                why = f"the scheduler's output for request {rid!r} cannot become a response"
                await self._end(
                    context, rid, Abort(AbortCode.INTERNAL, f"{why} ({type(exc).__name__}: {exc})")
                )
            if chunk is not None:
                self.stats.chunks += 1
                yield chunk
            if complete is not None:
                call.finished = True
                self.stats.completes += 1
                yield complete
                return

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        rid: str,
        req: Request | None,
        abort: Abort,
        t0: float,
    ) -> None:
        """End a call that never reached the pool (counted once, as its outcome:
        ``requests_total{transport="smg_grpc",outcome="aborted"}``)."""
        await self._end(context, rid, self.admissions.finish(rid, req, abort, t0, _same))

    async def _end(self, context: grpc.aio.ServicerContext, rid: str, abort: Abort) -> None:
        """End a call with the status of its abort (STATUS_OF, "CODE: message")."""
        logger.debug("rid=%s: ended %s: %s", rid, abort.code.value, abort.message)
        await context.abort(STATUS_OF[abort.code], f"{abort.code.value}: {abort.message}")

    async def Abort(  # noqa: N802
        self, request: ts.AbortRequest, context: grpc.aio.ServicerContext
    ) -> ts.AbortResponse:
        rid = request.request_id
        reason = request.reason or "no reason given"
        if self.admissions.cancel((b"", rid), AbortCode.CANCELLED, f"aborted: {reason}"):
            self.stats.abort_calls += 1
            logger.info("rid=%s: aborted by SMG while materializing (%s)", rid, reason)
            return ts.AbortResponse(success=True, message=f"request {rid!r} cancelled")
        call = self._calls.get(rid)
        if call is None or call.finished or call.aborted:
            return ts.AbortResponse(
                success=False, message=f"no request {rid!r} is in flight on this replica"
            )
        call.aborted = True
        self.stats.abort_calls += 1
        self._send_abort(rid)  # after its ADD: one FIFO
        call.queue.put_nowait(_ABORTED)  # the open stream ends now
        logger.info("rid=%s: aborted by SMG (%s); ABORT to the scheduler", rid, reason)
        return ts.AbortResponse(success=True, message=f"request {rid!r} aborted")

    async def HealthCheck(  # noqa: N802
        self, request: ts.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> ts.HealthCheckResponse:
        if self.link.gone:
            return ts.HealthCheckResponse(healthy=False, message="the scheduler went away")
        if self.draining or self.link.stopping:
            return ts.HealthCheckResponse(healthy=False, message="shutting down")
        if not self.ready:
            return ts.HealthCheckResponse(
                healthy=False, message="waiting for the scheduler's handshake"
            )
        return ts.HealthCheckResponse(healthy=True, message="ok")

    def model_info(self) -> ts.GetModelInfoResponse:
        profile = self.profile
        info = self._ready_info
        max_len = info.get("max_model_len") or profile.max_model_len or 0
        modalities = [
            _MODALITIES[m] for m in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)
            if profile.multimodal_active and profile.supports(m)
        ]  # fmt: skip
        dtype = info.get("dtype")
        encoder_dtype = info.get("multimodal_encoder_dtype")
        return ts.GetModelInfoResponse(
            model_path=self.model_path,
            tokenizer_path=self.model_path,
            served_model_name=self.served_model_name,
            model_type=profile.model_type,
            architectures=list(profile.architectures),
            max_context_length=int(max_len) if isinstance(max_len, int) else 0,
            max_req_input_len=int(max_len) if isinstance(max_len, int) else 0,
            vocab_size=profile.vocab_size,
            supports_vision=common_pb2.IMAGE in modalities or common_pb2.VIDEO in modalities,
            supports_multimodal=bool(modalities),
            supported_modalities=modalities,
            model_dtype=dtype if isinstance(dtype, str) else "",
            multimodal_encoder_dtype=encoder_dtype if isinstance(encoder_dtype, str) else "",
        )

    async def GetModelInfo(  # noqa: N802
        self, request: ts.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetModelInfoResponse:
        return self.model_info()

    async def GetServerInfo(  # noqa: N802
        self, request: ts.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetServerInfoResponse:
        resp = ts.GetServerInfoResponse(
            active_requests=len(self._calls) + len(self.admissions),
            is_paused=False,
            uptime_seconds=time.time() - self.started_at,
            tokenspeed_version=_VERSION,
        )
        resp.start_time.FromSeconds(int(self.started_at))
        resp.server_args.update(
            {
                "served_model_name": self.served_model_name,
                "model_path": self.model_path,
                "family": self.profile.family.value,
                "engine_index": self.link.engine_index,
                "max_inflight": self.pool.max_inflight,
            }
        )
        scheduler = {
            k: v for k, v in self._ready_info.items() if isinstance(v, str | int | float | bool)
        }
        resp.scheduler_info.update(scheduler)
        return resp

    async def GetLoads(  # noqa: N802
        self, request: ts.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetLoadsResponse:
        loads = self.outputs.loads
        queued = len(self.admissions)  # materializing here, not yet at the scheduler
        usage = loads.kv_active_pages / loads.kv_total_pages if loads.kv_total_pages else 0.0
        running = loads.num_running
        waiting = loads.num_waiting + queued
        load = ts.SchedulerLoad(
            dp_rank=self.link.engine_index,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            token_usage=usage,
            active_token_usage=usage,
            utilization=usage,
        )
        return ts.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=_VERSION,
            dp_rank_count=1,
            loads=[load],
            aggregate=ts.AggregateMetrics(
                total_running_reqs=running,
                total_waiting_reqs=waiting,
                total_reqs=running + waiting,
                avg_token_usage=usage,
                avg_utilization=usage,
            ),
        )

    # ------------------------------------------------------------------ gRPC wiring

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The method handlers of ``TokenSpeedScheduler`` (every method of the
        contract: those the msgpack wire cannot carry answer ``UNIMPLEMENTED``)."""
        stats = self.stats
        limits = self.limits

        def deserialize(data: bytes) -> Any:
            stats.received_bytes += len(data)
            return parse_or_undecodable(lambda b: parse_generate(b, limits), data)

        def unary(method: Any, req_type: Any, resp_type: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=req_type.FromString,
                response_serializer=resp_type.SerializeToString,
            )

        handlers: dict[str, grpc.RpcMethodHandler] = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate,
                request_deserializer=deserialize,
                response_serializer=ts.GenerateResponse.SerializeToString,
            ),
            "HealthCheck": unary(self.HealthCheck, ts.HealthCheckRequest, ts.HealthCheckResponse),
            "Abort": unary(self.Abort, ts.AbortRequest, ts.AbortResponse),
            "GetModelInfo": unary(
                self.GetModelInfo, ts.GetModelInfoRequest, ts.GetModelInfoResponse
            ),
            "GetServerInfo": unary(
                self.GetServerInfo, ts.GetServerInfoRequest, ts.GetServerInfoResponse
            ),
            "GetLoads": unary(self.GetLoads, ts.GetLoadsRequest, ts.GetLoadsResponse),
        }
        service = ts.DESCRIPTOR.services_by_name["TokenSpeedScheduler"]
        for method in service.methods:
            if method.name in handlers:
                continue
            handlers[method.name] = _unimplemented(method)
        return handlers


# What the msgpack wire to the scheduler cannot carry, by method (the status message).
_UNIMPLEMENTED_WHY = {
    "GetTokenizer": "mmadmit holds no tokenizer; give SMG the model's tokenizer path",
    "SubscribeKvEvents": "the scheduler's KV events do not travel on the msgpack wire",
    "FlushCache": "cache flushes do not travel on the msgpack wire",
    "StartProfile": "profiling does not travel on the msgpack wire",
    "StopProfile": "profiling does not travel on the msgpack wire",
}


def _unimplemented(method: Any) -> grpc.RpcMethodHandler:
    from google.protobuf import message_factory

    name = method.name
    why = _UNIMPLEMENTED_WHY.get(name, "not carried by mmadmit's SMG gRPC face")
    text = f"{name} is not implemented by mmadmit's SMG gRPC face: {why}"
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, text)

    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            refuse,  # type: ignore[arg-type]
            request_deserializer=req_cls.FromString,
            response_serializer=resp_cls.SerializeToString,
        )
    return grpc.unary_unary_rpc_method_handler(
        refuse,
        request_deserializer=req_cls.FromString,
        response_serializer=resp_cls.SerializeToString,
    )


def _same(outcome: Materialized | Abort) -> Abort:
    """``_refuse``'s ``encode``: the call ends with the abort's own status."""
    assert isinstance(outcome, Abort)
    return outcome


def _ignore(msg: list[Any]) -> None:
    pass


__all__ = [
    "SERVICE",
    "STATUS_OF",
    "TRANSPORT",
    "SmgGrpcFace",
    "SmgStats",
]
