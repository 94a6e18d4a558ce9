"""The materializer pool: one shared materializer, ``workers`` threads, bounded admission.

Every transport admits through :meth:`MaterializerPool.submit`, which either
returns a :class:`Ticket` at once or raises ``Overloaded`` / ``ShuttingDown``
(never an unbounded queue). A ticket ends in exactly one outcome, whichever
comes first:

* the worker finishes: the materialized request or its abort;
* :meth:`Ticket.cancel` (ZMQ ABORT, gRPC ``Abort``/cancel): ``CANCELLED``;
* its own deadline (``timeout_ms``): ``DEADLINE_EXCEEDED``;
* the drain deadline at shutdown: ``SHUTTING_DOWN``.

Work still queued when a ticket ends early is removed from the queue; work
already running finishes on its worker and its outcome is discarded. The
in-flight count (queued + running) drops only when a worker really lets go of
the request, so "in flight" never hides work still holding memory.

**Small requests run inline, up to a measured cost, hashing included.** One
estimate (:class:`InlineCost`) prices every request before it is admitted: a
fixed part, a rate per unit (a token, or a thousandth of an item) learned from
the runs this pool times, and the feature bytes it would hash (items with
neither a hash nor a pad value) at BLAKE2b's rate on this machine, measured at
start-up (:meth:`~MaterializerPool.calibrate_inline`) and then learned from the
hashing this pool times (one thread's: shared hashing says nothing of it),
divided among the threads that would share it (below) plus a helper's
wake-up (``SHARE_WAKE_US``). A request is materialized at once, on the calling
(event loop) thread, and :meth:`~MaterializerPool.submit` returns its ticket
already finished, when it hashes nothing and has at most ``inline_max_tokens``
tokens, or when its whole estimate is within ``inline_max_us``. Such a request
is about a millisecond at most, while a trip through a worker costs two thread
hand-offs and a GIL convoy, which on a small host are worth more than the work
itself. Every other request goes to the workers: the loop never stalls behind
a large request, and never blocks for longer than ``inline_max_us`` at the
measured rates (and hashes nothing with ``inline_max_us=0``). Inline requests
never count as in flight (they are done before ``submit`` returns) and use the
CPU array ops, which give the same bytes as any worker's.
``inline_max_tokens=0`` turns inline runs off; a pool with a ``before_run``
test hook never runs inline.

**Hashing is shared with the idle workers.** When a run, on the loop or on a
worker, has at least ``SHARE_MIN_BYTES`` to hash in two items or more of at
least ``SHARE_MIN_ITEM_BYTES``, the pool's idle workers help: each thread takes
the next item left, the largest first (``hashlib`` releases the GIL, so they
hash in parallel), and a helper stops at the first smaller item, or, after the
item in its hands, as soon as a request waits in the queue; the thread running
the request hashes whatever is left, and waits only for items already being
hashed. A busy pool lends nothing. Before it wakes them, the requester keeps
the other workers off the CPU it runs on (their CPU affinity, for the length of
the share, where libc tells a thread its CPU): woken while that CPU is busy, a
helper would otherwise wait behind the requester there while the other CPUs
sleep (a virtual machine's halted vCPU reads as preempted, and the scheduler
avoids it) until a timer tick moved it, which on 2 vCPUs after an idle gap took
about 0.5 ms and made sharing slower than hashing alone. Items under 32 KiB
and requests under 512 KiB are not shared: each item hands the GIL over, and
the helper's wake-up costs about what hashing 100 KiB does
(``bench/bench_pool.py --only share``, on 2 vCPUs after a 3 ms gap, steered
against alone: 17 items of 8 KiB 1.17-1.45x, 16 KiB 1.02-1.32x, 37 KiB
0.69-0.88x, 64 KiB 0.68-0.72x, 256 KiB 0.54-0.62x). The hashes are the same
either way.

Workers are threads: hashing (``hashlib`` releases the GIL on large buffers)
and numpy/torch/C array work on large arrays run in parallel. Each worker owns
its :class:`~mmadmit.materializer.ArrayOps`: the numpy one, or with CUDA a
:class:`~mmadmit.devices.TorchArrayOps` bound to that worker's own stream.
The event loop awaits futures; it materializes only the small inline requests
(on the CPU, their hashing bounded as above) and never waits on a device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from .errors import Abort, AbortCode, Overloaded, ShuttingDown
from .hashing import feature_hash, feature_hashes, measure_ns_per_byte
from .materializer import CPU_OPS, ArrayOps, Materializer, Outcome
from .model import Request
from .telemetry import Sample, counter, counters, gauge

logger = logging.getLogger(__name__)

# The inline estimate (InlineCost): a run costs FIXED_US plus RATE_NS per unit,
# a unit being a token or a thousandth of an item (an item's checks and plan cost
# about what a thousand tokens of arrays do), plus HASH_NS per feature byte it
# hashes. The rate starts cautious and then follows the runs this pool times (an
# exponential average over runs that hash nothing and are big enough for the rate
# to dominate); the hash rate starts cautious, is measured at calibration, and then
# follows the hashing this pool times (one thread's, of at least _LEARN_MIN_BYTES).
INLINE_FIXED_US = 20.0
INLINE_RATE_NS = 4.0
INLINE_HASH_NS = 2.0  # per byte: slower than BLAKE2b on any current x86 or ARM core
ITEM_UNITS = 1000
_LEARN_MIN_UNITS = 16_384
_LEARN_MIN_BYTES = 65_536
_LEARN_WEIGHT = 0.2
# Hashing shared with idle workers (module docstring): at least SHARE_MIN_BYTES
# in two items or more of at least SHARE_MIN_ITEM_BYTES (each item is a GIL
# hand-over), and never on more threads than the process may run on CPUs.
SHARE_MIN_ITEM_BYTES = 32 * 1024
SHARE_MIN_BYTES = 512 * 1024
SHARE_WAKE_US = 100.0  # a steered helper's wake-up, in the estimate (measured: 30-110 us)
_ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
_CPUS = len(_ALLOWED) or os.cpu_count() or 1


def _cpu_reader() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (the CPU this thread runs on), where there is one."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu if getcpu() >= 0 else None


_this_cpu = _cpu_reader()


class InlineCost:
    """The estimated materializer time of a request, its hashing included."""

    __slots__ = ("fixed_us", "hash_ns", "hash_samples", "rate_ns", "samples")

    def __init__(
        self,
        fixed_us: float = INLINE_FIXED_US,
        rate_ns: float = INLINE_RATE_NS,
        hash_ns: float = INLINE_HASH_NS,
    ):
        self.fixed_us, self.rate_ns, self.hash_ns = fixed_us, rate_ns, hash_ns
        self.samples = self.hash_samples = 0

    @staticmethod
    def units(req: Request) -> int:
        mm = req.mm
        return len(req.input_ids) + ITEM_UNITS * (len(mm.items) if mm is not None else 0)

    @staticmethod
    def hash_sizes(req: Request) -> list[int]:
        """The feature bytes the materializer would hash, item by item: the inline
        features of items with neither a hash nor a pad value (rule 6). Never fewer
        than it hashes: a request refused, or taken as materialized upstream, hashes
        nothing; a shared-memory feature is never read (without a hash it is
        refused)."""
        mm = req.mm
        if mm is None:
            return []
        return [
            item.feature.data.nbytes
            for item in mm.items
            if item.hash is None and item.pad_value is None and item.feature is not None
        ]

    @staticmethod
    def hash_bytes(req: Request) -> int:
        """The sum of :meth:`hash_sizes`."""
        return sum(InlineCost.hash_sizes(req))

    def estimate_us(
        self, req: Request, hash_bytes: int | None = None, helpers: int = 0, alone_bytes: int = 0
    ) -> float:
        """The estimate; ``hash_bytes``: :meth:`hash_bytes` when already counted;
        ``helpers``: the idle workers that would share the hashing. Shared, the
        bytes are divided among the 1 + ``helpers`` threads, but the requester
        hashes at least ``alone_bytes`` (the items too small to hand over), and a
        helper's wake-up (``SHARE_WAKE_US``) is added."""
        if hash_bytes is None:
            hash_bytes = self.hash_bytes(req)
        if helpers:
            hashed = max(hash_bytes / (1 + helpers), alone_bytes)
            hash_us = self.hash_ns * hashed / 1000.0 + SHARE_WAKE_US
        else:
            hash_us = self.hash_ns * hash_bytes / 1000.0
        return self.fixed_us + self.rate_ns * self.units(req) / 1000.0 + hash_us

    def learn(self, req: Request, seconds: float) -> None:
        """Fold one timed run of a request that hashed nothing into the rate."""
        units = self.units(req)
        if units < _LEARN_MIN_UNITS:
            return  # the fixed part dominates: says little about the rate
        rate = max(0.0, seconds * 1e6 - self.fixed_us) * 1000.0 / units
        self.rate_ns += _LEARN_WEIGHT * (rate - self.rate_ns)
        self.samples += 1

    def learn_hash(self, nbytes: int, seconds: float) -> None:
        """Fold one thread's timed hashing of ``nbytes`` into the hash rate."""
        if nbytes < _LEARN_MIN_BYTES:
            return  # the per-call overhead dominates
        self.hash_ns += _LEARN_WEIGHT * (seconds * 1e9 / nbytes - self.hash_ns)
        self.hash_samples += 1


