"""The scheduler side of the engine handshake, shared by engine mode and the SMG gRPC face.

A headless scheduler connects to whoever plays SMG for it (docs/spec/WIRE.md, "Engine
mode"). :class:`SchedulerLink` plays that part, once, for every face that
stands in front of a scheduler:

* it binds a handshake ROUTER at ``--engine-handshake-listen`` and, on the same
  host with ephemeral ports, an input ROUTER and an output PULL
  (:meth:`SchedulerLink.bind`);
* it completes the scheduler's handshake (HELLO, INIT carrying those two
  addresses, READY, the scheduler's ready response on the input socket) and
  keeps the ready response and the scheduler's identity
  (:meth:`SchedulerLink.handshake_scheduler`); a scheduler that restarts and
  says HELLO again is taken over (``ROUTER_HANDOVER``);
* it watches the scheduler's input and output connections: once its handshake
  is done, a drop is its death, reported once through
  :meth:`SchedulerLink._on_death` (the face's own reaction: engine mode sends
  ``ENGINE_CORE_DEAD`` to SMG, the gRPC face ends every open call) and then
  ``on_gone(why)`` (``mmadmit serve`` turns NOT_SERVING and exits 3).

What travels over the input and output sockets afterwards is the face's
business (:mod:`mmadmit.engine_mode`, :mod:`mmadmit.smg_grpc`). Each handshake
step waits up to ``--handshake-timeout`` with a progress line every 30 s; a
malformed message raises :class:`~mmadmit.handshake.HandshakeError`, a step
that never comes :class:`~mmadmit.handshake.HandshakeTimeout`.

Resources: every socket and the context are in one list closed by a
``weakref.finalize`` (STYLE 9), so they are released even if a face never
stops.
"""

from __future__ import annotations

