"""Rules 5, 7 and 8's per-token loops (:mod:`mmadmit.rules`: ``first_mismatch``,
``fill_spans``, ``positions``), compiled (``mmadmit._rules_c``) and interpreted,
against the numpy oracle in ``tests/kernels_oracle.py``.

All three must give identical results on random run plans (adjacent runs, runs
at token 0 and at the end, large temporal indices) and random spans, sorted or
not; both builds must refuse out-of-range input, with the same message, before
touching memory.

Run with: python -m pytest tests/test_kernels.py -q
"""

from __future__ import annotations

from types import ModuleType

import kernels_oracle as oracle
import numpy as np
import pytest
from conftest import rules_builds
from mmadmit.mrope import RunPlan

BUILDS = rules_builds()
COMPILED = BUILDS[1:]
a = lambda *x: np.asarray(x, np.int64)  # noqa: E731


def random_plan(rng: np.random.Generator) -> tuple[int, RunPlan]:
    k = int(rng.integers(0, 7))
    starts, frames, rows, cols, parts = [], [], [], [], []
    pos = int(rng.integers(0, 3))
    for _ in range(k):
        t, h, w = (int(x) for x in rng.integers(1, 5, 3))
        starts.append(pos)
        frames.append(t)
        rows.append(h)
        cols.append(w)
        mode = rng.integers(0, 3)
        idx = (
            np.arange(t)
            if mode == 0
            else np.zeros(t, int)
            if mode == 1
            else np.trunc(np.arange(t) * 6.5).astype(int)
        )
        parts.append(idx.astype(np.int64))
        pos += t * h * w + int(rng.integers(0, 3))  # 0: adjacent runs
    n = max(1, pos + int(rng.integers(0, 3)))
    a = lambda x: np.asarray(x, np.int64)  # noqa: E731
    t_off = np.cumsum([0, *frames[:-1]]).astype(np.int64) if k else a([])
    return n, RunPlan(
        a(starts), a(frames), a(rows), a(cols), t_off, np.concatenate(parts) if k else a([])
    )


@pytest.mark.parametrize("build", BUILDS)
def test_positions_equal_the_oracle_on_random_plans(build: ModuleType) -> None:
    rng = np.random.default_rng(7)
    for _ in range(2000):
        n, plan = random_plan(rng)
        got, d1 = build.positions(n, plan)
        want, d2 = oracle.positions(n, plan)
        assert type(d1) is int and d1 == d2 and np.array_equal(got, want), (n, plan)


