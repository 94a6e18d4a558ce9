"""The one socket layer: reading and writing ZMQ sockets on the event loop.

Scope: moving frames in and out of libzmq without blocking the loop, losing a
message or copying a buffer. Every ZMQ transport of the service uses it:
reply and forward mode (:mod:`mmadmit.zmq_ingest`) and engine mode
(:mod:`mmadmit.engine_mode`). Non-goals: what a message means (the codec,
:mod:`mmadmit.wire`), admission (the pool), counters (each user counts in its
own ``stats`` through the callbacks below).

Three pieces:

* :class:`SocketReader`, **intake**: a plain pyzmq socket driven by the event
  loop's reader on its ``ZMQ_FD`` (what pyzmq's asyncio sockets do inside,
  without a poller, futures and a task step per wake-up). The callback reads
  with ``NOBLOCK`` while ``EVENTS`` shows input, at most a batch per loop turn,
  and hands each message to ``on_message`` synchronously: no ``await`` sits
  between dequeuing a message and handling it, so stopping intake never drops
  one. ``ZMQ_FD`` is edge-triggered and any call on the socket (a send
  included) may consume the signal of a message that has arrived, so a batch
  ends only when ``EVENTS`` shows no input (or schedules its own
  continuation), :meth:`SocketReader.after_send` re-checks after a send on the
  same socket, and a watchdog re-checks once a second as a last resort
  (counted in ``stats.watchdog_reads``). While :attr:`SocketReader.blocked`
  (back-pressure), nothing is read; :meth:`SocketReader.resume` reads again.
* :class:`RetryingSender`, **delivery with retries** (``ROUTER_MANDATORY``
  sockets): sends are always ``NOBLOCK`` (a blocking send on a mandatory ROUTER
  would block the loop); ``EAGAIN`` (peer at its high-water mark) and
  ``EHOSTUNREACH`` (peer gone, maybe reconnecting) are retried with exponential
  backoff for at most ``timeout_s``, then the message is given up (the owner
  counts and logs it). A send that succeeds at once costs no task.
* :class:`OrderedSender`, **back-pressure and order**: one FIFO into a socket
  (a PUSH, or a ROUTER with a fixed destination ``prefix``). A message is sent
  at once with ``NOBLOCK`` when nothing is queued before it; otherwise it waits
  in the FIFO for one sender task that awaits the socket's high-water mark.
  Messages are counted *pending* from registration until libzmq has them;
  while ``max_pending`` are pending the readers it :meth:`pauses
  <OrderedSender.pauses>` stop reading, so a blocked downstream stops intake and
  upstream senders meet ZMQ's own back-pressure; nothing is dropped before it
  reaches libzmq. Per-key *slots* order messages of the same key (a request
  id): a message waits for the previous slot of each of its keys.

Zero-copy: frames are read with ``copy=False`` and sent with ``copy=False``;
a received ``zmq.Frame`` handed back to ``send`` is shared by libzmq, not
copied. Nothing here writes to a buffer after handing it to libzmq.

Ownership (STYLE 9): the loop's callbacks hold a reader or sender weakly, and
a reader holds its ``on_message`` as a weak method, so an owner that is never
stopped can still be collected and its finalizer release the sockets. The
owner closes the sockets; these classes only unregister their callbacks.

Threading: everything runs on the event loop thread that started it.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

# Messages read per reader wake-up before the loop yields to other work; large
# enough to amortize the wake-up, small enough to keep the latency of outputs flat.
RECV_BATCH = 64
# The intake watchdog's period: a lost wake-up (see the module docstring) costs
# at most this much delay instead of a stalled peer.
WATCHDOG_S = 1.0
# Backoff of retried sends (EAGAIN / EHOSTUNREACH): 1 ms doubling to 100 ms, so a
# peer that reconnects is served quickly and a gone one costs a few wake-ups.
RETRY_FIRST_S = 0.001
RETRY_MAX_S = 0.1

_POLLIN = int(zmq.POLLIN)  # a plain int: enum.Flag arithmetic costs a microsecond a call

# pyzmq's compiled send and recv, called past its Python layer: that layer costs
# more than the frames on a message of many (an enum ``SNDMORE | flags`` per sent
# frame, an enum-checked ``getsockopt(RCVMORE)`` per received one: 140 -> 65 us
# and 115 -> 47 us for a 36-frame reply). Always NOBLOCK; OrderedSender's slow
# path keeps the asyncio socket's awaited send_multipart.
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_BUFFER_TYPES = (zmq.Frame, bytes, memoryview)


def send_now(sock: zmq.Socket[Any], parts: list[Any]) -> None:
    """``sock.send_multipart(parts, zmq.NOBLOCK, copy=False)``, faster: every part
    is checked to be a buffer before the first is sent (a message is never left
    half sent), and ``zmq.Again`` is raised only by the first part (libzmq
    queues a multipart message whole or not at all)."""
    for part in parts:
        if type(part) not in _BUFFER_TYPES:
            memoryview(part)  # TypeError for what is not a buffer, before anything is sent
    last = len(parts) - 1
    for i in range(last):
        _raw_send(sock, parts[i], _MORE_NOBLOCK, False, False)
    _raw_send(sock, parts[last], _NOBLOCK, False, False)


OnMessage = Callable[[list[zmq.Frame]], None]


class ReaderStats(Protocol):
    wakeups: int
    watchdog_reads: int


def sizes(frames: Iterable[Any]) -> list[int]:
    return [len(f) for f in frames]


def retryable(exc: BaseException) -> bool:
    """``EAGAIN`` or ``EHOSTUNREACH``: worth retrying on a mandatory ROUTER."""
    return isinstance(exc, zmq.Again) or (
        isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH
    )


def _weakly(ref: weakref.ref[Any], method: Callable[[Any], None]) -> None:
    """Call ``method`` on the referent if it still exists (the loop's callbacks)."""
    obj = ref()
    if obj is not None:
        method(obj)


def _weak_callable(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any] | None]:
    """A getter for ``fn`` that does not keep a bound method's object alive."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)  # type: ignore[arg-type]
    return lambda: fn


# --------------------------------------------------------------------------- intake


class SocketReader:
    """Reads one plain socket from the loop's reader on its ``ZMQ_FD``.

    ``on_message(frames)`` is called for every message, on the loop, with no
    ``await`` in between; it should not raise (an exception is logged and
    reading goes on). ``stats`` receives ``wakeups`` and ``watchdog_reads``.
    ``watchdog_s=None`` turns the watchdog off (tests: a lost wake-up must
    show as a stall). With ``max_frames``, a message of more frames is handed
    over as a :class:`CutMessage` of its first ``max_frames`` frames: the rest
    are received and released one by one, never held together in Python.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: OnMessage,
        *,
        stats: ReaderStats,
        name: str,
        batch: int = RECV_BATCH,
        watchdog_s: float | None = WATCHDOG_S,
        max_frames: int | None = None,
    ) -> None:
        if max_frames is not None and max_frames < 1:
            raise ValueError("max_frames must be positive")
        self.sock = sock
        self.max_frames = max_frames
        self.stats = stats
        self.name = name
        self.batch = batch
        self.watchdog_s = watchdog_s
        self.blocked = False  # back-pressure: read nothing until resume()
        self.registration: tuple[asyncio.AbstractEventLoop, int] | None = None  # (loop, ZMQ_FD)
        self.read_scheduled = False  # a call_soon(on_readable) is pending
        self.last_read = 0.0  # loop time of the last wake-up (the drain counts quiet from it)
        self._on_message = _weak_callable(on_message)
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ref = weakref.ref(self)

    def start(self) -> None:
        """Register the reader (and the watchdog) and read what already waits."""
        self._loop = loop = asyncio.get_running_loop()
        fd = cast(int, self.sock.getsockopt(zmq.FD))
        loop.add_reader(fd, _weakly, self._ref, SocketReader.on_readable)
        self.registration = (loop, fd)
        self.arm_watchdog()
        self.schedule_read()  # a peer may have sent before the reader was registered

    def stop(self) -> None:
        """Unregister the reader and the watchdog (before the socket closes); idempotent."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.registration is not None:
            loop, fd = self.registration
            self.registration = None
            if not loop.is_closed():
                loop.remove_reader(fd)

    # ------------------------------------------------------------------ wake-ups

    def schedule_read(self) -> None:
        """Read soon, from the loop (once, however often it is asked)."""
        loop = self._loop
        if not self.read_scheduled and loop is not None and not loop.is_closed():
            self.read_scheduled = True
            loop.call_soon(_weakly, self._ref, SocketReader.on_readable)

    def resume(self) -> None:
        """Back-pressure lifted: read again."""
        self.blocked = False
        self.schedule_read()

    def input_waiting(self) -> bool:
        sock = self.sock
        if sock.closed:
            return False
        try:
            return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN)
        except zmq.ZMQError:  # closing
            return False

    def after_send(self) -> None:
        """Call after any send on this socket: the send may have consumed the FD's
        signal of a message that arrived meanwhile (edge-triggered)."""
        if not self.read_scheduled and self.input_waiting():
            self.schedule_read()

    def on_readable(self) -> None:
        """The reader callback (ZMQ_FD signalled) and every scheduled read."""
        self.read_scheduled = False
        if self.registration is None:  # stopped: the owner sweeps what is left
            return
        self.stats.wakeups += 1
        try:
            if self.read_batch(self.batch):
                self.schedule_read()  # more may wait: after the loop ran other work
            self.last_read = self._loop.time() if self._loop is not None else 0.0
        except Exception:  # noqa: BLE001 - the service must not go deaf silently
            logger.exception("%s intake failed; reading again on the next wake-up", self.name)

    def _on_watchdog(self) -> None:
        if self.registration is None or self.watchdog_s is None or self._loop is None:
            return  # stopped
        if not self.read_scheduled and not self.blocked and self.input_waiting():
            # Reading EVENTS consumed the FD's signal: from here a read must be ours.
            self.stats.watchdog_reads += 1
            logger.debug("%s intake: input was waiting unseen; reading now", self.name)
            self.schedule_read()
        self.arm_watchdog()

    def arm_watchdog(self) -> None:
        """(Re)start the watchdog's period from now (a no-op without a watchdog)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.watchdog_s is not None and self._loop is not None:
            self._watchdog = self._loop.call_later(
                self.watchdog_s, _weakly, self._ref, SocketReader._on_watchdog
            )

    def disarm_watchdog(self) -> None:
        """Stop the watchdog until :meth:`arm_watchdog`."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    # ------------------------------------------------------------------ reading

    def read_batch(self, limit: int) -> bool:
        """Read and hand over up to ``limit`` messages; True if input may still wait.

        Returns False once ``EVENTS`` shows no input (the FD will signal the
        next arrival), or while :attr:`blocked` (:meth:`resume` reads again).
        """
        sock = self.sock
        handler = self._on_message()
        if handler is None:  # the owner is gone
            return False
        for _ in range(limit):
            if self.blocked:
                # Read EVENTS anyway: it takes down ZMQ_FD's signal, which would
                # otherwise wake the loop on every turn while we wait for room.
                self.input_waiting()
                return False
            # Ask first instead of letting recv raise zmq.Again: a raised Again
            # keeps a traceback of this frame, a cycle that kept the previous
            # message alive until the cyclic GC ran.
            try:
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN:
                    return False
                frames = recv_now(sock, self.max_frames)
            except zmq.Again:
                return False
            except zmq.ZMQError as exc:  # the socket is closing
                logger.debug("%s receive stopped: %s", self.name, exc)
                return False
            handler(frames)
        return True


def recv_now(sock: zmq.Socket[Any], max_frames: int | None = None) -> list[zmq.Frame]:
    """One whole waiting message (libzmq delivers its parts together), read without
    copying; with ``max_frames``, at most that many parts are kept and a longer
    message comes back as a :class:`CutMessage`. ``zmq.Again`` if none waits."""
    frame = cast(zmq.Frame, _raw_recv(sock, _NOBLOCK, False, False))
    frames: list[zmq.Frame] = [frame]
    limit = -1 if max_frames is None else max_frames
    while frame.more:
        frame = cast(zmq.Frame, _raw_recv(sock, _NOBLOCK, False, False))
        if len(frames) != limit:
            frames.append(frame)
            continue
        cut = CutMessage(frames)
        cut.total_frames = len(frames) + 1
        cut.total_bytes = sum(len(f) for f in frames) + len(frame)
        while frame.more:  # the rest: counted, then released
            frame = cast(zmq.Frame, _raw_recv(sock, _NOBLOCK, False, False))
            cut.total_bytes += len(frame)
            cut.total_frames += 1
        return cut
    return frames


class CutMessage(list):  # type: ignore[type-arg]
    """The first ``max_frames`` frames of a longer message, with its real size."""

    total_frames: int = 0
    total_bytes: int = 0


# --------------------------------------------------------------------------- delivery


class RetryingSender:
    """``NOBLOCK`` sends on a mandatory ROUTER, retried for ``timeout_s``.

    ``on_sent(msg)`` is told of every message handed to libzmq, ``on_retry()``
    of every retry, ``give_up(msg, tag, why)`` of every message abandoned;
    ``reader`` is the :class:`SocketReader` of the same socket, if any (its
    edge-triggered wake-up is re-checked after every send).
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        *,
        timeout_s: float,
        on_sent: Callable[[list[Any]], None],
        on_retry: Callable[[], None],
        give_up: Callable[[list[Any], str, object], None],
        spawn: Callable[[Any], None],
        reader: SocketReader | None = None,
    ) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.reader = reader
        self._on_sent = on_sent
        self._on_retry = on_retry
        self._give_up = give_up
        self._spawn = spawn

    def try_send(self, msg: list[Any]) -> BaseException | None:
        sock = self.sock
        if sock.closed:
            return zmq.ZMQError(zmq.ENOTSOCK)
        try:
            send_now(sock, msg)
        except zmq.ZMQError as exc:
            error: BaseException | None = exc.with_traceback(None)  # no frame cycle
        else:
            error = None
            self._on_sent(msg)
        if self.reader is not None:
            self.reader.after_send()
        return error

    def send_now(self, msg: list[Any], tag: str) -> None:
        """Send from the receive path; only a send that must be retried gets a task."""
        exc = self.try_send(msg)
        if exc is None:
            return
        if retryable(exc):
            self._spawn(self.deliver(msg, tag))
        else:
            self._give_up(msg, tag, exc)

    async def deliver(self, msg: list[Any], tag: str) -> None:
        """Send one message, retrying EAGAIN / EHOSTUNREACH for ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        delay = RETRY_FIRST_S
        try:
            while True:
                exc = self.try_send(msg)
                if exc is None:
                    return
                now = loop.time()
                if not retryable(exc) or now >= deadline:
                    self._give_up(msg, tag, exc)
                    return
                self._on_retry()
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, RETRY_MAX_S)
        except asyncio.CancelledError:
            self._give_up(msg, tag, "stopped before it could be delivered")
            raise


# --------------------------------------------------------------------------- ordered FIFO


class Slot:
    """A message's place in the per-key order."""

    __slots__ = ("keys", "prevs", "done")

    def __init__(
        self, keys: list[Any], prevs: list[asyncio.Future[None]], done: asyncio.Future[None]
    ) -> None:
        self.keys = keys
        self.prevs = prevs
        self.done = done


