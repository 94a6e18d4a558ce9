"""The one admission path of both transports (``mmadmit.admission.Admissions``).

Unit tests on a real :class:`~mmadmit.pool.MaterializerPool`: the request-id
registry (duplicates, per peer), closing, the per-peer limit, inline tickets,
release, cancel, and counting each outcome once (stats and telemetry).
Workers are held with the pool's ``before_run`` hook, so what is in flight is
deterministic.

Run with: python -m pytest tests/test_admission.py -q
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import pytest
from mmadmit.admission import Admissions, AdmissionStats
from mmadmit.errors import Abort, AbortCode, InvalidRequest, Overloaded, ShuttingDown
from mmadmit.materializer import Materializer
from mmadmit.model import Materialized, Request
from mmadmit.pool import MaterializerPool, Ticket
from mmadmit.profile import load_profile
from mmadmit.telemetry import Telemetry

HOLD_S = 10.0


class Gate:
    """Holds every worker run until :meth:`open` (a test that never opens it fails)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.timed_out: list[str] = []

    def __call__(self, req: Request) -> None:
        if not self.event.wait(HOLD_S):
            self.timed_out.append(req.rid)
            raise AssertionError(f"{req.rid} was held {HOLD_S} s and never released")

    def open(self) -> None:
        self.event.set()


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open()
    assert not g.timed_out, f"held requests were never released: {g.timed_out}"


def _req(rid: str, n: int = 16) -> Request:
    return Request(rid=rid, input_ids=np.arange(n, dtype=np.int64))


@contextmanager
def _pool(**kw: Any) -> Iterator[MaterializerPool]:
    """A one-worker llama pool (``kw``: more of its settings), closed on the way out."""
    pool = MaterializerPool(Materializer(load_profile("llama")), workers=1, **kw)
    try:
        yield pool
    finally:
        pool.close()


def _held_pool(gate: Gate, max_inflight: int = 8) -> AbstractContextManager[MaterializerPool]:
    return _pool(max_inflight=max_inflight, before_run=gate)


def _inline_pool() -> AbstractContextManager[MaterializerPool]:
    return _pool(max_inflight=8, inline_max_tokens=64)


async def _finish(
    adm: Admissions, *pairs: tuple[tuple[bytes, str], Ticket]
) -> list[Materialized | Abort]:
    """Await each ticket's outcome and release it, as a transport does."""
    outs = []
    for key, ticket in pairs:
        try:
            outs.append(await ticket.outcome())
        finally:
            adm.release(key, ticket)
    return outs


def test_max_per_peer_must_be_positive() -> None:
    with _inline_pool() as pool:
        with pytest.raises(ValueError, match="positive"):
            Admissions(pool, transport="zmq", max_per_peer=0)


async def test_duplicate_refused_while_first_in_flight(gate: Gate) -> None:
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="zmq", scope="from this peer")
        first_key = (b"a", "r1")
        first = adm.submit(first_key, _req("r1"))
        assert not first.done and first_key in adm and adm.get(first_key) is first
        with pytest.raises(InvalidRequest, match=r"'r1' is already in flight from this peer"):
            adm.submit(first_key, _req("r1"))
        assert pool.stats.admitted == 1  # the duplicate never reached the pool
        other = adm.submit((b"b", "r1"), _req("r1"))  # ids are scoped by peer
        assert len(adm) == 2 and adm.rids() == frozenset({"r1"})
        gate.open()
        outs = await _finish(adm, (first_key, first), ((b"b", "r1"), other))
        assert all(isinstance(o, Materialized) for o in outs)
        assert len(adm) == 0 and adm.peer_count(b"a") == 0
        again = adm.submit(first_key, _req("r1"))  # free again once the first has its outcome
        await _finish(adm, (first_key, again))


async def test_grpc_scope_words_the_duplicate(gate: Gate) -> None:
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="grpc")
        ticket = adm.submit((b"", "x"), _req("x"))
        with pytest.raises(InvalidRequest, match="already in flight on this replica"):
            adm.submit((b"", "x"), _req("x"))
        gate.open()
        await _finish(adm, ((b"", "x"), ticket))


async def test_closing_refuses_shutting_down_before_the_pool(gate: Gate) -> None:
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="zmq", max_per_peer=1)
        held = adm.submit((b"a", "held"), _req("held"))
        adm.closing = True
        with pytest.raises(ShuttingDown, match="shutting down"):
            adm.submit((b"b", "new"), _req("new"))
        # the duplicate check comes first; then closing, before the per-peer limit
        with pytest.raises(InvalidRequest):
            adm.submit((b"a", "held"), _req("held"))
        with pytest.raises(ShuttingDown):
            adm.submit((b"a", "other"), _req("other"))
        assert pool.stats.admitted == 1 and len(adm) == 1 and adm.peer_count(b"b") == 0
        gate.open()
        await _finish(adm, ((b"a", "held"), held))  # what was in flight still ends normally


