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
    """Blocks workers on requests whose rid starts with 'hold' until released.

    Its timeouts fail the test: a held request the test never releases fails
    (the worker raises, and the fixture reports it), and :meth:`wait_entered`
    fails when no worker picked a held request up."""

    HOLD_S = 10.0

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.timed_out: list[str] = []

    def __call__(self, req: Request) -> None:
        if req.rid.startswith("hold"):
            self.entered.release()
            if not self.gate.wait(self.HOLD_S):
                self.timed_out.append(req.rid)
                raise AssertionError(f"{req.rid} was held {self.HOLD_S} s and never released")

    async def wait_entered(self, timeout_s: float = 5.0) -> None:
        entered = await asyncio.to_thread(self.entered.acquire, True, timeout_s)
        assert entered, f"no worker started a held request within {timeout_s} s"


@pytest.fixture
def hold() -> Iterator[Hold]:
    h = Hold()
    yield h
    h.gate.set()
    assert not h.timed_out, f"held requests were never released: {h.timed_out}"


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
        burst = [asyncio.ensure_future(pool.materialize(_req(f"r{i}"))) for i in range(50)]
        # 49 are refused at once; the one admitted waits behind the held request, so the
        # gate is released only once the refusals are in (not after its timeout)
        for _ in range(500):
            if sum(t.done() for t in burst) == 49:
                break
            await asyncio.sleep(0.002)
        assert sum(t.done() for t in burst) == 49 and pool.inflight == 2
        hold.gate.set()
        outcomes = await asyncio.gather(*burst)
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


# --------------------------------------------------------------------------- inline runs

QWEN35_IMAGE = 248056  # Qwen3.5 <|image_pad|>


def _image_req(rid: str, *, n_text: int = 24, hashed: bool = True) -> Request:
    """Qwen3.5: text, one 8x8-patch image (16 placeholders), text; hash supplied or
    a small feature to hash."""
    from mmadmit.model import Item, Modality, MultimodalInputs, Tensor

    ids = np.concatenate(
        [np.arange(1, n_text + 1), np.full(16, QWEN35_IMAGE), np.arange(1, 9)]
    ).astype(np.int64)
    item = Item(
        modality=int(Modality.IMAGE),
        hash=0x1234_5678_9ABC_DEF1 if hashed else None,
        offsets=np.array([[n_text, n_text + 15]], np.int64),
        feature=None if hashed else Tensor.from_numpy(np.ones((16, 8), np.float32)),
        side={"image_grid_thw": Tensor.from_numpy(np.array([[1, 8, 8]], np.int64))},
    )
    return Request(rid=rid, input_ids=ids, mm=MultimodalInputs(items=[item]))


def _qwen_pool(inline_max_tokens: int, **kw: object) -> MaterializerPool:
    return MaterializerPool(
        Materializer(load_profile("qwen3_5")),
        workers=1,
        inline_max_tokens=inline_max_tokens,
        **kw,  # type: ignore[arg-type]
    )


async def test_small_request_runs_inline_with_the_worker_path_result() -> None:
    inline, workers = _qwen_pool(64), _qwen_pool(0)
    try:
        ticket = inline.submit(_image_req("small"))
        assert ticket.done  # finished before submit returned: no worker, no await
        assert inline.inflight == 0 and inline.queued == 0
        assert (inline.stats.inline, inline.stats.admitted, inline.stats.completed) == (1, 1, 1)
        got = await ticket.outcome()
        other = workers.submit(_image_req("small"))
        assert not other.done
        want = await other.outcome()
        assert workers.stats.inline == 0
        assert isinstance(got, Materialized) and isinstance(want, Materialized)
        a, b = got.request, want.request
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.input_ids_unpadded, b.input_ids_unpadded)
        assert a.mm is not None and b.mm is not None
        assert [i.pad_value for i in a.mm.items] == [i.pad_value for i in b.mm.items]
        assert a.mm.mrope_positions is not None and b.mm.mrope_positions is not None
        np.testing.assert_array_equal(
            a.mm.mrope_positions.to_numpy(), b.mm.mrope_positions.to_numpy()
        )
        assert a.mm.mrope_position_delta_scalar == b.mm.mrope_position_delta_scalar
        assert not ticket.cancel()  # it already has its one outcome
    finally:
        inline.close()
        workers.close()


