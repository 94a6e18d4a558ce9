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

**Requests with nothing to hash run inline, up to a measured cost.** A request
whose items need no feature hashing is materialized at once, on the calling
(event loop) thread, and :meth:`~MaterializerPool.submit` returns its ticket
already finished, when it has at most ``inline_max_tokens`` tokens, or more
tokens but an estimated materializer time within ``inline_max_us``
(:class:`InlineCost`: a fixed part plus a rate per token and item, the rate
learned from the runs this pool times, inline or not). Such a request is array
work, well under a millisecond even at 128K tokens, while a trip through a
worker costs two thread hand-offs and a GIL convoy, which on a small host are
worth more than the work itself. Every request that hashes feature bytes goes
to the workers, and so does one whose estimate is over the budget: the loop
never stalls behind a large request. Inline requests never count as in flight
(they are done before ``submit`` returns) and use the CPU array ops, which give
the same bytes as any worker's. ``inline_max_tokens=0`` turns inline runs off;
a pool with a ``before_run`` test hook never runs inline.

Workers are threads: hashing (``hashlib`` releases the GIL on large buffers)
and numpy/torch/C array work on large arrays run in parallel. Each worker owns
its :class:`~mmadmit.materializer.ArrayOps`: the numpy one, or with CUDA a
:class:`~mmadmit.devices.TorchArrayOps` bound to that worker's own stream.
The event loop awaits futures; it materializes only the small inline requests
(on the CPU), never hashes features and never waits on a device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import Abort, AbortCode, Overloaded, ShuttingDown
from .materializer import CPU_OPS, ArrayOps, Materializer, Outcome
from .model import Request

logger = logging.getLogger(__name__)

# The inline estimate (InlineCost): a run costs FIXED_US plus RATE_NS per unit,
# a unit being a token or a thousandth of an item (an item's checks and plan cost
# about what a thousand tokens of arrays do). The rate starts cautious and then
# follows the runs this pool times (an exponential average over runs big enough
# for the rate to dominate).
INLINE_FIXED_US = 20.0
INLINE_RATE_NS = 4.0
ITEM_UNITS = 1000
_LEARN_MIN_UNITS = 16_384
_LEARN_WEIGHT = 0.2


class InlineCost:
    """The estimated materializer time of a request that hashes nothing."""

    __slots__ = ("fixed_us", "rate_ns", "samples")

    def __init__(self, fixed_us: float = INLINE_FIXED_US, rate_ns: float = INLINE_RATE_NS):
        self.fixed_us, self.rate_ns, self.samples = fixed_us, rate_ns, 0

    @staticmethod
    def units(req: Request) -> int:
        mm = req.mm
        return len(req.input_ids) + ITEM_UNITS * (len(mm.items) if mm is not None else 0)

    def estimate_us(self, req: Request) -> float:
        return self.fixed_us + self.rate_ns * self.units(req) / 1000.0

    def learn(self, req: Request, seconds: float) -> None:
        """Fold one timed run of a request that hashed nothing into the rate."""
        units = self.units(req)
        if units < _LEARN_MIN_UNITS:
            return  # the fixed part dominates: says little about the rate
        rate = max(0.0, seconds * 1e6 - self.fixed_us) * 1000.0 / units
        self.rate_ns += _LEARN_WEIGHT * (rate - self.rate_ns)
        self.samples += 1


def hashes_nothing(req: Request) -> bool:
    """No item needs its feature bytes hashed (the one cost with no bound here)."""
    mm = req.mm
    if mm is not None:
        for item in mm.items:
            if item.hash is None and (item.feature is not None or item.feature_shm is not None):
                return False
    return True


# A test hook run on the worker thread before each request (tests hold workers
# with it to make queueing deterministic); None in production.
BeforeRun = Callable[[Request], None]
# Told (tokens, seconds, inline) after every materializer run, on the thread that
# ran it (telemetry's histogram); None when nobody listens.
RunObserver = Callable[[int, float, bool], None]


@dataclass
class PoolStats:
    """Counters of the pool's own work, for metrics; written on the event loop thread
    only. Outcomes (and refusals) are counted by the transports, once
    (:class:`~mmadmit.admission.AdmissionStats`), not here."""

    admitted: int = 0
    completed: int = 0  # admitted requests whose run gave their outcome
    cancelled_queued: int = 0  # removed before a worker took them
    discarded_running: int = 0  # ended early while running; result thrown away
    shutdown_aborted: int = 0  # ended SHUTTING_DOWN at the drain deadline
    inline: int = 0  # admitted and materialized on the calling thread (small requests)


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
        self._local.ops = self._ops_factory(index) if self._ops_factory else CPU_OPS

    def _work(self, req: Request) -> Outcome:
        ops: ArrayOps = getattr(self._local, "ops", CPU_OPS)
        if self._choose_ops is not None:
            ops = self._choose_ops(req, ops)
        if self._before_run is not None:
            self._before_run(req)
        return self._timed_run(req, ops, False)

    def _timed_run(self, req: Request, ops: ArrayOps, inline: bool) -> Outcome:
        # What an inline run would cost (an inline request was checked to hash nothing).
        learn = inline or (ops is CPU_OPS and hashes_nothing(req))
        observe = self._observe_run
        if observe is None and not learn:
            return self.materializer.run(req, ops)
        t0 = time.perf_counter()
        outcome = self.materializer.run(req, ops)
        seconds = time.perf_counter() - t0
        if learn:
            self.inline_cost.learn(req, seconds)  # a float store: safe from a worker
        if observe is not None:
            observe(len(req.input_ids), seconds, inline)
        return outcome

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

    def calibrate_inline(self, req: Request, runs: int = 3) -> float:
        """Time ``req`` (which must hash nothing) on the CPU ops ``runs`` times, outside
        the pool's counts, and learn the inline rate from it (start-up: this machine's
        rate before any request); returns the rate in ns per unit."""
        if not hashes_nothing(req):
            raise ValueError("calibrate_inline: the request must hash nothing")
        for _ in range(runs):
            t0 = time.perf_counter()
            self.materializer.run(req, CPU_OPS)
            self.inline_cost.learn(req, time.perf_counter() - t0)
        return self.inline_cost.rate_ns

    def runs_inline(self, req: Request) -> bool:
        """Whether :meth:`submit` materializes ``req`` at once on the calling thread:
        it hashes nothing, and it is small (``inline_max_tokens``) or its estimated
        cost is within ``inline_max_us``."""
        limit = self.inline_max_tokens
        if limit == 0 or not hashes_nothing(req):
            return False
        if len(req.input_ids) <= limit:
            return True
        return self.inline_cost.estimate_us(req) <= self.inline_max_us

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
        if self.runs_inline(req):
            return self._run_inline(req, loop)
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

    def _run_inline(self, req: Request, loop: asyncio.AbstractEventLoop) -> Ticket:
        ticket = Ticket(self, req.rid, loop)
        ticket._released = True  # never held by a worker, never in flight
        self.stats.admitted += 1
        self.stats.inline += 1
        ticket._finish(self._timed_run(req, CPU_OPS, True))  # run() never raises
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