def hashes_nothing(req: Request) -> bool:
    """No item has feature bytes to hash (:meth:`InlineCost.hash_bytes` is 0)."""
    return InlineCost.hash_bytes(req) == 0


class _HashShare:
    """One request's feature buffers, hashed by every thread that calls :meth:`work`:
    each takes the next buffer left, the largest first, until none is."""

    __slots__ = ("buffers", "hashes", "_order", "_next", "_left", "_lock", "_done", "_error")

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self.buffers = buffers
        self.hashes = [0] * len(buffers)
        self._order = sorted(range(len(buffers)), key=lambda i: -buffers[i].nbytes)
        self._next = 0
        self._left = len(buffers)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def work(self, queued: Callable[[], bool] | None = None, min_bytes: int = 0) -> None:
        """Hash buffers until none is left to take. A helper passes ``queued`` and
        ``min_bytes``: it stops once a request waits for a worker, or at the first
        buffer smaller than ``min_bytes``."""
        order, buffers, n, lock = self._order, self.buffers, len(self._order), self._lock
        while True:
            if queued is not None and queued():
                return
            with lock:
                k = self._next
                if k >= n or buffers[order[k]].nbytes < min_bytes:
                    return
                self._next = k + 1
            i = order[k]
            try:
                self.hashes[i] = feature_hash(buffers[i])
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
                self._error = exc
            finally:
                with lock:
                    self._left -= 1
                    if not self._left:
                        self._done.set()

    def wait(self) -> list[int]:
        """The hashes, once every buffer is done (call after :meth:`work` without
        ``min_bytes`` returned: only buffers other threads took can be left, each
        already being hashed)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self.hashes


# A test hook run on the worker thread before each request (tests hold workers
# with it to make queueing deterministic); None in production.
BeforeRun = Callable[[Request], None]
# Told (tokens, seconds, inline) after every materializer run, on the thread that
# ran it (telemetry's histogram); None when nobody listens.
RunObserver = Callable[[int, float, bool], None]


@dataclass
class PoolStats:
    """Counters of the pool's own work, for metrics; written on the event loop thread
    only, but for the shares, which the thread that shares counts under the pool's
    lock. Outcomes (and refusals) are counted by the transports, once
    (:class:`~mmadmit.admission.AdmissionStats`), not here."""

    admitted: int = 0
    completed: int = 0  # admitted requests whose run gave their outcome
    cancelled_queued: int = 0  # removed before a worker took them
    discarded_running: int = 0  # ended early while running; result thrown away
    shutdown_aborted: int = 0  # ended SHUTTING_DOWN at the drain deadline
    inline: int = 0  # admitted and materialized on the calling thread (small requests)
    hash_shares: int = 0  # runs whose hashing idle workers shared
    hash_shares_steered: int = 0  # of those, with the other workers kept off its CPU

    # exported as mmadmit_<field>_total, with this help (MaterializerPool.metrics())
    COUNTERS: ClassVar[dict[str, str]] = {
        "admitted": "Requests admitted to the pool.",
        "cancelled_queued": "Admitted requests removed from the queue before a worker took them.",
        "discarded_running": "Requests ended early while running; their result was thrown away.",
        "inline": "Admitted requests materialized inline (--inline-max-tokens).",
        "completed": "Admitted requests whose materializer run gave their outcome.",
        "shutdown_aborted": "Admitted requests ended SHUTTING_DOWN at the drain deadline.",
        "hash_shares": "Requests whose feature hashing was shared with idle workers.",
        "hash_shares_steered": "Shared hashings whose helpers were kept off the requester's CPU.",
    }


class Ticket:
    """One admitted request. Methods must be called on the pool's event loop."""

    __slots__ = (
        "id",
        "rid",
        "_pool",
        "_cf",
        "_done",
        "_deadline_handle",
        "_released",
        "started_at",
    )

    def __init__(self, pool: MaterializerPool, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        self.id = next(pool._ids)
        self.rid = rid
        self._pool = pool
        self._cf: concurrent.futures.Future[Outcome] | None = None
        self._done: asyncio.Future[Outcome] = loop.create_future()
        self._deadline_handle: asyncio.TimerHandle | None = None
        self._released = False
        self.started_at = time.monotonic()

    @property
    def done(self) -> bool:
        return self._done.done()

    def result(self) -> Outcome:
        """The outcome of a ticket that is :attr:`done` (e.g. run inline)."""
        return self._done.result()

    async def outcome(self) -> Outcome:
        """Wait for the one outcome. If the awaiting task is cancelled (a gRPC call
        cancelled or past its deadline), the ticket's work is cancelled too."""
        try:
            return await asyncio.shield(self._done)
        except asyncio.CancelledError:
            self.cancel(AbortCode.CANCELLED, "the caller went away")
            raise

    def cancel(
        self, code: AbortCode = AbortCode.CANCELLED, message: str = "cancelled by the client"
    ) -> bool:
        """End the ticket early with ``code``; False if it already had an outcome."""
        if self._done.done():
            return False
        self._finish(Abort(code, message))
        cf = self._cf
        if cf is not None and cf.cancel():
            self._pool.stats.cancelled_queued += 1
            self._release()
        else:
            self._pool.stats.discarded_running += 1
        return True

    def _finish(self, outcome: Outcome) -> None:
        if self._done.done():
            return
        self._done.set_result(outcome)
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None  # the handle's callback refers back to us

    def _release(self) -> None:
        if not self._released:
            self._released = True
            # The worker let go: drop the future. Its done-callback refers back to
            # this ticket, and the cycle would keep the whole outcome (request,
            # positions, features) alive until the cyclic GC ran.
            self._cf = None
            self._pool._release(self)


class MaterializerPool:
    """The process's one pool; create it on the event loop that will use it."""

    def __init__(
        self,
        materializer: Materializer,
        *,
        workers: int = 2,
        max_inflight: int = 64,
        ops_factory: Callable[[int], ArrayOps] | None = None,
        choose_ops: Callable[[Request, ArrayOps], ArrayOps] | None = None,
        before_run: BeforeRun | None = None,
        inline_max_tokens: int = 0,
        inline_max_us: float = 0.0,
        observe_run: RunObserver | None = None,
    ) -> None:
        if workers < 1 or max_inflight < 1:
            raise ValueError("workers and max_inflight must be positive")
        if inline_max_tokens < 0:
            raise ValueError("inline_max_tokens must be >= 0 (0 turns inline runs off)")
        if inline_max_us < 0:
            raise ValueError("inline_max_us must be >= 0")
        self.materializer = materializer
        self.workers = workers
        self.max_inflight = max_inflight
        # a before_run hook exists to hold workers: then every request must reach one
        self.inline_max_tokens = 0 if before_run is not None else inline_max_tokens
        self.inline_max_us = inline_max_us
        self.inline_cost = InlineCost()
        self.stats = PoolStats()
        self._ids = itertools.count(1)
        self._ops_factory = ops_factory
        self._choose_ops = choose_ops
        self._before_run = before_run
        self._observe_run = observe_run
        self._local = threading.local()
        self._worker_ids = itertools.count()
        self._worker_tids: list[int] = []  # the workers' OS thread ids (CPU steering)
        self._tickets: dict[int, Ticket] = {}
        self._running = 0
        self._running_lock = threading.Lock()
        self._draining = False
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="mmadmit-worker", initializer=self._init_worker
        )

    # ------------------------------------------------------------------ workers

    def _init_worker(self) -> None:
        index = next(self._worker_ids)
        self._worker_tids.append(threading.get_native_id())
        self._local.ops = self._ops_factory(index) if self._ops_factory else CPU_OPS

    def _work(self, req: Request) -> Outcome:
        ops: ArrayOps = getattr(self._local, "ops", CPU_OPS)
        if self._choose_ops is not None:
            ops = self._choose_ops(req, ops)
        if self._before_run is not None:
            self._before_run(req)
        # what an inline run would cost: CPU runs that hash nothing teach the rate
        learn = ops is CPU_OPS and hashes_nothing(req)
        return self._timed_run(req, ops, False, learn)

    def _timed_run(self, req: Request, ops: ArrayOps, inline: bool, learn: bool) -> Outcome:
        hash_many = self._hash_shared
        observe = self._observe_run
        if observe is None and not learn:
            return self.materializer.run(req, ops, hash_many)
        t0 = time.perf_counter()
        outcome = self.materializer.run(req, ops, hash_many)
        seconds = time.perf_counter() - t0
        if learn:
            self.inline_cost.learn(req, seconds)  # a float store: safe from a worker
        if observe is not None:
            observe(len(req.input_ids), seconds, inline)
        return outcome

    def _has_queued(self) -> bool:
        """A request waits for a worker (read from any thread: two atomic reads)."""
        return len(self._tickets) > self._running

    def _hash_alone(self, buffers: Sequence[memoryview]) -> list[int]:
        """Hash on this thread, timed: the estimate's hash rate follows it."""
        t0 = time.perf_counter()
        hashes = feature_hashes(buffers)
        seconds = time.perf_counter() - t0
        self.inline_cost.learn_hash(sum(b.nbytes for b in buffers), seconds)  # float stores
        return hashes

    def _helpers(self, sizes: Sequence[int]) -> int:
        """How many idle workers would share hashing features of these sizes (module
        docstring); 0: the calling thread hashes them alone."""
        helpers = min(len(sizes) - 1, _CPUS - 1, self.workers - self._running)
        if helpers < 1:
            return 0
        shared = [n for n in sizes if n >= SHARE_MIN_ITEM_BYTES]
        return helpers if len(shared) >= 2 and sum(shared) >= SHARE_MIN_BYTES else 0

    def _hash_shared(self, buffers: Sequence[memoryview]) -> list[int]:
        """A run's hashing, on the loop or a worker: its items of at least
        ``SHARE_MIN_ITEM_BYTES`` shared with the idle workers (module docstring),
        else all of them on this thread."""
        helpers = self._helpers([b.nbytes for b in buffers])
        if not helpers:
            return self._hash_alone(buffers)
        share = _HashShare(buffers)
        steered: list[int] = []
        try:
            steered = self._steer_helpers()
            with self._running_lock:  # from the loop or a worker
                self.stats.hash_shares += 1
                self.stats.hash_shares_steered += bool(steered)
            for _ in range(helpers):
                try:
                    self._executor.submit(share.work, self._has_queued, SHARE_MIN_ITEM_BYTES)
                except RuntimeError:  # the pool is closing: this thread hashes them all
                    break
            share.work()
            return share.wait()
        finally:
            self._set_affinity(steered, _ALLOWED)

    def _steer_helpers(self) -> list[int]:
        """Keep the other workers off this thread's CPU (module docstring); the
        thread ids steered, to be given every allowed CPU back after the share."""
        if _this_cpu is None:
            return []
        cpu = _this_cpu()
        others = _ALLOWED - {cpu}
        if cpu not in _ALLOWED or not others:
            return []
        me = threading.get_native_id()
        tids = [tid for tid in self._worker_tids if tid != me]
        return self._set_affinity(tids, others)

    def _set_affinity(self, tids: list[int], cpus: frozenset[int]) -> list[int]:
        """The threads' CPUs set to ``cpus``; the ids it was set for. Steering only
        places threads: a thread gone, or an OS that refuses, changes nothing else."""
        done = []
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                continue
            done.append(tid)
        return done

    # ------------------------------------------------------------------ admission

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet let go by a worker (queued + running)."""
        return len(self._tickets)

    @property
    def queued(self) -> int:
        return max(0, len(self._tickets) - self._running)

    @property
    def running(self) -> int:
        return self._running

    @property
    def draining(self) -> bool:
        return self._draining

    def metrics(self) -> Iterator[Sample]:
        """The pool now and its counters (telemetry's ``Exports``)."""
        yield gauge("inflight", "Requests admitted, not yet released by a worker.", self.inflight)
        yield gauge("queue_depth", "Admitted requests waiting for a worker.", self.queued)
        yield gauge("running", "Requests a worker is materializing now.", self.running)
        yield gauge("max_inflight", "The --max-inflight limit.", self.max_inflight)
        yield gauge("draining", "1 once shutdown began (new requests refused).", self._draining)
        stats = self.stats
        yield from counters(stats, "", stats.COUNTERS)
        doc = "Admitted requests by where they ran."
        yield counter("admissions", doc, stats.inline, path="inline")
        yield counter("admissions", doc, stats.admitted - stats.inline, path="worker")

    def calibrate_inline(self, req: Request, runs: int = 3) -> float:
        """Start-up: this machine's rates before any request, outside the pool's counts.
        Times ``req`` (which must hash nothing) on the CPU ops ``runs`` times and learns
        the inline rate from it, and measures BLAKE2b's rate per byte
        (:func:`~mmadmit.hashing.measure_ns_per_byte`) for the bytes a request
        hashes; returns the inline rate in ns per unit."""
        if InlineCost.hash_bytes(req):
            raise ValueError("calibrate_inline: the request must hash nothing")
        for _ in range(runs):
            t0 = time.perf_counter()
            self.materializer.run(req, CPU_OPS)
            self.inline_cost.learn(req, time.perf_counter() - t0)
        self.inline_cost.hash_ns = measure_ns_per_byte()
        return self.inline_cost.rate_ns

    def runs_inline(self, req: Request) -> bool:
        """Whether :meth:`submit` materializes ``req`` at once on the calling thread:
        it hashes nothing and has at most ``inline_max_tokens`` tokens, or its
        estimated cost, hashing included, is within ``inline_max_us``."""
        return self._inline_hash_bytes(req) is not None

    def _inline_hash_bytes(self, req: Request) -> int | None:
        """The bytes ``req`` hashes when it runs inline (:meth:`runs_inline`), else None."""
        if self.inline_max_tokens == 0:
            return None
        sizes = InlineCost.hash_sizes(req)
        hash_bytes = sum(sizes)
        if not hash_bytes and len(req.input_ids) <= self.inline_max_tokens:
            return 0
        helpers = self._helpers(sizes)
        alone = sum(n for n in sizes if n < SHARE_MIN_ITEM_BYTES) if helpers else 0
        if self.inline_cost.estimate_us(req, hash_bytes, helpers, alone) <= self.inline_max_us:
            return hash_bytes
        return None

    def submit(self, req: Request, *, timeout_s: float | None = None) -> Ticket:
        """Admit ``req`` now or raise ``Overloaded`` / ``ShuttingDown``; never blocks.

        A small request (:meth:`runs_inline`) comes back with its ticket already
        finished; ``timeout_s`` cannot expire for it.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._idle = asyncio.Event()
            self._idle.set()
        if self._draining:
            raise ShuttingDown("the service is shutting down; retry on another replica")
        hash_bytes = self._inline_hash_bytes(req)
        if hash_bytes is not None:
            return self._run_inline(req, loop, hash_bytes)
        if len(self._tickets) >= self.max_inflight:
            raise Overloaded(
                f"{len(self._tickets)} requests in flight (limit {self.max_inflight}, "
                "--max-inflight); retry later"
            )
        ticket = Ticket(self, req.rid, loop)
        self._tickets[ticket.id] = ticket
        assert self._idle is not None
        self._idle.clear()
        self.stats.admitted += 1
        if timeout_s is not None:
            ticket._deadline_handle = loop.call_later(
                timeout_s,
                ticket.cancel,
                AbortCode.DEADLINE_EXCEEDED,
                f"no outcome within the request's timeout of {timeout_s * 1000:.0f} ms",
            )
        cf = self._executor.submit(self._run_tracked, req)
        ticket._cf = cf
        cf.add_done_callback(lambda f: self._post_done(loop, ticket, f))
        return ticket

    def _run_inline(self, req: Request, loop: asyncio.AbstractEventLoop, hash_bytes: int) -> Ticket:
        ticket = Ticket(self, req.rid, loop)
        ticket._released = True  # never held by a worker, never in flight
        self.stats.admitted += 1
        self.stats.inline += 1
        # run() never raises; a run that hashed says nothing of the rate per unit
        ticket._finish(self._timed_run(req, CPU_OPS, True, not hash_bytes))
        self.stats.completed += 1
        return ticket

    def _run_tracked(self, req: Request) -> Outcome:
        # Runs on a worker thread.
        with self._running_lock:
            self._running += 1
        try:
            return self._work(req)
        finally:
            with self._running_lock:
                self._running -= 1

    def _post_done(
        self,
        loop: asyncio.AbstractEventLoop,
        ticket: Ticket,
        cf: concurrent.futures.Future[Outcome],
    ) -> None:
        """Worker thread: hand the result to the loop. After a drain that timed out the
        loop may be gone; the ticket already ended SHUTTING_DOWN, so drop it quietly."""
        try:
            loop.call_soon_threadsafe(self._on_done, ticket, cf)
        except RuntimeError:  # event loop is closed
            logger.debug("rid=%s: finished after the event loop closed; dropped", ticket.rid)

    def _on_done(self, ticket: Ticket, cf: concurrent.futures.Future[Outcome]) -> None:
        if cf.cancelled():
            return  # removed from the queue by Ticket.cancel, already released
        ticket._release()
        if ticket.done:
            return  # ended early; the finished work is discarded
        exc = cf.exception()
        if exc is not None:  # materializer.run never raises; this is a bug
            logger.error("rid=%s: worker raised %r", ticket.rid, exc)
            ticket._finish(Abort(AbortCode.INTERNAL, "internal error in a worker"))
        else:
            ticket._finish(cf.result())
        self.stats.completed += 1

    def _release(self, ticket: Ticket) -> None:
        self._tickets.pop(ticket.id, None)
        if not self._tickets and self._idle is not None:
            self._idle.set()

    async def materialize(self, req: Request, *, timeout_s: float | None = None) -> Outcome:
        """Submit and await; admission refusals come back as aborts."""
        try:
            ticket = self.submit(req, timeout_s=timeout_s)
        except (Overloaded, ShuttingDown) as exc:
            return exc.to_abort()
        return await ticket.outcome()

    # ------------------------------------------------------------------ lifecycle

    def begin_drain(self) -> None:
        """From now on every submit is refused with ``SHUTTING_DOWN``."""
        self._draining = True

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for in-flight work; end the rest ``SHUTTING_DOWN``.

        Returns how many tickets were ended by the deadline.
        """
        self.begin_drain()
        if self._idle is None or not self._tickets:
            return 0
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except TimeoutError:
            pass
        ended = 0
        for ticket in list(self._tickets.values()):
            if ticket.cancel(
                AbortCode.SHUTTING_DOWN, "the service shut down before this request finished"
            ):
                ended += 1
        self.stats.shutdown_aborted += ended
        logger.warning(
            "[shutdown] %d request(s) still in flight after %.1fs ended SHUTTING_DOWN",
            ended,
            timeout_s,
        )
        return ended

    def close(self) -> None:
        """Stop the workers (idempotent). Running work is abandoned, not joined."""
        self._executor.shutdown(wait=False, cancel_futures=True)
