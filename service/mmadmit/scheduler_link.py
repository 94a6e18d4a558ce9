"""The scheduler side of the engine handshake, shared by engine mode and the SMG gRPC face.

A headless scheduler connects to whoever plays SMG for it (docs/spec/WIRE.md, "Engine
mode"). :class:`SchedulerLink` plays that part, once, for every face that
stands in front of a scheduler; the face holds it (``face.link``) and
:mod:`mmadmit.server` drives its lifecycle:

* it binds a handshake ROUTER at ``--engine-handshake-listen`` and, on the same
  host with ephemeral ports, an input ROUTER and an output PULL
  (:meth:`SchedulerLink.bind`);
* it completes the scheduler's handshake (HELLO, INIT carrying those two
  addresses, READY, the scheduler's ready response on the input socket) and
  keeps the ready response and the scheduler's identity
  (:meth:`SchedulerLink.handshake`); a scheduler that restarts and
  says HELLO again is taken over (``ROUTER_HANDOVER``);
* it watches the scheduler's input and output connections: once its handshake
  is done (and until ``stopping``), a drop is its death, reported once through
  ``on_death(why)`` (the face's own reaction: engine mode sends
  ``ENGINE_CORE_DEAD`` to SMG, the gRPC face ends every open call) and then
  ``on_gone(why)`` (``mmadmit serve`` turns NOT_SERVING and exits 3).

What travels over the input and output sockets afterwards is the face's
business (:mod:`mmadmit.engine_mode`, :mod:`mmadmit.smg_grpc`). Each handshake
step waits up to ``--handshake-timeout`` with a progress line every 30 s; a
malformed message raises :class:`~mmadmit.handshake.HandshakeError`, a step
that never comes :class:`~mmadmit.handshake.HandshakeTimeout`.

Resources: every socket on the link's context, the face's too
(:meth:`SchedulerLink.socket`), and the context are in one list closed by a
``weakref.finalize`` (STYLE 9), so they are released even if nobody closes the link.
"""

from __future__ import annotations

