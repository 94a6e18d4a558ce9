"""What the service tells its operators: Prometheus series and a log line per outcome.

Scope: the one :class:`Telemetry` object of a server, shared by every
transport and the pool. Each outcome is counted in exactly one place: the
transport's :class:`~mmadmit.admission.AdmissionStats` (a plain integer add in
:meth:`~mmadmit.admission.Admissions.finish`), which registers with
:meth:`Telemetry.track` and is exported as ``requests_total`` when
``/metrics`` is scraped. :meth:`Telemetry.outcome`, called by the same
``finish``, adds what a count cannot hold: the latency observation, the
feature bytes hashed and the outcome log line. The pool reports how long each
materializer run took. Everything else (in-flight, queue depth, bytes, the
pool's and transports' own counters) is declared where it is counted: each
stats class's ``metrics()`` yields its series (:func:`counter`, :func:`gauge`),
read at scrape time by :class:`StatsCollector`, so it costs the request path
nothing but a plain integer add, and a new stats field is exported only once
someone declares it.

Non-goals: the HTTP endpoint (``metrics.py``), and deciding outcomes: this
module only observes them.

Series (all prefixed ``mmadmit_``; the family label is the model profile's)::

    requests_total{transport,outcome,code}          one per terminal outcome
    request_duration_seconds{transport,family,tokens}   receipt -> outcome sent
    materialize_duration_seconds{family,tokens,path}    one materializer run
    feature_hashed_bytes_total{transport}           feature bytes we hashed
    heap_bytes{state}, build_info, log_records_dropped_total
    ... and those declared by the pool and the transports' metrics().

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
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .errors import Abort
from .logs import dropped_records
from .model import Materialized, Request
from .runtime import heap_stats

if TYPE_CHECKING:
    from .admission import AdmissionStats

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

    def answered(self) -> tuple[int, int]:
        """(materialized, aborted): every tracked transport's outcomes so far."""
        totals = self._outcomes.totals()
        ok = sum(n for (_, code), n in totals.items() if code == "OK")
        return ok, sum(totals.values()) - ok

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


class Sample(NamedTuple):
    """One value of a series declared where it is counted (a ``metrics()`` method):
    ``name`` after ``mmadmit_`` (a counter's sample gets ``_total``), ``doc`` what
    it counts; samples of one name form one family, so they share kind, doc and
    label names."""

    kind: str  # "counter" or "gauge"
    name: str
    doc: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


def counter(name: str, doc: str, value: float, **labels: str) -> Sample:
    return Sample("counter", name, doc, value, tuple(labels.items()))


def gauge(name: str, doc: str, value: float, **labels: str) -> Sample:
    return Sample("gauge", name, doc, value, tuple(labels.items()))


def counters(stats: object, prefix: str, docs: dict[str, str]) -> Iterator[Sample]:
    """A counter ``{prefix}_{field}`` of each field of ``stats`` that ``docs`` declares,
    with its help text (the stats class's own table)."""
    for field, doc in docs.items():
        yield Sample(
            "counter", f"{prefix}_{field}" if prefix else field, doc, getattr(stats, field)
        )


# The families every transport adds a ``transport`` sample to.
RECEIVED_BYTES = "Bytes of request messages received."
SENT_BYTES = "Bytes of outcome messages handed to the socket."
UNDELIVERABLE = (
    "Outcomes that reached nobody: ZMQ replies or forwards given up, gRPC calls cancelled "
    "or past their deadline before their answer, ADD / ABORT messages the scheduler's "
    "socket refused (smg_grpc)."
)


class Exports(Protocol):
    """What :class:`StatsCollector` reads: the series an object declares, read at
    scrape time (the pool, each transport or its stats)."""

    def metrics(self) -> Iterable[Sample]: ...


class OutcomeCollector(Collector):
    """``mmadmit_requests_total{transport,outcome,code}``, read at scrape time from the
    transports' outcome counts (:meth:`~mmadmit.admission.AdmissionStats.outcome_counts`):
    the one count of each outcome, exported once. Every code of a tracked transport
    is present from the start (0 until it happens), so a rate never begins mid-series."""

    def __init__(self) -> None:
        self._tracked: list[tuple[str, AdmissionStats]] = []

    def track(self, transport: str, stats: AdmissionStats) -> None:
        if not any(s is stats for _, s in self._tracked):
            self._tracked.append((transport, stats))

    def totals(self) -> dict[tuple[str, str], int]:
        """(transport, code) -> outcomes so far (code ``OK``: materialized)."""
        totals: dict[tuple[str, str], int] = {}
        for transport, stats in list(self._tracked):  # scrape thread: copy, then read
            for code, count in stats.outcome_counts().items():
                totals[transport, code] = totals.get((transport, code), 0) + count
        return totals

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "mmadmit_requests",
            "Terminal outcomes by transport: outcome is materialized or aborted, code the "
            "abort code (OK when materialized).",
            labels=["transport", "outcome", "code"],
        )
        for (transport, code), count in self.totals().items():
            outcome = "materialized" if code == "OK" else "aborted"
            family.add_metric([transport, outcome, code], count)
        yield family


class StatsCollector(Collector):
    """The series the pool and the transports declare (:class:`Exports`), then the
    process's own (heap, build, dropped log records), read at scrape time on the
    metrics thread: it only reads plain ints, atomic under the GIL."""

    def __init__(self, sources: Iterable[Exports], build: dict[str, str]):
        self.sources = list(sources)
        self.build = build

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for source in self.sources:
            for s in source.metrics():
                family = families.get(s.name)
                if family is None:
                    kind = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                    labels = [k for k, _ in s.labels]
                    family = families[s.name] = kind(f"mmadmit_{s.name}", s.doc, labels=labels)
                family.add_metric([v for _, v in s.labels], s.value)
        yield from families.values()
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
        yield CounterMetricFamily(
            "mmadmit_log_records_dropped",
            "Log records and lines dropped because standard error could not keep up "
            "(logging never blocks the service).",
            value=dropped_records(),
        )


__all__ = [
    "LATENCY_BUCKETS_S",
    "Exports",
    "OutcomeCollector",
    "Sample",
    "disable_created_metrics",
    "StatsCollector",
    "Telemetry",
    "counter",
    "counters",
    "gauge",
    "request_size",
    "token_bucket",
]
