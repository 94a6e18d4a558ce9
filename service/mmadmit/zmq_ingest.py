"""The ZMQ msgpack front end (WIRE.md): a ROUTER that admits requests into the pool.

Scope: sockets and delivery only. Decoding and encoding are :mod:`mmadmit.wire`,
admission and materialization are :class:`~mmadmit.pool.MaterializerPool`; this
module reads messages, hands requests to the pool and sends each outcome where
it belongs. Non-goals: engine mode (the SMG handshake relay), metrics export
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
  socket driven by the event loop's reader on its ``ZMQ_FD`` (what pyzmq's
  asyncio sockets do inside, without a poller, futures and a task step per
  wake-up). The reader callback reads with ``NOBLOCK`` while ``EVENTS`` shows
  input, at most a batch per loop turn. No ``await`` sits between dequeuing a
  message and handling it, so stopping intake never drops one.
* **Edge-triggered wake-ups**: ``ZMQ_FD`` signals *changes*, and any call on
  the socket (a send included) may consume the signal of a message that has
  arrived. So every read batch ends only when ``EVENTS`` shows no input (or
  schedules its own continuation), and every send re-checks ``EVENTS`` and
  schedules a read if input is waiting. A watchdog re-checks once a second
  and counts what it finds (``stats.watchdog_reads``) as a last resort.
* **Small requests inline**: the pool materializes a small request at once
  (:meth:`~mmadmit.pool.MaterializerPool.runs_inline`); its outcome is emitted
  from the reader callback, with no task and no in-flight entry.
* **Exactly one reply per ADD**: every path through :meth:`ZmqIngest._handle`
  ends in one of: an immediate abort, or a ticket whose completion task emits
  the outcome. The completion task has a broad guard (``INTERNAL``) and a
  ``finally`` that always releases its forward-ordering slot.
* **Per-peer request ids**: in-flight tickets are keyed by ``(identity, rid)``.
  An ADD whose key is in flight is aborted ``INVALID_REQUEST`` at once (the
  first goes on); an ABORT cancels only its own peer's tickets.
* **Delivery** (reply mode): the ROUTER sets ``ROUTER_MANDATORY``, so a reply to
  a peer that is gone raises ``EHOSTUNREACH`` and one at its high-water mark
  ``EAGAIN`` instead of vanishing. Sends are always ``NOBLOCK`` (a blocking
  send on a mandatory ROUTER would block the event loop) and are retried with
  exponential backoff for at most ``send_timeout_s``; then the reply is
  counted ``undeliverable`` and logged.
* **Back-pressure** (forward mode): one sender task feeds the PUSH in FIFO
  order and awaits its high-water mark. The PUSH sets ``IMMEDIATE``, so nothing
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
* **Size limit**: the bytes of all frames of a message are summed as received;
  above ``max_message_bytes`` the ADD is answered ``TOO_LARGE``. ``ZMQ_MAXMSGSIZE``
  is never set: libzmq would drop the peer's connection without a reply.

Threading: everything runs on the event loop that called :meth:`ZmqIngest.start`;
no zmq call here blocks, and materialization runs on the pool's workers (or,
for small requests, inline: see the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.asyncio

from . import wire
from .errors import Abort, AbortCode, AdmissionError, abort_from_exception
from .model import Materialized, Request
from .pool import MaterializerPool, Ticket
from .telemetry import Telemetry

logger = logging.getLogger(__name__)

ADD = bytes([wire.MSG_ADD])
ABORT = bytes([wire.MSG_ABORT])

# Messages read per reader wake-up before the loop yields to reply tasks; large
# enough to amortize the wake-up, small enough to keep latency of replies flat.
_RECV_BATCH = 64
# The intake watchdog's period: a lost wake-up (see the module docstring) costs
# at most this much delay instead of a stalled peer.
_WATCHDOG_S = 1.0
# Backoff of reply retries (EAGAIN / EHOSTUNREACH): 1 ms doubling to 100 ms, so a
# peer that reconnects is served quickly and a gone one costs a few wake-ups.
_RETRY_FIRST_S = 0.001
_RETRY_MAX_S = 0.1
# Messages still queued in the ROUTER when stop() runs are answered
# SHUTTING_DOWN; at most this many, so a peer that keeps sending cannot hold
# stop() forever.
_FINAL_SWEEP_MAX = 10_000

PeerKey = tuple[bytes, str]
# A test/diagnostic hook called with every outgoing message (``[identity,
# status, payload, *aux]`` in reply mode, ``[0x00 or 0x01, payload, *aux]`` in
# forward mode) just before it is handed to libzmq; None in production.
SentHook = Callable[[list[Any]], None]


@dataclass
class ZmqIngestStats:
    """Counters for metrics; written on the event loop thread only."""

    received: int = 0  # messages read off the ROUTER (ADD, ABORT or malformed)
    aborts_received: int = 0  # well-formed ABORT messages
    cancelled_by_peer: int = 0  # in-flight tickets ended by an ABORT
    materialized: int = 0  # ADDs whose outcome was materialized
    aborted_by_code: dict[str, int] = field(default_factory=dict)  # ADD aborts, by code
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

    def count_abort(self, abort: Abort) -> None:
        name = abort.code.value
        self.aborted_by_code[name] = self.aborted_by_code.get(name, 0) + 1


_POLLIN = int(zmq.POLLIN)  # a plain int: enum.Flag arithmetic costs a microsecond a call


def _sizes(frames: Iterable[Any]) -> list[int]:
    return [len(f) for f in frames]


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, zmq.Again) or (
        isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH
    )


# --------------------------------------------------------------------------- forward


class _Slot:
    """A forward output's place in the per-(peer, rid) order."""

    __slots__ = ("keys", "prevs", "done")

    def __init__(
        self, keys: list[PeerKey], prevs: list[asyncio.Future[None]], done: asyncio.Future[None]
    ) -> None:
        self.keys = keys
        self.prevs = prevs
        self.done = done


