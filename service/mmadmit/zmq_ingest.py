"""The ZMQ msgpack front end (docs/spec/WIRE.md): a ROUTER that admits requests into the pool.

Scope: a thin adapter. Decoding and encoding are :mod:`mmadmit.wire`; the
request-id registry, submit, cancel and outcome counting are
:class:`~mmadmit.admission.Admissions` (shared with both gRPC faces);
materializing is :class:`~mmadmit.pool.MaterializerPool`; where an outcome
goes is the ingest's :class:`~mmadmit.zmq_output.Output` strategy; reading
and writing the sockets on the event loop (intake, back-pressure, delivery
retries) is :mod:`mmadmit.zsock`. This module reads messages, hands requests
to the admission path and each outcome to its output. Non-goals: the SMG
handshake (:mod:`mmadmit.engine_mode` adopts an ingest for its relay, see
:meth:`ZmqIngest.adopt`), metrics export (:meth:`ZmqIngest.metrics` declares the series of
its counters, :class:`ZmqIngestStats`, and its output's).

One intake (a bound ROUTER; peers connect DEALERs), two outputs (docs/spec/WIRE.md,
"Reply mode (the default)" and "Forward mode"): :class:`~mmadmit.zmq_output.Reply`
and :class:`~mmadmit.zmq_output.Forward`, which engine mode also runs on the
scheduler's input socket.

How the hard parts work:

* **Intake with nothing to cancel** (STYLE 6): the ROUTER is a plain pyzmq
  socket driven by the event loop's reader on its ``ZMQ_FD``
  (:class:`~mmadmit.zsock.SocketReader`): no ``await`` sits between dequeuing
  a message and handling it, so stopping intake never drops one.
* **Edge-triggered wake-ups**: ``ZMQ_FD`` signals *changes*, and any call on
  the socket (a send included) may consume the signal of a message that has
  arrived. So every read batch ends only when ``EVENTS`` shows no input (or
  schedules its own continuation), and every reply sent re-checks ``EVENTS``
  and schedules a read if input is waiting. A watchdog re-checks once a second
  and counts what it finds (``stats.watchdog_reads``) as a last resort.
* **Small requests inline**: the pool materializes a small request at once
  (:meth:`~mmadmit.pool.MaterializerPool.runs_inline`); its outcome is emitted
  from the reader callback, with no task and no in-flight entry.
* **Exactly one output per ADD, counted once**: every path through
  :meth:`ZmqIngest._handle` ends in one of: an immediate abort, or a ticket
  whose completion task emits the outcome. Each is counted once, by
  :meth:`~mmadmit.admission.Admissions.finish`, once its message is encoded.
  The completion task has a broad guard (``INTERNAL``) and a ``finally`` that
  always releases what the output reserved for it.
* **Per-peer request ids** (docs/spec/WIRE.md, "Reply mode (the default)"): in-flight tickets are
  keyed by ``(identity, rid)`` in :class:`~mmadmit.admission.Admissions` (the
  bookkeeping shared with gRPC: duplicates, closing, the per-peer limit,
  cancel, outcome counting).
* **Delivery** (docs/spec/WIRE.md, "Reply mode (the default)"): under
  ``ROUTER_MANDATORY`` a reply to a peer that is gone raises ``EHOSTUNREACH``
  and one at its high-water mark ``EAGAIN``. Sends are always ``NOBLOCK`` (a blocking
  send on a mandatory ROUTER would block the event loop) and are retried with
  exponential backoff for at most ``send_timeout_s``; then the reply is
  counted ``undeliverable`` and logged (:class:`~mmadmit.zsock.RetryingSender`).
* **Back-pressure** (forward mode): the PUSH is fed in FIFO order
  (:class:`~mmadmit.zsock.OrderedSender`): at once while libzmq takes
  messages, else by one sender task that awaits its high-water mark. The PUSH
  sets ``IMMEDIATE``, so nothing
  queues on a connection that does not exist yet: an absent downstream blocks
  the sender instead of silently filling a pipe. Every forward output is
  counted *pending* from the moment it is registered until libzmq has it; the
  receive loop stops reading while ``max_pending`` are pending, so a
  blocked downstream stops intake and upstream senders meet ZMQ's own
  back-pressure.
* **Forward ordering** (docs/spec/WIRE.md, "Forward mode"): each output registers
  a slot under its keys ``(identity, rid)``; an output waits for the previous
  slot of each of its keys to be enqueued.
* **Zero-copy**: received frames are read with ``copy=False``; the decoded
  request's tensors are views on them (:mod:`mmadmit.wire`), and the encoder
  puts those same buffer objects into the outgoing frame list, sent with
  ``copy=False``. Buffer ownership: a received ``zmq.Frame`` stays alive as
  long as a view on it exists (the request object, then libzmq's reference
  taken by ``send(copy=False)``, released by pyzmq's garbage collector thread
  once the message is on the wire). Nothing here writes to a buffer after
  handing it to ``send`` (the copy threshold: docs/spec/WIRE.md, "Reply mode
  (the default)").
* **CURVE** (``curve=``, :mod:`mmadmit.security`): the ROUTER is a CURVE
  server, its keys set before it binds; with an allow-list folder a ZAP
  authenticator thread runs on a synchronous shadow of the context and is
  stopped before the context terminates (``term()`` would wait for its sockets
  forever). A peer refused by ZAP, or one without CURVE, never completes the
  handshake, so none of its messages reaches intake. The forward PUSH stays plain.
* **Size limits** (docs/spec/WIRE.md, "Reply mode (the default)"): the bytes of all frames of a
  message are summed as received; a message of more than ``max_frames``
  frames keeps only its first ones in Python (:class:`~mmadmit.zsock.CutMessage`).
  The codec decides the per-request ``limits`` (:mod:`mmadmit.wire`).

Threading: everything runs on the event loop that called :meth:`ZmqIngest.start`;
no zmq call here blocks, and materialization runs on the pool's workers (or,
for small requests, inline: see the pool).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import zmq
import zmq.asyncio

from . import wire
from .admission import INTAKE_MAX_S, INTAKE_QUIET_S, Admissions, until_quiet
from .errors import Abort, AbortCode, AdmissionError, InvalidRequest, abort_from_exception
from .limits import DEFAULT_LIMITS, Limits
from .model import Materialized, Request
from .pool import MaterializerPool, Ticket
from .security import CurveAuthenticator, CurveServer
from .telemetry import RECEIVED_BYTES, Sample, Telemetry, counter, counters
from .zmq_output import ABORT, ADD, Forward, Output, PeerKey, Reply
from .zsock import WATCHDOG_S, CutMessage, Slot, SocketReader, sizes

logger = logging.getLogger(__name__)

# Replies handed to libzmq before close get at least this long to leave
# (LINGER), even past the drain deadline.
CLOSE_LINGER_MIN_S = 1.0
# What is still queued in the ROUTER after the reader stopped is answered
# SHUTTING_DOWN; at most this many, so the last sweep is bounded.
_FINAL_SWEEP_MAX = 10_000


@dataclass
class ZmqIngestStats:
    """The intake's counters (``ZmqIngest.stats``); written on the event loop thread
    only. Outcomes are the admission path's (``admissions.stats``), delivery the
    output's (``output.stats``)."""

    received: int = 0  # messages read off the ROUTER (ADD, ABORT or malformed)
    aborts_received: int = 0  # well-formed ABORT messages
    cancelled_by_peer: int = 0  # in-flight tickets ended by an ABORT
    malformed: int = 0  # messages that did not decode (ADDs answered, ABORTs dropped)
    inline: int = 0  # ADDs materialized inline (small requests), no task
    wakeups: int = 0  # intake callbacks run (ZMQ_FD signalled, or a scheduled read)
    watchdog_reads: int = 0  # reads started by the watchdog (input waited unseen)
    received_bytes: int = 0  # bytes of every message read (all frames but the identity)

    # exported as mmadmit_<transport>_<field>_total, with this help (metrics())
    COUNTERS: ClassVar[dict[str, str]] = {
        "received": "Messages read off the intake: ADD, ABORT or malformed.",
        "aborts_received": "Well-formed ABORT messages received.",
        "cancelled_by_peer": "Requests in flight ended by their peer's ABORT.",
        "malformed": "Messages that did not decode (ADDs answered, ABORTs dropped).",
        "inline": "ADDs materialized inline by the intake callback, with no task.",
        "wakeups": "Intake callbacks run (ZMQ_FD signalled, or a scheduled read).",
        "watchdog_reads": "Intake reads started by the watchdog: input waited unseen.",
    }

    def metrics(self, transport: str) -> Iterator[Sample]:
        yield from counters(self, transport, self.COUNTERS)
        yield counter("received_bytes", RECEIVED_BYTES, self.received_bytes, transport=transport)


