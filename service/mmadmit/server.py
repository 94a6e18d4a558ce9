"""``mmadmit serve``: wiring and lifecycle only (no request logic lives here).

Start-up: profile -> materializer -> pool -> transports bound -> one warm-up
request through the pool -> health SERVING and the ready line on stderr::

    mmadmit ready grpc=HOST:PORT zmq=tcp://HOST:PORT metrics=HOST:PORT

Every resource is entered into one ``AsyncExitStack`` as soon as it exists, so
a start-up that fails half-way still releases what it had.

Shutdown (SIGTERM or SIGINT), in this order: health NOT_SERVING; the pool
refuses new work, so every transport, which keeps reading, answers each new
request ``SHUTTING_DOWN`` at once; in-flight work gets ``--drain-timeout``
seconds, then what remains ends ``SHUTTING_DOWN``; each intake (ZMQ socket,
gRPC port) closes once nothing has arrived on it for
:data:`~mmadmit.admission.INTAKE_QUIET_S` (a message still on the wire is
answered, not dropped), ZMQ replies lingering to leave; the process exits 0. A
second signal exits at once with status 1.

Engine mode (``--smg-handshake`` with ``--engine-handshake-listen``,
:mod:`mmadmit.engine_mode`): the scheduler-facing sockets are bound with the
other transports (a line ``mmadmit engine-handshake ADDRESS`` tells where,
before anything waits), then the warm-up, then both handshakes, scheduler
first; only then health turns SERVING and the ready line, which then ends with
`` engine=ADDRESS`` (the bound scheduler handshake address), is printed. A
malformed handshake message exits 2, a handshake step that times out exits 3.
When the scheduler goes away the relay sends ENGINE_CORE_DEAD upstream, health
turns NOT_SERVING and the process exits 3 after the usual (short) shutdown. On
a signal the drain also waits, within ``--drain-timeout``, until every request
forwarded to the scheduler has a finished output; then ENGINE_CORE_DEAD goes
upstream and the process exits 0.

The SMG gRPC face (``--smg-grpc-listen`` with ``--engine-handshake-listen``,
:mod:`mmadmit.smg_grpc`) has the same lifecycle in front of its scheduler: its
gRPC port is bound with the others, health turns SERVING after the scheduler's
handshake, and the ready line ends `` smg-grpc=HOST:PORT engine=ADDRESS``. When
the scheduler goes away every open ``Generate`` ends ``UNAVAILABLE`` and the
process exits 3; on a signal, outputs of forwarded requests flow until each
has finished or ``--drain-timeout`` passed, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import native, security
from .admission import INTAKE_MAX_S
from .config import OFF, ServeConfig, default_workers
from .devices import cuda_ops_factory, resolve_device
from .errors import ConfigError
from .logs import configure_logging, fields, json_line, stop_writer, write_line
from .materializer import CPU_OPS, ArrayOps, Materializer
from .model import Item, Materialized, Modality, MultimodalInputs, Request, Tensor
from .pool import BeforeRun, MaterializerPool
from .profile import ModelProfile
from .runtime import run_loop, tune_process
from .telemetry import Exports, StatsCollector, Telemetry, disable_created_metrics

logger = logging.getLogger("mmadmit.server")

EXIT_FORCED = 1
EXIT_HANDSHAKE = 2  # a malformed engine handshake message: a deployment problem
EXIT_SCHEDULER_GONE = 3  # engine mode: the scheduler went away (or never came)
_TRANSPORT_NAMES = ("grpc", "zmq", "metrics")


@dataclass
class ServerHandle:
    """What a running server exposes to its owner (tests, the CLI)."""

    config: ServeConfig
    profile: ModelProfile
    pool: MaterializerPool
    telemetry: Telemetry
    addresses: dict[str, str] = field(default_factory=dict)
    grpc: Any = None
    zmq: Any = None
    metrics: Any = None
    link: Any = None  # scheduler_link.SchedulerLink of engine mode or the SMG gRPC face
    engine: Any = None  # engine_mode.EngineRelay in engine mode
    smg: Any = None  # smg_grpc.SmgGrpcFace with the SMG gRPC face
    smg_port: Any = None  # grpc_server.GrpcPort serving it
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0

    @property
    def front(self) -> Any:
        """The face on ``link`` (engine mode's relay or the SMG gRPC face), or None."""
        return self.engine if self.engine is not None else self.smg

    def ready_fields(self) -> dict[str, str]:
        """The ready line's ``name=address`` pairs: the three transports, then
        ``smg-grpc`` with the SMG gRPC face and ``engine`` in engine mode or with the
        face (so the usual line is unchanged)."""
        out = {name: self.addresses.get(name, OFF) for name in _TRANSPORT_NAMES}
        if "smg-grpc" in self.addresses:
            out["smg-grpc"] = self.addresses["smg-grpc"]
        if "engine" in self.addresses:
            out["engine"] = self.addresses["engine"]
        return out

    def ready_line(self) -> str:
        parts = [f"{name}={address}" for name, address in self.ready_fields().items()]
        return "mmadmit ready " + " ".join(parts)


def warmup_request(profile: ModelProfile, within: Materializer | None = None) -> Request:
    """The service's own first request, built *within* the limits of ``within`` (the
    materializer that will run it: its ``--max-*`` limits, its profile's
    ``--max-model-len``), so that no valid setting refuses it.

    Why built within the limits rather than run outside them: start-up runs it
    through the pool, on the materializer that serves every request (the pool's
    counts, its inline path or a worker, the rules of this very profile), and that
    materializer holds the operator's limits; a twin materializer without them would
    leave the real one unexercised. So the request shrinks to fit and still takes the
    profile's multimodal path: 8 text tokens, an image of 2x2 merged patches (4
    placeholders), 8 more tokens; with fewer tokens allowed, less text and an image
    of one merged patch (one token: ``--max-model-len 2`` or ``--max-tokens 1`` leave
    just that); its ``image_grid_thw`` is int64 ``[[t, h, w]]``, or rank 1 (``[t, h,
    w]``) and a narrower integer type under tight tensor limits. Only when no grid can
    pass at all (``--max-tensor-dim`` or ``--max-tensor-bytes`` under 3, which refuses
    every image request) is it text alone, as it is for a text-only profile: the
    service then runs nothing but text either. ``within`` None: the default limits.
    """
    from .limits import DEFAULT_LIMITS

    limits = within.limits if within is not None else DEFAULT_LIMITS
    budget = limits.max_tokens
    if profile.max_model_len is not None:
        budget = min(budget, profile.max_model_len - 1)
    text = np.arange(1, 1 + min(8, budget), dtype=np.int64) % profile.vocab_size
    grid_dtype = next(
        (dt for dt in (np.int64, np.int32, np.int16, np.int8)
         if 3 * np.dtype(dt).itemsize <= limits.max_tensor_bytes),
        None,
    )  # fmt: skip
    if (
        not (profile.multimodal_active and profile.supports(Modality.IMAGE))
        or grid_dtype is None
        or limits.max_tensor_dim < 3
    ):
        return Request(rid="mmadmit-warmup", input_ids=text)
    merge = profile.spatial_merge_size
    image_id = profile.image_token_id
    assert image_id is not None
    side = 2 if budget >= 4 else 1  # merged patches per side: side**2 placeholders
    placeholders = side * side
    before = min(8, (budget - placeholders + 1) // 2)
    after = min(8, budget - placeholders - before)
    ids = np.concatenate([text[:before], np.full(placeholders, image_id, np.int64), text[:after]])
    thw = np.array([1, side * merge, side * merge], grid_dtype)
    grid = Tensor.from_numpy(thw if limits.max_tensor_rank < 2 else thw.reshape(1, 3))
    item = Item(
        modality=int(Modality.IMAGE),
        hash=0,
        offsets=np.array([[before, before + placeholders - 1]], np.int64),
        side={"image_grid_thw": grid},
    )
    return Request(rid="mmadmit-warmup", input_ids=ids, mm=MultimodalInputs(items=[item]))


def calibration_request(
    profile: ModelProfile, tokens: int = 32_768, within: Materializer | None = None
) -> Request:
    """A text request big enough for the pool to learn its inline rate from: ``tokens``
    long, or the longest ``within`` (the materializer that will time it) admits when
    its ``--max-tokens`` or ``--max-model-len`` is shorter. A refused request would
    be timed as a near-zero rate, which sends every later request inline; a shorter
    one is what the service can admit at all, and the pool learns nothing from a run
    too short to say (``pool.InlineCost.learn``), so the default rate stands."""
    if within is not None:
        tokens = min(tokens, within.limits.max_tokens)
        if within.profile.max_model_len is not None:
            tokens = min(tokens, within.profile.max_model_len - 1)
    ids = np.arange(tokens, dtype=np.int64) % max(2, min(profile.vocab_size, 30_000))
    return Request(rid="mmadmit-calibration", input_ids=ids)


def build_pool(
    config: ServeConfig,
    profile: ModelProfile,
    *,
    before_run: BeforeRun | None = None,
    telemetry: Telemetry | None = None,
) -> MaterializerPool:
    device = resolve_device(config.device)
    materializer = Materializer(profile, config.limits)
    ops_factory = None
    choose_ops: Callable[[Request, ArrayOps], ArrayOps] | None = None
    if device == "cuda":
        ops_factory = cuda_ops_factory()
        threshold = config.cuda_min_tokens

        def choose_ops(req: Request, ops: ArrayOps) -> ArrayOps:
            # Small requests do not pay for the transfers: keep them on the CPU.
            return ops if len(req.input_ids) >= threshold else CPU_OPS

    workers = default_workers(config, device == "cuda")
    logger.info(
        "materializer: %s on %s, %d worker(s), max %d in flight, inline up to %d tokens "
        "(larger ones up to an estimated %.0f us), native code %s",
        profile.family.value,
        device,
        workers,
        config.max_inflight,
        config.inline_max_tokens,
        config.inline_max_us,
        "on" if config.native else "off",
        extra=fields(
            "starting",
            family=profile.family.value,
            device=device,
            workers=workers,
            max_inflight=config.max_inflight,
            inline_max_tokens=config.inline_max_tokens,
            inline_max_us=config.inline_max_us,
            native=config.native,
        ),
    )
    return MaterializerPool(
        materializer,
        workers=workers,
        max_inflight=config.max_inflight,
        ops_factory=ops_factory,
        choose_ops=choose_ops,
        before_run=before_run,
        inline_max_tokens=config.inline_max_tokens,
        inline_max_us=config.inline_max_us,
        observe_run=telemetry.materialize_time if telemetry is not None else None,
    )


async def start_server(
    config: ServeConfig,
    stack: contextlib.AsyncExitStack,
    *,
    before_run: BeforeRun | None = None,
    stop_event: asyncio.Event | None = None,
) -> ServerHandle:
    """Bind everything, warm up, turn SERVING; resources are pushed onto ``stack``.

    In engine mode health stays NOT_SERVING: :func:`serve` turns it SERVING once
    both handshakes are done (:func:`engine_handshake`).
    """
    native.set_enabled(config.native)  # before anything reads a request
    profile = config.load_profile()
    telemetry = Telemetry(profile.family.value, log_outcomes=config.log_outcomes)
    pool = build_pool(config, profile, before_run=before_run, telemetry=telemetry)
    stack.callback(pool.close)
    handle = ServerHandle(config=config, profile=profile, pool=pool, telemetry=telemetry)
    if stop_event is not None:
        handle.stop_event = stop_event

    if config.grpc_listen != OFF:
        from .grpc_server import GrpcServer

        tls = security.grpc_tls_from_config(config)
        grpc_server = GrpcServer(
            pool,
            profile,
            listen=config.grpc_listen,
            max_message_bytes=config.max_message_bytes,
            max_streams=config.max_grpc_streams,
            max_stream_inflight=config.max_stream_inflight,
            telemetry=telemetry,
            credentials=tls.server_credentials() if tls is not None else None,
            security=("mutual TLS" if tls.mutual else "TLS") if tls is not None else "plaintext",
        )
        stack.push_async_callback(grpc_server.stop, 0.0)
        handle.addresses["grpc"] = await grpc_server.start()
        handle.grpc = grpc_server
    if config.zmq_listen != OFF:
        from .zmq_ingest import ZmqIngest
        from .zmq_output import Forward, Reply

        ingest = ZmqIngest(
            pool,
            Reply() if config.zmq_forward is None else Forward(config.zmq_forward),
            listen=config.zmq_listen,
            max_message_bytes=config.max_message_bytes,
            telemetry=telemetry,
            curve=security.curve_from_config(config),
            limits=config.limits,
            max_frames=config.max_frames,
            max_peer_inflight=config.max_peer_inflight,
        )
        stack.push_async_callback(ingest.stop, 0.0)
        handle.addresses["zmq"] = await ingest.start()
        handle.zmq = ingest
    if config.engine_mode or config.smg_grpc:
        from .scheduler_link import SchedulerLink

        assert config.engine_handshake_listen is not None
        link = handle.link = SchedulerLink(
            listen=config.engine_handshake_listen,
            engine_index=config.engine_index,
            handshake_timeout_s=config.handshake_timeout,
            on_gone=lambda why: _scheduler_gone(handle, why),
        )
        stack.push_async_callback(link.close)
        handle.addresses["engine"] = await link.bind()
    if config.engine_mode:
        from .engine_mode import EngineRelay

        assert config.smg_handshake is not None
        relay = EngineRelay(
            pool,
            link,
            smg_handshake=config.smg_handshake,
            max_message_bytes=config.max_message_bytes,
            telemetry=telemetry,
            limits=config.limits,
            max_frames=config.max_frames,
        )
        stack.push_async_callback(relay.stop, 0.0)
        handle.engine = relay
    if config.smg_grpc:
        from .grpc_server import GrpcPort
        from .smg_grpc import SERVICE, SmgGrpcFace

        assert config.smg_grpc_listen is not None
        face = SmgGrpcFace(
            pool,
            profile,
            link,
            served_model_name=config.model_name(),
            model_path=config.model_name(),
            telemetry=telemetry,
        )
        stack.push_async_callback(face.stop)
        handle.smg = face
        tls = security.grpc_tls_from_config(config)  # the same TLS as --grpc-listen
        port = GrpcPort(
            {SERVICE: face.handlers()},
            listen=config.smg_grpc_listen,
            max_message_bytes=config.max_message_bytes,
            max_streams=config.max_grpc_streams,
            credentials=tls.server_credentials() if tls is not None else None,
            security=("mutual TLS" if tls.mutual else "TLS") if tls is not None else "plaintext",
            activity=face.calls_received,
        )
        stack.push_async_callback(port.stop, 0.0)
        handle.addresses["smg-grpc"] = await port.start()
        handle.smg_port = port
    if handle.link is not None:
        _print_line(
            config,
            f"mmadmit engine-handshake {handle.addresses['engine']}",
            fields("engine_listen", handshake=handle.addresses["engine"]),
        )
    # What /metrics reads: each declares its series (telemetry.Exports).
    sources: list[Exports] = [
        pool,
        *(t for t in (handle.zmq, handle.engine, handle.smg) if t is not None),
    ]
    if handle.grpc is not None:
        sources.append(handle.grpc.stats)
    device = resolve_device(config.device)
    build = {"family": profile.family.value, "device": device, "role": profile.role}
    telemetry.registry.register(StatsCollector(sources, build))
    if config.metrics_listen != OFF:
        from .metrics import MetricsServer

        metrics = MetricsServer(telemetry.registry, listen=config.metrics_listen)
        stack.push_async_callback(metrics.stop)
        handle.addresses["metrics"] = await metrics.start()
        handle.metrics = metrics

    outcome = await pool.materialize(warmup_request(profile, pool.materializer))
    if not isinstance(outcome, Materialized):
        raise RuntimeError(f"warm-up request failed: {outcome}")
    # this machine's rates (pool.InlineCost: per token and item, per hashed byte) before
    # the first request
    pool.calibrate_inline(calibration_request(profile, within=pool.materializer))
    if handle.grpc is not None and handle.link is None:
        handle.grpc.set_serving()
    return handle


def _print_line(config: ServeConfig, line: str, extra: dict[str, Any]) -> None:
    """A machine-readable line on stderr at any log level (a JSON object in json format)."""
    write_line(json_line(logger.name, line, extra) if config.log_format == "json" else line)


def _scheduler_gone(handle: ServerHandle, why: str) -> None:
    """The link lost the scheduler (its face has reacted): NOT_SERVING, exit 3."""
    if handle.exit_code == 0:
        handle.exit_code = EXIT_SCHEDULER_GONE
    if handle.grpc is not None:
        handle.grpc.enter_drain()
    if handle.smg_port is not None:
        handle.smg_port.enter_drain()
    logger.error(
        "the scheduler went away (%s): shutting down, exit status %d",
        why,
        EXIT_SCHEDULER_GONE,
        extra=fields("scheduler_gone", reason=why),
    )
    handle.stop_event.set()


async def engine_handshake(handle: ServerHandle) -> int | None:
    """Complete both engine handshakes, or return the exit status that ends the run.

    None: done (health may turn SERVING). Otherwise: 0 for a signal during the
    handshake, 2 for a malformed handshake message, 3 for a step that timed out
    or a scheduler that went away meanwhile.
    """
    from .handshake import HandshakeError, HandshakeTimeout

    async def handshakes() -> None:
        await handle.link.handshake()
        await handle.front.start()

    task = asyncio.ensure_future(handshakes())
    stopped = asyncio.ensure_future(handle.stop_event.wait())
    try:
        done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return handle.exit_code
    try:
        task.result()
    except HandshakeError as exc:
        logger.error("engine handshake failed: %s", exc, extra=fields("handshake_failed"))
        write_line(f"mmadmit: engine handshake failed: {exc}")
        return EXIT_HANDSHAKE
    except HandshakeTimeout as exc:
        logger.error("engine handshake timed out: %s", exc, extra=fields("handshake_timeout"))
        write_line(f"mmadmit: engine handshake timed out: {exc}")
        return EXIT_SCHEDULER_GONE
    return handle.exit_code or None


async def shutdown(handle: ServerHandle) -> None:
    """Drain in the fixed order of the module docstring (idempotent enough to call once)."""
    config = handle.config
    deadline = asyncio.get_running_loop().time() + config.drain_timeout
    logger.info(
        "[shutdown] draining: up to %.1fs for %d request(s) in flight",
        config.drain_timeout,
        handle.pool.inflight,
        extra=fields("drain", timeout_s=config.drain_timeout, inflight=handle.pool.inflight),
    )
    if handle.grpc is not None:
        handle.grpc.enter_drain()
    if handle.smg_port is not None:
        handle.smg_port.enter_drain()
    if handle.smg is not None:
        handle.smg.begin_drain()  # new Generate calls: UNAVAILABLE
    handle.pool.begin_drain()
    ended = await handle.pool.drain(config.drain_timeout)
    if handle.engine is not None:
        from .engine_mode import DEAD_LINGER_S

        if handle.engine.ready:
            await handle.engine.drain(deadline)  # outputs flow until forwarded work finished
        await handle.engine.stop(DEAD_LINGER_S)  # then ENGINE_CORE_DEAD upstream
    if handle.smg is not None:
        if handle.smg.ready:
            await handle.smg.drain(deadline)  # outputs flow until forwarded work finished
        await handle.smg.stop()  # the calls still open end UNAVAILABLE
    if handle.link is not None:
        await handle.link.close()  # the scheduler's sockets, the face's last ones
    # Each intake answers SHUTTING_DOWN until nothing more arrives, then closes.
    await asyncio.gather(
        *(_close_port(port, deadline) for port in (handle.smg_port, handle.grpc) if port),
        *([handle.zmq.stop(config.drain_timeout)] if handle.zmq is not None else []),
    )
    # Not the pool's admitted: that counts the start-up's warm-up request too.
    materialized, aborted = handle.telemetry.answered()
    logger.info(
        "[shutdown] done: %d request(s) answered (%d materialized, %d aborted), "
        "%d ended SHUTTING_DOWN by the drain deadline",
        materialized + aborted,
        materialized,
        aborted,
        ended,
        extra=fields(
            "stopped",
            answered=materialized + aborted,
            materialized=materialized,
            aborted=aborted,
            shutdown_aborted=ended,
        ),
    )


async def _close_port(port: Any, deadline: float) -> None:
    """A gRPC port at shutdown: serve until quiet, then stop (running calls get 1 s)."""
    await port.quiesce(max(deadline, asyncio.get_running_loop().time()) + INTAKE_MAX_S)
    await port.stop(1.0)


async def serve(
    config: ServeConfig,
    *,
    on_ready: Callable[[ServerHandle], Awaitable[None] | None] | None = None,
    install_signals: bool = True,
) -> int:
    """Run until a signal (or ``handle.stop_event``); return the exit status."""
    async with contextlib.AsyncExitStack() as stack:
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        if install_signals:
            # Before start-up: engine mode may wait long for its handshakes.
            _install_signal_handlers(loop, stop_event)
        handle = await start_server(config, stack, stop_event=stop_event)
        if handle.link is not None:
            status = await engine_handshake(handle)
            if status is not None:
                await shutdown(handle)
                return status
            for port in (handle.grpc, handle.smg_port):
                if port is not None:
                    port.set_serving()
        line = handle.ready_line()
        ready = fields("ready", **handle.ready_fields())
        if config.log_format == "json":
            # the ready line is this JSON object (its message is the text line), at any level
            write_line(json_line(logger.name, line, ready))
        else:
            write_line(line)
            logger.info("ready: %s", line, extra=ready)
        if on_ready is not None:
            result = on_ready(handle)
            if asyncio.iscoroutine(result):
                await result
        await handle.stop_event.wait()
        await shutdown(handle)
    return handle.exit_code


def _install_signal_handlers(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("[shutdown] second signal %d: exiting at once", signum)
            os._exit(EXIT_FORCED)
        logger.info("[shutdown] signal %d received", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def run(config: ServeConfig) -> int:
    """Entry point of ``mmadmit serve``: logging, process tuning, the event loop."""
    configure_logging(config.log_level, config.log_format)
    # No `*_created` timestamp series beside every counter and histogram: they double
    # the exposition and Prometheus does not need them (process-wide switch).
    disable_created_metrics()
    tune_process(config.malloc_arenas)  # after the imports: what they made is frozen (GC)
    try:
        return run_loop(serve(config))
    except ConfigError:
        raise
    except OSError as exc:
        # A bind failure is an operator problem, not a crash: one clear line.
        raise ConfigError(f"cannot start: {exc}") from exc
    finally:
        stop_writer()  # what is queued reaches stderr (bounded: a reader may be gone)
