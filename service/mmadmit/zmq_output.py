"""Where a ZMQ ingest's outcomes go: two small strategies, :class:`Reply` and :class:`Forward`.

:class:`~mmadmit.zmq_ingest.ZmqIngest` reads messages, admits requests and
counts each outcome once (:mod:`mmadmit.admission`); what happens to an
outcome after that is the one thing reply mode and forward mode do
differently, and it lives here:

* :class:`Reply` (docs/spec/WIRE.md, "Reply mode (the default)"): on the intake
  ROUTER. Sends are ``NOBLOCK``, retried with backoff for ``send_timeout_s``,
  then counted ``undeliverable`` (:class:`~mmadmit.zsock.RetryingSender`).
* :class:`Forward` (docs/spec/WIRE.md, "Forward mode"; engine mode's relay
  too): on a PUSH connected to ``--zmq-forward``, or on a socket someone else
  connected (engine mode gives the scheduler's input ROUTER and its identity
  as ``prefix``). Outputs go through one FIFO
  (:class:`~mmadmit.zsock.OrderedSender`) whose pending bound pauses intake
  (back-pressure); per-key slots keep the spec's order.

The contract an ingest relies on (:class:`Output`): :meth:`Output.frames`
encodes an outcome for this strategy, :meth:`Output.emit_now` sends one decided
in the receive path, :meth:`Output.reserve` / :meth:`Output.emit` /
:meth:`Output.release` carry one that a completion task awaits, and
:meth:`Output.flush` / :meth:`Output.close` end it. Each strategy counts its
own delivery (:class:`OutputStats`: ``replied`` or ``forwarded``,
``undeliverable``, ``sent_bytes``); outcomes are counted by the admission path,
never here.

Threading: the event loop of the ingest; no call here blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import zmq
import zmq.asyncio

from . import wire
from .errors import Abort
from .model import Materialized, Request
from .telemetry import SENT_BYTES, UNDELIVERABLE, Sample, counter, counters
from .zsock import OrderedSender, RetryingSender, Slot, SocketReader, sizes

logger = logging.getLogger(__name__)

ADD = bytes([wire.MSG_ADD])
ABORT = bytes([wire.MSG_ABORT])

PeerKey = tuple[Hashable, str]  # (identity bytes, rid)
# A test/diagnostic hook called with every outgoing message (``[identity,
# status, payload, *aux]`` from Reply, ``[0x00 or 0x01, payload, *aux]`` from
# Forward) when it is handed to libzmq; None in production.
SentHook = Callable[[list[Any]], None]
Spawn = Callable[[Any], None]


@dataclass
class OutputStats:
    """What an output counts (``Output.stats``); event loop only."""

    replied: int = 0  # reply messages handed to libzmq (Reply)
    send_retries: int = 0  # reply sends retried after EAGAIN / EHOSTUNREACH (Reply)
    undeliverable: int = 0  # replies or forwards given up (peer gone, stop deadline)
    forwarded: int = 0  # messages handed to the downstream socket (Forward)
    forwarded_aborts: int = 0  # of which ABORT messages (Forward)
    sent_bytes: int = 0  # bytes of every reply or forward handed to libzmq
    intake_paused: int = 0  # times intake stopped reading: forwards pending at their bound

    # exported as mmadmit_<transport>_<field>_total, with this help (metrics())
    COUNTERS: ClassVar[dict[str, str]] = {
        "replied": "Reply messages handed to libzmq.",
        "send_retries": "Reply sends retried after EAGAIN or EHOSTUNREACH.",
        "forwarded": "Messages handed to the downstream socket.",
        "forwarded_aborts": "ABORT messages handed to the downstream socket.",
        "intake_paused": "Times intake stopped reading: forwards pending at their bound.",
    }

    def metrics(self, transport: str) -> Iterator[Sample]:
        yield from counters(self, transport, self.COUNTERS)
        yield counter(
            "undeliverable_replies", UNDELIVERABLE, self.undeliverable, transport=transport
        )
        yield counter("sent_bytes", SENT_BYTES, self.sent_bytes, transport=transport)


class Output:
    """Where one ingest's outcomes go (see the module docstring); one per ingest."""

    mode = ""  # "reply" | "forward", for logs
    adoptable = False  # may run on an adopted intake that is not a ROUTER

    def __init__(self, sent_hook: SentHook | None = None) -> None:
        self._sent_hook = sent_hook
        self.stats = OutputStats()
        self._spawn: Spawn | None = None

    # ------------------------------------------------------------------ lifecycle

    def bind(
        self,
        ctx: zmq.asyncio.Context,
        intake: zmq.Socket[Any],
        reader: SocketReader,
        *,
        spawn: Spawn,
        name: str,
        default_max_pending: int,
    ) -> None:
        """Make (or take) the sockets and senders; called once, before intake reads.
        Raises ``OSError`` for an unusable address. ``spawn(coro)`` runs a task the
        ingest waits for at stop."""
        self._spawn = spawn
        self._bind(ctx, intake, reader, spawn, name, default_max_pending)

    def _bind(
        self,
        ctx: zmq.asyncio.Context,
        intake: zmq.Socket[Any],
        reader: SocketReader,
        spawn: Spawn,
        name: str,
        default_max_pending: int,
    ) -> None:
        """The strategy's own part of :meth:`bind`."""

    @property
    def pending(self) -> int:
        """Outputs registered and not yet handed to libzmq."""
        return 0

    def describe(self) -> str:
        """A suffix for the ingest's listening line."""
        return ""

    async def flush(self, deadline: float) -> None:
        """At stop, once no task will emit again: hand over what is queued until
        ``deadline`` (loop time), count the rest undeliverable."""

    def close(self, linger_ms: int) -> None:
        """Close the sockets this output owns (idempotent)."""

    def close_now(self) -> None:
        """The finalizer's :meth:`close`: no await, linger 0."""
        self.close(0)

    # ------------------------------------------------------------------ outcomes

    def frames(self, request: Request | None, rid: str, outcome: Materialized | Abort) -> list[Any]:
        """The message for one outcome of the ADD ``rid`` (``request``: None when it
        never decoded), without the ROUTER identity."""
        raise NotImplementedError

    def emit_now(self, identity: zmq.Frame, rid: str, frames: list[Any]) -> None:
        """Send an outcome decided in the receive path (no task of its own)."""
        raise NotImplementedError

    def reserve(self, key: PeerKey) -> Slot | None:
        """Hold the output's place for an ADD whose outcome a task will await."""
        return None

    async def emit(
        self, identity: zmq.Frame, rid: str, frames: list[Any], slot: Slot | None
    ) -> None:
        """Send the awaited outcome of a reserved ADD; from here the output counts
        whatever cannot be delivered (a cancelled send included)."""
        raise NotImplementedError

    def release(self, slot: Slot | None) -> None:
        """The reserved ADD's task ended before :meth:`emit` (cancelled at stop)."""

    # ------------------------------------------------------------------ other messages

    def on_abort(self, peer: bytes, payload: zmq.Frame, rids: list[str]) -> None:
        """A well-formed ABORT, after it cancelled what it names."""

    def pass_through(self, body: list[zmq.Frame]) -> bool:
        """A message of an unknown type: True if this output sent it on unchanged."""
        return False