# --------------------------------------------------------------------------- resources


@dataclass
class _Resources:
    """Everything :class:`ZmqIngest` must release, in one place (STYLE 9).

    ``close_now`` is also the ingest's ``weakref.finalize`` callback, so sockets
    and an owned context are released even if ``stop()`` is never called or
    ``start()`` fails half-way.
    """

    ctx: zmq.asyncio.Context | None
    own_ctx: bool
    output: Output  # owns the forward socket, if any
    router: zmq.Socket[Any] | None = None  # the intake (plain: the loop's reader drives it)
    intake: SocketReader | None = None
    auth: CurveAuthenticator | None = None  # the ZAP thread (CURVE with an allow-list)

    @property
    def reader(self) -> tuple[asyncio.AbstractEventLoop, int] | None:
        """(loop, ZMQ_FD) of the registered intake reader; None once stopped."""
        return self.intake.registration if self.intake is not None else None

    def stop_reading(self) -> None:
        """Unregister the reader and the watchdog (before the ROUTER closes)."""
        if self.intake is not None:
            self.intake.stop()

    def close_sockets(self, linger_ms: int) -> None:
        self.stop_reading()
        if self.router is not None and not self.router.closed:
            self.router.close(linger=linger_ms)
        self.output.close(linger_ms)

    def stop_auth(self) -> None:
        """Stop the ZAP thread (before the context terminates; idempotent)."""
        if self.auth is not None:
            self.auth.stop()

    def close_now(self) -> None:
        self.stop_reading()
        if self.router is not None and not self.router.closed:
            self.router.close(linger=0)
        self.output.close_now()
        self.stop_auth()
        if self.own_ctx and self.ctx is not None and not self.ctx.closed:
            self.ctx.term()  # sockets are closed with linger 0: returns at once