@pytest.mark.parametrize("build", BUILDS)
def test_long_positions_start_on_a_cache_line(build: ModuleType) -> None:
    """From 16K tokens the positions are allocated 64-byte aligned (the vector
    stores of the grid loops then never straddle a cache line), still one
    C-contiguous [3, n] int64 array with the oracle's values; shorter ones are
    a plain array."""
    rng = np.random.default_rng(16)
    for n in (16_383, 16_384, 16_385, 40_000, 1 << 17):
        cols = int(rng.integers(1, 60))
        rows = (n // 2) // cols
        plan = RunPlan(a(n // 4), a(1), a(rows), a(cols), a(0), a(0))
        for _ in range(3):  # whatever the heap hands out
            got, delta = build.positions(n, plan)
            want, want_delta = oracle.positions(n, plan)
            assert np.array_equal(got, want) and delta == want_delta
            assert got.shape == (3, n) and got.dtype == np.int64 and got.flags.c_contiguous
            if n >= 16_384:
                assert got.__array_interface__["data"][0] % 64 == 0, n


def random_spans(rng: np.random.Generator, shuffled: bool) -> tuple[np.ndarray, ...]:
    n = int(rng.integers(1, 400))
    cuts = np.sort(
        rng.choice(
            np.arange(n + 1),
            size=min(n + 1, 2 * int(rng.integers(0, 8))) // 2 * 2,
            replace=False,
        )
    )
    starts, stops = cuts[0::2].astype(np.int64), cuts[1::2].astype(np.int64)
    if shuffled:  # the check reports in the given order; the fill takes any order
        order = rng.permutation(len(starts))
        starts, stops = starts[order], stops[order]
    ids = rng.integers(0, 5, n).astype(np.int64)
    expected = rng.integers(0, 3, len(starts)).astype(np.int64)
    for k in range(len(starts)):  # mostly valid spans
        if rng.random() < 0.8:
            ids[starts[k] : stops[k]] = expected[k]
    values = rng.integers(10**6, 10**7, len(starts)).astype(np.int64)
    return ids, starts, stops, expected, values


@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted", "shuffled"])
@pytest.mark.parametrize("build", BUILDS)
def test_spans_equal_the_oracle(build: ModuleType, shuffled: bool) -> None:
    rng = np.random.default_rng(11)
    for _ in range(300):
        ids, starts, stops, expected, values = random_spans(rng, shuffled)
        want_bad = next(
            (k for k in range(len(starts)) if (ids[starts[k] : stops[k]] != expected[k]).any()), -1
        )
        assert oracle.first_mismatch(ids, starts, stops, expected) == want_bad
        assert build.first_mismatch(ids, starts, stops, expected) == want_bad
        want_fill = oracle.fill_spans(ids, starts, stops, values)
        got = build.fill_spans(ids, starts, stops, values)
        assert np.array_equal(got, want_fill) and got is not ids


@pytest.mark.parametrize("build", COMPILED)
def test_compiled_loops_take_only_contiguous_int64(build: ModuleType) -> None:
    """The compiled loops read C-contiguous int64 buffers (what the rules make and
    pass) and refuse anything else instead of guessing at its layout."""
    ids = np.arange(20, dtype=np.int64)
    for bad in (ids.astype(np.int32), ids[::2]):
        with pytest.raises(ValueError):
            build.first_mismatch(bad, a(1), a(2), a(3))
        with pytest.raises(ValueError):
            build.fill_spans(bad, a(1), a(2), a(3))
    plan = RunPlan(a(0), a(1), a(1), a(2), a(0), a(0).astype(np.int32))  # int32 t_index
    with pytest.raises(ValueError):
        build.positions(4, plan)


@pytest.mark.parametrize("build", BUILDS)
def test_long_inputs_run_without_the_gil_and_agree(build: ModuleType) -> None:
    n = (1 << 16) + 5  # at and over the length that releases the GIL compiled
    ids = np.full(n, 9, np.int64)
    starts, stops = a(0, 62_000), a(60_000, n)
    assert build.first_mismatch(ids, starts, stops, a(9, 9)) == -1
    ids[n - 1] = 8
    assert build.first_mismatch(ids, starts, stops, a(9, 9)) == 1
    filled = build.fill_spans(ids, starts, stops, a(1, 2))
    assert np.array_equal(filled, oracle.fill_spans(ids, starts, stops, a(1, 2)))
    plan = RunPlan(a(10, 40_000), a(3, 2), a(100, 50), a(64, 20), a(0, 3), a(0, 2, 4, 0, 9))
    got, delta = build.positions(n, plan)
    want, want_delta = oracle.positions(n, plan)
    assert delta == want_delta and np.array_equal(got, want)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(
    "start, frames, rows, cols, t_off, t_index, message",
    [
        ([0], [2], [2], [2], [0], [0, 1], "past the end"),  # 8 tokens into n=4
        ([2, 1], [1, 1], [1, 1], [1, 1], [0, 1], [0, 0], "sorted"),
        ([-1], [1], [1], [1], [0], [0], "sorted"),
        ([0], [0], [1], [1], [0], [0], "positive"),
        ([0], [2], [1], [1], [1], [0, 1], "t_off"),
        ([0], [1], [1], [1], [0], [-1], "non-negative"),
        ([0], [1], [1], [1], [0], [2**63 - 4], "overflow"),
        ([0, 1], [1], [1], [1], [0], [0], "equal lengths"),
    ],
)
def test_positions_refuse_bad_plans(
    build: ModuleType, start, frames, rows, cols, t_off, t_index, message
) -> None:
    plan = RunPlan(a(*start), a(*frames), a(*rows), a(*cols), a(*t_off), a(*t_index))
    with pytest.raises(ValueError, match=message):
        build.positions(4, plan)


@pytest.mark.parametrize("build", BUILDS)
def test_spans_refuse_out_of_range(build: ModuleType) -> None:
    ids = np.zeros(4, np.int64)
    for starts, stops in (([2], [5]), ([-1], [1]), ([3], [2])):
        with pytest.raises(ValueError, match="out of range"):
            build.first_mismatch(ids, a(*starts), a(*stops), a(0))
        with pytest.raises(ValueError, match="out of range"):
            build.fill_spans(ids, a(*starts), a(*stops), a(0))
    with pytest.raises(ValueError, match="equal lengths"):
        build.fill_spans(ids, a(0), a(1, 2), a(0))
    with pytest.raises(ValueError, match="equal lengths"):
        build.first_mismatch(ids, a(0), a(1), a(0, 0))


@pytest.mark.parametrize("build", BUILDS)
def test_empty_spans_and_spans_that_touch(build: ModuleType) -> None:
    """An empty span where another starts or ends changes nothing (the numpy
    reference once assigned where it had to accumulate, and got this wrong)."""
    ids = np.arange(8, dtype=np.int64)
    starts, stops, values = a(0, 3, 3, 5, 8), a(3, 3, 5, 5, 8), a(-1, -2, -3, -4, -5)
    want = [-1, -1, -1, -3, -3, 5, 6, 7]
    assert build.fill_spans(ids, starts, stops, values).tolist() == want
    assert oracle.fill_spans(ids, starts, stops, values).tolist() == want
    assert build.first_mismatch(ids, a(3, 0), a(3, 1), a(-9, 0)) == -1