# --------------------------------------------------------------------------- reply


class Reply(Output):
    """Reply mode: each outcome back on the intake ROUTER to the peer that sent it.

    ``send_timeout_s``: how long one reply may be retried (EAGAIN at the peer's
    high-water mark, EHOSTUNREACH before it reconnects) before it is counted
    ``undeliverable``.
    """

    mode = "reply"

    def __init__(self, *, send_timeout_s: float = 5.0, sent_hook: SentHook | None = None) -> None:
        if not send_timeout_s >= 0:
            raise ValueError("send_timeout_s must be a non-negative number")
        super().__init__(sent_hook)
        self.send_timeout_s = send_timeout_s
        self._sender: RetryingSender | None = None

    def _bind(
        self,
        ctx: zmq.asyncio.Context,
        intake: zmq.Socket[Any],
        reader: SocketReader,
        spawn: Spawn,
        name: str,
        default_max_pending: int,
    ) -> None:
        self._sender = RetryingSender(
            intake,
            timeout_s=self.send_timeout_s,
            on_sent=self._count_replied,
            on_retry=self._count_retry,
            give_up=self._give_up,
            spawn=spawn,
            reader=reader,
        )

    def frames(self, request: Request | None, rid: str, outcome: Materialized | Abort) -> list[Any]:
        if isinstance(outcome, Materialized):
            return wire.encode_materialized(outcome)
        return wire.encode_aborted(request, outcome, rid)

    def emit_now(self, identity: zmq.Frame, rid: str, frames: list[Any]) -> None:
        msg = [identity, *frames]
        if self._sent_hook is not None:
            self._sent_hook(msg)
        assert self._sender is not None
        self._sender.send_now(msg, rid)  # only a send that must be retried gets a task

    async def emit(
        self, identity: zmq.Frame, rid: str, frames: list[Any], slot: Slot | None
    ) -> None:
        msg = [identity, *frames]
        if self._sent_hook is not None:
            self._sent_hook(msg)
        assert self._sender is not None
        await self._sender.deliver(msg, rid)  # counts a give-up (and a cancel) itself

    def _count_replied(self, msg: list[Any]) -> None:
        self.stats.replied += 1
        self.stats.sent_bytes += sum(sizes(msg[1:]))

    def _count_retry(self) -> None:
        self.stats.send_retries += 1

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


