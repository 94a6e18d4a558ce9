"""Rules 5, 7 and 8's per-token loops (:mod:`mmadmit.rules`) compiled (every build
this CPU runs: ``_rules_c``, and ``_rules_avx2`` where it has AVX2), against the
same source interpreted and the numpy oracle (``tests/kernels_oracle.py``).

``positions`` gets run plans that are mostly well formed (sorted, disjoint,
inside the prompt) with fields replaced by boundary values; ``first_mismatch``
and ``fill_spans`` get spans likewise (fill_spans also in any order,
overlapping, against a loop). Whether a plan or span set is inside the loops'
contract is decided here, in exact Python integers (:func:`plan_ok` for a
plan, the bounds of each span in :func:`_spans`): inside, both builds and the
oracle must give identical arrays and delta; outside, both builds must refuse
it with the same ``ValueError`` (the oracle's answer to an invalid plan is
unspecified).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from mmadmit import mrope, planner, rules

from ._common import outcome, same
from ._data import Data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import kernels_oracle as oracle  # noqa: E402  (the tests' oracle)

NAME = "kernels"
INT64_MAX = 2**63 - 1


def plan_ok(n: int, p: mrope.RunPlan) -> bool:
    """The contract ``rules.positions`` checks, replayed with Python ints."""
    k = len(p.start)
    if not (len(p.frames) == len(p.rows) == len(p.cols) == len(p.t_off) == k):
        return False
    nt = len(p.t_index)
    prev_end = pos = tok = 0
    for r in range(k):
        s, f, h, w, off = (int(x[r]) for x in (p.start, p.frames, p.rows, p.cols, p.t_off))
        if min(f, h, w) < 1 or s < prev_end or s > n or f * h * w > n - s:
            return False
        if off < 0 or off > nt - f:
            return False
        tr = [int(v) for v in p.t_index[off : off + f]]
        if min(tr) < 0:
            return False
        origin = pos + (s - tok)
        if origin + max(h - 1, w - 1, *tr) + 1 > INT64_MAX - n:
            return False
        pos = origin + max(tr[-1], h - 1, w - 1) + 1
        tok = prev_end = s + f * h * w
    return True


def _plan(d: Data) -> tuple[int, mrope.RunPlan]:
    k = d.int_in(0, 5)
    starts, frames, rows, cols, t_index, t_off = [], [], [], [], [], []
    pos = d.int_in(0, 3)
    for _ in range(k):
        f, h, w = d.int_in(1, 4), d.int_in(1, 4), d.int_in(1, 4)
        starts.append(pos)
        frames.append(f)
        rows.append(h)
        cols.append(w)
        t_off.append(len(t_index))
        mode = d.u8() % 4
        if mode == 0:
            t_index += range(f)
        elif mode == 1:
            t_index += [0] * f
        elif mode == 2:
            step = d.int_in(0, 50)
            t_index += [i * step for i in range(f)]
        else:
            t_index += [d.wild_int() % 2**64 - (2**63 if d.flag(20) else 0) for _ in range(f)]
        pos += f * h * w + d.int_in(0, 2)
    n = max(0, pos + d.int_in(0, 3) - (d.int_in(0, 3) if d.flag(10) else 0))
    fields = [starts, frames, rows, cols, t_off, t_index]
    for _ in range(d.int_in(0, 2)):  # replace a field by a boundary value
        which = fields[d.int_in(0, 5)]
        if which:
            which[d.int_in(0, len(which) - 1)] = d.wild_int()
    arrays = []
    for vals in fields:
        # a value outside int64 is not representable in the plan: wrap it as C would see it
        arrays.append(np.array([v % 2**64 - 2**64 if v % 2**64 >= 2**63 else v % 2**64
                                for v in vals], np.int64))  # fmt: skip
    return n, mrope.RunPlan(*arrays)


def _compiled(name: str, *args: Any) -> Any:
    """The outcome of ``name`` in every compiled build this CPU runs (``_rules_c``,
    and ``_rules_avx2`` where it has AVX2), which must all agree."""
    outs = [outcome(getattr(build, name), *args) for build in planner.COMPILED.values()]
    for other in outs[1:]:
        same(other, outs[0], f"{name}: the compiled builds differ")
    return outs[0]


def _mrope(d: Data) -> None:
    n, plan = _plan(d)
    ok = plan_ok(n, plan)
    got = _compiled("positions", n, plan)
    same(got, outcome(rules.positions, n, plan), f"positions (n={n}, {plan})")
    if got[0] == "err":
        assert not ok, f"positions refused a plan inside its contract: {got} (n={n}, {plan})"
        return
    assert ok, f"positions accepted a plan outside its contract (n={n}, {plan})"
    want, wdelta = oracle.positions(n, plan)
    out, delta = got[1]
    assert delta == wdelta and np.array_equal(out, want), f"positions != numpy (n={n}, {plan})"


def _spans(d: Data) -> None:
    n = d.int_in(0, 64)
    ids = np.array([d.int_in(0, 3) for _ in range(n)], np.int64)
    k = d.int_in(0, 6)
    starts, stops, vals = [], [], []
    pos = 0
    for _ in range(k):
        a = pos + d.int_in(0, 4)
        z = a + d.int_in(0, 6)
        starts.append(a)
        stops.append(z)
        vals.append(d.int_in(0, 3))
        pos = z
    for _ in range(d.int_in(0, 1)):
        which = (starts, stops)[d.int_in(0, 1)]
        if which:
            which[d.int_in(0, len(which) - 1)] = d.wild_int() % 2**63 * (-1 if d.flag(30) else 1)
    a_, z_, v_ = (np.array(x, np.int64) for x in (starts, stops, vals))
    ok = all(0 <= a <= z <= n for a, z in zip(starts, stops, strict=True))
    disjoint = ok and all(stops[i] <= starts[i + 1] for i in range(k - 1))
    got = _compiled("first_mismatch", ids, a_, z_, v_)
    same(got, outcome(rules.first_mismatch, ids, a_, z_, v_), "first_mismatch")
    if got[0] == "err":
        assert not ok, "first_mismatch refused valid spans"
    else:
        assert ok, "first_mismatch accepted spans outside the prompt"
        want = oracle.first_mismatch(ids, a_, z_, v_)
        assert got[1] == want, f"first_mismatch {got[1]} != numpy {want}"
    if d.flag(3):  # now and then spans in any order, overlapping: the last one wins
        k = d.int_in(0, 4)
        starts = [d.int_in(0, n) for _ in range(k)]
        stops = [min(n, a + d.int_in(0, 8)) for a in starts]
        vals = [d.int_in(0, 3) for _ in range(k)]
        a_, z_, v_ = (np.array(x, np.int64) for x in (starts, stops, vals))
        ok, disjoint = True, False
    got = _compiled("fill_spans", ids, a_, z_, v_)
    same(got, outcome(rules.fill_spans, ids, a_, z_, v_), "fill_spans")
    if got[0] == "err":
        assert not ok, "fill_spans refused valid spans"
        return
    assert ok, "fill_spans accepted spans outside the prompt"
    want_fill = ids.copy()
    for a, z, v in zip(starts, stops, vals, strict=True):
        want_fill[a:z] = v
    assert np.array_equal(got[1], want_fill), "fill_spans != the loop"
    if disjoint:
        assert np.array_equal(oracle.fill_spans(ids, a_, z_, v_), want_fill), "numpy fill"


def one(data: bytes) -> None:
    if planner._BUILT is None:
        return  # nothing compiled to compare
    d = Data(data)
    if d.u8() % 3:
        _mrope(d)
    else:
        _spans(d)
