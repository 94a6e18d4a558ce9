"""M-RoPE positions for the Qwen-VL families (docs/spec/MATERIALIZE.md "M-RoPE conventions").

Two steps, both transport-free:

* :func:`mmadmit.rules.plan_items` (rule 5, with every other item check)
  turns the items' spans and grids into *runs*, a :class:`RunPlan`:
  placeholder runs that get 3-D grid positions. Audio spans (Qwen3-Omni)
  advance linearly on all axes exactly like text, so they produce no run.
* :func:`positions` builds the ``[3, N]`` int64 positions and the delta from the
  runs with array operations only: no Python loop over tokens or over runs on
  the token axis. :func:`delta_only` gives the delta without per-token work
  (the decode exemption needs nothing else).

A run starting at position ``s`` with merged grid ``T' x H' x W'`` gets
``t = s + t_index[frame]``, ``h = s + row``, ``w = s + col``; the text after it
resumes at ``s + extent + 1`` with ``extent = max(t_index[-1], H'-1, W'-1)``.
Because every run ends one below where the next token starts, the largest
position of the prompt is ``N - 1 + shift`` where ``shift`` is the total
displacement, so ``delta = shift``.
"""

from __future__ import annotations

import msgspec
import numpy as np


class RunPlan(msgspec.Struct, frozen=True, eq=False, gc=False):
    """The runs of one prompt, as parallel int64 arrays sorted by start.

    ``t_index`` holds every run's temporal indices back to back; run ``k`` owns
    ``t_index[t_off[k] : t_off[k] + frames[k]]``. A frozen ``msgspec.Struct``: one
    is built for every M-RoPE request, and its constructor runs in C.
    """

    start: np.ndarray
    frames: np.ndarray  # T'
    rows: np.ndarray  # H'
    cols: np.ndarray  # W'
    t_off: np.ndarray
    t_index: np.ndarray

    @property
    def length(self) -> np.ndarray:
        return self.frames * self.rows * self.cols

    @property
    def extent(self) -> np.ndarray:
        """Largest offset inside each run over all three axes."""
        if len(self.start) == 0:
            return np.zeros(0, np.int64)
        last_t = self.t_index[self.t_off + self.frames - 1]
        return np.maximum(np.maximum(last_t, self.rows - 1), self.cols - 1)


def delta_only(n: int, plan: RunPlan) -> int:
    """The position delta (``max + 1 - N``) without building per-token positions."""
    del n  # the delta does not depend on the prompt length, only on the runs
    return int((plan.extent + 1 - plan.length).sum())


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