async def test_what_stays_on_the_workers(hold: Hold) -> None:
    pool = _qwen_pool(48)  # the image request is 48 tokens with n_text=24
    try:
        assert pool.runs_inline(_image_req("fits"))
        assert not pool.runs_inline(_image_req("longer", n_text=25))  # 49 tokens
        assert not pool.runs_inline(_image_req("to-hash", hashed=False))  # feature bytes to hash
        big = pool.submit(_image_req("longer", n_text=25))
        hashed = pool.submit(_image_req("to-hash", hashed=False))
        assert not big.done and not hashed.done
        assert isinstance(await big.outcome(), Materialized)
        assert isinstance(await hashed.outcome(), Materialized)
        assert pool.stats.inline == 0
    finally:
        pool.close()
    hooked = _qwen_pool(1 << 20, before_run=hold)  # a hook exists to hold workers: no inline
    off = _qwen_pool(0)
    try:
        assert hooked.inline_max_tokens == 0 and not hooked.runs_inline(_image_req("x"))
        assert not off.runs_inline(_image_req("x"))
    finally:
        hooked.close()
        off.close()
    with pytest.raises(ValueError, match="inline_max_tokens"):
        _qwen_pool(-1)


async def test_larger_requests_run_inline_by_their_estimated_cost() -> None:
    """Past ``inline_max_tokens`` a request that hashes nothing runs inline when its
    estimated time is within ``inline_max_us``; the estimate's rate follows the runs
    the pool times (those that hash nothing); ``inline_max_tokens=0`` is off. The
    bytes a request hashes are priced by the same estimate: tests/test_inline_cost.py."""
    pool = _qwen_pool(48, inline_max_us=1000.0)
    try:
        cost = pool.inline_cost
        big = _image_req("big", n_text=40_000)  # 40,024 tokens and one item: 41,024 units
        assert cost.units(big) == 40_024 + 1000
        cost.rate_ns = 10.0  # 20 + 410.2 us: within the budget
        assert pool.runs_inline(big)
        ticket = pool.submit(big)
        assert ticket.done and isinstance(ticket.result(), Materialized)
        assert pool.stats.inline == 1 and cost.samples == 1
        learned = cost.rate_ns
        assert learned != 10.0  # moved toward the measured rate of that run
        cost.rate_ns = 30.0  # 20 + 1230.7 us: over the budget, to a worker
        assert not pool.runs_inline(big)
        late = pool.submit(_image_req("big2", n_text=40_000))
        assert not late.done
        assert isinstance(await late.outcome(), Materialized)
        assert cost.samples == 2  # the worker's run of a request that hashed nothing teaches too
        cost.rate_ns = 0.0
        hashing = _image_req("hash-big", n_text=40_000, hashed=False)
        with pytest.raises(ValueError, match="hash nothing"):
            pool.calibrate_inline(hashing)
        rate = pool.calibrate_inline(big, runs=2)
        assert rate > 0 and cost.samples == 4 and pool.stats.admitted == 2  # not counted
    finally:
        pool.close()
    off = _qwen_pool(0, inline_max_us=1e9)
    budgetless = _qwen_pool(48, inline_max_us=0.0)
    try:
        assert not off.runs_inline(_image_req("x"))
        assert budgetless.runs_inline(_image_req("fits"))
        assert not budgetless.runs_inline(_image_req("longer", n_text=25))
    finally:
        off.close()
        budgetless.close()
    with pytest.raises(ValueError, match="inline_max_us"):
        _qwen_pool(48, inline_max_us=-1.0)


async def test_inline_is_refused_while_draining_and_not_counted_in_flight() -> None:
    gate = threading.Event()

    def hold_big(req: Request, ops: object) -> object:  # runs on the worker thread
        if req.rid.startswith("hold"):
            gate.wait(10)
        return ops

    pool = _qwen_pool(64, max_inflight=1, choose_ops=hold_big)
    try:
        held = pool.submit(_image_req("hold-big", n_text=100))  # 124 tokens: a worker's
        assert pool.inflight == 1
        # the pool is full, yet a small request is answered at once: it holds nothing
        assert isinstance(await pool.submit(_image_req("small")).outcome(), Materialized)
        from mmadmit.errors import Overloaded, ShuttingDown

        with pytest.raises(Overloaded):
            pool.submit(_image_req("hold-more", n_text=100))
        pool.begin_drain()
        with pytest.raises(ShuttingDown):
            pool.submit(_image_req("late"))
        gate.set()
        assert isinstance(await held.outcome(), Materialized)
        assert pool.stats.inline == 1 and pool.stats.admitted == 2  # no refusal admitted
    finally:
        gate.set()
        pool.close()
