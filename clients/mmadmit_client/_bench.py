"""``mmadmit-client bench``: steady closed-loop load over one transport.

``concurrency`` workers share one open transport; each sends a request, waits
for its outcome, and sends the next, cycling through the request files, until
``duration_s`` has passed (no new request after it; those in flight finish) or
``requests`` have been sent. Every request gets its own request id
(``bench-<pid>-<random>-<n>``): a frames file is re-encoded with the service's
codec under it (:meth:`~mmadmit_client._cli_request.LoadedRequest.zmq_frames`),
any other request sent as the same :class:`~mmadmit_client.Request` under it.

Accounting: ``sent`` counts requests handed to the transport, ``received`` the
outcomes that came back (materialized or aborted; an abort such as
``OVERLOADED`` is a result, not an error), ``errors`` what ended without an
outcome (a timeout, a transport error), by exception type: over ZMQ a server
that goes away mid-run ends the requests it held ``ServerUnavailable`` at once,
and later ones find no connection within ``--timeout`` and end so too, none of
them sent afterwards (the table's ``error: ServerUnavailable``). ``sent == received``
is the transport keeping its promise of exactly one outcome per request; the
report says whether it held. Latencies are per outcome, from the send to the
outcome (the client's own decoding included).

Outcomes are shown by code everywhere (the progress bar, the tables, the plot),
and the run's status (:meth:`BenchReport.status`) heads the table and the plot
in its colour: green when every request materialized, orange when some were
aborted, red when all were (a load of requests the server refuses, e.g. ids of
another profile: 100% ``INVALID_REQUEST`` at a fine rate is not a healthy
run) or some got no outcome.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._cli_request import LoadedRequest, UsageError
from ._cli_transport import CliTransport
from ._exceptions import ClientError

MATERIALIZED = "MATERIALIZED"
# the status's level -> (rich style, matplotlib colour)
STATUS_STYLES = {
    "ok": ("bold green", "#228833"),
    "aborts": ("bold dark_orange", "#ee7733"),
    "failed": ("bold red", "#cc3311"),
}


@dataclass(frozen=True)
class BenchSettings:
    concurrency: int
    duration_s: float | None = None  # one of duration_s / requests
    requests: int | None = None
    progress: bool = True


@dataclass
class BenchReport:
    target: str
    transport: str
    files: list[str]
    settings: BenchSettings
    sent: int = 0
    # (seconds since start at send, latency in ms, code) per outcome
    samples: list[tuple[float, float, str]] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    elapsed_s: float = 0.0
    transport_counters: dict[str, int] = field(default_factory=dict)

    @property
    def received(self) -> int:
        return len(self.samples)

    @property
    def lost(self) -> int:
        return self.sent - self.received

    @property
    def all_received(self) -> bool:
        return self.sent == self.received and not self.errors

    @property
    def throughput_rps(self) -> float:
        return self.received / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def latencies_ms(self) -> np.ndarray:
        return np.array([s[1] for s in self.samples], dtype=np.float64)

    def latency_summary(self) -> dict[str, float | None]:
        lat = self.latencies_ms()
        if lat.size == 0:
            return {k: None for k in ("min", "mean", "p50", "p90", "p99", "max")}
        p50, p90, p99 = np.percentile(lat, [50, 90, 99]).tolist()
        return {
            "min": round(float(lat.min()), 3),
            "mean": round(float(lat.mean()), 3),
            "p50": round(p50, 3),
            "p90": round(p90, 3),
            "p99": round(p99, 3),
            "max": round(float(lat.max()), 3),
        }

    def outcomes(self) -> dict[str, int]:
        counts = collections.Counter(code for _, _, code in self.samples)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    @property
    def aborted(self) -> int:
        """Outcomes that are aborts (any code but ``MATERIALIZED``)."""
        return sum(n for code, n in self.outcomes().items() if code != MATERIALIZED)

    def status(self) -> tuple[str, str]:
        """(text, level): the run in one line, outcomes by code; level ``ok`` (every
        request materialized), ``aborts`` (some aborted) or ``failed`` (all aborted,
        none answered, or some without an outcome); see :data:`STATUS_STYLES`."""
        outcomes = self.outcomes()
        aborted = self.aborted
        if self.received == 0:
            head, level = "NO OUTCOME", "failed"
        elif aborted == self.received:
            head, level = "ALL ABORTED", "failed"
        elif aborted:
            share = 100 * aborted / self.received
            head = f"{share:.1f}% ABORTED" if share >= 0.1 else "<0.1% ABORTED"
            level = "aborts"
        else:
            head, level = "all materialized", "ok"
        text = f"{head}: {self.received} outcomes, {self.throughput_rps:.0f}/s"
        if outcomes:
            text += " (" + ", ".join(f"{code} {n}" for code, n in outcomes.items()) + ")"
        missing = sum(self.errors.values())
        if missing or self.lost:
            level = "failed"
            text += f"; {max(missing, self.lost)} without an outcome"
            if self.errors:
                text += " (" + ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) + ")"
        return text, level

    def throughput_series(self) -> tuple[np.ndarray, np.ndarray]:
        """(bucket start in s, outcomes per second) over the run, about 40 buckets."""
        done = np.array([t + lat / 1e3 for t, lat, _ in self.samples], dtype=np.float64)
        span = max(self.elapsed_s, float(done.max()) if done.size else 0.0, 1e-3)
        buckets = max(1, min(40, int(span / 0.05)))
        edges = np.linspace(0.0, span, buckets + 1)
        counts, _ = np.histogram(done, bins=edges)
        return edges[:-1], counts / (span / buckets)

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "target": self.target,
            "transport": self.transport,
            "files": self.files,
            "concurrency": s.concurrency,
            "duration_s": s.duration_s,
            "requests": s.requests,
            "sent": self.sent,
            "received": self.received,
            "lost": self.lost,
            "all_received": self.all_received,
            "errors": dict(self.errors),
            "elapsed_s": round(self.elapsed_s, 3),
            "throughput_rps": round(self.throughput_rps, 2),
            "latency_ms": self.latency_summary(),
            "outcomes": self.outcomes(),
            "aborted": self.aborted,
            "status": self.status()[0],
            "transport_counters": self.transport_counters,
        }


async def run_bench(
    transport: CliTransport,
    files: Sequence[LoadedRequest],
    settings: BenchSettings,
    *,
    stderr_console: Any = None,
) -> BenchReport:
    """Run the load on an open ``transport``; returns the report (never raises for a
    request that fails: it is counted in ``errors``)."""
    if not files:
        raise UsageError("bench needs at least one request file")
    prefix = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    for loaded in files:  # refuse what this transport cannot carry before sending anything
        transport.prepare(loaded, f"{prefix}-check")
    report = BenchReport(
        target=transport.target.text,
        transport=transport.kind,
        files=[str(f.path) for f in files],
        settings=settings,
    )
    t0 = time.perf_counter()
    deadline = None if settings.duration_s is None else t0 + settings.duration_s
    limit = settings.requests

    progress = _Progress(settings, stderr_console) if settings.progress else None

    def next_ticket() -> int | None:
        if limit is not None and report.sent >= limit:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        n = report.sent
        report.sent += 1
        return n

    async def worker() -> None:
        while (n := next_ticket()) is not None:
            loaded = files[n % len(files)]
            started = time.perf_counter()
            try:
                code = await transport.admit_code(loaded, f"{prefix}-{n}")
            except ClientError as exc:  # no outcome: counted, the load goes on
                report.errors[type(exc).__name__] += 1
            else:
                report.samples.append((started - t0, (time.perf_counter() - started) * 1e3, code))
            if progress is not None:
                progress.done(report, time.perf_counter() - t0)

    if progress is not None:
        progress.start()
    try:
        await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
    finally:
        report.elapsed_s = time.perf_counter() - t0
        if progress is not None:
            progress.stop(report, report.elapsed_s)
    report.transport_counters = transport.counters
    return report


class _Progress:
    """A rich progress bar on stderr: requests done of N, or seconds of the duration."""

    def __init__(self, settings: BenchSettings, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.by_count = settings.requests is not None
        total = float((settings.requests or 0) if self.by_count else (settings.duration_s or 0.0))
        columns: list[Any] = [TextColumn("[bold]bench"), BarColumn()]
        if self.by_count:
            columns.append(MofNCompleteColumn())
        columns += [TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        self.progress = Progress(*columns, console=console, transient=False)
        self.task = self.progress.add_task("bench", total=total, info="")
        self._last = 0.0
        self._seen = 0  # samples looked at so far
        self._aborted = 0  # aborts among them

    def start(self) -> None:
        self.progress.start()

    def done(self, report: BenchReport, elapsed_s: float) -> None:
        if elapsed_s - self._last < 0.05 and not self.by_count:
            return
        self._last = elapsed_s
        self._update(report, elapsed_s)

    def _update(self, report: BenchReport, elapsed_s: float) -> None:
        rate = report.received / elapsed_s if elapsed_s > 0 else 0.0
        for _, _, code in report.samples[self._seen :]:
            self._aborted += code != MATERIALIZED
        self._seen = report.received
        info = f"{report.received} outcomes, {rate:.0f}/s"
        if self._aborted:
            info += f", [bold red]{self._aborted} aborted[/]"
        if report.errors:
            info += f", [bold red]{sum(report.errors.values())} errors[/]"
        completed: float = report.received + sum(report.errors.values())
        if not self.by_count:
            completed = min(elapsed_s, self.progress.tasks[0].total or elapsed_s)
        self.progress.update(self.task, completed=completed, info=info)

    def stop(self, report: BenchReport, elapsed_s: float) -> None:
        self._update(report, elapsed_s)
        if not self.by_count:
            self.progress.update(self.task, completed=self.progress.tasks[0].total)
        self.progress.stop()


# --------------------------------------------------------------------------- output


def describe_load(report: BenchReport) -> str:
    """``bench TARGET (transport): LOAD at concurrency C, N file(s)``."""
    s = report.settings
    load = f"{s.duration_s:g} s" if s.duration_s is not None else f"{s.requests} requests"
    return (
        f"bench {report.target} ({report.transport}): {load} at concurrency "
        f"{s.concurrency}, {len(report.files)} file(s)"
    )


def render_report(report: BenchReport, console: Any) -> None:
    """What was run and the run's status (outcomes by code, in its colour: the
    title of the tables), then the tables: sent / received / aborted /
    throughput, latency percentiles, outcomes by code."""
    from rich.table import Table
    from rich.text import Text

    from ._cli_output import print_line, print_table

    print_line(console, Text(describe_load(report), style="bold"))
    status, level = report.status()
    style = STATUS_STYLES[level][0]
    print_line(console, Text(status, style=style))  # the table's title, never wrapped
    head = Table(show_header=True)
    for col in ("sent", "received", "aborted", "lost", "errors", "elapsed s",
                "throughput req/s"):  # fmt: skip
        head.add_column(col, justify="right")
    head.add_row(
        str(report.sent),
        str(report.received),
        Text(str(report.aborted), style=style if report.aborted else ""),
        str(report.lost),
        str(sum(report.errors.values())),
        f"{report.elapsed_s:.2f}",
        f"{report.throughput_rps:.1f}",
    )
    print_table(console, head)

    lat = report.latency_summary()
    lat_table = Table(title="latency (ms)")
    keys = ("p50", "p90", "p99", "max", "mean", "min")
    for key in keys:
        lat_table.add_column(key, justify="right")
    lat_table.add_row(*("-" if lat[k] is None else f"{lat[k]:.2f}" for k in keys))
    print_table(console, lat_table)

    out_table = Table(title="outcomes by code")
    out_table.add_column("code")
    out_table.add_column("count", justify="right")
    out_table.add_column("share", justify="right")
    for code, count in report.outcomes().items():
        share = f"{100 * count / max(report.received, 1):.1f}%"
        row_style = "green" if code == MATERIALIZED else "bold red"
        out_table.add_row(Text(code, style=row_style), str(count), share)
    for name, count in sorted(report.errors.items()):
        out_table.add_row(Text(f"error: {name}", style="bold red"), str(count), "-")
    print_table(console, out_table)
    verdict = (
        "every request got exactly one outcome"
        if report.all_received
        else f"{report.lost} request(s) got no outcome"
    )
    extra = ", ".join(f"{k} {v}" for k, v in report.transport_counters.items())
    print_line(
        console,
        f"sent {report.sent}, received {report.received}: {verdict}"
        + (f" ({extra})" if extra else ""),
    )


def require_matplotlib() -> None:
    """:class:`UsageError` naming the extra to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            "--plot needs matplotlib, an optional dependency: "
            "pip install 'mmadmit-client[plot]' (or 'mmadmit[plot]' with the service)"
        ) from exc