async def test_per_peer_limit_at_and_past_it(gate: Gate) -> None:
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="zmq", max_per_peer=2)
        a0 = adm.submit((b"a", "0"), _req("0"))
        a1 = adm.submit((b"a", "1"), _req("1"))  # at the limit: admitted
        assert adm.peer_count(b"a") == 2
        with pytest.raises(Overloaded) as refused:  # one past it
            adm.submit((b"a", "2"), _req("2"))
        assert refused.value.code is AbortCode.OVERLOADED
        assert "this peer has 2 requests in flight" in refused.value.message
        assert "--max-peer-inflight" in refused.value.message
        assert pool.stats.admitted == 2 and adm.peer_count(b"a") == 2
        b0 = adm.submit((b"b", "0"), _req("0"))  # another peer is not limited by a's
        assert adm.peer_count(b"b") == 1 and len(adm) == 3
        gate.open()
        await _finish(adm, ((b"a", "0"), a0))
        assert adm.peer_count(b"a") == 1
        a2 = adm.submit((b"a", "2"), _req("2"))  # room again
        await _finish(adm, ((b"a", "1"), a1), ((b"a", "2"), a2), ((b"b", "0"), b0))
        assert len(adm) == 0 and not adm._peer_counts  # no entry kept per peer once idle


async def test_pool_refusal_registers_nothing(gate: Gate) -> None:
    with _held_pool(gate, max_inflight=1) as pool:
        adm = Admissions(pool, transport="zmq", max_per_peer=4)
        held = adm.submit((b"a", "held"), _req("held"))
        with pytest.raises(Overloaded, match="--max-inflight"):
            adm.submit((b"a", "next"), _req("next"))
        assert (b"a", "next") not in adm and adm.peer_count(b"a") == 1
        gate.open()
        await _finish(adm, ((b"a", "held"), held))


async def test_inline_tickets_are_not_registered() -> None:
    with _inline_pool() as pool:
        adm = Admissions(pool, transport="zmq", max_per_peer=1)
        key = (b"a", "small")
        ticket = adm.submit(key, _req("small"))
        assert ticket.done and isinstance(ticket.result(), Materialized)
        assert key not in adm and len(adm) == 0 and adm.peer_count(b"a") == 0
        # neither a duplicate nor counted against the per-peer limit
        again = adm.submit(key, _req("small"))
        assert again.done and len(adm) == 0
        adm.release(key, again)  # harmless
        assert pool.stats.inline == 2


async def test_release_is_idempotent_and_keeps_a_newer_ticket(gate: Gate) -> None:
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="zmq")
        key = (b"a", "r")
        old = adm.submit(key, _req("r"))
        adm.submit((b"a", "s"), _req("s"))
        adm.release(key, old)
        adm.release(key, old)  # twice: nothing more is forgotten
        assert key not in adm and adm.peer_count(b"a") == 1 and len(adm) == 1
        new = adm.submit(key, _req("r"))
        adm.release(key, old)  # a stale ticket never forgets the newer one under its key
        assert adm.get(key) is new and adm.peer_count(b"a") == 2
        gate.open()
        other = adm.get((b"a", "s"))
        assert other is not None
        await _finish(adm, (key, new), ((b"a", "s"), other))
        await old.outcome()
        assert len(adm) == 0 and adm.peer_count(b"a") == 0 and not adm._peer_counts


async def test_cancel_by_key(gate: Gate) -> None:
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="zmq")
        key = (b"a", "r")
        ticket = adm.submit(key, _req("r"))
        assert adm.cancel((b"a", "nope"), AbortCode.CANCELLED, "x") is False
        assert adm.cancel((b"b", "r"), AbortCode.CANCELLED, "x") is False  # another peer's id
        assert adm.cancel(key, AbortCode.CANCELLED, "cancelled by the client (ABORT)") is True
        assert adm.cancel(key, AbortCode.CANCELLED, "again") is False  # one outcome only
        assert adm.get(key) is ticket  # registered until the transport releases it
        (out,) = await _finish(adm, (key, ticket))
        assert isinstance(out, Abort) and out.code is AbortCode.CANCELLED
        assert out.message == "cancelled by the client (ABORT)"
        assert key not in adm
        assert adm.cancel(key, AbortCode.CANCELLED, "late") is False
        assert adm.stats == AdmissionStats()  # cancel counts nothing: observe does


def _requests_total(telemetry: Telemetry, transport: str, outcome: str, code: str) -> float:
    value = telemetry.registry.get_sample_value(
        "mmadmit_requests_total", {"transport": transport, "outcome": outcome, "code": code}
    )
    return value or 0.0