class _Forwarder:
    """The PUSH side of forward mode: ordering, pending bound and the sender task.

    Holds no reference to the ingest, so its sender task does not keep the
    ingest alive (STYLE 9).
    """

    def __init__(
        self,
        push: zmq.asyncio.Socket,
        stats: ZmqIngestStats,
        max_pending: int,
        sent_hook: SentHook | None,
        on_room: Callable[[], None],
    ) -> None:
        self.push = push
        self.stats = stats
        self.max_pending = max_pending
        self.sent_hook = sent_hook
        self.on_room = on_room  # intake stopped reading for lack of room: resume it
        self.queue: asyncio.Queue[list[Any]] = asyncio.Queue()
        self.has_room = True
        self.pending = 0  # registered, not yet handed to libzmq
        self._tails: dict[PeerKey, asyncio.Future[None]] = {}
        self._loop = asyncio.get_running_loop()

    # pending bound: intake reads nothing while there is no room
    def add_pending(self) -> None:
        self.pending += 1
        if self.pending >= self.max_pending:
            self.has_room = False

    def done_pending(self, n: int = 1) -> None:
        self.pending -= n
        if not self.has_room and self.pending < self.max_pending:
            self.has_room = True
            self.on_room()

    # ordering
    def slot(self, keys: list[PeerKey]) -> _Slot:
        prevs: list[asyncio.Future[None]] = []
        for key in keys:
            prev = self._tails.get(key)
            if prev is not None and prev not in prevs:
                prevs.append(prev)
        done: asyncio.Future[None] = self._loop.create_future()
        for key in keys:
            self._tails[key] = done
        return _Slot(keys, prevs, done)

    def has_predecessor(self, keys: list[PeerKey]) -> bool:
        return any(key in self._tails for key in keys)

    def release(self, slot: _Slot) -> None:
        if not slot.done.done():
            slot.done.set_result(None)
        for key in slot.keys:
            if self._tails.get(key) is slot.done:
                del self._tails[key]

    async def enqueue(self, msg: list[Any], slot: _Slot) -> None:
        """Wait for the slot's predecessors to be enqueued, then enqueue ``msg``."""
        if slot.prevs:
            # asyncio.wait, not await: a cancelled waiter must not cancel the
            # predecessor futures other outputs wait on too.
            await asyncio.wait(slot.prevs)
        self.queue.put_nowait(msg)

    async def run(self) -> None:
        """The sender: FIFO into the PUSH; awaiting its HWM is the back-pressure."""
        while True:
            msg = await self.queue.get()
            try:
                if self.sent_hook is not None:
                    self.sent_hook(msg)
                await self.push.send_multipart(msg, copy=False)
            except asyncio.CancelledError:
                self.stats.undeliverable += 1
                self.done_pending()
                raise
            except zmq.ZMQError as exc:
                self.stats.undeliverable += 1
                logger.warning(
                    "rid=%s: forward: could not hand the message to the PUSH (%s)",
                    wire.recover_rid(msg[1]) if msg[0] == ADD else "(ABORT)",
                    exc,
                )
            else:
                self.stats.forwarded += 1
                self.stats.sent_bytes += sum(_sizes(msg))
                if msg[0] == ABORT:
                    self.stats.forwarded_aborts += 1
            self.done_pending()

    def abandon_queued(self) -> int:
        """Count what never reached libzmq (at stop, after the linger deadline)."""
        left = 0
        while not self.queue.empty():
            self.queue.get_nowait()
            left += 1
        if left:
            self.stats.undeliverable += left
            self.done_pending(left)
        return left


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
    router: zmq.Socket[Any] | None = None  # plain socket: the loop's reader drives it
    push: zmq.asyncio.Socket | None = None
    sender_task: asyncio.Task[None] | None = None
    reader: tuple[asyncio.AbstractEventLoop, int] | None = None  # (loop, ZMQ_FD)
    watchdog: asyncio.TimerHandle | None = None

    def stop_reading(self) -> None:
        """Unregister the reader and the watchdog (before the ROUTER closes)."""
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.reader is not None:
            loop, fd = self.reader
            self.reader = None
            if not loop.is_closed():
                loop.remove_reader(fd)

    def close_sockets(self, linger_ms: int) -> None:
        self.stop_reading()
        for sock in (self.router, self.push):
            if sock is not None and not sock.closed:
                sock.close(linger=linger_ms)

    def close_now(self) -> None:
        task = self.sender_task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # loop already closed
                task.cancel()
        self.close_sockets(0)
        if self.own_ctx and self.ctx is not None and not self.ctx.closed:
            self.ctx.term()  # sockets are closed with linger 0: returns at once


