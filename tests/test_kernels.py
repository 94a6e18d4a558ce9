"""The fused C loops (mmadmit._kernels) against their numpy fallbacks.

Both must give identical results on random run plans (adjacent runs, runs at
token 0 and at the end, large temporal indices), random spans, and the vectors;
the C side must refuse out-of-range input instead of touching memory.

Run with: python -m pytest tests/test_kernels.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from conftest import native_as
from mmadmit import kernels, mrope
from mmadmit.mrope import RunPlan

# skipped only where the extension is not built, not where native code is switched
# off (MMADMIT_NATIVE=0): the compiled half runs with native switched on (``compiled``)
native = pytest.mark.skipif(
    kernels._BUILT is None, reason="mmadmit._kernels not built (no C compiler at install time)"
)


@pytest.fixture
def compiled() -> Iterator[None]:
    """Native switched on for the case, whatever the session's setting; restored after."""
    with native_as(True):
        assert kernels.HAVE_NATIVE
        yield


@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kernels, "_kernels", None)
    return kernels


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


@native
def test_positions_native_equals_numpy_on_random_plans(compiled: None) -> None:
    rng = np.random.default_rng(7)
    for _ in range(2000):
        n, plan = random_plan(rng)
        got, d1 = kernels.positions(n, plan)
        want, d2 = mrope.positions(n, plan)
        assert d1 == d2 and np.array_equal(got, want), (n, plan)


def test_spans_native_and_fallback_agree(fallback) -> None:
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(1, 400))
        cuts = np.sort(
            rng.choice(
                np.arange(n + 1),
                size=min(n + 1, 2 * int(rng.integers(0, 8))) // 2 * 2,
                replace=False,
            )
        )
        starts, stops = cuts[0::2].astype(np.int64), cuts[1::2].astype(np.int64)
        ids = rng.integers(0, 5, n).astype(np.int64)
        expected = rng.integers(0, 3, len(starts)).astype(np.int64)
        for k in range(len(starts)):  # mostly valid spans
            if rng.random() < 0.8:
                ids[starts[k] : stops[k]] = expected[k]
        values = rng.integers(10**6, 10**7, len(starts)).astype(np.int64)
        want_bad = next(
            (k for k in range(len(starts)) if (ids[starts[k] : stops[k]] != expected[k]).any()), -1
        )
        want_fill = ids.copy()
        for a, b, v in zip(starts, stops, values, strict=True):
            want_fill[a:b] = v
        assert fallback.first_mismatch(ids, starts, stops, expected) == want_bad
        assert np.array_equal(fallback.fill_spans(ids, starts, stops, values), want_fill)
        if kernels._BUILT is not None:
            import mmadmit._kernels as ck

            out = np.full_like(ids, -1)
            ck.spans_fill(out, ids, starts, stops, values)
            assert np.array_equal(out, want_fill)
            out = ids.copy()
            ck.spans_fill(out, out, starts, stops, values)  # in place
            assert np.array_equal(out, want_fill)
            assert ck.spans_check(ids, starts, stops, expected) == want_bad


def test_fill_many_spans_uses_difference_arrays(fallback) -> None:
    n = 5000
    starts = np.arange(0, n - 10, 20, dtype=np.int64)  # 250 spans > slice-fill threshold
    stops = starts + 7
    stops[::5] = starts[::5] + 20  # some spans end where the next begins
    values = np.arange(len(starts), dtype=np.int64) + 10**6
    ids = np.arange(n, dtype=np.int64)
    want = ids.copy()
    for a, b, v in zip(starts, stops, values, strict=True):
        want[a:b] = v
    assert np.array_equal(fallback.fill_spans(ids, starts, stops, values), want)


@native
@pytest.mark.parametrize(
    "start, frames, rows, cols, t_off, t_index, message",
    [
        ([0], [2], [2], [2], [0], [0, 1], "past the end"),  # 8 tokens into n=4
        ([2, 1], [1, 1], [1, 1], [1, 1], [0, 1], [0, 0], "sorted"),
        ([0], [0], [1], [1], [0], [0], "positive"),
        ([0], [2], [1], [1], [1], [0, 1], "t_index"),
        ([0, 1], [1], [1], [1], [0], [0], "equal lengths"),
    ],
)
def test_mrope_fill_refuses_bad_plans(start, frames, rows, cols, t_off, t_index, message) -> None:
    import mmadmit._kernels as ck

    a = lambda x: np.asarray(x, np.int64)  # noqa: E731
    out = np.zeros((3, 4), np.int64)
    with pytest.raises(ValueError, match=message):
        ck.mrope_fill(out, a(start), a(frames), a(rows), a(cols), a(t_off), a(t_index))
    assert not out.any()  # nothing written before validation finished


@native
def test_spans_refuse_out_of_range() -> None:
    import mmadmit._kernels as ck

    ids = np.zeros(4, np.int64)
    a = lambda x: np.asarray(x, np.int64)  # noqa: E731
    with pytest.raises(ValueError, match="out of range"):
        ck.spans_check(ids, a([2]), a([5]), a([0]))
    with pytest.raises(ValueError, match="out of range"):
        ck.spans_fill(ids, ids, a([-1]), a([1]), a([0]))
    with pytest.raises(ValueError, match="equal lengths"):
        ck.spans_fill(np.zeros(3, np.int64), ids, a([0]), a([1]), a([0]))
    with pytest.raises(TypeError, match="int64"):
        ck.spans_fill(ids.astype(np.int32), ids, a([0]), a([1]), a([0]))