async def test_finish_counts_each_outcome_once(gate: Gate) -> None:
    telemetry = Telemetry("llama", log_outcomes=False)
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="zmq", telemetry=telemetry)
        stats = adm.stats  # the transport's one count of its outcomes
        t0 = time.perf_counter()
        ok_key, cancel_key = (b"a", "ok"), (b"a", "gone")
        ok_req = _req("ok")
        ok = adm.submit(ok_key, ok_req)
        gone = adm.submit(cancel_key, _req("gone"))
        adm.cancel(cancel_key, AbortCode.CANCELLED, "cancelled")
        gate.open()
        ok_out, gone_out = await _finish(adm, (ok_key, ok), (cancel_key, gone))
        # submit, cancel and release count nothing
        assert stats.materialized == 0 and stats.aborted_by_code == {}
        assert _requests_total(telemetry, "zmq", "materialized", "OK") == 0
        assert isinstance(ok_out, Materialized) and isinstance(gone_out, Abort)
        assert adm.finish("ok", ok_req, ok_out, t0, _same) is ok_out
        adm.finish("gone", None, gone_out, t0, _same)
        refused = Abort(AbortCode.INVALID_REQUEST, "duplicate")
        adm.finish("dup", None, refused, t0, _same)
        assert stats.materialized == 1
        assert stats.aborted_by_code == {"CANCELLED": 1, "INVALID_REQUEST": 1}
        assert _requests_total(telemetry, "zmq", "materialized", "OK") == 1
        assert _requests_total(telemetry, "zmq", "aborted", "CANCELLED") == 1
        assert _requests_total(telemetry, "zmq", "aborted", "INVALID_REQUEST") == 1
        # under its own transport's label only
        assert _requests_total(telemetry, "grpc", "materialized", "OK") == 0
        assert _requests_total(telemetry, "grpc", "aborted", "CANCELLED") == 0
        counts = stats.outcome_counts()  # what telemetry reads: every code, OK materialized
        assert counts["OK"] == 1 and counts["CANCELLED"] == 1 and counts["TOO_LARGE"] == 0
        assert len(counts) == 1 + len(AbortCode)
        assert telemetry.answered() == (1, 2)  # the shutdown line's totals


async def test_finish_without_telemetry_counts_stats_only(gate: Gate) -> None:
    with _held_pool(gate) as pool:
        adm = Admissions(pool, transport="grpc")
        adm.finish("r", None, Abort(AbortCode.OVERLOADED, "full"), 0.0, _same)
        assert adm.stats == AdmissionStats(materialized=0, aborted_by_code={"OVERLOADED": 1})


def _same(outcome: Any) -> Any:
    return outcome


async def test_the_ladder_counts_what_was_encoded(gate: Gate) -> None:
    """``admit``: a refusal at submit is an outcome (encoded, counted); a cancelled wait
    is counted CANCELLED, releases its key and re-raises; an encoder that raises an
    AdmissionError ends the request with that code, one that raises anything else
    ends it INTERNAL (encoded by ``encode_failed``); each counted once, after its
    reply exists."""
    with _held_pool(gate, max_inflight=4) as pool:
        try:
            adm = Admissions(pool, transport="grpc")
            t0 = time.perf_counter()
            held = asyncio.ensure_future(adm.admit((b"", "held"), _req("held"), _same, t0))
            await asyncio.sleep(0.05)
            dup = await adm.admit((b"", "held"), _req("held"), _same, t0)
            assert dup.code is AbortCode.INVALID_REQUEST  # the id is in flight
            held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await held
            assert len(adm) == 0
            assert adm.stats.aborted_by_code == {"INVALID_REQUEST": 1, "CANCELLED": 1}
            gate.open()
            ok = await adm.admit((b"", "ok"), _req("ok"), _same, t0)
            assert isinstance(ok, Materialized)

            def refuse(outcome: Any) -> Any:
                if isinstance(outcome, Materialized):
                    raise ShuttingDown("the scheduler went away")
                return outcome

            gone = await adm.admit((b"", "gone"), _req("gone"), refuse, t0)
            assert gone.code is AbortCode.SHUTTING_DOWN

            def broken(outcome: Any) -> Any:
                raise ValueError("planted")

            reply = adm.finish("bug", None, ok, t0, broken, lambda out: ("fallback", out))
            assert reply[0] == "fallback" and reply[1].code is AbortCode.INTERNAL
            assert adm.stats == AdmissionStats(
                materialized=1,
                aborted_by_code={
                    "INVALID_REQUEST": 1,
                    "CANCELLED": 1,
                    "SHUTTING_DOWN": 1,
                    "INTERNAL": 1,
                },
            )
        finally:
            gate.open()


async def test_until_quiet_does_not_take_a_stalled_loop_for_a_quiet_peer() -> None:
    """The drain closes an intake once nothing arrived for ``quiet_s``; a loop that
    stalled (here 0.3 s, past ``quiet_s``) was not listening meanwhile, so an arrival
    due during the stall still restarts the quiet period instead of meeting a close."""
    from mmadmit.admission import until_quiet

    loop = asyncio.get_running_loop()
    arrivals = [0]

    def arrive() -> None:
        arrivals[0] += 1

    t0 = loop.time()
    quiet = asyncio.ensure_future(until_quiet(lambda: arrivals[0], t0 + 5, quiet_s=0.1))
    loop.call_later(0.05, time.sleep, 0.3)  # the loop stalls
    loop.call_later(0.2, arrive)  # due while it stalls
    assert await quiet is True
    assert arrivals[0] == 1
    assert loop.time() - t0 >= 0.35 + 0.1  # quiet counted from the arrival, after the stall