def _spawner(ingest: ZmqIngest) -> Callable[[Any], None]:
    """``ingest._spawn`` for its output, without keeping the ingest alive: the output
    is held by the finalizer's resources, so a strong reference back would keep an
    unstopped ingest (and its sockets) alive for good (STYLE 9)."""
    ref = weakref.ref(ingest)

    def spawn(coro: Any) -> None:
        owner = ref()
        if owner is None:  # the ingest is gone: nothing may run for it
            coro.close()
            return
        owner._spawn(coro)

    return spawn


def _curve_note(curve: CurveServer | None) -> str:
    if curve is None:
        return ""
    if curve.clients_dir is None:
        return " (CURVE, any client with the server key)"
    return f" (CURVE, {curve.allowed} allowed client key(s) from {curve.clients_dir})"


# --------------------------------------------------------------------------- ingest


class ZmqIngest:
    """The ZMQ ROUTER front end of docs/spec/WIRE.md; ``output`` says where outcomes go.

    Usage (the server wires it; tests do the same on an ephemeral port)::

        ingest = ZmqIngest(pool, Reply(), listen="tcp://127.0.0.1:0",
                           max_message_bytes=1 << 30)
        endpoint = await ingest.start()        # "tcp://127.0.0.1:43117"
        ...
        pool.begin_drain()                     # new ADDs are answered SHUTTING_DOWN
        await pool.drain(timeout_s)
        await ingest.stop(linger_s=timeout_s)  # idempotent

    ``output`` is a :class:`~mmadmit.zmq_output.Reply` (the default) or a
    :class:`~mmadmit.zmq_output.Forward`; the ingest itself never asks which.
    ``watchdog_s`` is the intake watchdog's period (``None``: no watchdog, so
    that tests see a lost wake-up as a stall); ``transport`` names the outcomes
    in telemetry and its series; ``curve`` makes the ROUTER a CURVE server
    (``start()`` only; adopted sockets are the adopter's); ``quiet_s``: how
    long intake must be silent before :meth:`stop` closes it.
    """

    def __init__(
        self,
        pool: MaterializerPool,
        output: Output | None = None,
        *,
        listen: str,
        max_message_bytes: int,
        limits: Limits = DEFAULT_LIMITS,
        max_frames: int | None = None,
        max_peer_inflight: int | None = None,
        context: zmq.asyncio.Context | None = None,
        watchdog_s: float | None = WATCHDOG_S,
        telemetry: Telemetry | None = None,
        transport: str = "zmq",
        curve: CurveServer | None = None,
        quiet_s: float = INTAKE_QUIET_S,
    ) -> None:
        if max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        if max_frames is not None and max_frames < 2:
            raise ValueError("max_frames must be at least 2 (type and payload)")
        if max_peer_inflight is not None and max_peer_inflight < 1:
            raise ValueError("max_peer_inflight must be positive")
        self.pool = pool
        self.output: Output = output if output is not None else Reply()
        self.listen = listen
        self.max_message_bytes = max_message_bytes
        self.limits = limits
        self.max_frames = max_frames
        self.stats = ZmqIngestStats()
        self.telemetry = telemetry
        self.transport = transport
        # The requests in flight, keyed (identity, rid); ``closing`` is set once
        # stop() begins (or start() fails): no new admissions.
        self.admissions = Admissions(
            pool,
            transport=transport,
            telemetry=telemetry,
            scope="from this peer",
            max_per_peer=max_peer_inflight,
        )
        self.endpoint: str | None = None
        self._res = _Resources(ctx=context, own_ctx=context is None, output=self.output)
        self._finalizer = weakref.finalize(self, self._res.close_now)
        self._intake: SocketReader | None = None
        self._peer: zmq.Frame | None = None  # adopted DEALER intake: the one peer's key
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._stop_task: asyncio.Future[None] | None = None
        self._answered = False  # the message being handled got its outcome path
        self._watchdog_s = watchdog_s
        self._curve = curve
        self._quiet_s = quiet_s

    @property
    def mode(self) -> str:
        return self.output.mode

    @property
    def inflight(self) -> int:
        """ADDs admitted to the pool whose outcome has not arrived yet."""
        return len(self.admissions)

    @property
    def forward_pending(self) -> int:
        """Outputs registered and not yet handed to libzmq (forward mode)."""
        return self.output.pending

    def metrics(self) -> Iterator[Sample]:
        """The intake's series and its output's (telemetry's :class:`Exports`)."""
        yield from self.stats.metrics(self.transport)
        yield from self.output.stats.metrics(self.transport)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Bind the ROUTER (and let the output connect); return the endpoint bound."""
        if self._started:
            raise RuntimeError("ZmqIngest.start() may be called only once")
        self._started = True
        res = self._res
        try:
            if res.ctx is None:
                res.ctx = zmq.asyncio.Context()
            curve = self._curve
            if curve is not None and curve.clients_dir is not None:
                res.auth = CurveAuthenticator(res.ctx, curve.clients_dir)
                res.auth.start()  # ZAP is bound before any peer can connect
            router: zmq.Socket[Any] = zmq.Socket(res.ctx, zmq.ROUTER)
            res.router = router
            if curve is not None:
                curve.apply(router)  # before bind: the listener is CURVE from the start
            # Mandatory routing: an unroutable reply raises instead of vanishing.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.LINGER, 0)  # the real linger is given at stop()
            try:
                router.bind(self.listen)
            except zmq.ZMQError as exc:  # e.g. address in use: an operator error, not a crash
                raise OSError(exc.errno, f"cannot bind ZMQ {self.listen}: {exc.strerror}") from exc
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._begin(router)
        except BaseException:
            self.admissions.closing = True
            self._finalizer()  # close whatever was created; stop() is then a no-op
            raise
        logger.info(
            "ZMQ ingest (%s mode) listening on %s%s%s",
            self.mode,
            self.endpoint,
            _curve_note(self._curve),
            self.output.describe(),
        )
        return self.endpoint

    def adopt(self, intake: zmq.Socket[Any], *, peer: bytes) -> None:
        """Run on an intake someone else connected (engine mode).

        ``intake`` is a plain DEALER whose one peer sends ``[type, payload,
        *aux]`` with no identity frame (``peer`` keys its request ids); the
        output must not reply on it (:class:`~mmadmit.zmq_output.Forward`, given
        its socket). The ingest owns ``intake`` from here (closed by
        :meth:`stop`), not the context.
        """
        if self._started:
            raise RuntimeError("ZmqIngest.adopt() / start() may be called only once")
        if not self.output.adoptable:
            raise ValueError("adopt() needs an output that does not reply on the intake")
        if self._res.ctx is None:
            raise ValueError("adopt() needs the context= its sockets were made on")
        self._started = True
        res = self._res
        res.router = intake
        self._peer = zmq.Frame(peer)
        self.endpoint = self.listen
        try:
            self._begin(intake)
        except BaseException:
            self.admissions.closing = True
            self._finalizer()
            raise

    def _begin(self, intake: zmq.Socket[Any]) -> None:
        res = self._res
        assert res.ctx is not None
        limit = self.max_frames
        reader = SocketReader(
            intake,
            self._on_message,
            stats=self.stats,
            name=f"{self.transport} {self.mode}",
            watchdog_s=self._watchdog_s,
            # a ROUTER's messages start with the peer's identity frame
            max_frames=None if limit is None else limit + (self._peer is None),
        )
        res.intake = self._intake = reader
        self.output.bind(
            res.ctx,
            intake,
            reader,
            spawn=_spawner(self),
            name=self.transport,
            default_max_pending=2 * self.pool.max_inflight,
        )
        reader.start()

    async def stop(self, linger_s: float) -> None:
        """Answer what still arrives, finish outputs within ``linger_s``, close sockets.

        Idempotent; concurrent callers wait for the same shutdown. Every message
        that reaches the socket before it closes gets its one outcome, and one sent
        after it is not answered (docs/spec/CLI.md, "Shutdown"). Steps:

        1. new ADDs are answered ``SHUTTING_DOWN``; the reader keeps reading;
        2. wait up to ``linger_s`` for completion and reply tasks (after
           ``pool.drain()`` every ticket has its outcome, so these only send);
           cancel the rest, counting them undeliverable;
        3. keep reading until intake has been quiet for ``quiet_s``
           (:data:`INTAKE_QUIET_S`) with no task left, or :data:`INTAKE_MAX_S`
           past ``linger_s``; then stop the reader and answer what is queued;
        4. let the output flush until the deadline (forward mode: the FIFO; what
           is left is counted undeliverable);
        5. close the sockets with a linger of what is left of ``linger_s``, at
           least :data:`CLOSE_LINGER_MIN_S` (replies handed to libzmq leave),
           terminate an owned context.
        """
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(max(0.0, linger_s)))
        await asyncio.shield(self._stop_task)

    async def _stop(self, linger_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + linger_s
        self.admissions.closing = True
        res = self._res
        if not self._finalizer.alive:  # never started, or start() failed: released
            return
        await self._finish_tasks(deadline, linger_s)
        await self._until_quiet(deadline + INTAKE_MAX_S)
        await self._finish_tasks(deadline, linger_s)  # retries of the last answers
        res.stop_reading()
        if self._intake is not None and res.router is not None and not res.router.closed:
            self._intake.read_batch(_FINAL_SWEEP_MAX)  # SHUTTING_DOWN for what is queued
        await self.output.flush(deadline)
        linger_ms = int(max(CLOSE_LINGER_MIN_S, deadline - loop.time()) * 1000)
        res.close_sockets(linger_ms)
        res.stop_auth()
        if res.own_ctx and res.ctx is not None and not res.ctx.closed:
            # term() waits for the sockets' linger: off the loop thread.
            await asyncio.to_thread(res.ctx.term)
        self._finalizer.detach()
        logger.info("[shutdown] ZMQ ingest (%s) stopped (%s)", self.transport, self.stats)

    async def _finish_tasks(self, deadline: float, linger_s: float) -> None:
        """Wait for the completion and reply tasks until ``deadline``; cancel the rest."""
        loop = asyncio.get_running_loop()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - loop.time()))
        late = [t for t in self._tasks if not t.done()]
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)
            logger.warning(
                "[shutdown] %d ZMQ output(s) unfinished after %.1fs", len(late), linger_s
            )

    async def _until_quiet(self, until: float) -> None:
        """Keep answering until intake has been quiet for ``quiet_s`` (or ``until``):
        a burst still on the wire when the drain ends is answered, not dropped
        with the socket."""
        intake = self._intake
        if intake is None or intake.registration is None:
            return

        def waiting() -> bool:
            if intake.input_waiting():  # the FD's signal is consumed: read it ourselves
                intake.schedule_read()
                return True
            return False

        stats = self.stats
        if not await until_quiet(
            lambda: stats.received,
            until,
            quiet_s=self._quiet_s,
            waiting=waiting,
            since=intake.last_read,
        ):
            logger.warning(
                "[shutdown] ZMQ intake (%s) still receiving; closing it anyway", self.transport
            )

    # ------------------------------------------------------------------ intake

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        """One message off the intake, with its outcome path guaranteed."""
        peer = self._peer
        if peer is None:
            identity, body = frames[0], frames[1:]
        else:
            identity, body = peer, frames
        self._answered = False
        try:
            self._handle(identity, body, frames if isinstance(frames, CutMessage) else None)
        except Exception as exc:  # noqa: BLE001 - one bad message must not kill intake
            logger.exception("unexpected error handling a ZMQ message (frames %s)", sizes(body))
            if not self._answered and len(body) > 0 and body[0].bytes != ABORT:
                rid = wire.recover_rid(body[1]) if len(body) > 1 else ""
                try:
                    self._abort_now(
                        identity, None, rid, abort_from_exception(exc), time.perf_counter()
                    )
                except Exception:  # noqa: BLE001 - already logged above; keep reading
                    logger.exception("rid=%s: could not answer INTERNAL either", rid)

    def _handle(
        self, identity: zmq.Frame, body: list[zmq.Frame], cut: CutMessage | None = None
    ) -> None:
        """One message; ``cut``: it had more than ``max_frames`` frames (``body`` holds
        its first ones, ``cut`` its real size)."""
        t0 = time.perf_counter()
        self.stats.received += 1
        total = sum(sizes(body))
        if cut is not None:
            total += cut.total_bytes - sum(sizes(cut))  # the frames released unkept
        self.stats.received_bytes += total
        kind = body[0].bytes if body else b""
        if cut is not None:
            self._on_cut(identity, body, cut, kind, t0)
            return
        if kind == ABORT and len(body) >= 2:
            self._on_abort(identity, body, total)
            return
        if kind and kind != ADD and kind != ABORT and self.output.pass_through(body):
            self._answered = True
            return
        if total > self.max_message_bytes:
            self._oversized(
                identity, body, t0, f"message of {total} bytes exceeds the limit of "
                f"{self.max_message_bytes} bytes (--max-message-bytes)"
            )  # fmt: skip
            return
        try:
            msg = wire.decode_message(body, self.limits)
        except wire.WireError as exc:
            if exc.code is AbortCode.INVALID_REQUEST:  # a breach is counted by its code
                self.stats.malformed += 1
            logger.warning(
                "rid=%s: %s message from peer %s (frames %s): %s",
                exc.rid,
                "malformed" if exc.code is AbortCode.INVALID_REQUEST else "oversized",
                identity.bytes.hex(),
                sizes(body),
                exc.message,
            )
            self._abort_now(identity, None, exc.rid, exc.to_abort(), t0)
            return
        request = msg.request
        assert request is not None  # an ABORT type byte was dispatched above
        key = (identity.bytes, request.rid)
        try:
            ticket = self.admissions.submit(key, request)
        except AdmissionError as exc:  # duplicate id, closing, per-peer limit, pool refusal
            if isinstance(exc, InvalidRequest):
                logger.warning(
                    "rid=%s: duplicate request id from peer %s while the first is in flight",
                    request.rid,
                    identity.bytes.hex(),
                )
            self._abort_now(identity, request, request.rid, exc.to_abort(), t0)
            return
        if ticket.done:  # materialized inline: emit now, no task, never in flight
            self.stats.inline += 1
            frames_out = self._outcome_frames(request, request.rid, ticket.result(), t0)
            self._answered = True
            self.output.emit_now(identity, request.rid, frames_out)
            return
        slot = self.output.reserve(key)
        self._answered = True
        self._spawn(self._complete(identity, key, request, ticket, slot, t0))

    def _on_cut(
        self, identity: zmq.Frame, body: list[zmq.Frame], cut: CutMessage, kind: bytes, t0: float
    ) -> None:
        """A message of more than ``max_frames`` frames: an ABORT dropped, else TOO_LARGE."""
        n_frames = cut.total_frames - (len(cut) - len(body))  # without the identity
        if kind == ABORT:
            self.stats.malformed += 1
            logger.warning(
                "ABORT from peer %s of %d frames dropped (an ABORT has 2)",
                identity.bytes.hex(),
                n_frames,
            )
            self._answered = True
            return
        self._oversized(
            identity, body, t0, f"message of {n_frames} frames exceeds the limit of "
            f"{self.max_frames} frames (--max-frames)"
        )  # fmt: skip

    def _oversized(self, identity: zmq.Frame, body: list[zmq.Frame], t0: float, why: str) -> None:
        """An ADD over a transport limit: TOO_LARGE to the rid its payload names, undecoded."""
        rid = wire.recover_rid(body[1]) if len(body) > 1 else ""
        logger.warning("rid=%s: from peer %s: %s", rid, identity.bytes.hex(), why)
        self._abort_now(identity, None, rid, Abort(AbortCode.TOO_LARGE, why), t0)

    def _on_abort(self, identity: zmq.Frame, body: list[zmq.Frame], total: int) -> None:
        peer = identity.bytes
        if total > self.max_message_bytes:
            self.stats.malformed += 1
            logger.warning(
                "ABORT from peer %s of %d bytes exceeds the limit; dropped", peer.hex(), total
            )
            return
        try:
            rids = wire.decode_message(body, self.limits).abort_rids
        except wire.WireError as exc:
            self.stats.malformed += 1
            logger.warning(
                "malformed ABORT from peer %s (frames %s) dropped: %s",
                peer.hex(),
                sizes(body),
                exc.message,
            )
            return
        self.stats.aborts_received += 1
        cancel = self.admissions.cancel
        for rid in rids:
            if cancel((peer, rid), AbortCode.CANCELLED, "cancelled by the client (ABORT)"):
                self.stats.cancelled_by_peer += 1
                logger.info("rid=%s: cancelled by an ABORT from peer %s", rid, peer.hex())
        self.output.on_abort(peer, body[1], rids)

    # ------------------------------------------------------------------ outcomes

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _abort_now(
        self, identity: zmq.Frame, request: Request | None, rid: str, abort: Abort, t0: float
    ) -> None:
        """An ADD answered without reaching the pool (malformed, dup, refused)."""
        self._answered = True
        self.output.emit_now(identity, rid, self._outcome_frames(request, rid, abort, t0))

    def _outcome_frames(
        self, request: Request | None, rid: str, outcome: Materialized | Abort, t0: float
    ) -> list[Any]:
        """The output's message for ``outcome``, counted once encoded
        (:meth:`~mmadmit.admission.Admissions.finish`: an encoding failure is
        answered, and counted, ``INTERNAL``, worded without the request)."""
        frames = self.output.frames
        return self.admissions.finish(
            rid,
            request,
            outcome,
            t0,
            lambda out: frames(request, rid, out),
            lambda out: frames(None, rid, out),
        )

    async def _complete(
        self,
        identity: zmq.Frame,
        key: PeerKey,
        request: Request,
        ticket: Ticket,
        slot: Slot | None,
        t0: float,
    ) -> None:
        """Await one ticket's outcome and emit it: exactly one output per ADD."""
        rid = request.rid
        emitted = False  # handed to the output, which counts what it cannot deliver
        try:
            outcome = await self.admissions.wait(key, ticket)
            frames = self._outcome_frames(request, rid, outcome, t0)
            emitted = True
            await self.output.emit(identity, rid, frames, slot)
        finally:
            if not emitted:  # cancelled at stop before the output was emitted
                self.output.stats.undeliverable += 1  # one count of undelivered outcomes
                logger.warning("rid=%s: stopped before its outcome could be sent", rid)
                self.output.release(slot)


__all__ = ["Forward", "Output", "Reply", "ZmqIngest", "ZmqIngestStats"]