class OrderedSender:
    """One FIFO into ``sock`` (an asyncio PUSH, or ROUTER with ``prefix``).

    ``on_sent(msg)`` / ``on_failed(msg, exc)`` are told of every message handed
    to libzmq / refused by it (``msg`` without the prefix); ``sent_hook(msg)``
    is a test hook called for every message libzmq took. Holds no reference to its owner, so its
    sender task does not keep the owner alive (STYLE 9).
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        *,
        max_pending: int,
        on_sent: Callable[[list[Any]], None],
        on_failed: Callable[[list[Any], BaseException], None],
        prefix: list[Any] | None = None,
        sent_hook: Callable[[list[Any]], None] | None = None,
        name: str = "forward",
        on_pause: Callable[[], None] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be positive")
        self.sock = sock
        # A plain twin of the asyncio socket for the NOBLOCK fast path; used only
        # while nothing is queued or being sent, so it never overtakes the FIFO.
        self._sync: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        self.max_pending = max_pending
        self.prefix = list(prefix or ())
        self.name = name
        self.has_room = True
        self.pending = 0  # registered, not yet handed to libzmq
        self._on_sent = on_sent
        self._on_failed = on_failed
        self._on_pause = on_pause  # told each time the pending bound stops the readers
        self._sent_hook = sent_hook
        self._queue: deque[list[Any]] = deque()
        self._wake: asyncio.Event = asyncio.Event()
        self._sending = False  # the sender task holds a message inside an await
        self._paused: list[weakref.ref[SocketReader]] = []
        self._tails: dict[Any, asyncio.Future[None]] = {}
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.get_running_loop().create_task(
            _sender_loop(weakref.ref(self), self._wake), name=f"mmadmit-zmq-{self.name}"
        )
        return self._task

    async def stop(self) -> None:
        """Cancel the sender task (what is queued stays counted pending)."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def cancel_task(self) -> None:
        """Synchronous :meth:`stop` for finalizers."""
        task = self._task
        if task is not None and not task.done():
            try:
                task.cancel()
            except RuntimeError:  # loop already closed
                pass

    def pauses(self, reader: SocketReader) -> None:
        """``reader`` stops reading while there is no room (and resumes after)."""
        self._paused.append(weakref.ref(reader))

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ pending bound

    def add_pending(self) -> None:
        self.pending += 1
        if self.pending >= self.max_pending and self.has_room:
            self.has_room = False
            if self._on_pause is not None:
                self._on_pause()
            for ref in self._paused:
                reader = ref()
                if reader is not None:
                    reader.blocked = True

    def done_pending(self, n: int = 1) -> None:
        self.pending -= n
        if not self.has_room and self.pending < self.max_pending:
            self.has_room = True
            for ref in self._paused:
                reader = ref()
                if reader is not None:
                    reader.resume()

    # ------------------------------------------------------------------ ordering

    def slot(self, keys: list[Any]) -> Slot:
        prevs: list[asyncio.Future[None]] = []
        for key in keys:
            prev = self._tails.get(key)
            if prev is not None and prev not in prevs:
                prevs.append(prev)
        done: asyncio.Future[None] = self._loop.create_future()
        for key in keys:
            self._tails[key] = done
        return Slot(keys, prevs, done)

    def has_predecessor(self, keys: list[Any]) -> bool:
        return any(key in self._tails for key in keys)

    def release(self, slot: Slot) -> None:
        if not slot.done.done():
            slot.done.set_result(None)
        for key in slot.keys:
            if self._tails.get(key) is slot.done:
                del self._tails[key]

    async def enqueue(self, msg: list[Any], slot: Slot) -> None:
        """Wait for the slot's predecessors to be handed over, then :meth:`put` ``msg``."""
        if slot.prevs:
            # asyncio.wait, not await: a cancelled waiter must not cancel the
            # predecessor futures other messages wait on too.
            await asyncio.wait(slot.prevs)
        self.put(msg)

    # ------------------------------------------------------------------ sending

    def put(self, msg: list[Any]) -> None:
        """Hand ``msg`` (already counted pending) over in FIFO order: at once when
        nothing is ahead of it and libzmq takes it, else through the sender task."""
        # The asyncio socket's own flag: the shadow must never outlive its socket.
        if not self._queue and not self._sending and not self.sock.closed:
            out = [*self.prefix, *msg] if self.prefix else msg
            try:
                send_now(self._sync, out)
            except zmq.Again:
                pass  # at the high-water mark (or not connected): the task waits for room
            except zmq.ZMQError as exc:
                self._failed(msg, exc.with_traceback(None))
                return
            else:
                self._sent(msg)
                return
        self._queue.append(msg)
        self._wake.set()

    def _sent(self, msg: list[Any]) -> None:
        if self._sent_hook is not None:
            self._sent_hook(msg)
        self._on_sent(msg)
        self.done_pending()

    def _failed(self, msg: list[Any], exc: BaseException) -> None:
        try:
            self._on_failed(msg, exc)
        finally:
            self.done_pending()

    async def _send_one(self, msg: list[Any]) -> None:
        out = [*self.prefix, *msg] if self.prefix else msg
        self._sending = True
        try:
            await self.sock.send_multipart(out, copy=False)
        except asyncio.CancelledError:
            self._queue.appendleft(msg)  # still pending: abandon_queued() counts it
            raise
        except zmq.ZMQError as exc:
            self._failed(msg, exc)
        else:
            self._sent(msg)
        finally:
            self._sending = False

    def abandon_queued(self) -> list[list[Any]]:
        """Take what never reached libzmq (at stop, after the linger deadline)."""
        left = list(self._queue)
        self._queue.clear()
        if left:
            self.done_pending(len(left))
        return left


async def _sender_loop(ref: weakref.ref[OrderedSender], wake: asyncio.Event) -> None:
    """The sender task: FIFO into the socket; awaiting its HWM is the back-pressure."""
    while True:
        await wake.wait()
        sender = ref()
        if sender is None:
            return
        while sender._queue:
            await sender._send_one(sender._queue.popleft())
        wake.clear()
        del sender  # hold the sender only while working


__all__ = [
    "RECV_BATCH",
    "WATCHDOG_S",
    "CutMessage",
    "OrderedSender",
    "RetryingSender",
    "Slot",
    "SocketReader",
    "retryable",
    "sizes",
]
