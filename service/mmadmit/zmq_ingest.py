"""The ZMQ msgpack front end (WIRE.md): a ROUTER that admits requests into the pool.

Scope: sockets and delivery only. Decoding and encoding are :mod:`mmadmit.wire`,
admission and materialization are :class:`~mmadmit.pool.MaterializerPool`; this
module reads messages, hands requests to the pool and sends each outcome where
it belongs. Reading and writing the sockets on the event loop (intake,
back-pressure, delivery retries) is :mod:`mmadmit.zsock`, shared with engine
mode. Non-goals: the SMG handshake (:mod:`mmadmit.engine_mode` adopts an ingest
for its relay, see :meth:`ZmqIngest.adopt`), metrics export
(:class:`ZmqIngestStats` holds the counters a metrics module reads).

Two modes, one intake (a bound ROUTER; peers connect DEALERs):

* **reply mode** (``forward=None``): every ADD gets exactly one reply
  ``[status, payload, *aux]`` on the ROUTER, addressed by the peer's identity.
  Replies may leave out of order (each waits for its own outcome).
* **forward mode** (``forward="tcp://..."``): senders get nothing back; every
  outcome leaves on a PUSH connected to ``forward`` as an ordinary ADD
  (``[0x00, payload, *aux]``, aborts marked with ``validation_error``), ready for
  a scheduler's msgpack receiver. ABORT messages are forwarded too, after every
  ADD of the same peer and request id that intake saw before them.

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
* **Exactly one reply per ADD**: every path through :meth:`ZmqIngest._handle`
  ends in one of: an immediate abort, or a ticket whose completion task emits
  the outcome. The completion task has a broad guard (``INTERNAL``) and a
  ``finally`` that always releases its forward-ordering slot.
* **Per-peer request ids**: in-flight tickets are keyed by ``(identity, rid)``
  in :class:`~mmadmit.admission.Admissions` (the bookkeeping shared with
  gRPC: duplicates, closing, the per-peer limit, cancel, outcome counting).
  An ADD whose key is in flight is aborted ``INVALID_REQUEST`` at once (the
  first goes on); an ABORT cancels only its own peer's tickets.
* **Delivery** (reply mode): the ROUTER sets ``ROUTER_MANDATORY``, so a reply to
  a peer that is gone raises ``EHOSTUNREACH`` and one at its high-water mark
  ``EAGAIN`` instead of vanishing. Sends are always ``NOBLOCK`` (a blocking
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
  receive loop stops reading while ``max_pending_forwards`` are pending, so a
  blocked downstream stops intake and upstream senders meet ZMQ's own
  back-pressure. Nothing is dropped before it reaches libzmq.
* **Forward ordering**: each output registers a slot under its keys
  ``(identity, rid)``; an output waits for the previous slot of each of its
  keys to be enqueued. So an ABORT that cancels an in-flight ADD goes
  downstream after that ADD (marked ``CANCELLED``), and a duplicate's marked
  ADD goes after the original.
* **Zero-copy**: received frames are read with ``copy=False``; the decoded
  request's tensors are views on them (:mod:`mmadmit.wire`), and the encoder
  puts those same buffer objects into the outgoing frame list, sent with
  ``copy=False``. Buffer ownership: a received ``zmq.Frame`` stays alive as
  long as a view on it exists (the request object, then libzmq's reference
  taken by ``send(copy=False)``, released by pyzmq's garbage collector thread
  once the message is on the wire). Nothing here writes to a buffer after
  handing it to ``send``. Frames below pyzmq's copy threshold (64 KiB) are
  copied by pyzmq itself, which is cheaper than tracking them.
* **CURVE** (``curve=``, :mod:`mmadmit.security`): the ROUTER is a CURVE
  server, its keys set before it binds; with an allow-list folder a ZAP
  authenticator thread runs on a synchronous shadow of the context and is
  stopped before the context terminates (``term()`` would wait for its sockets
  forever). A peer refused by ZAP, or one without CURVE, never completes the
  handshake, so none of its messages reaches intake. The forward PUSH stays plain.
* **Size limits**: the bytes of all frames of a message are summed as received;
  above ``max_message_bytes`` the ADD is answered ``TOO_LARGE``. ``ZMQ_MAXMSGSIZE``
  is never set: libzmq would drop the peer's connection without a reply. A
  message of more than ``max_frames`` frames keeps only its first ones in
  Python (:class:`~mmadmit.zsock.CutMessage`) and is answered ``TOO_LARGE``.
  The codec decides the per-request ``limits`` before it decodes
  (:mod:`mmadmit.wire`). A peer with ``max_peer_inflight`` requests already
  in flight has the next one answered ``OVERLOADED``, so that one sender
  cannot take the whole pool.

Threading: everything runs on the event loop that called :meth:`ZmqIngest.start`;
no zmq call here blocks, and materialization runs on the pool's workers (or,
for small requests, inline: see the pool).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from . import wire
from .admission import Admissions, AdmissionStats
from .errors import Abort, AbortCode, AdmissionError, InvalidRequest, abort_from_exception
from .limits import DEFAULT_LIMITS, Limits
from .model import Materialized, Request
from .pool import MaterializerPool, Ticket
from .security import CurveAuthenticator, CurveServer
from .telemetry import Telemetry
from .zsock import (
    WATCHDOG_S,
    CutMessage,
    OrderedSender,
    RetryingSender,
    Slot,
    SocketReader,
    sizes,
)

logger = logging.getLogger(__name__)

ADD = bytes([wire.MSG_ADD])
ABORT = bytes([wire.MSG_ABORT])

# Messages still queued in the ROUTER when stop() runs are answered
# SHUTTING_DOWN; at most this many, so a peer that keeps sending cannot hold
# stop() forever.
_FINAL_SWEEP_MAX = 10_000

PeerKey = tuple[bytes, str]
# A test/diagnostic hook called with every outgoing message (``[identity,
# status, payload, *aux]`` in reply mode, ``[0x00 or 0x01, payload, *aux]`` in
# forward mode) when it is handed to libzmq; None in production.
SentHook = Callable[[list[Any]], None]


@dataclass
class ZmqIngestStats(AdmissionStats):
    """Counters for metrics; written on the event loop thread only.

    ``materialized`` / ``aborted_by_code`` (from :class:`AdmissionStats`) count
    the ADDs' outcomes, each once, through :meth:`Admissions.observe`.
    """

    received: int = 0  # messages read off the ROUTER (ADD, ABORT or malformed)
    aborts_received: int = 0  # well-formed ABORT messages
    cancelled_by_peer: int = 0  # in-flight tickets ended by an ABORT
    malformed: int = 0  # messages that did not decode (ADDs answered, ABORTs dropped)
    replied: int = 0  # reply messages handed to libzmq (reply mode)
    send_retries: int = 0  # reply sends retried after EAGAIN / EHOSTUNREACH
    undeliverable: int = 0  # replies or forwards given up (peer gone, stop deadline)
    forwarded: int = 0  # messages handed to the PUSH (forward mode)
    forwarded_aborts: int = 0  # of which ABORT messages
    inline: int = 0  # ADDs materialized inline (small requests), no task
    wakeups: int = 0  # intake callbacks run (ZMQ_FD signalled, or a scheduled read)
    watchdog_reads: int = 0  # reads started by the watchdog (input waited unseen)
    received_bytes: int = 0  # bytes of every message read (all frames but the identity)
    sent_bytes: int = 0  # bytes of every reply or forward handed to libzmq
    intake_paused: int = 0  # times intake stopped reading: forwards pending at their bound


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
    router: zmq.Socket[Any] | None = None  # the intake (plain: the loop's reader drives it)
    push: zmq.asyncio.Socket | None = None  # the forward target
    intake: SocketReader | None = None
    sender: OrderedSender | None = None
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
        for sock in (self.router, self.push):
            if sock is not None and not sock.closed:
                sock.close(linger=linger_ms)

    def stop_auth(self) -> None:
        """Stop the ZAP thread (before the context terminates; idempotent)."""
        if self.auth is not None:
            self.auth.stop()

    def close_now(self) -> None:
        if self.sender is not None:
            self.sender.cancel_task()
        self.close_sockets(0)
        self.stop_auth()
        if self.own_ctx and self.ctx is not None and not self.ctx.closed:
            self.ctx.term()  # sockets are closed with linger 0: returns at once


def _curve_note(curve: CurveServer | None) -> str:
    if curve is None:
        return ""
    if curve.clients_dir is None:
        return " (CURVE, any client with the server key)"
    return f" (CURVE, {curve.allowed} allowed client key(s) from {curve.clients_dir})"


# --------------------------------------------------------------------------- ingest


class ZmqIngest:
    """The ZMQ ROUTER front end of WIRE.md, in reply or forward mode.

    Usage (the server wires it; tests do the same on an ephemeral port)::

        ingest = ZmqIngest(pool, listen="tcp://127.0.0.1:0", max_message_bytes=1 << 30)
        endpoint = await ingest.start()        # "tcp://127.0.0.1:43117"
        ...
        pool.begin_drain()                     # new ADDs are answered SHUTTING_DOWN
        await pool.drain(timeout_s)
        await ingest.stop(linger_s=timeout_s)  # idempotent

    ``max_pending_forwards`` bounds forward outputs not yet handed to libzmq
    (default: twice the pool's ``max_inflight``); ``sent_hook`` is a test hook
    (see :data:`SentHook`); ``watchdog_s`` is the intake watchdog's period
    (``None``: no watchdog, so that tests see a lost wake-up as a stall);
    ``transport`` names the outcomes in telemetry; ``stats`` may be a subclass
    of :class:`ZmqIngestStats` its owner extends (engine mode). Forward mode
    only: ``on_forward(rid)`` is told of every ADD output registered for the
    downstream; with ``passthrough`` a message whose type byte is neither ADD
    nor ABORT (a utility call of a newer frontend) is forwarded unchanged, in
    order, instead of being answered as malformed. ``curve`` makes the ROUTER a
    CURVE server (``start()`` only; adopted sockets are the adopter's).
    """

    def __init__(
        self,
        pool: MaterializerPool,
        *,
        listen: str,
        forward: str | None = None,
        max_message_bytes: int,
        send_timeout_s: float = 5.0,
        context: zmq.asyncio.Context | None = None,
        max_pending_forwards: int | None = None,
        sent_hook: SentHook | None = None,
        watchdog_s: float | None = WATCHDOG_S,
        telemetry: Telemetry | None = None,
        transport: str = "zmq",
        stats: ZmqIngestStats | None = None,
        on_forward: Callable[[str], None] | None = None,
        passthrough: bool = False,
        curve: CurveServer | None = None,
        limits: Limits = DEFAULT_LIMITS,
        max_frames: int | None = None,
        max_peer_inflight: int | None = None,
    ) -> None:
        if max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        if max_frames is not None and max_frames < 2:
            raise ValueError("max_frames must be at least 2 (type and payload)")
        if max_peer_inflight is not None and max_peer_inflight < 1:
            raise ValueError("max_peer_inflight must be positive")
        self.limits = limits
        self.max_frames = max_frames
        self.max_peer_inflight = max_peer_inflight
        if not send_timeout_s >= 0:
            raise ValueError("send_timeout_s must be a non-negative number")
        self.pool = pool
        self.listen = listen
        self.forward = forward
        self.max_message_bytes = max_message_bytes
        self.send_timeout_s = send_timeout_s
        self.max_pending_forwards = (
            max_pending_forwards if max_pending_forwards is not None else 2 * pool.max_inflight
        )
        if self.max_pending_forwards < 1:
            raise ValueError("max_pending_forwards must be positive")
        self.stats = stats if stats is not None else ZmqIngestStats()
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
            stats=self.stats,
        )
        self.endpoint: str | None = None
        self._sent_hook = sent_hook
        self._res = _Resources(ctx=context, own_ctx=context is None)
        self._finalizer = weakref.finalize(self, self._res.close_now)
        self._fwd: OrderedSender | None = None
        self._replier: RetryingSender | None = None
        self._intake: SocketReader | None = None
        self._peer: zmq.Frame | None = None  # adopted DEALER intake: the one peer's key
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._stop_task: asyncio.Future[None] | None = None
        self._answered = False  # the message being handled got its outcome path
        self._watchdog_s = watchdog_s
        self._on_forward = on_forward
        self._passthrough = passthrough and forward is not None
        self._curve = curve

    @property
    def mode(self) -> str:
        return "reply" if self.forward is None else "forward"

    @property
    def inflight(self) -> int:
        """ADDs admitted to the pool whose outcome has not arrived yet."""
        return len(self.admissions)

    @property
    def forward_pending(self) -> int:
        """Forward outputs registered and not yet handed to libzmq."""
        return self._fwd.pending if self._fwd is not None else 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Bind the ROUTER (and connect the PUSH); return the endpoint actually bound."""
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
            push = None
            if self.forward is not None:
                push = res.ctx.socket(zmq.PUSH)
                res.push = push
                # IMMEDIATE: queue only on completed connections, so an absent
                # downstream blocks the sender (back-pressure) and what is not
                # delivered at stop is still ours to count.
                push.setsockopt(zmq.IMMEDIATE, 1)
                push.setsockopt(zmq.LINGER, 0)
                try:
                    push.connect(self.forward)
                except zmq.ZMQError as exc:  # unusable --zmq-forward address
                    raise OSError(
                        exc.errno, f"cannot connect ZMQ forward {self.forward}: {exc.strerror}"
                    ) from exc
            self._begin(router, push, prefix=None)
        except BaseException:
            self.admissions.closing = True
            self._finalizer()  # close whatever was created; stop() is then a no-op
            raise
        logger.info(
            "ZMQ ingest (%s mode) listening on %s%s%s",
            self.mode,
            self.endpoint,
            _curve_note(self._curve),
            f", forwarding to {self.forward}" if self.forward else "",
        )
        return self.endpoint

    def adopt(
        self,
        intake: zmq.Socket[Any],
        forward: zmq.asyncio.Socket,
        *,
        peer: bytes,
        forward_prefix: list[Any] | None = None,
    ) -> None:
        """Run forward mode on sockets someone else connected (engine mode).

        ``intake`` is a plain DEALER whose one peer sends ``[type, payload,
        *aux]`` with no identity frame (``peer`` keys its request ids);
        ``forward`` is an asyncio socket the outputs go to, each prefixed with
        ``forward_prefix`` (a ROUTER destination identity). The ingest owns both
        sockets from here (closed by :meth:`stop`), not the context.
        """
        if self._started:
            raise RuntimeError("ZmqIngest.adopt() / start() may be called only once")
        if self.forward is None:
            raise ValueError("adopt() runs forward mode: give forward= a description")
        self._started = True
        res = self._res
        res.router, res.push = intake, forward
        self._peer = zmq.Frame(peer)
        self.endpoint = self.listen
        try:
            self._begin(intake, forward, prefix=forward_prefix)
        except BaseException:
            self.admissions.closing = True
            self._finalizer()
            raise

    def _begin(
        self,
        intake: zmq.Socket[Any],
        push: zmq.asyncio.Socket | None,
        *,
        prefix: list[Any] | None,
    ) -> None:
        res = self._res
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
        if push is not None:
            fwd = OrderedSender(
                push,
                max_pending=self.max_pending_forwards,
                on_sent=self._count_forwarded,
                on_failed=self._forward_failed,
                prefix=prefix,
                sent_hook=self._sent_hook,
                name=f"{self.transport}-forward",
                on_pause=self._count_pause,
            )
            fwd.pauses(reader)
            res.sender = self._fwd = fwd
            fwd.start()
        else:
            self._replier = RetryingSender(
                intake,
                timeout_s=self.send_timeout_s,
                on_sent=self._count_replied,
                on_retry=self._count_retry,
                give_up=self._give_up,
                spawn=self._spawn,
                reader=reader,
            )
        reader.start()

    async def stop(self, linger_s: float) -> None:
        """Stop intake, finish or abandon outputs within ``linger_s``, close sockets.

        Idempotent; concurrent callers wait for the same shutdown. Steps:

        1. stop the receive loop (cancellation-safe, see module docstring), then
           answer what is still queued in the ROUTER ``SHUTTING_DOWN``;
        2. wait up to ``linger_s`` for completion and reply tasks (after
           ``pool.drain()`` every ticket has its outcome, so these only send);
           cancel the rest, counting them undeliverable;
        3. forward mode: let the sender flush its queue until the deadline, then
           count what is left undeliverable; the PUSH lingers for the rest of
           ``linger_s`` (messages inside libzmq by then are its to deliver);
        4. close the sockets, terminate an owned context.
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
        res.stop_reading()
        if self._intake is not None and res.router is not None and not res.router.closed:
            self._intake.read_batch(_FINAL_SWEEP_MAX)  # SHUTTING_DOWN for what is queued
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
        fwd = self._fwd
        if fwd is not None:
            while fwd.pending and loop.time() < deadline:
                await asyncio.sleep(min(0.01, max(0.0, deadline - loop.time())))
            await fwd.stop()
            left = len(fwd.abandon_queued())
            if left:
                self.stats.undeliverable += left
                logger.warning(
                    "[shutdown] %d message(s) never reached the forward socket (%s)",
                    left,
                    self.forward,
                )
        linger_ms = int(max(0.0, deadline - loop.time()) * 1000)
        res.close_sockets(linger_ms)
        res.stop_auth()
        if res.own_ctx and res.ctx is not None and not res.ctx.closed:
            # term() waits for the sockets' linger: off the loop thread.
            await asyncio.to_thread(res.ctx.term)
        self._finalizer.detach()
        logger.info("[shutdown] ZMQ ingest (%s) stopped (%s)", self.transport, self.stats)

    # ------------------------------------------------------------------ intake

    # The reader's state, named as before it moved to zsock (tests poke at it).
    @property
    def _read_scheduled(self) -> bool:
        return self._intake is not None and self._intake.read_scheduled

    def _schedule_read(self) -> None:
        if self._intake is not None:
            self._intake.schedule_read()

    def _on_readable(self) -> None:
        if self._intake is not None:
            self._intake.on_readable()

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
        if self._passthrough and kind and kind != ADD and kind != ABORT:
            self._answered = True
            logger.debug("forwarding a message of type %s unchanged", kind.hex())
            self._forward_now(list(body), [])
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
            frames_out = self._outcome_frames(request, ticket.result(), t0)
            self._emit_now(identity, request.rid, frames_out)
            return
        slot = None
        if self._fwd is not None:
            self._fwd.add_pending()
            slot = self._fwd.slot([key])
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
        if self._fwd is not None:
            self._forward_now([ABORT, body[1]], [(peer, rid) for rid in rids])

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
        self.admissions.observe(rid, request, abort, t0)
        if self._fwd is not None:
            frames = [ADD, *self._forward_abort_frames(request, rid, abort)]
        else:
            frames = wire.encode_aborted(request, abort, rid)
        self._emit_now(identity, rid, frames)

    def _emit_now(self, identity: zmq.Frame, rid: str, frames: list[Any]) -> None:
        """Send an outcome decided in the receive path (no task): ``frames`` are
        ``[status, payload, *aux]`` in reply mode, ``[ADD, payload, *aux]`` in
        forward mode."""
        self._answered = True
        if self._fwd is not None:
            if self._on_forward is not None:
                self._on_forward(rid)
            self._forward_now(frames, [(identity.bytes, rid)])
        else:
            self._reply_now([identity, *frames], rid)

    @staticmethod
    def _forward_abort_frames(request: Request | None, rid: str, abort: Abort) -> list[Any]:
        if request is None:
            return [wire.minimal_abort_payload(rid, abort)]
        return wire.encode_request(
            request, validation_error=abort.as_validation_error(), drop_features=True
        )

    def _outcome_frames(
        self, request: Request, outcome: Materialized | Abort, t0: float
    ) -> list[Any]:
        """``[type/status, payload, *aux]`` for the outcome in this mode; counts it
        once encoded (an encoding failure is answered, and counted, as INTERNAL)."""
        fwd = self._fwd is not None
        if isinstance(outcome, Materialized):
            if fwd:
                frames = [ADD, *wire.encode_request(outcome.request)]
            else:
                frames = wire.encode_materialized(outcome)
        elif fwd:
            frames = [ADD, *self._forward_abort_frames(request, request.rid, outcome)]
        else:
            frames = wire.encode_aborted(request, outcome)
        self.admissions.observe(request.rid, request, outcome, t0)
        return frames

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
        handed_off = False  # the output reached the forward queue / the reply sender
        try:
            try:
                outcome: Materialized | Abort = await ticket.outcome()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the pool never raises here; a bug must still answer
                logger.exception("rid=%s: waiting for the outcome failed", rid)
                outcome = abort_from_exception(exc)
            finally:
                self.admissions.release(key, ticket)
            try:
                frames = self._outcome_frames(request, outcome, t0)
            except Exception as exc:  # noqa: BLE001 - an encoding bug must still answer
                logger.exception("rid=%s: encoding the outcome failed", rid)
                abort = abort_from_exception(exc)
                self.admissions.observe(rid, request, abort, t0)
                frames = (
                    [ADD, wire.minimal_abort_payload(rid, abort)]
                    if self._fwd is not None
                    else wire.encode_aborted(None, abort, rid)
                )
            if self._fwd is not None:
                assert slot is not None
                if self._on_forward is not None:
                    self._on_forward(rid)
                await self._fwd.enqueue(frames, slot)
                handed_off = True
            else:
                handed_off = True
                await self._deliver([identity, *frames], rid)
        finally:
            if not handed_off:  # cancelled at stop before the output was emitted
                self.stats.undeliverable += 1
                logger.warning("rid=%s: stopped before its outcome could be sent", rid)
            if self._fwd is not None and slot is not None:
                self._fwd.release(slot)
                if not handed_off:
                    self._fwd.done_pending()

    # ------------------------------------------------------------------ reply mode

    def _count_replied(self, msg: list[Any]) -> None:
        self.stats.replied += 1
        self.stats.sent_bytes += sum(sizes(msg[1:]))

    def _count_retry(self) -> None:
        self.stats.send_retries += 1

    def _reply_now(self, msg: list[Any], rid: str) -> None:
        """Send from the receive loop; only a send that must be retried gets a task."""
        if self._sent_hook is not None:
            self._sent_hook(msg)
        assert self._replier is not None
        self._replier.send_now(msg, rid)

    async def _deliver(self, msg: list[Any], rid: str) -> None:
        """Send one reply, retrying EAGAIN / EHOSTUNREACH for ``send_timeout_s``."""
        if self._sent_hook is not None:
            self._sent_hook(msg)
        assert self._replier is not None
        await self._replier.deliver(msg, rid)

    def _give_up(self, msg: list[Any], rid: str, why: object) -> None:
        self.stats.undeliverable += 1
        peer = msg[0].bytes if isinstance(msg[0], zmq.Frame) else bytes(msg[0])
        logger.warning(
            "rid=%s: reply to peer %s undeliverable (send timeout %.1fs): %s",
            rid,
            peer.hex(),
            self.send_timeout_s,
            why,
        )

    # ------------------------------------------------------------------ forward mode

    def _count_pause(self) -> None:
        self.stats.intake_paused += 1

    def _count_forwarded(self, msg: list[Any]) -> None:
        stats = self.stats
        stats.forwarded += 1
        stats.sent_bytes += sum(sizes(msg))
        if msg[0] == ABORT:
            stats.forwarded_aborts += 1

    def _forward_failed(self, msg: list[Any], exc: BaseException) -> None:
        self.stats.undeliverable += 1
        logger.warning(
            "rid=%s: forward: could not hand the message to %s (%s)",
            wire.recover_rid(msg[1]) if msg[0] == ADD else "(ABORT)",
            self.forward,
            exc,
        )

    def _forward_now(self, msg: list[Any], keys: list[PeerKey]) -> None:
        """Register a forward output decided in the receive loop (abort or ABORT)."""
        fwd = self._fwd
        assert fwd is not None
        fwd.add_pending()
        if not fwd.has_predecessor(keys):
            fwd.put(msg)  # FIFO: later outputs of these keys come after
            return
        slot = fwd.slot(keys)

        async def after_predecessors() -> None:
            handed_off = False
            try:
                await fwd.enqueue(msg, slot)
                handed_off = True
            finally:
                fwd.release(slot)
                if not handed_off:
                    self.stats.undeliverable += 1
                    fwd.done_pending()

        self._spawn(after_predecessors())
