"""Engine mode: mmadmit as a transparent admission hop between SMG and a scheduler.

What the relay does, handshakes included, is docs/spec/WIRE.md, "Engine mode:
between SMG and a scheduler", and its death and drain rules are
docs/spec/CLI.md, "Engine mode and the SMG gRPC face". :class:`EngineRelay`
looks like an engine to SMG and like SMG to the scheduler:

* **downstream** (the scheduler): its :class:`~mmadmit.scheduler_link.SchedulerLink`
  (``relay.link``) binds the scheduler's sockets and completes its handshake;
* **upstream** (SMG): only then :meth:`EngineRelay.start` connects to SMG as an
  engine. A malformed message raises :class:`~mmadmit.handshake.HandshakeError`,
  a step that never comes :class:`~mmadmit.handshake.HandshakeTimeout`.

The relay, once both handshakes are done:

* **requests**: SMG's input DEALER is the intake of a forward-mode
  :class:`~mmadmit.zmq_ingest.ZmqIngest` (:meth:`~mmadmit.zmq_ingest.ZmqIngest.adopt`)
  whose :class:`~mmadmit.zmq_output.Forward` output is the scheduler's input
  ROUTER (with ``passthrough`` for other message types). This is the very
  code of forward mode, not a copy.
* **outputs**: the output PULL is read by a :class:`~mmadmit.zsock.SocketReader`
  and every message goes to SMG's output PUSH through an
  :class:`~mmadmit.zsock.OrderedSender`: the received ``zmq.Frame`` objects
  themselves (no copy), in order, never decoded strictly. To know when a drain
  is done the relay *reads* ``BatchTokenIDOutSlim`` outputs leniently (tag,
  ``rids``, ``finished_reasons``; anything else is relayed and merely not
  tracked, ``stats.outputs_untracked``).
* **death**: a socket monitor on the scheduler's input and output connections
  sees them drop; that, or ``ENGINE_CORE_DEAD`` from the scheduler, makes the
  relay send its ``ENGINE_CORE_DEAD`` and report the scheduler gone.
* **drain** (SIGTERM): the pool refuses new work (requests arriving now are
  forwarded marked); :meth:`EngineRelay.drain` waits until every forwarded
  request has a finished output (or the deadline); :meth:`EngineRelay.stop`
  then stops intake, sends ``ENGINE_CORE_DEAD`` to SMG and closes.

Threading: everything runs on the event loop; the handshake sockets and the
forward/output targets are asyncio sockets, the two intakes plain sockets
driven by :mod:`mmadmit.zsock`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import zmq
import zmq.asyncio

from .handshake import ENGINE_CORE_DEAD, HandshakeError, parse_init, status_message
from .limits import DEFAULT_LIMITS, Limits
from .pool import MaterializerPool
from .scheduler_link import HANDSHAKE_STEPS, PROGRESS_S, SchedulerLink
from .telemetry import Sample, Telemetry, counter, counters, gauge
from .zmq_ingest import ZmqIngest
from .zmq_output import Forward
from .zsock import WATCHDOG_S, OrderedSender, SocketReader

logger = logging.getLogger(__name__)

# Outputs read from the scheduler and not yet handed to SMG's PUSH before the
# relay stops reading the scheduler's output socket (its PUSH then meets ZMQ's
# own high-water mark).
MAX_PENDING_OUTPUTS = 4096
# How long, at the end, ENGINE_CORE_DEAD and the last outputs may take to leave.
DEAD_LINGER_S = 2.0
# Output frames read per scheduler death before the ENGINE_CORE_DEAD frame, so
# that what the scheduler sent before it went is relayed first.
_FINAL_OUTPUTS_MAX = 100_000

_DEAD_LEN = len(ENGINE_CORE_DEAD)
_SPLIT = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ANY = msgspec.msgpack.Decoder()
_OUTPUT_TAG = "BatchTokenIDOutSlim"


@dataclass
class EngineStats:
    """The relay's own counters (``EngineRelay.stats``); SMG's input is its ingest's
    (``ingest.stats``, ``ingest.output.stats``), the scheduler side its link's."""

    relayed_requests: int = 0  # ADD outputs (materialized or marked) queued for the scheduler
    output_messages: int = 0  # scheduler output messages relayed to SMG (read)
    output_bytes: int = 0  # their bytes, all frames
    output_undeliverable: int = 0  # outputs libzmq refused (SMG's PUSH closed)
    outputs_untracked: int = 0  # outputs not read as BatchTokenIDOutSlim (drain can't see them)
    handshake_steps_smg: int = 0  # HELLO, INIT, READY, ready response, output connected
    engine_core_dead_sent: int = 0  # ENGINE_CORE_DEAD frames handed to SMG's PUSH
    outstanding: int = 0  # forwarded requests without a finished output yet
    wakeups: int = 0  # output reader callbacks run
    watchdog_reads: int = 0  # output reads started by the watchdog

    # exported as mmadmit_engine_<field>_total, with this help (metrics())
    COUNTERS: ClassVar[dict[str, str]] = {
        "relayed_requests": "Requests from SMG forwarded to the scheduler, materialized or marked.",
        "output_undeliverable": "Scheduler outputs that never reached SMG's output socket.",
        "outputs_untracked": "Scheduler outputs relayed without reading what they finish.",
    }

    # the output reader's, as mmadmit_engine_output_<field>_total
    READER_COUNTERS: ClassVar[dict[str, str]] = {
        "wakeups": "Scheduler output reader callbacks run.",
        "watchdog_reads": "Scheduler output reads started by the watchdog: output waited unseen.",
    }

    def metrics(self) -> Iterator[Sample]:
        yield from counters(self, "engine", self.COUNTERS)
        yield from counters(self, "engine_output", self.READER_COUNTERS)
        doc = "Scheduler output messages relayed to SMG."
        yield counter("engine_relayed_outputs", doc, self.output_messages)
        doc = "Bytes of the scheduler output messages relayed to SMG."
        yield counter("engine_relayed_output_bytes", doc, self.output_bytes)
        doc = "ENGINE_CORE_DEAD messages sent to SMG."
        yield counter("engine_core_dead_sent", doc, self.engine_core_dead_sent)
        yield counter(
            "engine_handshake_steps", HANDSHAKE_STEPS, self.handshake_steps_smg, side="smg"
        )
        doc = "Requests forwarded to the scheduler without a finished output yet."
        yield gauge("engine_outstanding", doc, self.outstanding)