# --------------------------------------------------------------------------- ingest


# The loop's callbacks hold the ingest weakly, so an ingest that is never
# stopped can still be collected and its finalizer release the sockets (STYLE 9).


def _weakly(ref: weakref.ref[ZmqIngest], method: Callable[[ZmqIngest], None]) -> None:
    """Call ``method`` on the ingest if it still exists."""
    ingest = ref()
    if ingest is not None:
        method(ingest)


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
    (``None``: no watchdog, so that tests see a lost wake-up as a stall).
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
        watchdog_s: float | None = _WATCHDOG_S,
        telemetry: Telemetry | None = None,
    ) -> None:
        if max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
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
        self.stats = ZmqIngestStats()
        self.telemetry = telemetry
        self.endpoint: str | None = None
        self._sent_hook = sent_hook
        self._res = _Resources(ctx=context, own_ctx=context is None)
        self._finalizer = weakref.finalize(self, self._res.close_now)
        self._fwd: _Forwarder | None = None
        self._inflight: dict[PeerKey, Ticket] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closing = False  # stop() began: no new admissions
        self._stop_task: asyncio.Future[None] | None = None
        self._answered = False  # the message being handled got its outcome path
        self._watchdog_s = watchdog_s
        self._ref = weakref.ref(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._read_scheduled = False  # a call_soon(_on_readable) is pending

    @property
    def mode(self) -> str:
        return "reply" if self.forward is None else "forward"

    @property
    def inflight(self) -> int:
        """ADDs admitted to the pool whose outcome has not arrived yet."""
        return len(self._inflight)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Bind the ROUTER (and connect the PUSH); return the endpoint actually bound."""
        if self._started:
            raise RuntimeError("ZmqIngest.start() may be called only once")
        self._started = True
        self._loop = loop = asyncio.get_running_loop()
        res = self._res
        try:
            if res.ctx is None:
                res.ctx = zmq.asyncio.Context()
            router: zmq.Socket[Any] = zmq.Socket(res.ctx, zmq.ROUTER)
            res.router = router
            # Mandatory routing: an unroutable reply raises instead of vanishing.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.LINGER, 0)  # the real linger is given at stop()
            try:
                router.bind(self.listen)
            except zmq.ZMQError as exc:  # e.g. address in use: an operator error, not a crash
                raise OSError(exc.errno, f"cannot bind ZMQ {self.listen}: {exc.strerror}") from exc
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
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
                self._fwd = _Forwarder(
                    push,
                    self.stats,
                    self.max_pending_forwards,
                    self._sent_hook,
                    on_room=functools.partial(_weakly, self._ref, ZmqIngest._schedule_read),
                )
                res.sender_task = asyncio.create_task(self._fwd.run(), name="mmadmit-zmq-forward")
            fd = cast(int, router.getsockopt(zmq.FD))
            loop.add_reader(fd, _weakly, self._ref, ZmqIngest._on_readable)
            res.reader = (loop, fd)
            if self._watchdog_s is not None:
                res.watchdog = loop.call_later(
                    self._watchdog_s, _weakly, self._ref, ZmqIngest._on_watchdog
                )
            self._schedule_read()  # a peer may have sent before the reader was registered
        except BaseException:
            self._closing = True
            self._finalizer()  # close whatever was created; stop() is then a no-op
            raise
        logger.info(
            "ZMQ ingest (%s mode) listening on %s%s",
            self.mode,
            self.endpoint,
            f", forwarding to {self.forward}" if self.forward else "",
        )
        return self.endpoint

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
        self._closing = True
        res = self._res
        if not self._finalizer.alive:  # never started, or start() failed: released
            return
        res.stop_reading()
        if res.router is not None and not res.router.closed:
            self._read_batch(_FINAL_SWEEP_MAX)  # SHUTTING_DOWN for what is queued
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
            sender = res.sender_task
            if sender is not None:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
            left = fwd.abandon_queued()
            if left:
                logger.warning(
                    "[shutdown] %d message(s) never reached the forward PUSH (%s)",
                    left,
                    self.forward,
                )
        linger_ms = int(max(0.0, deadline - loop.time()) * 1000)
        res.close_sockets(linger_ms)
        if res.own_ctx and res.ctx is not None and not res.ctx.closed:
            # term() waits for the sockets' linger: off the loop thread.
            await asyncio.to_thread(res.ctx.term)
        self._finalizer.detach()
        logger.info("[shutdown] ZMQ ingest stopped (%s)", self.stats)

    # ------------------------------------------------------------------ intake

    def _schedule_read(self) -> None:
        """Read soon, from the loop (once, however often it is asked)."""
        if not self._read_scheduled and self._loop is not None and not self._loop.is_closed():
            self._read_scheduled = True
            self._loop.call_soon(_weakly, self._ref, ZmqIngest._on_readable)

    def _input_waiting(self) -> bool:
        router = self._res.router
        if router is None or router.closed:
            return False
        try:
            return bool(cast(int, router.getsockopt(zmq.EVENTS)) & _POLLIN)
        except zmq.ZMQError:  # closing
            return False

    def _on_readable(self) -> None:
        """The reader callback (ZMQ_FD signalled) and every scheduled read."""
        self._read_scheduled = False
        if self._res.reader is None:  # stopped: stop() sweeps what is left
            return
        self.stats.wakeups += 1
        try:
            if self._read_batch(_RECV_BATCH):
                self._schedule_read()  # more may wait: after the loop ran other work
        except Exception:  # noqa: BLE001 - the service must not go deaf silently
            logger.exception("ZMQ intake failed; reading again on the next wake-up")

    def _on_watchdog(self) -> None:
        res = self._res
        if res.reader is None or self._watchdog_s is None or self._loop is None:
            return  # stopped
        if not self._read_scheduled and self._input_waiting():
            # Reading EVENTS consumed the FD's signal: from here a read must be ours.
            self.stats.watchdog_reads += 1
            logger.debug("ZMQ intake: input was waiting unseen; reading now")
            self._schedule_read()
        res.watchdog = self._loop.call_later(
            self._watchdog_s, _weakly, self._ref, ZmqIngest._on_watchdog
        )

    def _read_batch(self, limit: int) -> bool:
        """Read and handle up to ``limit`` messages; True if input may still wait.

        Returns False once ``EVENTS`` shows no input (the FD will signal the
        next arrival), or while forward mode has no room (``on_room`` resumes).
        """
        router = self._res.router
        assert router is not None
        fwd = self._fwd
        for _ in range(limit):
            if fwd is not None and not fwd.has_room:
                # Read EVENTS anyway: it takes down ZMQ_FD's signal, which would
                # otherwise wake the loop on every turn while we wait for room.
                self._input_waiting()
                return False
            # Ask first instead of letting recv raise zmq.Again: a raised Again
            # keeps a traceback of this frame, a cycle that kept the previous
            # message alive until the cyclic GC ran.
            try:
                if not cast(int, router.getsockopt(zmq.EVENTS)) & _POLLIN:
                    return False
                frames = cast(list[zmq.Frame], router.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return False
            except zmq.ZMQError as exc:  # the socket is closing
                logger.debug("ZMQ receive stopped: %s", exc)
                return False
            self._answered = False
            try:
                self._handle(frames)
            except Exception as exc:  # noqa: BLE001 - one bad message must not kill intake
                logger.exception(
                    "unexpected error handling a ZMQ message (frames %s)", _sizes(frames[1:])
                )
                if not self._answered and len(frames) > 1 and frames[1].bytes != ABORT:
                    rid = wire.recover_rid(frames[2]) if len(frames) > 2 else ""
                    try:
                        self._abort_now(
                            frames[0], None, rid, abort_from_exception(exc), time.perf_counter()
                        )
                    except Exception:  # noqa: BLE001 - already logged above; keep reading
                        logger.exception("rid=%s: could not answer INTERNAL either", rid)
        return True

    def _handle(self, frames: list[zmq.Frame]) -> None:
        t0 = time.perf_counter()
        self.stats.received += 1
        identity, body = frames[0], frames[1:]
        total = sum(_sizes(body))
        self.stats.received_bytes += total
        kind = body[0].bytes if body else b""
        if kind == ABORT and len(body) >= 2:
            self._on_abort(identity, body, total)
            return
        if total > self.max_message_bytes:
            rid = wire.recover_rid(body[1]) if len(body) >= 2 else ""
            logger.warning(
                "rid=%s: message of %d bytes (frames %s) exceeds the limit of %d",
                rid,
                total,
                _sizes(body),
                self.max_message_bytes,
            )
            self._abort_now(
                identity,
                None,
                rid,
                Abort(
                    AbortCode.TOO_LARGE,
                    f"message of {total} bytes exceeds the limit of {self.max_message_bytes} "
                    "bytes (--max-message-bytes)",
                ),
                t0,
            )
            return
        try:
            msg = wire.decode_message(body)
        except wire.WireError as exc:
            self.stats.malformed += 1
            logger.warning(
                "rid=%s: malformed message from peer %s (frames %s): %s",
                exc.rid,
                identity.bytes.hex(),
                _sizes(body),
                exc.message,
            )
            self._abort_now(identity, None, exc.rid, exc.to_abort(), t0)
            return
        request = msg.request
        assert request is not None  # an ABORT type byte was dispatched above
        key = (identity.bytes, request.rid)
        if key in self._inflight:
            logger.warning(
                "rid=%s: duplicate request id from peer %s while the first is in flight",
                request.rid,
                identity.bytes.hex(),
            )
            self._abort_now(
                identity,
                request,
                request.rid,
                Abort(
                    AbortCode.INVALID_REQUEST,
                    f"request id {request.rid!r} is already in flight from this peer",
                ),
                t0,
            )
            return
        if self._closing:
            self._abort_now(
                identity,
                request,
                request.rid,
                Abort(
                    AbortCode.SHUTTING_DOWN,
                    "the service is shutting down; retry on another replica",
                ),
                t0,
            )
            return
        try:
            ticket = self.pool.submit(request)
        except AdmissionError as exc:  # Overloaded, ShuttingDown
            self._abort_now(identity, request, request.rid, exc.to_abort(), t0)
            return
        if ticket.done:  # materialized inline: emit now, no task, never in flight
            self.stats.inline += 1
            frames_out = self._outcome_frames(request, ticket.result(), t0)
            self._emit_now(identity, request.rid, frames_out)
            return
        self._inflight[key] = ticket
        slot = None
        if self._fwd is not None:
            self._fwd.add_pending()
            slot = self._fwd.slot([key])
        self._answered = True
        self._spawn(self._complete(identity, key, request, ticket, slot, t0))

    def _on_abort(self, identity: zmq.Frame, body: list[zmq.Frame], total: int) -> None:
        peer = identity.bytes
        if total > self.max_message_bytes:
            self.stats.malformed += 1
            logger.warning(
                "ABORT from peer %s of %d bytes exceeds the limit; dropped", peer.hex(), total
            )
            return
        try:
            rids = wire.decode_message(body).abort_rids
        except wire.WireError as exc:
            self.stats.malformed += 1
            logger.warning(
                "malformed ABORT from peer %s (frames %s) dropped: %s",
                peer.hex(),
                _sizes(body),
                exc.message,
            )
            return
        self.stats.aborts_received += 1
        for rid in rids:
            ticket = self._inflight.get((peer, rid))
            if ticket is not None and ticket.cancel(
                AbortCode.CANCELLED, "cancelled by the client (ABORT)"
            ):
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
        self.stats.count_abort(abort)
        if self.telemetry is not None:
            self.telemetry.outcome("zmq", rid, request, abort, t0)
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
            self.stats.materialized += 1
        else:
            if fwd:
                frames = [ADD, *self._forward_abort_frames(request, request.rid, outcome)]
            else:
                frames = wire.encode_aborted(request, outcome)
            self.stats.count_abort(outcome)
        if self.telemetry is not None:
            self.telemetry.outcome("zmq", request.rid, request, outcome, t0)
        return frames

    async def _complete(
        self,
        identity: zmq.Frame,
        key: PeerKey,
        request: Request,
        ticket: Ticket,
        slot: _Slot | None,
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
                if self._inflight.get(key) is ticket:
                    del self._inflight[key]
            try:
                frames = self._outcome_frames(request, outcome, t0)
            except Exception as exc:  # noqa: BLE001 - an encoding bug must still answer
                logger.exception("rid=%s: encoding the outcome failed", rid)
                abort = abort_from_exception(exc)
                self.stats.count_abort(abort)
                if self.telemetry is not None:
                    self.telemetry.outcome("zmq", rid, request, abort, t0)
                frames = (
                    [ADD, wire.minimal_abort_payload(rid, abort)]
                    if self._fwd is not None
                    else wire.encode_aborted(None, abort, rid)
                )
            if self._fwd is not None:
                assert slot is not None
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

    def _try_send(self, msg: list[Any]) -> BaseException | None:
        router = self._res.router
        if router is None or router.closed:
            return zmq.ZMQError(zmq.ENOTSOCK)
        # NOBLOCK always: on a mandatory ROUTER a blocking send to a full peer
        # would block the loop.
        try:
            router.send_multipart(msg, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            error: BaseException | None = exc.with_traceback(None)  # no frame cycle
        else:
            error = None
            self.stats.replied += 1
            self.stats.sent_bytes += sum(_sizes(msg[1:]))
        # The send may have consumed ZMQ_FD's signal of a message that arrived
        # meanwhile (edge-triggered): then nobody would read it. Check.
        if not self._read_scheduled and self._input_waiting():
            self._schedule_read()
        return error

    def _reply_now(self, msg: list[Any], rid: str) -> None:
        """Send from the receive loop; only a send that must be retried gets a task."""
        if self._sent_hook is not None:
            self._sent_hook(msg)
        exc = self._try_send(msg)
        if exc is None:
            return
        if _retryable(exc):
            self._spawn(self._deliver(msg, rid, hooked=True))
        else:
            self._give_up(msg, rid, exc)

    async def _deliver(self, msg: list[Any], rid: str, *, hooked: bool = False) -> None:
        """Send one reply, retrying EAGAIN / EHOSTUNREACH for ``send_timeout_s``."""
        if self._sent_hook is not None and not hooked:
            self._sent_hook(msg)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.send_timeout_s
        delay = _RETRY_FIRST_S
        try:
            while True:
                exc = self._try_send(msg)
                if exc is None:
                    return
                now = loop.time()
                if not _retryable(exc) or now >= deadline:
                    self._give_up(msg, rid, exc)
                    return
                self.stats.send_retries += 1
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, _RETRY_MAX_S)
        except asyncio.CancelledError:
            self._give_up(msg, rid, "stopped before it could be delivered")
            raise

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

    def _forward_now(self, msg: list[Any], keys: list[PeerKey]) -> None:
        """Register a forward output decided in the receive loop (abort or ABORT)."""
        fwd = self._fwd
        assert fwd is not None
        fwd.add_pending()
        if not fwd.has_predecessor(keys):
            fwd.queue.put_nowait(msg)  # FIFO: later outputs of these keys come after
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
