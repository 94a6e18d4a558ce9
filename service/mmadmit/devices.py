"""Device selection and the torch implementation of the materializer's array work.

:class:`TorchArrayOps` mirrors :class:`~mmadmit.materializer.CpuArrayOps`
(pad substitution, M-RoPE positions) with torch operations issued on one
stream. The stream and its completion event sit behind :class:`StreamLike`:
on CUDA a ``torch.cuda.Stream`` and ``torch.cuda.Event``; on the CPU
:class:`HostStream`, whose record/synchronize are no-ops because CPU torch ops
complete synchronously. Tests run the very same code on the CPU and assert it is
bit-identical to numpy; a CUDA machine runs it on real streams.

Data path with CUDA: host arrays are staged into pinned buffers, copied to the
device with ``non_blocking=True`` on the worker's stream, computed there,
copied back into pinned buffers, and the worker thread (never the event loop)
waits on an event recorded after the copy. Everything is integer arithmetic;
the float32 temporal indices are computed on the CPU while planning, so both
paths are bit-identical.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from . import mrope, planner

logger = logging.getLogger(__name__)


class StreamLike(Protocol):
    def context(self) -> contextlib.AbstractContextManager[Any]: ...

    def record_and_wait(self) -> None:
        """Record an event after the work issued so far and wait for it (worker thread)."""
        ...


class HostStream:
    """CPU stand-in: torch CPU ops are synchronous, so there is nothing to wait for."""

    pinned = False

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record_and_wait(self) -> None:
        return None


class CudaStream:
    """A worker's own CUDA stream plus a reusable completion event."""

    pinned = True

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.event = torch.cuda.Event()

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return self._torch.cuda.stream(self.stream)

    def record_and_wait(self) -> None:
        self.event.record(self.stream)
        self.event.synchronize()


class TorchArrayOps:
    """Array work on one torch device and stream (see module docstring)."""

    def __init__(self, device: str = "cpu", stream: StreamLike | None = None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.stream: StreamLike = stream if stream is not None else HostStream()
        self._pinned = bool(getattr(self.stream, "pinned", False))

    # -- transfers ------------------------------------------------------------

    def _to_device(self, arr: np.ndarray) -> Any:
        torch = self.torch
        host = torch.from_numpy(np.ascontiguousarray(arr))
        if self._pinned:
            staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            staged.copy_(host)
            return staged.to(self.device, non_blocking=True)
        return host.to(self.device)

    def _to_host(self, tensor: Any) -> Any:
        if self._pinned:
            out = self.torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            out.copy_(tensor, non_blocking=True)
            return out
        return tensor

    @contextlib.contextmanager
    def _issue(self) -> Iterator[None]:
        with self.stream.context():
            yield
        self.stream.record_and_wait()

    # -- ArrayOps -------------------------------------------------------------

    def substitute(
        self, ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, values: np.ndarray
    ) -> np.ndarray:
        torch = self.torch
        lengths = stops - starts
        with self._issue():
            d_ids = self._to_device(ids).clone()
            d_len = self._to_device(lengths)
            total = int(lengths.sum())
            span_of = torch.repeat_interleave(
                torch.arange(len(starts), device=d_ids.device), d_len, output_size=total
            )
            first = torch.cumsum(d_len, 0) - d_len
            local = torch.arange(total, dtype=torch.int64, device=d_ids.device) - first[span_of]
            index = self._to_device(starts)[span_of] + local
            d_ids[index] = self._to_device(values)[span_of]
            host = self._to_host(d_ids)
        return host.numpy()

    def positions(self, n: int, plan: mrope.RunPlan) -> tuple[np.ndarray, int]:
        torch = self.torch
        k = len(plan.start)
        if k == 0:  # text only: counting up on the host is cheaper than a copy back
            return planner.positions(n, plan)
        length_np = plan.length
        shift_np = plan.extent + 1 - length_np
        with self._issue():
            start = self._to_device(plan.start)
            length = self._to_device(length_np)
            shift = self._to_device(shift_np)
            rows = self._to_device(plan.rows)
            cols = self._to_device(plan.cols)
            t_off = self._to_device(plan.t_off)
            t_index = self._to_device(plan.t_index)
            dev = start.device
            shift_before = torch.cumsum(shift, 0) - shift
            run_s = start + shift_before
            step = torch.zeros(n + 1, dtype=torch.int64, device=dev)
            step.index_add_(0, start + length, shift)
            text = torch.arange(n, dtype=torch.int64, device=dev) + torch.cumsum(step[:n], 0)
            out = text.unsqueeze(0).expand(3, n).clone()
            total = int(length_np.sum())
            run_of = torch.repeat_interleave(torch.arange(k, device=dev), length, output_size=total)
            first_tok = torch.cumsum(length, 0) - length
            local = torch.arange(total, dtype=torch.int64, device=dev) - first_tok[run_of]
            idx = start[run_of] + local
            plane = (rows * cols)[run_of]
            frame = torch.div(local, plane, rounding_mode="floor")
            rem = local - frame * plane
            c = cols[run_of]
            row = torch.div(rem, c, rounding_mode="floor")
            col = rem - row * c
            origin = run_s[run_of]
            out[0, idx] = origin + t_index[t_off[run_of] + frame]
            out[1, idx] = origin + row
            out[2, idx] = origin + col
            host = self._to_host(out)
        return host.numpy(), int(shift_np.sum())


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # torch is optional for CPU-only deployments
        return False
    return bool(torch.cuda.is_available())


def resolve_device(choice: str) -> str:
    """``auto`` -> ``cuda`` when present, else ``cpu``; ``cuda`` without CUDA is an error."""
    from .errors import ConfigError

    if choice == "cpu":
        return "cpu"
    has_cuda = cuda_available()
    if choice == "cuda" and not has_cuda:
        raise ConfigError(
            "--device cuda: no CUDA device is available (torch.cuda.is_available() is False)"
        )
    return "cuda" if has_cuda else "cpu"


def cuda_ops_factory(device_index: int = 0) -> Any:
    """A pool ``ops_factory``: worker ``i`` gets its own stream on the device."""

    def make(worker: int) -> TorchArrayOps:
        import torch

        device = torch.device("cuda", device_index)
        return TorchArrayOps(str(device), CudaStream(device))

    return make
