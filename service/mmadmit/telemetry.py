"""What the service tells its operators: Prometheus series and a log line per outcome.

Scope: the one :class:`Telemetry` object of a server, shared by every
transport and the pool. Each outcome is counted in exactly one place: the
transport's :class:`~mmadmit.admission.AdmissionStats` (a plain integer add in
:meth:`~mmadmit.admission.Admissions.finish`), which registers with
:meth:`Telemetry.track` and is exported as ``requests_total`` when
``/metrics`` is scraped. :meth:`Telemetry.outcome`, called by the same
``finish``, adds what a count cannot hold: the latency observation, the
feature bytes hashed and the outcome log line. The pool reports how long each
materializer run took. Everything else (in-flight, queue depth, draining,
bytes received and sent, the pool's and transports' own counters) is read from
their ``stats`` objects at scrape time too (:class:`StatsCollector`), so it
costs the request path nothing but a plain integer add.

Non-goals: the HTTP endpoint (``metrics.py``), and deciding outcomes: this
module only observes them.

Series (all prefixed ``mmadmit_``; the family label is the model profile's)::

    requests_total{transport,outcome,code}          one per terminal outcome (read from
                                                    the transports' AdmissionStats)
    request_duration_seconds{transport,family,tokens}   receipt -> outcome sent
    materialize_duration_seconds{family,tokens,path}    one materializer run
    received_bytes_total{transport}, sent_bytes_total{transport}
    feature_hashed_bytes_total{transport}           feature bytes we hashed
    admissions_total{path}                          inline | worker
    undeliverable_replies_total{transport}          outcomes nobody received
    engine_relayed_requests_total, engine_relayed_outputs_total,
    engine_relayed_output_bytes_total, engine_handshake_steps_total{side},
    engine_scheduler_up                              engine mode (server wires it)

Cost on the request path: label children are resolved once and cached, so an
outcome is an integer add, a dict lookup and a histogram observation
(about 2 microseconds), plus the log line when outcome logging asks for one
(``--log-outcomes``: aborts by default, every outcome with ``all``). The line is
queued for the log writer thread (:mod:`mmadmit.logs`): it never blocks the
event loop, and its message is formatted off the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .errors import Abort, AbortCode
from .logs import dropped_records
from .model import Materialized, Request
from .runtime import heap_stats

if TYPE_CHECKING:
    from .admission import AdmissionStats
    from .pool import MaterializerPool

outcome_logger = logging.getLogger("mmadmit.outcome")

TRANSPORTS = ("grpc", "zmq", "engine", "smg_grpc")

# Token-count buckets of the latency histograms: (upper bound inclusive, label).
_TOKEN_BUCKETS: tuple[tuple[int, str], ...] = (
    (1024, "0-1K"),
    (8192, "1K-8K"),
    (32768, "8K-32K"),
    (131072, "32K-128K"),
)
_TOKEN_BUCKET_MAX = "128K+"

# Seconds: 100 us (a small inline request) to 10 s (a drain-length wait).
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def token_bucket(tokens: int) -> str:
    """The ``tokens`` label of a request of ``tokens`` tokens."""
    for bound, label in _TOKEN_BUCKETS:
        if tokens <= bound:
            return label
    return _TOKEN_BUCKET_MAX


def request_size(request: Request | None) -> tuple[int, int]:
    """(tokens, items) of a decoded request; (0, 0) when it never decoded."""
    if request is None:
        return 0, 0
    mm = request.mm
    return len(request.input_ids), (len(mm.items) if mm is not None else 0)


class Telemetry:
    """The service's Prometheus series (on its own registry) and the outcome log.

    Safe to call from any thread (``prometheus_client`` locks its values; the
    child cache is filled under a lock). One per server: tests run several
    servers in one process, each with its own registry.
    """

    def __init__(
        self,
        family: str,
        *,
        registry: CollectorRegistry | None = None,
        log_outcomes: bool | str = "aborts",
    ) -> None:
        self.family = family
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # "all", "aborts" (the default: the operator's signal) or "off"; True / False
        # are "all" / "off".
        if isinstance(log_outcomes, bool):
            log_outcomes = "all" if log_outcomes else "off"
        if log_outcomes not in ("all", "aborts", "off"):
            raise ValueError(f"log_outcomes must be all, aborts or off, not {log_outcomes!r}")
        self.log_outcomes = log_outcomes
        reg = self.registry
        self._outcomes = OutcomeCollector()
        reg.register(self._outcomes)
        self._latency = Histogram(
            "mmadmit_request_duration_seconds",
            "End to end, from the request's receipt to its outcome handed to the transport.",
            ["transport", "family", "tokens"],
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self._materialize = Histogram(
            "mmadmit_materialize_duration_seconds",
            "One materializer run (validation, hashing, pad values, positions, substitution).",
            ["family", "tokens", "path"],
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self._hashed = Counter(
            "mmadmit_feature_hashed_bytes",
            "Feature bytes hashed because the request carried no content hash.",
            ["transport"],
            registry=reg,
        )
        self._lock = threading.Lock()
        self._children: dict[tuple[Any, ...], Any] = {}
        self._hashed_by = {t: self._hashed.labels(t) for t in TRANSPORTS}

    def track(self, transport: str, stats: AdmissionStats) -> None:
        """Export ``stats`` (a transport's one count of its outcomes) as
        ``requests_total{transport=...}`` from now on (idempotent per object)."""
        self._outcomes.track(transport, stats)

    # ------------------------------------------------------------------ children

    def _child(self, key: tuple[Any, ...]) -> Any:
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    metric, *labels = key
                    child = metric.labels(*labels)
                    self._children[key] = child
        return child

    # ------------------------------------------------------------------ observations

    def materialize_time(self, tokens: int, seconds: float, inline: bool) -> None:
        """One materializer run (the pool calls this, on whichever thread ran it)."""
        path = "inline" if inline else "worker"
        self._child((self._materialize, self.family, token_bucket(tokens), path)).observe(seconds)

    def outcome(
        self,
        transport: str,
        rid: str,
        request: Request | None,
        outcome: Materialized | Abort,
        started: float,
    ) -> None:
        """Time and log one terminal outcome (counted by the caller's stats, see
        :meth:`track`); ``started`` is the receipt's ``time.perf_counter()``."""
        latency_s = time.perf_counter() - started
        tokens, items = request_size(request)
        if isinstance(outcome, Abort):
            kind, code = "aborted", outcome.code.value
        else:
            kind, code = "materialized", "OK"
            if outcome.hashed_bytes:
                self._hashed_by[transport].inc(outcome.hashed_bytes)
        bucket = token_bucket(tokens)
        self._child((self._latency, transport, self.family, bucket)).observe(latency_s)
        mode = self.log_outcomes
        if (
            mode != "off"
            and (mode == "all" or kind == "aborted")
            and outcome_logger.isEnabledFor(logging.INFO)
        ):
            outcome_logger.info(
                "rid=%s transport=%s outcome=%s code=%s tokens=%d items=%d latency_ms=%.3f",
                rid,
                transport,
                kind,
                code,
                tokens,
                items,
                latency_s * 1000,
                extra={
                    "fields": {
                        "event": "outcome",
                        "rid": rid,
                        "transport": transport,
                        "outcome": kind,
                        "code": code,
                        "tokens": tokens,
                        "items": items,
                        "latency_ms": round(latency_s * 1000, 3),
                    }
                },
            )


# --------------------------------------------------------------------------- scrape-time


class OutcomeCollector(Collector):
    """``mmadmit_requests_total{transport,outcome,code}``, read at scrape time from the
    transports' outcome counts (:class:`~mmadmit.admission.AdmissionStats`): the one
    count of each outcome, exported once. Every code of a tracked transport is
    present from the start (0 until it happens), so a rate never begins mid-series."""

    def __init__(self) -> None:
        self._tracked: list[tuple[str, AdmissionStats]] = []

    def track(self, transport: str, stats: AdmissionStats) -> None:
        if not any(s is stats for _, s in self._tracked):
            self._tracked.append((transport, stats))

    def collect(self) -> Iterator[Metric]:
        totals: dict[tuple[str, str, str], float] = {}
        for transport, stats in list(self._tracked):  # scrape thread: copy, then read
            key = (transport, "materialized", "OK")
            totals[key] = totals.get(key, 0) + stats.materialized
            aborted = dict(stats.aborted_by_code)
            for code in AbortCode:
                key = (transport, "aborted", code.value)
                totals[key] = totals.get(key, 0) + aborted.get(code.value, 0)
        family = CounterMetricFamily(
            "mmadmit_requests",
            "Terminal outcomes by transport: outcome is materialized or aborted, code the "
            "abort code (OK when materialized).",
            labels=["transport", "outcome", "code"],
        )
        for labels, value in totals.items():
            family.add_metric(list(labels), value)
        yield family


# The outcome counts every transport's stats carry: exported by OutcomeCollector
# as requests_total, so not again as mmadmit_<transport>_<name>.
_OUTCOME_FIELDS = frozenset({"materialized", "aborted_by_code"})


def _numeric(stats: Any) -> dict[str, float]:
    if stats is None or not hasattr(stats, "__dict__"):
        return {}
    return {
        k: v
        for k, v in list(vars(stats).items())
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _OUTCOME_FIELDS
    }


def _counters(transport: Any) -> dict[str, float]:
    """A transport's ``stats`` and, for a face in front of a scheduler, its link's."""
    link_stats = getattr(getattr(transport, "link", None), "stats", None)
    return {**_numeric(getattr(transport, "stats", None)), **_numeric(link_stats)}


class StatsCollector(Collector):
    """The pool's gauges and the counters the pool and transports keep, read at scrape
    time (the scrape runs on the metrics thread; it only reads plain ints and copies
    dicts, both atomic under the GIL)."""

    def __init__(self, pool: MaterializerPool, transports: dict[str, Any], build: dict[str, str]):
        self.pool = pool
        self.transports = transports  # name -> object with a ``stats`` dataclass, or None
        self.build = build

    def collect(self) -> Iterator[Metric]:
        pool, stats = self.pool, self.pool.stats
        yield _gauge(
            "mmadmit_inflight", "Requests admitted and not yet released by a worker.", pool.inflight
        )
        yield _gauge("mmadmit_queue_depth", "Admitted requests waiting for a worker.", pool.queued)
        yield _gauge("mmadmit_running", "Requests a worker is materializing now.", pool.running)
        yield _gauge("mmadmit_max_inflight", "The --max-inflight limit.", pool.max_inflight)
        yield _gauge(
            "mmadmit_draining", "1 once shutdown began (new requests refused).", int(pool.draining)
        )
        yield _counter("mmadmit_admitted", "Requests admitted to the pool.", stats.admitted)
        yield _counter(
            "mmadmit_cancelled_queued",
            "Admitted requests removed from the queue before a worker took them.",
            stats.cancelled_queued,
        )
        yield _counter(
            "mmadmit_discarded_running",
            "Requests ended early while running; their result was thrown away.",
            stats.discarded_running,
        )
        yield _counter(
            "mmadmit_inline",
            "Admitted requests materialized inline (--inline-max-tokens).",
            stats.inline,
        )
        admissions = CounterMetricFamily(
            "mmadmit_admissions", "Admitted requests by where they ran.", labels=["path"]
        )
        admissions.add_metric(["inline"], stats.inline)
        admissions.add_metric(["worker"], stats.admitted - stats.inline)
        yield admissions
        yield _counter(
            "mmadmit_completed",
            "Admitted requests whose materializer run gave their outcome.",
            stats.completed,
        )
        yield _counter(
            "mmadmit_shutdown_aborted",
            "Admitted requests ended SHUTTING_DOWN because the drain deadline passed.",
            stats.shutdown_aborted,
        )
        undeliverable = CounterMetricFamily(
            "mmadmit_undeliverable_replies",
            "Outcomes that reached nobody: ZMQ replies or forwards given up, gRPC calls "
            "cancelled or past their deadline before their answer.",
            labels=["transport"],
        )
        for name, obj in self.transports.items():
            numeric = _counters(obj)
            lost: float = numeric.get("undeliverable", numeric.get("calls_cancelled", 0))
            undeliverable.add_metric([name], lost)
            for key, count in numeric.items():  # every transport counter, as before
                yield _untyped(f"mmadmit_{name}_{key}", count)
        yield undeliverable
        for metric, attr, doc in (
            ("mmadmit_received_bytes", "received_bytes", "Bytes of request messages received."),
            ("mmadmit_sent_bytes", "sent_bytes", "Bytes of outcome messages handed to the socket."),
        ):
            family = CounterMetricFamily(metric, doc, labels=["transport"])
            for name, obj in self.transports.items():
                family.add_metric([name], _counters(obj).get(attr, 0))
            yield family
        engine = self.transports.get("engine")
        if engine is not None:
            yield from _engine_families(engine.stats, engine.link.stats)
        heap = heap_stats()
        if heap is not None:  # glibc only
            heap_family = GaugeMetricFamily(
                "mmadmit_heap_bytes",
                "glibc's heap over all arenas: bytes in use by the process (state=in_use) and "
                "bytes the allocator holds free without returning them (state=free); a leak "
                "grows in_use, fragmentation grows free.",
                labels=["state"],
            )
            heap_family.add_metric(["in_use"], heap.in_use)
            heap_family.add_metric(["free"], heap.free)
            yield heap_family
        info = GaugeMetricFamily(
            "mmadmit_build_info",
            "The running profile and device (value 1).",
            labels=sorted(self.build),
        )
        info.add_metric([self.build[k] for k in sorted(self.build)], 1)
        yield info
        yield _counter(
            "mmadmit_log_records_dropped",
            "Log records and lines dropped because standard error could not keep up "
            "(logging never blocks the service).",
            dropped_records(),
        )


def _engine_families(stats: Any, link: Any) -> Iterator[Metric]:
    """Engine mode's relay (``EngineStats``, its link's ``SchedulerStats``) for operators."""
    yield _counter(
        "mmadmit_engine_relayed_requests",
        "Requests from SMG forwarded to the scheduler (materialized or marked aborted).",
        stats.forwarded - stats.forwarded_aborts,
    )
    yield _counter(
        "mmadmit_engine_relayed_outputs",
        "Scheduler output messages relayed to SMG.",
        stats.output_messages,
    )
    yield _counter(
        "mmadmit_engine_relayed_output_bytes",
        "Bytes of the scheduler output messages relayed to SMG.",
        stats.output_bytes,
    )
    steps = CounterMetricFamily(
        "mmadmit_engine_handshake_steps",
        "Engine handshake steps completed, by side (scheduler: HELLO, INIT, READY, ready "
        "response; smg: HELLO, INIT, READY, ready response, output connected).",
        labels=["side"],
    )
    steps.add_metric(["scheduler"], link.handshake_steps_scheduler)
    steps.add_metric(["smg"], stats.handshake_steps_smg)
    yield steps
    yield _gauge(
        "mmadmit_engine_scheduler_up",
        "1 while the scheduler is alive (from its ready response until it goes away).",
        link.scheduler_alive,
    )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _untyped(name: str, value: float) -> Metric:
    metric = Metric(name, f"Transport counter {name}.", "untyped")
    metric.add_sample(name, {}, value)
    return metric


__all__ = [
    "LATENCY_BUCKETS_S",
    "OutcomeCollector",
    "disable_created_metrics",
    "StatsCollector",
    "Telemetry",
    "request_size",
    "token_bucket",
]
