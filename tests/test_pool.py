"""The materializer pool: bounded admission, exactly one outcome, cancellation, drain.

Workers are held with the pool's ``before_run`` test hook (a threading.Event)
so queueing is deterministic, never timing-dependent.

Run with: python -m pytest tests/test_pool.py -q
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from mmadmit.errors import Abort, AbortCode
from mmadmit.materializer import Materializer
from mmadmit.model import Materialized, Request
from mmadmit.pool import MaterializerPool
from mmadmit.profile import load_profile


class Hold:
    """Blocks workers on requests whose rid starts with 'hold' until released."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, req: Request) -> None:
        if req.rid.startswith("hold"):
            self.entered.release()
            self.gate.wait(10)

    async def wait_entered(self) -> None:
        await asyncio.to_thread(self.entered.acquire, True, 5)


@pytest.fixture
def hold() -> Iterator[Hold]:
    h = Hold()
    yield h
    h.gate.set()


def _req(rid: str, n: int = 16) -> Request:
    return Request(rid=rid, input_ids=np.arange(n, dtype=np.int64))


def _pool(hold: Hold, workers: int = 1, max_inflight: int = 2) -> MaterializerPool:
    return MaterializerPool(
        Materializer(load_profile("llama")),
        workers=workers,
        max_inflight=max_inflight,
        before_run=hold,
    )


async def test_burst_gets_exactly_one_outcome_each_some_overloaded(hold: Hold) -> None:
    pool = _pool(hold)
    try:
        first = pool.submit(_req("hold-0"))
        await hold.wait_entered()
        outcomes = await asyncio.gather(*(pool.materialize(_req(f"r{i}")) for i in range(50)))
        hold.gate.set()
        first_out = await first.outcome()
        codes = [o.code if isinstance(o, Abort) else "ok" for o in outcomes]
        assert len(outcomes) == 50
        assert codes.count(AbortCode.OVERLOADED) == 49  # one slot left beside the held one
        assert codes.count("ok") == 1
        assert isinstance(first_out, Materialized)
        assert pool.inflight == 0
    finally:
        pool.close()


async def test_cancel_removes_queued_and_discards_running(hold: Hold) -> None:
    pool = _pool(hold, max_inflight=3)
    try:
        running = pool.submit(_req("hold-run"))
        await hold.wait_entered()
        queued = pool.submit(_req("queued"))
        assert pool.inflight == 2
        assert queued.cancel() is True
        assert (await queued.outcome()).code is AbortCode.CANCELLED
        assert pool.inflight == 1 and pool.stats.cancelled_queued == 1
        assert running.cancel() is True
        assert (await running.outcome()).code is AbortCode.CANCELLED
        assert pool.inflight == 1  # still running on its worker: not released yet
        assert running.cancel() is False  # one outcome only
        hold.gate.set()
        for _ in range(100):
            if pool.inflight == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.inflight == 0 and pool.stats.discarded_running == 1
        assert isinstance(await pool.materialize(_req("after")), Materialized)
    finally:
        pool.close()


async def test_awaiting_task_cancelled_cancels_the_ticket(hold: Hold) -> None:
    pool = _pool(hold, max_inflight=3)
    try:
        pool.submit(_req("hold-x"))
        await hold.wait_entered()
        task = asyncio.ensure_future(pool.materialize(_req("queued-2")))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.stats.cancelled_queued == 1 and pool.inflight == 1
    finally:
        hold.gate.set()
        pool.close()


async def test_request_timeout_is_deadline_exceeded(hold: Hold) -> None:
    pool = _pool(hold, max_inflight=3)
    try:
        ticket = pool.submit(_req("hold-t"), timeout_s=0.05)
        out = await ticket.outcome()
        assert isinstance(out, Abort) and out.code is AbortCode.DEADLINE_EXCEEDED
        assert "timeout" in out.message
    finally:
        hold.gate.set()
        pool.close()


async def test_drain_finishes_or_ends_shutting_down(hold: Hold) -> None:
    pool = _pool(hold, max_inflight=4)
    try:
        done_fast = pool.submit(_req("fast"))
        assert isinstance(await done_fast.outcome(), Materialized)
        stuck = pool.submit(_req("hold-stuck"))
        await hold.wait_entered()
        ended = await pool.drain(0.1)
        assert ended == 1
        out = await stuck.outcome()
        assert isinstance(out, Abort) and out.code is AbortCode.SHUTTING_DOWN
        late = await pool.materialize(_req("late"))
        assert isinstance(late, Abort) and late.code is AbortCode.SHUTTING_DOWN
    finally:
        hold.gate.set()
        pool.close()


async def test_two_workers_run_in_parallel(hold: Hold) -> None:
    pool = _pool(hold, workers=2, max_inflight=4)
    try:
        a = pool.submit(_req("hold-a"))
        b = pool.submit(_req("hold-b"))
        await hold.wait_entered()
        await hold.wait_entered()  # both entered: two workers at once
        assert pool.running == 2
        hold.gate.set()
        assert isinstance(await a.outcome(), Materialized)
        assert isinstance(await b.outcome(), Materialized)
    finally:
        pool.close()