import asyncio
import logging
import socket as _socket
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .handshake import (
    HandshakeError,
    HandshakeTimeout,
    decode_map,
    encode_init,
    engine_identity,
    parse_ready_response,
    parse_status,
)
from .telemetry import Sample, counter, gauge

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A progress line while a handshake step waits (the reference engine's period).
PROGRESS_S = 30.0
# The help of <face>_handshake_steps_total, whose two sides two modules count.
HANDSHAKE_STEPS = (
    "Engine handshake steps completed, by side (scheduler: HELLO, INIT, READY, ready "
    "response; smg, engine mode only: HELLO, INIT, READY, ready response, output connected)."
)


@dataclass
class SchedulerStats:
    """The scheduler link's counters (``SchedulerLink.stats``), exported by its face."""

    handshake_steps_scheduler: int = 0  # HELLO, INIT, READY, ready response
    scheduler_alive: int = 0  # 1 from the scheduler's ready response until it goes away
    # the scheduler's input / output connections seen dropping (before its handshake,
    # while stopping or after it: a death only in between)
    scheduler_drops: int = 0

    def metrics(self, face: str) -> Iterator[Sample]:
        """Under the face's name: ``engine_*`` or ``smg_grpc_*``."""
        steps = self.handshake_steps_scheduler
        yield counter(f"{face}_handshake_steps", HANDSHAKE_STEPS, steps, side="scheduler")
        doc = "1 while the scheduler is alive (from its ready response until it goes away)."
        yield gauge(f"{face}_scheduler_up", doc, self.scheduler_alive)
        doc = "The scheduler's input or output connection seen dropping."
        yield counter(f"{face}_scheduler_drops", doc, self.scheduler_drops)


def _bind_next_to(endpoint: str, suffix: str) -> str:
    """A bind address on the handshake's host with an ephemeral port (or a sibling path)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        host = rest.rsplit(":", 1)[0]
        return f"tcp://{host}:0"
    if scheme == "ipc":
        return f"ipc://{rest}.{suffix}"
    return f"{scheme}://{rest}-{suffix}"


def _advertised(bound: str) -> str:
    """What the scheduler is told to connect to: a wildcard host becomes this host's name."""
    scheme, _, rest = bound.partition("://")
    if scheme != "tcp":
        return bound
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::", "[::0]"):
        return f"tcp://{_socket.gethostname()}:{port}"
    return bound


def _close_all(socks: list[zmq.Socket[Any]], ctx: zmq.Context[Any] | None) -> None:
    """Finalizer: release every socket (linger 0) and the context."""
    for sock in socks:
        if not sock.closed:
            sock.close(linger=0)
    if ctx is not None and not ctx.closed:
        ctx.term()


class SchedulerLink:
    """One scheduler, as SMG would see it (usage in :mod:`mmadmit.server`)::

    link = SchedulerLink(listen=..., engine_index=0, handshake_timeout_s=600,
                         on_gone=lambda why: ...)
    await link.bind()        # the scheduler may connect from now on
    face = SmgGrpcFace(pool, profile, link, ...)   # sets link.on_death
    await link.handshake()   # the scheduler's; then await face.start()
    ...                      # face.drain(deadline), face.stop() (sets stopping)
    await link.close()       # idempotent
    """

    def __init__(
        self,
        *,
        listen: str,
        engine_index: int,
        handshake_timeout_s: float,
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        self.listen = listen
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        self.handshake_timeout_s = handshake_timeout_s
        self.stats = SchedulerStats()
        self.endpoint: str | None = None  # the bound handshake address (for the scheduler)
        self.input_address: str | None = None  # as told to the scheduler in INIT
        self.output_address: str | None = None
        self.on_death: Callable[[str], None] | None = None  # the face's reaction
        self.on_gone = on_gone
        self.context: zmq.asyncio.Context | None = None
        self.sockets: list[zmq.Socket[Any]] = []  # closed by close(), the face's too
        self._finalizer = weakref.finalize(self, _close_all, self.sockets, None)
        self._hs_down: zmq.asyncio.Socket | None = None
        self.input: zmq.asyncio.Socket | None = None  # the scheduler's input ROUTER
        self.output: zmq.Socket[Any] | None = None  # the scheduler's output PULL
        self.scheduler_identity: bytes | None = None
        self.ready_response: zmq.Frame | None = None
        self.ready = False  # its handshake is done: a drop from now on is death
        self.gone = False
        self.stopping = False  # our own stop closes the scheduler's connections: not a death
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ sockets

    def socket(self, kind: int, *, plain: bool = False) -> Any:
        """A socket on the link's context, closed (linger 0) by :meth:`close`."""
        assert self.context is not None
        ctx = self.context
        sock: zmq.Socket[Any] = zmq.Socket(ctx, kind) if plain else ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)  # the real linger is given at stop()
        self.sockets.append(sock)
        return sock

    def _bind(self, sock: zmq.Socket[Any], address: str, what: str) -> str:
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:  # e.g. address in use: an operator error, not a crash
            raise OSError(exc.errno, f"cannot bind {what} {address}: {exc.strerror}") from exc
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def bind(self) -> str:
        """Bind what SMG would bind for the scheduler; return the handshake endpoint."""
        if self.context is not None:
            raise RuntimeError(f"{type(self).__name__}.bind() may be called only once")
        self.context = ctx = zmq.asyncio.Context()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close_all, self.sockets, ctx)
        try:
            hs = self._hs_down = self.socket(zmq.ROUTER)
            # A restarted scheduler reconnects with the same identity: take it over.
            hs.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self.endpoint = self._bind(hs, self.listen, "the engine handshake")
            inp = self.input = self.socket(zmq.ROUTER)
            inp.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # Mandatory: a full scheduler raises EAGAIN (awaited: back-pressure) and a
            # gone one EHOSTUNREACH, instead of either silently dropping requests.
            inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.input_address = _advertised(
                self._bind(inp, _bind_next_to(self.endpoint, "input"), "the scheduler input")
            )
            pull = self.output = self.socket(zmq.PULL, plain=True)
            self.output_address = _advertised(
                self._bind(pull, _bind_next_to(self.endpoint, "output"), "the scheduler output")
            )
            for sock, what in ((inp, "input"), (pull, "output")):
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self.sockets.append(monitor)
                self._spawn(self._watch(monitor, what))
        except BaseException:
            self._finalizer()
            raise
        logger.info(
            "scheduler handshake on %s (input %s, output %s) for engine %d",
            self.endpoint,
            self.input_address,
            self.output_address,
            self.engine_index,
        )
        return self.endpoint

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ handshake

    async def step(self, aw: Awaitable[T], step: str) -> T:
        """Wait for one handshake step: a progress line every 30 s, at most the timeout."""
        fut = asyncio.ensure_future(aw)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.handshake_timeout_s
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise HandshakeTimeout(step, self.handshake_timeout_s)
                done, _ = await asyncio.wait({fut}, timeout=min(PROGRESS_S, remaining))
                if done:
                    return fut.result()
                logger.info(
                    "engine handshake: still waiting for %s (%.0fs of %.0fs)",
                    step,
                    loop.time() - start,
                    self.handshake_timeout_s,
                )
        finally:
            if not fut.done():
                fut.cancel()

    def _check_identity(self, identity: bytes, step: str) -> None:
        if len(identity) != 2:
            raise HandshakeError(
                step,
                "identity",
                "must be the engine index as 2 bytes little-endian, got "
                f"{identity.hex() or '(empty)'}",
            )
        index = int.from_bytes(identity, "little")
        if index != self.engine_index:
            raise HandshakeError(
                step,
                "identity",
                f"the scheduler is engine {index} but --engine-index is {self.engine_index}; "
                "they must be equal (its outputs name it to SMG)",
            )

    async def handshake(self) -> None:
        """The scheduler's handshake; raises HandshakeError / HandshakeTimeout."""
        hs, inp = self._hs_down, self.input
        assert hs is not None and inp is not None
        assert self.input_address is not None and self.output_address is not None
        hello: list[zmq.Frame] | None = None
        while True:
            step = "HELLO from the scheduler"
            if hello is None:
                hello = await self.step(hs.recv_multipart(copy=False), step)
            frames, hello = hello, None
            if len(frames) < 2:
                raise HandshakeError(step, "(message)", "no frame after the identity")
            identity = frames[0].bytes
            parse_status(frames[-1].buffer, "HELLO", step)
            self._check_identity(identity, step)
            self.stats.handshake_steps_scheduler += 1
            logger.info("engine handshake: HELLO from the scheduler (engine %d)", self.engine_index)
            init = encode_init([self.input_address], [self.output_address])
            await hs.send_multipart([identity, init])
            self.stats.handshake_steps_scheduler += 1
            step = "READY from the scheduler"
            frames = await self.step(hs.recv_multipart(copy=False), step)
            status = decode_map(frames[-1].buffer, step).get("status")
            if status == "HELLO":  # the scheduler restarted: start over with this HELLO
                logger.info("engine handshake: the scheduler said HELLO again; starting over")
                hello = frames
                continue
            parse_status(frames[-1].buffer, "READY", step)
            if frames[0].bytes != identity:
                raise HandshakeError(step, "identity", "READY came from another peer than HELLO")
            self.stats.handshake_steps_scheduler += 1
            step = "ready response from the scheduler"
            frames = await self.step(inp.recv_multipart(copy=False), step)
            if frames[0].bytes != identity:
                self._check_identity(frames[0].bytes, step)
            missing = parse_ready_response(frames[-1].buffer, step)
            if missing:
                logger.warning(
                    "engine handshake: the scheduler's ready response lacks %s (relayed as is)",
                    ", ".join(missing),
                )
            self.scheduler_identity = identity
            self.ready_response = frames[-1]
            self.ready = True
            self.stats.handshake_steps_scheduler += 1
            self.stats.scheduler_alive = 1
            logger.info("engine handshake: the scheduler is ready")
            return

    # ------------------------------------------------------------------ death

    async def _watch(self, monitor: zmq.asyncio.Socket, what: str) -> None:
        """The scheduler's connection dropped: after its handshake, that is its death."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] != zmq.EVENT_DISCONNECTED:
                    continue
                self.stats.scheduler_drops += 1
                if self.ready:
                    self.died(f"its {what} connection dropped")
                else:
                    logger.info("engine handshake: a connection to the scheduler %s dropped", what)
        except (asyncio.CancelledError, zmq.ZMQError):
            return

    def died(self, why: str) -> None:
        """The scheduler went away: ``on_death`` then ``on_gone``, once (not while stopping)."""
        if self.gone or self.stopping:
            return
        self.gone = True
        self.stats.scheduler_alive = 0
        logger.error("the scheduler went away (%s)", why)
        if self.on_death is not None:
            self.on_death(why)
        if self.on_gone is not None:
            self.on_gone(why)

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Cancel the link's tasks, close every socket still open (linger 0) and
        terminate the context off the loop (idempotent)."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for sock in self.sockets:
            if not sock.closed:
                sock.close(linger=0)
        ctx = self.context
        if ctx is not None and not ctx.closed:
            await asyncio.to_thread(ctx.term)  # waits for lingering sockets: off the loop
        self._finalizer.detach()


__all__ = ["HANDSHAKE_STEPS", "PROGRESS_S", "SchedulerLink", "SchedulerStats"]
