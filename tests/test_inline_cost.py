"""One cost model decides what runs inline, hashing included (pool.InlineCost).

The bytes a request would hash are priced at BLAKE2b's measured rate, next to
its tokens and items: a small request with features to hash runs on the event
loop, a large one on a worker; large hashing is shared with the idle workers,
from the loop or a worker, which are steered off the requester's CPU for it.
Every way gives the same outcome, bit for bit, with native code on and off.

Run with: python -m pytest tests/test_inline_cost.py -q
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import numpy as np
import pytest
from mmadmit import hashing, planner, rules
from mmadmit import pool as pool_mod
from mmadmit.materializer import Materializer
from mmadmit.model import Item, Materialized, Modality, MultimodalInputs, Request, Tensor
from mmadmit.pool import InlineCost, MaterializerPool
from mmadmit.profile import load_profile

OMNI_AUDIO = 151675  # Qwen3-Omni <|audio_pad|>
AUDIO_TOKENS = 100
BIG = pool_mod.SHARE_MIN_ITEM_BYTES  # an item the idle workers may take
SHARED = [pool_mod.SHARE_MIN_BYTES // 2] * 2  # the least a request shares, in two items


def _feature(nbytes: int, seed: int) -> Tensor:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return Tensor.from_numpy(data.view(np.float32).reshape(-1, 2))


def omni_request(
    rid: str,
    feature_bytes: list[int],
    *,
    hashed: set[int] = frozenset(),  # type: ignore[assignment]
    padded: set[int] = frozenset(),  # type: ignore[assignment]
    n_text: int = 16,
) -> Request:
    """Qwen3-Omni: text, then one 100-token audio item per entry of ``feature_bytes``
    (its feature that long), text between and after. Items in ``hashed`` come with
    their hash, those in ``padded`` with their pad value; the others are hashed."""
    ids: list[np.ndarray] = [np.arange(1, n_text + 1)]
    items = []
    pos = n_text
    for i, nbytes in enumerate(feature_bytes):
        ids += [np.full(AUDIO_TOKENS, OMNI_AUDIO), np.arange(1, 9)]
        items.append(
            Item(
                modality=int(Modality.AUDIO),
                hash=0x0123_4567_89AB_CDEF + i if i in hashed else None,
                pad_value=rules.pad_interval(int(Modality.AUDIO))[0] + i if i in padded else None,
                offsets=np.array([[pos, pos + AUDIO_TOKENS - 1]], np.int64),
                feature=_feature(nbytes, i),
            )
        )
        pos += AUDIO_TOKENS + 8
    return Request(
        rid=rid,
        input_ids=np.concatenate(ids).astype(np.int64),
        mm=MultimodalInputs(items=items),
    )


def _pool(**kw: Any) -> MaterializerPool:
    kw.setdefault("workers", 1)
    return MaterializerPool(Materializer(load_profile("qwen3_omni_moe")), **kw)


def _want_hashes(req: Request) -> list[int | None]:
    """Each item's hash as rule 6 defines it, computed here without the service."""
    assert req.mm is not None
    return [
        it.hash
        if it.hash is not None or it.pad_value is not None
        else int.from_bytes(hashlib.blake2b(bytes(it.feature.data), digest_size=8).digest(), "big")
        for it in req.mm.items
    ]


def _fields(outcome: object) -> tuple[Any, ...]:
    """Everything a materialized outcome carries, as comparable values."""
    assert isinstance(outcome, Materialized), outcome
    r = outcome.request
    assert r.mm is not None and r.mm.mrope_positions is not None
    return (
        r.input_ids.tobytes(),
        None if r.input_ids_unpadded is None else r.input_ids_unpadded.tobytes(),
        [(it.modality, it.hash, it.pad_value, it.offsets.tobytes()) for it in r.mm.items],
        r.mm.mrope_positions.to_numpy().tobytes(),
        r.mm.mrope_position_delta_scalar,
        outcome.rule,
        outcome.hashed_bytes,
    )


# --------------------------------------------------------------------------- the estimate