# --------------------------------------------------------------------------- forward


class Forward(Output):
    """Forward mode: each outcome downstream as an ADD, ABORTs after their ADDs.

    ``target`` is the address a PUSH connects to at :meth:`bind` (``--zmq-forward``),
    or, with ``socket``, only a description of a socket someone else connected
    (engine mode: the scheduler's input ROUTER, each message prefixed with
    ``prefix``, its identity). Either way the output owns the socket from
    :meth:`bind` on and closes it. ``max_pending`` bounds outputs not yet handed
    to libzmq (default: the ingest's, twice the pool's ``max_inflight``);
    ``on_forward(rid)`` is told of every ADD output registered; with
    ``passthrough`` a message of another type byte is forwarded unchanged
    (docs/spec/WIRE.md, "Engine mode: between SMG and a scheduler", step 3).
    """

    mode = "forward"
    adoptable = True

    def __init__(
        self,
        target: str,
        *,
        socket: zmq.asyncio.Socket | None = None,
        prefix: list[Any] | None = None,
        max_pending: int | None = None,
        on_forward: Callable[[str], None] | None = None,
        passthrough: bool = False,
        sent_hook: SentHook | None = None,
    ) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError("max_pending must be positive")
        super().__init__(sent_hook)
        self.target = target
        self.socket = socket
        self.prefix = prefix
        self.max_pending = max_pending
        self._on_forward = on_forward
        self._passthrough = passthrough
        self._fifo: OrderedSender | None = None

    def _bind(
        self,
        ctx: zmq.asyncio.Context,
        intake: zmq.Socket[Any],
        reader: SocketReader,
        spawn: Spawn,
        name: str,
        default_max_pending: int,
    ) -> None:
        if self.max_pending is None:
            self.max_pending = default_max_pending
        if self.socket is None:
            push = self.socket = ctx.socket(zmq.PUSH)
            # IMMEDIATE: queue only on completed connections, so an absent
            # downstream blocks the sender (back-pressure) and what is not
            # delivered at stop is still ours to count.
            push.setsockopt(zmq.IMMEDIATE, 1)
            push.setsockopt(zmq.LINGER, 0)
            try:
                push.connect(self.target)
            except zmq.ZMQError as exc:  # unusable --zmq-forward address
                raise OSError(
                    exc.errno, f"cannot connect ZMQ forward {self.target}: {exc.strerror}"
                ) from exc
        fifo = self._fifo = OrderedSender(
            self.socket,
            max_pending=self.max_pending,
            on_sent=self._count_forwarded,
            on_failed=self._forward_failed,
            prefix=self.prefix,
            sent_hook=self._sent_hook,
            name=f"{name}-forward",
            on_pause=self._count_pause,
        )
        fifo.pauses(reader)
        fifo.start()

    @property
    def fifo(self) -> OrderedSender | None:
        """The one FIFO into the socket (from :meth:`bind` on)."""
        return self._fifo

    @property
    def pending(self) -> int:
        return self._fifo.pending if self._fifo is not None else 0

    def describe(self) -> str:
        return f", forwarding to {self.target}"

    async def flush(self, deadline: float) -> None:
        fifo = self._fifo
        if fifo is None:
            return
        loop = asyncio.get_running_loop()
        while fifo.pending and loop.time() < deadline:
            await asyncio.sleep(min(0.01, max(0.0, deadline - loop.time())))
        await fifo.stop()
        left = len(fifo.abandon_queued())
        if left:
            self.stats.undeliverable += left
            logger.warning(
                "[shutdown] %d message(s) never reached the forward socket (%s)",
                left,
                self.target,
            )

    def close(self, linger_ms: int) -> None:
        sock = self.socket
        if sock is not None and not sock.closed:
            sock.close(linger=linger_ms)

    def close_now(self) -> None:
        if self._fifo is not None:
            self._fifo.cancel_task()
        self.close(0)

    # ------------------------------------------------------------------ outcomes

    def frames(self, request: Request | None, rid: str, outcome: Materialized | Abort) -> list[Any]:
        if isinstance(outcome, Materialized):
            return [ADD, *wire.encode_request(outcome.request)]
        if request is None:
            return [ADD, wire.minimal_abort_payload(rid, outcome)]
        marked = wire.encode_request(
            request, validation_error=outcome.as_validation_error(), drop_features=True
        )
        return [ADD, *marked]

    def emit_now(self, identity: zmq.Frame, rid: str, frames: list[Any]) -> None:
        if self._on_forward is not None:
            self._on_forward(rid)
        self._forward_now(frames, [(identity.bytes, rid)])

    def reserve(self, key: PeerKey) -> Slot:
        fifo = self._fifo
        assert fifo is not None
        fifo.add_pending()
        return fifo.slot([key])

    async def emit(
        self, identity: zmq.Frame, rid: str, frames: list[Any], slot: Slot | None
    ) -> None:
        fifo = self._fifo
        assert fifo is not None and slot is not None
        enqueued = False
        try:
            if self._on_forward is not None:
                self._on_forward(rid)
            await fifo.enqueue(frames, slot)
            enqueued = True
        finally:
            fifo.release(slot)
            if not enqueued:  # cancelled at stop while an earlier output of its key waited
                self.stats.undeliverable += 1
                fifo.done_pending()
                logger.warning("rid=%s: stopped before its outcome could be forwarded", rid)

    def release(self, slot: Slot | None) -> None:
        fifo = self._fifo
        if fifo is not None and slot is not None:
            fifo.release(slot)
            fifo.done_pending()

    # ------------------------------------------------------------------ other messages

    def on_abort(self, peer: bytes, payload: zmq.Frame, rids: list[str]) -> None:
        self._forward_now([ABORT, payload], [(peer, rid) for rid in rids])

    def pass_through(self, body: list[zmq.Frame]) -> bool:
        if not self._passthrough:
            return False
        logger.debug("forwarding a message of type %s unchanged", body[0].bytes.hex())
        self._forward_now(list(body), [])
        return True

    # ------------------------------------------------------------------ sending

    def _forward_now(self, msg: list[Any], keys: list[PeerKey]) -> None:
        """Register an output decided in the receive loop (an abort, an ABORT)."""
        fifo = self._fifo
        assert fifo is not None and self._spawn is not None
        fifo.add_pending()
        if not fifo.has_predecessor(keys):
            fifo.put(msg)  # FIFO: later outputs of these keys come after
            return
        slot = fifo.slot(keys)

        async def after_predecessors() -> None:
            handed_off = False
            try:
                await fifo.enqueue(msg, slot)
                handed_off = True
            finally:
                fifo.release(slot)
                if not handed_off:
                    self.stats.undeliverable += 1
                    fifo.done_pending()

        self._spawn(after_predecessors())

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
            self.target,
            exc,
        )


__all__ = ["Forward", "Output", "OutputStats", "PeerKey", "Reply", "SentHook"]
