"""The numpy references of rules 5, 7 and 8's per-token loops: the oracle the
tests (``tests/test_kernels.py``) and the ``kernels`` fuzz target compare
:mod:`mmadmit.rules`' loops with, compiled and interpreted. Tests only: in
production :func:`mmadmit.rules.first_mismatch`, :func:`~mmadmit.rules.fill_spans`
and :func:`~mmadmit.rules.positions` run (one source, compiled or interpreted).

These are written the other way round from the rules' loops: whole-array numpy
passes (prefix counts, difference arrays, one cumulative sum of per-token
increments) instead of loops over spans and grid rows, so a shared mistake is
unlikely.
"""

from __future__ import annotations

import numpy as np
from mmadmit.mrope import RunPlan


def first_mismatch(
    ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, expected: np.ndarray
) -> int:
    """First span ``k`` holding a token other than ``expected[k]``; -1 when none."""
    bad = np.zeros(len(starts), np.bool_)
    for ph in np.unique(expected).tolist():
        # per placeholder id, a prefix count must grow by exactly the span length
        sel = expected == ph
        counts = np.zeros(len(ids) + 1, np.int32)
        np.cumsum(ids == ph, dtype=np.int32, out=counts[1:])
        bad[sel] = counts[stops[sel]] - counts[starts[sel]] != stops[sel] - starts[sel]
    return int(np.argmax(bad)) if bad.any() else -1


def fill_spans(
    ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, values: np.ndarray
) -> np.ndarray:
    """A copy of ``ids`` with ``ids[starts[k]:stops[k]] = values[k]`` (disjoint spans),
    marking entries and exits in difference arrays, one cumulative sum each."""
    out = np.array(ids, dtype=np.int64, copy=True)
    n = len(ids)
    val = np.zeros(n + 1, np.int64)  # accumulated, not assigned: a stop may be the
    np.add.at(val, starts, values)  # next span's start, an empty span anywhere
    np.add.at(val, stops, -values)
    cover = np.zeros(n + 1, np.int8)
    np.add.at(cover, starts, 1)
    np.add.at(cover, stops, -1)
    inside = np.cumsum(cover[:n], dtype=np.int8).view(np.bool_)
    np.copyto(out, np.cumsum(val[:n]), where=inside)
    return out


def positions(n: int, plan: RunPlan) -> tuple[np.ndarray, int]:
    """The ``[3, n]`` int64 M-RoPE positions and the delta, vectorized.

    Built as one cumulative sum of per-token increments: text tokens step by 1
    on every axis and run tokens by (0, 0, 1) inside a grid row, so only the
    first token of each grid row and the first text token after each run need
    an explicit jump. Per-token work is a handful of streaming passes; all
    bookkeeping is per grid row (tokens / W of them), never per token.
    """
    k = len(plan.start)
    if k == 0:
        base = np.arange(n, dtype=np.int64)
        return np.broadcast_to(base, (3, n)).copy(), 0
    frames, rows, cols = plan.frames, plan.rows, plan.cols
    length = frames * rows * cols
    shift = plan.extent + 1 - length  # displacement each run adds after itself
    shift_before = np.cumsum(shift) - shift
    origin = plan.start + shift_before  # position of each run's first token
    end = plan.start + length  # one past each run

    d = np.empty((3, n), np.int64)
    # Base increments: text (1, 1, 1); run tokens (0, 0, 1).
    cover = np.zeros(n + 1, np.int8)
    cover[plan.start] += 1
    cover[end] -= 1
    in_run = np.cumsum(cover[:n], dtype=np.int8).view(np.bool_)
    np.logical_not(in_run, out=d[0], casting="unsafe")
    d[1] = d[0]
    d[2] = 1

    # Every grid row of every run, flattened: its run, frame and row inside the frame.
    rows_per_run = frames * rows
    n_rows = int(rows_per_run.sum())
    run_of_row = np.repeat(np.arange(k), rows_per_run)
    row_in_run = np.arange(n_rows, dtype=np.int64) - np.repeat(
        np.cumsum(rows_per_run) - rows_per_run, rows_per_run
    )
    r_rows = rows[run_of_row]
    frame = row_in_run // r_rows
    row = row_in_run - frame * r_rows
    t_val = plan.t_index[plan.t_off[run_of_row] + frame]
    o = origin[run_of_row]
    first_tok = plan.start[run_of_row] + row_in_run * cols[run_of_row]
    # Position of each row's first token, and of the token just before it.
    cur = np.stack([o + t_val, o + row, o])
    prev_tok = first_tok - 1
    prev = np.empty_like(cur)
    inner = row_in_run > 0  # previous token is the last of the previous row, same run
    w_last = cols[run_of_row] - 1
    prev[:, inner] = np.stack(
        [
            o[inner]
            + plan.t_index[
                plan.t_off[run_of_row[inner]] + (row_in_run[inner] - 1) // r_rows[inner]
            ],
            o[inner] + (row_in_run[inner] - 1) % r_rows[inner],
            o[inner] + w_last[inner],
        ]
    )
    starts = ~inner
    run_idx = run_of_row[starts]
    # A run's first token follows either text or the last token of the run before it.
    after_run = np.zeros(len(run_idx), np.bool_)
    after_run[1:] = end[run_idx[1:] - 1] == plan.start[run_idx[1:]]
    text_prev = (plan.start[run_idx] - 1) + shift_before[run_idx]
    prev_s = np.broadcast_to(text_prev, (3, len(run_idx))).copy()
    if after_run.any():
        p_run = run_idx[after_run] - 1
        last_frame_t = plan.t_index[plan.t_off[p_run] + frames[p_run] - 1]
        prev_s[:, after_run] = np.stack(
            [
                origin[p_run] + last_frame_t,
                origin[p_run] + rows[p_run] - 1,
                origin[p_run] + cols[p_run] - 1,
            ]
        )
    prev[:, starts] = prev_s
    valid = prev_tok >= 0
    d[:, first_tok[valid]] = cur[:, valid] - prev[:, valid]
    if not valid.all():  # a run at token 0 starts from its own origin
        d[:, first_tok[~valid]] = cur[:, ~valid]
    # The first text token after each run resumes at origin + extent + 1.
    follows = end < n
    nxt = end[follows]
    text_after = nxt[~in_run[nxt]]
    if len(text_after):
        run_k = np.searchsorted(end, text_after)
        last_t = plan.t_index[plan.t_off[run_k] + frames[run_k] - 1]
        resume = origin[run_k] + plan.extent[run_k] + 1
        d[0, text_after] = resume - (origin[run_k] + last_t)
        d[1, text_after] = resume - (origin[run_k] + rows[run_k] - 1)
        d[2, text_after] = resume - (origin[run_k] + cols[run_k] - 1)
    if not in_run[0]:
        d[:, 0] = 0
    np.cumsum(d, axis=1, out=d)
    return d, int(shift.sum())