def test_hash_bytes_are_what_the_materializer_hashes() -> None:
    """Items with a hash or a pad value are not counted, a shared-memory feature
    never is (without a hash it is refused, unread); the count is exact."""
    req = omni_request("mix", [4096, 1000, 8192, 2048], hashed={1}, padded={3})
    assert InlineCost.hash_bytes(req) == 4096 + 8192
    outcome = Materializer(load_profile("qwen3_omni_moe")).run(req)
    assert isinstance(outcome, Materialized) and outcome.hashed_bytes == 4096 + 8192
    assert InlineCost.hash_bytes(omni_request("none", [4096], hashed={0})) == 0
    assert InlineCost.hash_bytes(Request(rid="text", input_ids=np.arange(8))) == 0

    from mmadmit.model import ShmHandle

    shm = omni_request("shm", [4096])
    assert shm.mm is not None
    shm.mm.items[0].feature = None
    shm.mm.items[0].feature_shm = ShmHandle(name="/nope", nbytes=4096)
    assert InlineCost.hash_bytes(shm) == 0  # refused by rule 5, never read


def test_the_estimate_prices_hash_bytes_at_the_calibrated_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_mod, "_CPUS", 1)  # nothing shared: one thread's hashing
    pool = _pool(inline_max_tokens=64, inline_max_us=1000.0)
    try:
        cost = pool.inline_cost
        assert cost.hash_ns == pool_mod.INLINE_HASH_NS  # cautious until calibrated
        monkeypatch.setattr(pool_mod, "measure_ns_per_byte", lambda: 0.25)
        pool.calibrate_inline(Request(rid="cal", input_ids=np.arange(20_000) % 1000), runs=1)
        assert cost.hash_ns == 0.25
        req = omni_request("r", [400_000, 400_000])
        units = len(req.input_ids) + 2 * pool_mod.ITEM_UNITS
        assert cost.estimate_us(req) == pytest.approx(
            cost.fixed_us + (cost.rate_ns * units + 0.25 * 800_000) / 1000.0
        )
        cost.rate_ns = 4.0
        assert pool.runs_inline(req)  # 20 + 9.1 + 200 us
        cost.hash_ns = 1.5  # 20 + 9.1 + 1200 us: the same request goes to a worker
        assert not pool.runs_inline(req)
        # with an idle worker to share it, the loop's part of the hashing and the
        # helper's wake-up: 20 + 9.1 + 600 + 100 us, inline again
        monkeypatch.setattr(pool_mod, "_CPUS", 2)
        assert pool._helpers(InlineCost.hash_sizes(req)) == 1
        assert cost.estimate_us(req, helpers=1) == pytest.approx(
            cost.fixed_us
            + cost.rate_ns * units / 1000.0
            + 1.5 * 800_000 / 1000.0 / 2
            + pool_mod.SHARE_WAKE_US
        )
        assert pool.runs_inline(req)
        # items too small to hand over stay with the requester: at least their bytes
        cost.hash_ns = 1.0
        mixed = omni_request("mixed", [pool_mod.SHARE_MIN_BYTES // 2] * 2 + [BIG - 8] * 26)
        sizes = InlineCost.hash_sizes(mixed)
        alone = 26 * (BIG - 8)
        assert pool._helpers(sizes) == 1 and alone > sum(sizes) / 2
        base = cost.fixed_us + cost.rate_ns * InlineCost.units(mixed) / 1000.0
        assert cost.estimate_us(mixed, None, 1, alone) == pytest.approx(
            base + alone / 1000.0 + pool_mod.SHARE_WAKE_US
        )
        assert cost.estimate_us(mixed, None, 1) <= pool.inline_max_us  # halved: it would fit
        assert not pool.runs_inline(mixed)  # 20 + 124 + 852 + 100 us
        cost.hash_ns = 1.5
        small = omni_request("small", [BIG - 8] * 40)  # no item large enough to hand over
        assert pool._helpers(InlineCost.hash_sizes(small)) == 0
        few = omni_request("few", [BIG, pool_mod.SHARE_MIN_BYTES - 2 * BIG])  # too few bytes
        assert pool._helpers(InlineCost.hash_sizes(few)) == 0
    finally:
        pool.close()
    # the real measurement: BLAKE2b's time per byte on this machine, a sane figure
    real = _pool(inline_max_tokens=64, inline_max_us=1000.0)
    try:
        real.calibrate_inline(Request(rid="cal", input_ids=np.arange(100)), runs=1)
        assert 0.05 < real.inline_cost.hash_ns < 50.0
    finally:
        real.close()


async def test_a_small_hashing_request_runs_inline_a_big_one_on_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_mod, "_CPUS", 1)  # the big one's hashing is not shared
    pool = _pool(inline_max_tokens=1 << 20, inline_max_us=1000.0)
    try:
        pool.inline_cost.hash_ns = 2.0
        small = omni_request("small", [4096, 4096])  # 8 KiB: 20 + ~9 + 16 us
        assert pool.runs_inline(small)
        ticket = pool.submit(small)
        assert ticket.done and pool.stats.inline == 1  # finished before submit returned
        got = ticket.result()
        assert isinstance(got, Materialized) and got.hashed_bytes == 8192
        assert [it.hash for it in got.request.mm.items] == _want_hashes(small)  # type: ignore[union-attr]

        big = omni_request("big", [300_000, 300_000])  # 600 KB at 2 ns: 1.2 ms
        assert not pool.runs_inline(big)
        ticket = pool.submit(big)
        assert not ticket.done
        assert isinstance(await ticket.outcome(), Materialized)
        assert pool.stats.inline == 1

        # hashing never shortcuts the estimate: few tokens, yet over the budget
        assert len(big.input_ids) < pool.inline_max_tokens
    finally:
        pool.close()
    budgetless = _pool(inline_max_tokens=1 << 20, inline_max_us=0.0)
    try:  # inline_max_us 0: only the token count decides, and only for no hashing
        assert budgetless.runs_inline(omni_request("supplied", [4096], hashed={0}))
        assert not budgetless.runs_inline(omni_request("tiny", [64]))
    finally:
        budgetless.close()


async def test_the_hash_rate_follows_the_hashing_the_pool_times() -> None:
    """One thread's hashing of at least 64 KiB, inline or on a worker, moves the
    hash rate toward what it took; a few bytes say nothing, and neither does
    hashing shared between threads."""
    pool = _pool(inline_max_tokens=1 << 20, inline_max_us=1e9)
    try:
        cost = pool.inline_cost
        cost.hash_ns = 1000.0  # far from any machine's: every sample pulls it down
        assert isinstance(pool.submit(omni_request("few", [4096])).result(), Materialized)
        assert cost.hash_samples == 0 and cost.hash_ns == 1000.0
        assert isinstance(pool.submit(omni_request("inline", [70_000])).result(), Materialized)
        assert cost.hash_samples == 1 and cost.hash_ns < 1000.0
    finally:
        pool.close()
    workers = _pool(workers=2, inline_max_tokens=0)
    try:
        cost = workers.inline_cost
        cost.hash_ns = 1000.0
        assert isinstance(await workers.materialize(omni_request("w", [70_000])), Materialized)
        assert cost.hash_samples == 1 and cost.hash_ns < 1000.0
        shared = omni_request("shared", SHARED)
        before = cost.hash_ns
        assert isinstance(await workers.materialize(shared), Materialized)
        if pool_mod._CPUS > 1:  # shared with the idle worker: not one thread's rate
            assert cost.hash_samples == 1 and cost.hash_ns == before
    finally:
        workers.close()


async def test_token_rate_is_learned_only_from_runs_that_hash_nothing() -> None:
    pool = _pool(inline_max_tokens=1, inline_max_us=1e9)
    try:
        cost = pool.inline_cost
        many = omni_request("many", [4096] * 150)  # 150 items: 166 K units, hashed inline
        assert pool.runs_inline(many)
        assert isinstance(pool.submit(many).result(), Materialized)
        assert cost.samples == 0
        supplied = omni_request("supplied", [4096] * 150, hashed=set(range(150)))
        assert isinstance(pool.submit(supplied).result(), Materialized)
        assert cost.samples == 1
    finally:
        pool.close()


# --------------------------------------------------------------------------- the same outcome


class Recorder:
    """Wraps feature_hash and records which thread hashed how many bytes. With
    ``hold`` (so that sharing is shown, not left to the scheduler's timing), the
    first thread to hash holds its first item until another thread has taken one."""

    def __init__(self, real: Any, hold: bool) -> None:
        self.real = real
        self.hashed: list[tuple[str, int]] = []
        self.first: str | None = None
        self.other_took = threading.Event()
        if not hold:
            self.other_took.set()
        self.lock = threading.Lock()

    def __call__(self, data: memoryview) -> int:
        name = threading.current_thread().name
        with self.lock:
            self.hashed.append((name, data.nbytes))
            first = self.first is None
            if first:
                self.first = name
            elif name != self.first:
                self.other_took.set()
        if first:
            self.other_took.wait(5.0)
        return self.real(data)  # type: ignore[no-any-return]


M = pool_mod.SHARE_MIN_BYTES
# item 2 comes with its hash; 4 000 and 20 000 are too small to hand over
SIZES = [M // 3 // 8 * 8, M // 4, BIG, BIG + 8_000, 4_000, M // 5 // 8 * 8, M // 6 // 8 * 8, 20_000]
WAYS = ["on-the-loop", "on-a-worker", "shared", "shared-from-the-loop"]


@pytest.mark.parametrize("way", WAYS)
async def test_every_way_gives_the_same_outcome(
    native_mode: bool, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """Hashed on the loop (inline), on one worker, or with its large items shared
    by the idle workers (from a worker or from the loop), a request's outcome is
    bit for bit what one plain materializer run gives, and what rule 6 defines;
    pad values and item copies come from the active build of the rules (compiled,
    or interpreted with native off). Only large items are handed over."""
    req = omni_request("same", SIZES, hashed={2})
    want = _fields(Materializer(load_profile("qwen3_omni_moe")).run(req))

    calls: list[tuple[int, int]] = []
    active = planner._active
    real_pad = active.pad_value
    monkeypatch.setattr(active, "pad_value", lambda *a: calls.append(a) or real_pad(*a))
    shared = way.startswith("shared")
    recorder = Recorder(hashing.feature_hash, hold=shared)
    monkeypatch.setattr(pool_mod, "feature_hash", recorder)
    monkeypatch.setattr(hashing, "feature_hash", recorder)
    # share even on a one-CPU machine; never on the loop that hashes alone
    monkeypatch.setattr(pool_mod, "_CPUS", 1 if way == "on-the-loop" else 4)
    runner: list[str] = []

    def on_worker(r: Request, ops: Any) -> Any:
        runner.append(threading.current_thread().name)
        return ops

    inline = way in ("on-the-loop", "shared-from-the-loop")
    pool = _pool(
        workers={"shared": 3, "shared-from-the-loop": 2}.get(way, 1),
        inline_max_tokens=1 << 20 if inline else 0,
        inline_max_us=1e9,
        choose_ops=on_worker,
    )
    try:
        assert pool.runs_inline(req) is inline
        got = await pool.materialize(req)
    finally:
        pool.close()
    assert _fields(got) == want
    assert isinstance(got, Materialized) and got.request.mm is not None
    hashes = _want_hashes(req)
    assert [it.hash for it in got.request.mm.items] == hashes
    assert [it.pad_value for it in got.request.mm.items] == [
        rules.pad_value(int(Modality.AUDIO), h)
        for h in hashes  # type: ignore[arg-type]
    ]
    assert got.hashed_bytes == sum(SIZES) - SIZES[2]
    hashed = [h for i, h in enumerate(hashes) if i != 2]
    assert set(hashed) <= {h for _, h in calls}  # the hashed items, in the active build
    assert planner.HAVE_NATIVE is (native_mode and planner._BUILT is not None)

    threads = {name for name, _ in recorder.hashed}
    assert sorted(n for _, n in recorder.hashed) == sorted(SIZES[:2] + SIZES[3:])
    assert len(runner) == (0 if inline else 1)
    owner = "MainThread" if inline else runner[0]
    if shared:
        assert len(threads) >= 2, recorder.hashed  # an idle worker took large items
        assert {name for name, n in recorder.hashed if n < BIG} == {owner}  # small: the owner
    else:
        assert threads == {owner}


async def test_a_busy_pool_lends_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every worker running a request, the worker hashes its large items alone."""
    recorder = Recorder(hashing.feature_hash, hold=False)
    monkeypatch.setattr(pool_mod, "feature_hash", recorder)
    monkeypatch.setattr(hashing, "feature_hash", recorder)
    monkeypatch.setattr(pool_mod, "_CPUS", 4)
    pool = _pool(workers=1, inline_max_tokens=0)
    try:
        req = omni_request("alone", [M // 2] * 3)  # shared, were a worker idle
        got = await pool.materialize(req)
    finally:
        pool.close()
    assert isinstance(got, Materialized) and got.request.mm is not None
    assert len(recorder.hashed) == 3 and len({name for name, _ in recorder.hashed}) == 1
    assert [it.hash for it in got.request.mm.items] == _want_hashes(req)


def test_a_helper_stops_at_small_items_and_when_a_request_waits() -> None:
    """A helper takes the large items only, the largest first, and none once a
    request is queued; the thread that runs the request hashes what is left, and
    every hash is there."""
    sizes = [10_000, 50_000, 30_000, 40_000, 20_000]
    buffers = [memoryview(bytes([i]) * n) for i, n in enumerate(sizes)]
    share = pool_mod._HashShare(buffers)
    share.work(lambda: False, 25_000)  # takes 50, 40 and 30 K, stops before 20 K
    assert share._next == 3
    share.work()  # the owner takes the rest
    assert share.wait() == [hashing.feature_hash(b) for b in buffers]

    queued = pool_mod._HashShare(buffers)
    seen = iter([False, True])  # a request is queued after the helper's first item
    queued.work(lambda: next(seen))
    assert queued._next == 1
    queued.work()
    assert queued.wait() == [hashing.feature_hash(b) for b in buffers]


class AffinityRecorder(Recorder):
    """A :class:`Recorder` (holding, so that a helper takes part) that also notes
    the CPUs each hashing thread may run on."""

    def __init__(self, real: Any) -> None:
        super().__init__(real, hold=True)
        self.cpus: dict[str, set[int]] = {}

    def __call__(self, data: memoryview) -> int:
        self.cpus[threading.current_thread().name] = os.sched_getaffinity(0)
        return super().__call__(data)


@pytest.mark.skipif(
    pool_mod._this_cpu is None or len(pool_mod._ALLOWED) < 2,
    reason="steering needs libc's sched_getcpu and two CPUs",
)
@pytest.mark.parametrize("os_says", ["yes", "refuses", "no-cpu-reader"])
async def test_helpers_are_steered_off_the_requesters_cpu(
    monkeypatch: pytest.MonkeyPatch, os_says: str
) -> None:
    """While one request's hashing is shared, the other workers may run on every
    allowed CPU but the requester's (a helper woken while that CPU is busy would
    otherwise queue behind it), and get them all back after the share. An OS that
    refuses, or no way to read the CPU, changes the placement only: the request
    is shared and materialized all the same."""
    real_cpu = pool_mod._this_cpu
    assert real_cpu is not None
    seen: list[int] = []
    if os_says == "no-cpu-reader":
        monkeypatch.setattr(pool_mod, "_this_cpu", None)
    else:
        monkeypatch.setattr(pool_mod, "_this_cpu", lambda: seen.append(real_cpu()) or seen[-1])
    if os_says == "refuses":

        def refuse(tid: int, cpus: Any) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(pool_mod.os, "sched_setaffinity", refuse)
    pool = _pool(workers=2, inline_max_tokens=1 << 20, inline_max_us=1e9)
    try:
        # the executor starts a worker thread at the first submit that finds none
        # idle: the first share's helper is new, so it is the second share that
        # finds a worker to steer
        warm = Recorder(hashing.feature_hash, hold=True)
        monkeypatch.setattr(pool_mod, "feature_hash", warm)
        await pool.materialize(omni_request("warm", SHARED))
        assert len({name for name, _ in warm.hashed}) == 2 and pool._worker_tids
        recorder = AffinityRecorder(hashing.feature_hash)
        monkeypatch.setattr(pool_mod, "feature_hash", recorder)
        req = omni_request("shared", SHARED)
        assert pool.runs_inline(req)  # from the loop, with both workers idle
        got = await pool.materialize(req)
        after = {tid: os.sched_getaffinity(tid) for tid in pool._worker_tids}
        shares, steered = pool.stats.hash_shares, pool.stats.hash_shares_steered
        exported = {
            (s.name, s.kind): s.value for s in pool.metrics() if s.name.startswith("hash_shares")
        }
    finally:
        pool.close()
    # the first share found no worker thread to steer; the second one did, if allowed
    assert (shares, steered) == (2, 1 if os_says == "yes" else 0)
    assert exported == {
        ("hash_shares", "counter"): shares,
        ("hash_shares_steered", "counter"): steered,
    }
    assert isinstance(got, Materialized) and got.request.mm is not None
    assert [it.hash for it in got.request.mm.items] == _want_hashes(req)
    (helper,) = set(recorder.cpus) - {"MainThread"}
    assert recorder.cpus["MainThread"] == set(pool_mod._ALLOWED)  # the requester: untouched
    if os_says == "yes":
        assert recorder.cpus[helper] == set(pool_mod._ALLOWED) - {seen[-1]}
    else:
        assert recorder.cpus[helper] == set(pool_mod._ALLOWED)
    assert after and all(cpus == set(pool_mod._ALLOWED) for cpus in after.values())
