"""Process-level tuning applied once at start-up by ``mmadmit serve``.

glibc's allocator returns large freed blocks to the OS (mmap threshold and
trim threshold adapt only up to a point), so a service whose requests each
allocate and free several arrays of 1-4 MB (token ids, pad-substituted ids,
``[3, N]`` positions, encoded replies) page-faults the same memory in again on
every request: measured on a 128K-token request, materialize 6.4 -> 3.5 ms,
encode 5.0 -> 2.7 ms and freeing 1.2 -> 0.15 ms once blocks stay in the heap.
Keeping blocks below ``mmap_threshold_bytes`` in the heap, and trimming only
beyond ``trim_threshold_bytes`` of free top memory, bounds what is retained.

:func:`heap_stats` reads glibc's own accounting (``mallinfo2``): bytes in use
by the program against bytes the allocator holds free. A leak grows the first;
fragmentation or retention across per-thread arenas grows only the second.

:func:`tune_gc` keeps CPython's cyclic collector out of the request path. Its
youngest generation is collected after every 700 net allocations of tracked
objects (containers): a request of 128 items holds more than that while it is
decoded, so one such request set off about two collections of the young
objects and, every few hundred requests, a full collection over every object
the process keeps (modules, numpy, gRPC, ZMQ): measured on ``bench_zmq``'s
Qwen3-Omni 128K requests, 565 young and 4 full collections in 300 requests,
49 ms and 82 ms in all. Start-up objects are frozen (never scanned again) and
the young threshold is raised above what any admitted request holds; cyclic
garbage is still collected, later.

:func:`run_loop` runs a coroutine to completion on uvloop where it is
installed (a dependency on POSIX), else on asyncio's own loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
from collections.abc import Coroutine
from typing import Any, NamedTuple, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its dynamic threshold
TRIM_THRESHOLD_BYTES = 128 << 20
ARENA_MAX = 2  # --malloc-arenas' default (RELIABILITY.md: the soak with and without it)
# Tracked objects allocated (net) before a young collection: 700 in CPython. A
# 128-item request holds about 1,300 while it is decoded; 20,000 leaves room for
# requests of several thousand items, and for many in flight, before one runs.
GC_GEN0_THRESHOLD = 20_000


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:  # no C library to load
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - ctypes' own declaration form
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


class HeapStats(NamedTuple):
    """glibc's heap, all arenas: ``in_use`` (allocated, mmapped blocks included) and
    ``free`` (held by the allocator, not given back to the OS)."""

    in_use: int
    free: int


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2``, typed, looked up once; None where absent."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is not None:
        fn.restype = _MallInfo2
        fn.argtypes = []
    return fn


def heap_stats() -> HeapStats | None:
    """The heap now (``mallinfo2``), or None off glibc (or before glibc 2.33).

    It walks every arena's free lists under their locks: call it at a scrape,
    not per request.
    """
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return HeapStats(in_use=info.uordblks + info.hblkhd, free=info.fordblks)


def tune_allocator(
    mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES,
    arena_max: int = ARENA_MAX,
) -> bool:
    """Apply the glibc thresholds, and cap the arenas at ``arena_max`` (0: glibc's
    own cap, 8 per core); False (and nothing changed) off glibc.

    Why cap arenas: every thread that allocates (workers, the event loop, gRPC's
    and libzmq's threads) may get an arena of its own, and each keeps up to
    ``trim_threshold_bytes`` of freed blocks. Over a long mixed load that free
    memory grows while the memory in use does not (``heap_stats``); with two
    arenas it stays flat (RELIABILITY.md, load and soak).
    """
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold_bytes)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold_bytes)
    )
    if arena_max > 0:
        ok = bool(mallopt(M_ARENA_MAX, arena_max)) and ok
    logger.debug("allocator tuning %s", "applied" if ok else "refused")
    return ok


def tune_process(arena_max: int = ARENA_MAX) -> None:
    """Everything ``mmadmit serve`` applies once at start-up, after its imports:
    :func:`tune_allocator` (``arena_max`` arenas) and :func:`tune_gc`. The
    benchmarks' servers call it too, so that they run as the service does."""
    tune_allocator(arena_max=arena_max)
    tune_gc()


def tune_gc(gen0_threshold: int = GC_GEN0_THRESHOLD) -> tuple[int, int, int]:
    """Freeze what start-up allocated and raise the young generation's threshold
    (never lowered); the thresholds now in force.

    Called once, through :func:`tune_process`, by ``mmadmit serve`` and the
    benchmarks' servers, after the imports: the frozen objects move to a
    permanent generation no collection scans (``gc.freeze``). The older
    generations keep CPython's own thresholds, so cyclic garbage is still
    found: after ``gen0_threshold`` net allocations instead of 700.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 > 0:  # 0: the collector is disabled; leave it so
        gc.set_threshold(max(gen0, gen0_threshold), gen1, gen2)
    logger.debug("gc: %d objects frozen, thresholds %s", gc.get_freeze_count(), gc.get_threshold())
    return gc.get_threshold()


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``main`` run to completion on a new event loop: uvloop's, else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main)
    return uvloop.run(main)