def plot_figure(report: BenchReport) -> Any:
    """The plot's matplotlib figure (the caller closes it): the latency histogram, the
    throughput over time and the outcomes by code, under the run's status in its
    colour (:meth:`BenchReport.status`)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    lat = report.latencies_ms()
    fig, (ax_lat, ax_tp, ax_out) = plt.subplots(
        1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [4, 4, 3]}
    )
    try:
        if lat.size:
            ax_lat.hist(lat, bins=int(min(60, max(10, lat.size // 10))), color="#4477aa")
            for q, style in ((50, "-"), (99, "--")):
                value = float(np.percentile(lat, q))
                ax_lat.axvline(
                    value, color="#cc3311", linestyle=style, label=f"p{q} {value:.2f} ms"
                )
            ax_lat.legend()
        ax_lat.set_xlabel("latency (ms)")
        ax_lat.set_ylabel("requests")
        ax_lat.set_title("latency (all outcomes)")
        starts, rates = report.throughput_series()
        ax_tp.step(starts, rates, where="post", color="#228833")
        ax_tp.set_xlabel("time since start (s)")
        ax_tp.set_ylabel("outcomes / s")
        ax_tp.set_title("throughput")
        ax_tp.set_ylim(bottom=0, top=max(float(rates.max(initial=0.0)), 1.0) * 1.15)

        rows = [(code, n, STATUS_STYLES["ok" if code == MATERIALIZED else "failed"][1])
                for code, n in report.outcomes().items()]  # fmt: skip
        rows += [(f"error: {k}", n, "#777777") for k, n in sorted(report.errors.items())]
        if rows:
            labels, counts, colours = zip(*rows, strict=True)
            y = np.arange(len(rows))
            bars = ax_out.barh(y, counts, color=colours)
            ax_out.set_yticks(y, labels)
            ax_out.invert_yaxis()  # the most frequent on top
            ax_out.bar_label(bars, labels=[str(n) for n in counts], padding=2)
            ax_out.set_xlim(right=max(counts) * 1.25)
        ax_out.set_xlabel("requests")
        ax_out.set_title("outcomes by code")

        status, level = report.status()
        fig.suptitle(
            f"{describe_load(report)}\n{status}",
            color=STATUS_STYLES[level][1],
            fontweight="normal" if level == "ok" else "bold",
        )
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


def write_plot(report: BenchReport, path: str) -> None:
    """A PNG of :func:`plot_figure`."""
    fig = plot_figure(report)  # (selects the Agg backend before pyplot is imported)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
