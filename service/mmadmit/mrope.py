"""M-RoPE positions for the Qwen-VL families (docs/spec/MATERIALIZE.md "M-RoPE conventions").

Two steps, both transport-free:

* :func:`mmadmit.rules.plan_items` (rule 5, with every other item check)
  turns the items' spans and grids into *runs*, a :class:`RunPlan`:
  placeholder runs that get 3-D grid positions. Audio spans (Qwen3-Omni)
  advance linearly on all axes exactly like text, so they produce no run.
* :func:`mmadmit.rules.positions` (rule 7) builds the ``[3, N]`` int64
  positions and the delta from the runs. :func:`delta_only` here gives the
  delta without per-token work (the decode exemption needs nothing else).

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
