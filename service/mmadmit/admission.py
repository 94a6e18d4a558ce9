"""One admission path for every transport: request ids, submit, cancel, outcome counting.

A transport decodes a request and encodes its outcome; the bookkeeping in
between is the same on every face, and lives here once
(:class:`Admissions`, one per transport instance):

* **the request-id registry**: requests in flight are keyed by ``(peer, rid)``
  (``peer`` is a ZMQ ROUTER identity, ``b""`` on gRPC, whose ids are scoped to
  the replica); a second request under a key already in flight is refused
  ``INVALID_REQUEST`` and the first goes on;
* **submit**: the duplicate check, intake closed at shutdown
  (``SHUTTING_DOWN``), the optional per-peer limit (``OVERLOADED``), then the
  pool (which may refuse ``OVERLOADED`` / ``SHUTTING_DOWN`` itself, or
  materialize a small request at once: such a ticket is never registered);
* **cancel**: by key, with the code that says why;
* **the ladder** (submit, await, release, encode, count), written once:
  :meth:`Admissions.admit` for a transport that awaits each request, or its
  two halves :meth:`Admissions.wait` and :meth:`Admissions.finish` for one
  that answers a small request from its reader callback (ZMQ). A transport
  hands in ``encode(outcome)``, which makes its reply; the outcome is counted
  only after that succeeded, so the count is of what the client receives: an
  encoder that raises turns the outcome into ``INTERNAL`` (our bug), one that
  raises an :class:`~mmadmit.errors.AdmissionError` into that error's code
  (e.g. the scheduler went away meanwhile), and a call cancelled while
  waiting is counted ``CANCELLED``;
* **outcome counting**: :meth:`Admissions._observe` counts every terminal
  outcome of the transport once (:class:`AdmissionStats`, ``Admissions.stats``),
  and that count is the only one: telemetry exports it at scrape time as
  ``mmadmit_requests_total`` under the transport's label
  (:meth:`~mmadmit.telemetry.Telemetry.track`) and is told of each outcome
  only for its latency histogram and log line. The pool
  counts its own work (admitted, inline, cancelled while queued, ...), never
  outcomes.

Non-goals: decoding, encoding and delivery (the transports), materializing
(the pool). Everything here runs on the event loop; nothing blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from .errors import (
    Abort,
    AbortCode,
    AdmissionError,
    InvalidRequest,
    Overloaded,
    ShuttingDown,
    abort_from_exception,
)
from .materializer import Outcome
from .model import Materialized, Request
from .pool import MaterializerPool, Ticket
from .telemetry import Telemetry

logger = logging.getLogger(__name__)

# At shutdown an intake (a ZMQ socket, a gRPC port) stays open, answering
# SHUTTING_DOWN, until nothing has arrived for INTAKE_QUIET_S: neither libzmq
# nor gRPC can say whether a peer's message is still on its way, so silence is
# the only sign. A peer that never falls silent holds it for INTAKE_MAX_S at most.
INTAKE_QUIET_S = 0.2
INTAKE_MAX_S = 5.0

Key = tuple[Hashable, str]  # (peer, rid)
T = TypeVar("T")
Encode = Callable[[Outcome], T]  # a transport's reply for one outcome
CALL_GONE = "the call went away"


@dataclass
class AdmissionStats:
    """Terminal outcomes of one transport, counted once each (:meth:`Admissions._observe`)."""

    materialized: int = 0
    aborted_by_code: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: Materialized | Abort) -> None:
        if isinstance(outcome, Abort):
            name = outcome.code.value
            self.aborted_by_code[name] = self.aborted_by_code.get(name, 0) + 1
        else:
            self.materialized += 1

    def outcome_counts(self) -> dict[str, int]:
        """Outcomes so far by code (``OK``: materialized), every code present; what
        telemetry reads (a copy, so the scrape thread may call it)."""
        aborted = dict(self.aborted_by_code)
        return {"OK": self.materialized, **{c.value: aborted.get(c.value, 0) for c in AbortCode}}


class Admissions:
    """The requests one transport has in flight, and how each ends.

    ``scope`` words the duplicate refusal ("from this peer", "on this
    replica"); ``max_per_peer`` bounds one peer's requests in flight
    (``--max-peer-inflight``; the message names the flag); ``stats`` counts the
    outcomes (the transport's own counters are its own stats object).
    """

    def __init__(
        self,
        pool: MaterializerPool,
        *,
        transport: str,
        telemetry: Telemetry | None = None,
        scope: str = "on this replica",
        max_per_peer: int | None = None,
    ) -> None:
        if max_per_peer is not None and max_per_peer < 1:
            raise ValueError("max_per_peer must be positive")
        self.pool = pool
        self.transport = transport
        self.telemetry = telemetry
        self.scope = scope
        self.max_per_peer = max_per_peer
        self.stats = AdmissionStats()
        if telemetry is not None:
            telemetry.track(transport, self.stats)
        self.closing = False  # set at shutdown: new requests are refused SHUTTING_DOWN
        self._inflight: dict[Key, Ticket] = {}
        self._peer_counts: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ registry

    def __len__(self) -> int:
        return len(self._inflight)

    def __contains__(self, key: Key) -> bool:
        return key in self._inflight

    def get(self, key: Key) -> Ticket | None:
        return self._inflight.get(key)

    def rids(self) -> frozenset[str]:
        return frozenset(rid for _, rid in self._inflight)

    def peer_count(self, peer: Hashable) -> int:
        return self._peer_counts.get(peer, 0)

    # ------------------------------------------------------------------ submit

    def submit(self, key: Key, request: Request, *, timeout_s: float | None = None) -> Ticket:
        """Admit ``request`` under ``key``; raise the :class:`~mmadmit.errors.AdmissionError`
        that refuses it. A ticket that comes back :attr:`~mmadmit.pool.Ticket.done`
        was materialized at once and is not registered."""
        peer, rid = key
        if key in self._inflight:
            raise self.duplicate(rid)
        if self.closing:
            raise ShuttingDown("the service is shutting down; retry on another replica")
        count = self._peer_counts.get(peer, 0)
        if self.max_per_peer is not None and count >= self.max_per_peer:
            raise Overloaded(
                f"this peer has {count} requests in flight, the limit per peer "
                "(--max-peer-inflight); retry once one has its outcome"
            )
        ticket = self.pool.submit(request, timeout_s=timeout_s)
        if not ticket.done:
            self._inflight[key] = ticket
            self._peer_counts[peer] = count + 1
        return ticket

    def duplicate(self, rid: str) -> InvalidRequest:
        """The refusal of a request whose id is already in flight (the one wording;
        a face with requests past admission checks its own registry with it)."""
        return InvalidRequest(f"request id {rid!r} is already in flight {self.scope}")

    def release(self, key: Key, ticket: Ticket) -> None:
        """Forget ``key`` if it still names ``ticket`` (idempotent); a transport
        calls it once the ticket's outcome is known (in a ``finally``, so that a
        cancelled wait releases too)."""
        if self._inflight.get(key) is ticket:
            del self._inflight[key]
            peer = key[0]
            left = self._peer_counts.get(peer, 1) - 1
            if left > 0:
                self._peer_counts[peer] = left
            else:
                self._peer_counts.pop(peer, None)  # no entry per peer that ever sent

    # ------------------------------------------------------------------ cancel

    def cancel(self, key: Key, code: AbortCode, message: str) -> bool:
        """End the request in flight under ``key`` with ``code``; False if there is
        none or it already had its outcome."""
        ticket = self._inflight.get(key)
        return ticket is not None and ticket.cancel(code, message)

    # ------------------------------------------------------------------ the ladder

    async def admit(
        self,
        key: Key,
        request: Request,
        encode: Encode[T],
        t0: float,
        *,
        timeout_s: float | None = None,
    ) -> T:
        """Submit, await, release, encode and count one request: its reply.

        Refusals at submit are outcomes like any other (encoded, counted). If
        the awaiting task is cancelled (the call went away) the ticket is
        cancelled with it, the request is counted ``CANCELLED`` and
        ``CancelledError`` propagates.
        """
        rid = key[1]
        try:
            ticket = self.submit(key, request, timeout_s=timeout_s)
        except AdmissionError as exc:
            return self.finish(rid, request, exc.to_abort(), t0, encode)
        if ticket.done:  # materialized at once, never registered
            return self.finish(rid, request, ticket.result(), t0, encode)
        try:
            outcome = await self.wait(key, ticket)
        except asyncio.CancelledError:
            self._observe(rid, request, Abort(AbortCode.CANCELLED, CALL_GONE), t0)
            raise
        return self.finish(rid, request, outcome, t0, encode)

    async def wait(self, key: Key, ticket: Ticket) -> Outcome:
        """A registered ticket's outcome; ``key`` is released however the wait ends
        (a cancelled wait cancels the ticket and raises ``CancelledError``)."""
        try:
            return await ticket.outcome()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the pool never raises here; a bug must still end
            logger.exception("rid=%s: waiting for the outcome failed", key[1])
            return abort_from_exception(exc)
        finally:
            self.release(key, ticket)

    def finish(
        self,
        rid: str,
        request: Request | None,
        outcome: Outcome,
        t0: float,
        encode: Encode[T],
        encode_failed: Encode[T] | None = None,
    ) -> T:
        """Encode ``outcome`` into the transport's reply, then count what was encoded.

        ``encode`` raising :class:`~mmadmit.errors.AdmissionError` replaces the
        outcome with that refusal (encoded by ``encode``); raising anything
        else is a bug of ours: logged, and the request ends ``INTERNAL``,
        encoded by ``encode_failed`` (default ``encode``; a transport whose
        encoder reads the request gives one that does not). Exactly one
        :meth:`_observe` per call, after the reply exists.
        """
        try:
            reply = encode(outcome)
        except AdmissionError as exc:
            outcome = exc.to_abort()
            reply = encode(outcome)
        except Exception as exc:  # noqa: BLE001 - an encoding bug must still answer, counted once
            logger.exception("rid=%s: encoding the outcome failed", rid)
            outcome = abort_from_exception(exc)
            reply = (encode_failed or encode)(outcome)
        self._observe(rid, request, outcome, t0)
        return reply

    # ------------------------------------------------------------------ outcomes

    def _observe(
        self, rid: str, request: Request | None, outcome: Materialized | Abort, t0: float
    ) -> None:
        """Count one terminal outcome of this transport (call exactly once per request;
        this is the one count of it) and tell telemetry for its latency and log line."""
        self.stats.count(outcome)
        if self.telemetry is not None:
            self.telemetry.outcome(self.transport, rid, request, outcome, t0)


async def until_quiet(
    activity: Callable[[], int],
    until: float,
    *,
    quiet_s: float = INTAKE_QUIET_S,
    waiting: Callable[[], bool] | None = None,
    since: float | None = None,
) -> bool:
    """Wait until ``activity()`` (a count of arrivals) has not moved for ``quiet_s``
    and ``waiting()`` (input queued unread) is false, or until ``until`` (loop time).
    ``since``: the loop time of the last arrival, when the intake knows it (else
    the quiet period is counted from now).

    True once quiet; False at ``until``. The intake keeps answering meanwhile:
    nothing is read here.
    """
    loop = asyncio.get_running_loop()
    seen = activity()
    last = loop.time() if since is None else since
    confirming = False
    while (now := loop.time()) < until:
        count = activity()
        if count != seen:
            seen, last, confirming = count, now, False
        elif waiting is not None and waiting():
            last, confirming = now, False
        elif now - last >= quiet_s:
            if confirming:
                return True
            # Look once more after a short pause: a loop that stalled (GC, a long
            # inline run) has not been listening, and a peer's message may be
            # due right behind the stall.
            confirming = True
            await asyncio.sleep(min(quiet_s / 8, max(0.0, until - now)))
            continue
        await asyncio.sleep(min(quiet_s / 4, max(0.0, until - now)))
    return False


__all__ = [
    "CALL_GONE",
    "INTAKE_MAX_S",
    "INTAKE_QUIET_S",
    "until_quiet",
    "AdmissionStats",
    "Admissions",
    "Encode",
    "Key",
    "Outcome",
]