import asyncio
import logging
import socket as _socket
import weakref
from collections.abc import Awaitable, Callable
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

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A progress line while a handshake step waits (the reference engine's period).
PROGRESS_S = 30.0


@dataclass
class SchedulerStats:
    """The scheduler link's counters (a face's stats class extends this)."""

    handshake_steps_scheduler: int = 0  # HELLO, INIT, READY, ready response
    scheduler_alive: int = 0  # 1 from the scheduler's ready response until it goes away
    # the scheduler's input / output connections seen dropping (before its handshake,
    # while stopping or after it: a death only in between)
    scheduler_drops: int = 0


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
    """One scheduler, as SMG would see it; a face extends it (usage: ``EngineRelay``).

    ``stats`` must have the :class:`SchedulerStats` fields; ``on_gone(why)`` is
    called once when the scheduler goes away after its handshake, after the
    face's own :meth:`_on_death`.
    """

    def __init__(
        self,
        *,
        listen: str,
        engine_index: int,
        handshake_timeout_s: float,
        stats: SchedulerStats,
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        self.listen = listen
        self.engine_index = engine_index
        self.identity = engine_identity(engine_index)
        self.handshake_timeout_s = handshake_timeout_s
        self.stats = stats
        self.endpoint: str | None = None  # the bound handshake address (for the scheduler)
        self.input_address: str | None = None  # as told to the scheduler in INIT
        self.output_address: str | None = None
        self._on_gone = on_gone
        self._ctx: zmq.asyncio.Context | None = None
        self._socks: list[zmq.Socket[Any]] = []
        self._finalizer = weakref.finalize(self, _close_all, self._socks, None)
        self._hs_down: zmq.asyncio.Socket | None = None
        self._in_down: zmq.asyncio.Socket | None = None
        self._pull: zmq.Socket[Any] | None = None
        self._scheduler_identity: bytes | None = None
        self._ready_response: zmq.Frame | None = None
        self._scheduler_ready = False  # its handshake is done: a drop from now on is death
        self._dead = False
        self._stopping = False  # our own stop closes the scheduler's connections: not a death
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def scheduler_gone(self) -> bool:
        return self._dead

    # ------------------------------------------------------------------ sockets

    def _socket(self, kind: int, *, plain: bool = False) -> Any:
        assert self._ctx is not None
        sock: zmq.Socket[Any] = zmq.Socket(self._ctx, kind) if plain else self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)  # the real linger is given at stop()
        self._socks.append(sock)
        return sock

    def _bind(self, sock: zmq.Socket[Any], address: str, what: str) -> str:
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:  # e.g. address in use: an operator error, not a crash
            raise OSError(exc.errno, f"cannot bind {what} {address}: {exc.strerror}") from exc
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def bind(self) -> str:
        """Bind what SMG would bind for the scheduler; return the handshake endpoint."""
        if self._ctx is not None:
            raise RuntimeError(f"{type(self).__name__}.bind() may be called only once")
        self._ctx = ctx = zmq.asyncio.Context()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close_all, self._socks, ctx)
        try:
            hs = self._hs_down = self._socket(zmq.ROUTER)
            # A restarted scheduler reconnects with the same identity: take it over.
            hs.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self.endpoint = self._bind(hs, self.listen, "the engine handshake")
            inp = self._in_down = self._socket(zmq.ROUTER)
            inp.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # Mandatory: a full scheduler raises EAGAIN (awaited: back-pressure) and a
            # gone one EHOSTUNREACH, instead of either silently dropping requests.
            inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.input_address = _advertised(
                self._bind(inp, _bind_next_to(self.endpoint, "input"), "the scheduler input")
            )
            pull = self._pull = self._socket(zmq.PULL, plain=True)
            self.output_address = _advertised(
                self._bind(pull, _bind_next_to(self.endpoint, "output"), "the scheduler output")
            )
            for sock, what in ((inp, "input"), (pull, "output")):
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._socks.append(monitor)
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

    async def _step(self, aw: Awaitable[T], step: str) -> T:
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

    async def handshake_scheduler(self) -> None:
        """The scheduler's handshake; raises HandshakeError / HandshakeTimeout."""
        hs, inp = self._hs_down, self._in_down
        assert hs is not None and inp is not None
        assert self.input_address is not None and self.output_address is not None
        hello: list[zmq.Frame] | None = None
        while True:
            step = "HELLO from the scheduler"
            if hello is None:
                hello = await self._step(hs.recv_multipart(copy=False), step)
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
            frames = await self._step(hs.recv_multipart(copy=False), step)
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
            frames = await self._step(inp.recv_multipart(copy=False), step)
            if frames[0].bytes != identity:
                self._check_identity(frames[0].bytes, step)
            missing = parse_ready_response(frames[-1].buffer, step)
            if missing:
                logger.warning(
                    "engine handshake: the scheduler's ready response lacks %s (relayed as is)",
                    ", ".join(missing),
                )
            self._scheduler_identity = identity
            self._ready_response = frames[-1]
            self._scheduler_ready = True
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
                if self._scheduler_ready:
                    self._scheduler_died(f"its {what} connection dropped")
                else:
                    logger.info("engine handshake: a connection to the scheduler %s dropped", what)
        except (asyncio.CancelledError, zmq.ZMQError):
            return

    def _scheduler_died(self, why: str) -> None:
        if self._dead or self._stopping:
            return
        self._dead = True
        self.stats.scheduler_alive = 0
        logger.error("the scheduler went away (%s)", why)
        self._on_death(why)
        if self._on_gone is not None:
            self._on_gone(why)

    def _on_death(self, why: str) -> None:
        """The face's reaction to the scheduler's death (called once)."""

    # ------------------------------------------------------------------ shutdown

    async def _close(self, linger_ms: dict[int, int] | None = None) -> None:
        """Cancel the link's tasks, close every socket (``linger_ms`` by socket id,
        else 0) and terminate the context off the loop."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        lingers = linger_ms or {}
        for sock in self._socks:
            if not sock.closed:
                sock.close(linger=lingers.get(id(sock), 0))
        ctx = self._ctx
        if ctx is not None and not ctx.closed:
            await asyncio.to_thread(ctx.term)  # waits for lingering sockets: off the loop
        self._finalizer.detach()


__all__ = ["PROGRESS_S", "SchedulerLink", "SchedulerStats"]