class EngineRelay:
    """One scheduler behind one SMG engine slot (usage in :mod:`mmadmit.server`)::

        relay = EngineRelay(pool, link, smg_handshake="tcp://smg:5555",
                            max_message_bytes=1 << 30)   # link: bound
        await link.handshake()              # the scheduler's first
        await relay.start()                 # then SMG's; the relay runs
        ...
        await relay.drain(deadline)         # SIGTERM: forwarded requests finish
        await relay.stop(linger_s)          # ENGINE_CORE_DEAD to SMG; idempotent
        await link.close()

    When the scheduler goes away after its handshake the relay sends
    ``ENGINE_CORE_DEAD`` upstream before the link's ``on_gone(why)``;
    ``output_hook(frames)`` is a test hook told of every message libzmq took
    for SMG's output socket.
    """

    def __init__(
        self,
        pool: MaterializerPool,
        link: SchedulerLink,
        *,
        smg_handshake: str,
        max_message_bytes: int,
        telemetry: Telemetry | None = None,
        watchdog_s: float | None = WATCHDOG_S,
        max_pending_outputs: int = MAX_PENDING_OUTPUTS,
        output_hook: Callable[[list[Any]], None] | None = None,
        limits: Limits = DEFAULT_LIMITS,
        max_frames: int | None = None,
    ) -> None:
        self.link = link
        link.on_death = self._on_death
        self.stats = EngineStats()
        self.pool = pool
        self.limits = limits
        self.max_frames = max_frames
        self.smg_handshake = smg_handshake
        self.max_message_bytes = max_message_bytes
        self.telemetry = telemetry
        self.ingest: ZmqIngest | None = None
        self.ready = False  # both handshakes done
        self._watchdog_s = watchdog_s
        self._max_pending_outputs = max_pending_outputs
        self._output_hook = output_hook
        self._hs_up: zmq.asyncio.Socket | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._out: OrderedSender | None = None
        self._out_reader: SocketReader | None = None
        self._dead_sent = False
        self._outstanding: set[str] = set()
        self._stop_task: asyncio.Future[None] | None = None

    def metrics(self) -> Iterator[Sample]:
        """The relay's series, its link's and, once relaying, SMG's input's."""
        yield from self.stats.metrics()
        yield from self.link.stats.metrics("engine")
        if self.ingest is not None:
            yield from self.ingest.metrics()

    # ------------------------------------------------------------------ handshake

    async def start(self) -> None:
        """After the scheduler's handshake (``link.handshake()``): SMG's, then the
        relay runs; raises HandshakeError / HandshakeTimeout."""
        await self._handshake_smg()
        self.ready = True
        logger.info(
            "engine mode: relaying SMG %s <-> scheduler (engine %d)",
            self.smg_handshake,
            self.link.engine_index,
        )

    async def _handshake_smg(self) -> None:
        link = self.link
        assert link.ready_response is not None and link.scheduler_identity is not None
        hs = self._hs_up = link.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, link.identity)
        try:
            hs.connect(self.smg_handshake)
        except zmq.ZMQError as exc:
            raise OSError(
                exc.errno, f"cannot connect to SMG's handshake {self.smg_handshake}: {exc.strerror}"
            ) from exc
        await hs.send(status_message("HELLO"))
        self.stats.handshake_steps_smg += 1
        logger.info("engine handshake: HELLO sent to SMG at %s", self.smg_handshake)
        step = "INIT from SMG"
        frames = await link.step(hs.recv_multipart(copy=False), step)
        init = parse_init(frames[-1].buffer, step)
        self.stats.handshake_steps_smg += 1
        await hs.send(status_message("READY"))
        self.stats.handshake_steps_smg += 1
        # SMG's input: requests arrive here; the ready response goes first, unchanged.
        intake: zmq.Socket[Any] = link.socket(zmq.DEALER, plain=True)
        intake.setsockopt(zmq.IDENTITY, link.identity)
        push: zmq.asyncio.Socket = link.socket(zmq.PUSH)
        try:
            intake.connect(init.inputs[0])
            push.connect(init.outputs[0])
        except zmq.ZMQError as exc:
            raise HandshakeError(step, "addresses", f"unusable endpoint ({exc.strerror})") from exc
        intake.send(link.ready_response, copy=False)  # an empty pipe: never blocks
        self.stats.handshake_steps_smg += 1
        self._push = push
        self.stats.handshake_steps_smg += 1
        logger.info(
            "engine handshake: ready response presented to SMG (input %s, output %s)",
            init.inputs[0],
            init.outputs[0],
        )
        self._start_relay(intake, push)

    # ------------------------------------------------------------------ relay

    def _start_relay(self, intake: zmq.Socket[Any], push: zmq.asyncio.Socket) -> None:
        link = self.link
        assert link.input is not None and link.output is not None and link.context is not None
        out = self._out = OrderedSender(
            push,
            max_pending=self._max_pending_outputs,
            on_sent=_ignore,
            on_failed=self._output_failed,
            sent_hook=self._output_hook,
            name="engine-output",
        )
        reader = self._out_reader = SocketReader(
            link.output,
            self._on_output,
            stats=self.stats,
            name="engine output",
            watchdog_s=self._watchdog_s,
        )
        out.pauses(reader)
        out.start()
        assert link.scheduler_identity is not None
        # Forward mode's own output, on the scheduler's input ROUTER (each message
        # addressed to the scheduler's identity) instead of a PUSH of its own.
        to_scheduler = Forward(
            f"the scheduler's input {link.input_address}",
            socket=link.input,
            prefix=[link.scheduler_identity],
            on_forward=self._forwarded,
            passthrough=True,
        )
        ingest = self.ingest = ZmqIngest(
            self.pool,
            to_scheduler,
            listen=f"SMG input (engine {link.engine_index})",
            max_message_bytes=self.max_message_bytes,
            context=link.context,
            watchdog_s=self._watchdog_s,
            telemetry=self.telemetry,
            transport="engine",
            limits=self.limits,
            max_frames=self.max_frames,
        )
        # The ingest owns these two from here (it closes them at stop).
        link.sockets.remove(intake)
        link.sockets.remove(link.input)
        ingest.adopt(intake, peer=link.identity)
        reader.start()
        if link.gone:  # the scheduler went while SMG's handshake ran
            self._send_dead()

    def _forwarded(self, rid: str) -> None:
        self.stats.relayed_requests += 1
        self._outstanding.add(rid)
        self.stats.outstanding = len(self._outstanding)

    def _on_output(self, frames: list[zmq.Frame]) -> None:
        """One scheduler output: relayed to SMG as received (the same frame objects)."""
        stats = self.stats
        first = frames[0]
        stats.output_messages += 1
        stats.output_bytes += len(first) if len(frames) == 1 else sum(len(f) for f in frames)
        out = self._out
        assert out is not None
        if len(frames) == 1 and len(first) == _DEAD_LEN and first.bytes == ENGINE_CORE_DEAD:
            if not self._dead_sent:
                self._dead_sent = True
                stats.engine_core_dead_sent += 1
                out.add_pending()
                out.put(frames)
            self.link.died("it sent ENGINE_CORE_DEAD")
            return
        if self._outstanding:
            self._track(first)
        out.add_pending()
        out.put(frames)

    def _track(self, frame: zmq.Frame) -> None:
        """Note the rids an output finishes (lenient: anything unexpected is untracked)."""
        try:
            elems = _SPLIT.decode(frame.buffer)
            if len(elems) < 4 or _ANY.decode(elems[0]) != _OUTPUT_TAG:
                self.stats.outputs_untracked += 1
                return
            rids = _ANY.decode(elems[1])
            reasons = _ANY.decode(elems[3])
            outstanding = self._outstanding
            for rid, reason in zip(rids, reasons, strict=False):
                if reason and isinstance(rid, str):
                    outstanding.discard(rid)
            self.stats.outstanding = len(outstanding)
        except Exception:  # noqa: BLE001 - tracking is best effort; the frame is relayed anyway
            self.stats.outputs_untracked += 1

    def _output_failed(self, msg: list[Any], exc: BaseException) -> None:
        self.stats.output_undeliverable += 1
        logger.warning("engine mode: an output could not be handed to SMG's PUSH (%s)", exc)

    # ------------------------------------------------------------------ death

    def _on_death(self, why: str) -> None:
        logger.error("engine mode: ENGINE_CORE_DEAD to SMG (the scheduler went away: %s)", why)
        self._send_dead()

    def _send_dead(self) -> None:
        """One ENGINE_CORE_DEAD to SMG, after every output already received."""
        out = self._out
        if self._dead_sent or out is None:
            return
        reader = self._out_reader
        if reader is not None and reader.registration is not None:
            reader.read_batch(_FINAL_OUTPUTS_MAX)  # what the scheduler sent before it went
        self._dead_sent = True
        self.stats.engine_core_dead_sent += 1
        out.add_pending()
        out.put([ENGINE_CORE_DEAD])

    # ------------------------------------------------------------------ shutdown

    async def drain(self, deadline: float) -> int:
        """Relay outputs until every forwarded request has finished or ``deadline``
        (loop time); return how many forwarded requests are still unfinished."""
        loop = asyncio.get_running_loop()
        while self._outstanding and not self.link.gone and loop.time() < deadline:
            await asyncio.sleep(min(0.01, max(0.0, deadline - loop.time())))
        left = len(self._outstanding)
        if left and not self.link.gone:
            logger.warning(
                "[shutdown] %d forwarded request(s) without a finished output at the drain "
                "deadline; SMG fails them on ENGINE_CORE_DEAD",
                left,
            )
        return left

    async def stop(self, linger_s: float = DEAD_LINGER_S) -> None:
        """Stop intake, send ENGINE_CORE_DEAD upstream, close everything (idempotent)."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(max(0.0, linger_s)))
        await asyncio.shield(self._stop_task)

    async def _stop(self, linger_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + linger_s
        self.link.stopping = True
        if self.ingest is not None:
            # Sweeps what SMG still queued (forwarded SHUTTING_DOWN), flushes to the
            # scheduler, closes SMG's input and the scheduler's input.
            await self.ingest.stop(min(linger_s, 0.5) if not self.link.gone else 0.0)
        self._send_dead()
        out = self._out
        if out is not None:
            while out.pending and loop.time() < deadline:
                await asyncio.sleep(0.005)
            await out.stop()
            left = out.abandon_queued()
            if left:
                self.stats.output_undeliverable += len(left)
                logger.warning("[shutdown] %d output(s) never reached SMG", len(left))
        if self._out_reader is not None:
            self._out_reader.stop()
        if self._push is not None:  # the link's close() waits for what it still holds
            self._push.close(linger=int(max(0.0, deadline - loop.time()) * 1000))
        logger.info("[shutdown] engine relay stopped (%s, %s)", self.stats, self.link.stats)


def _ignore(msg: list[Any]) -> None:
    pass


__all__ = ["DEAD_LINGER_S", "EngineRelay", "EngineStats", "PROGRESS_S"]
