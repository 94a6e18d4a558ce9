#!/usr/bin/env python3
"""Load and soak: a steady mixed load on both transports, with the server's memory.

Starts ``mmadmit serve`` (Qwen3.5 profile, ``--device cpu``, ephemeral ports on
127.0.0.1; the addresses come from its ``mmadmit ready`` line) unless
``--target-grpc``/``--target-zmq``/``--pid`` name a running one. Then, for
``--duration`` seconds, ``--concurrency`` closed-loop workers per transport send
Qwen3.5 requests of several sizes (``--sizes``), some with content hashes and some
without (the service hashes those features), plus a share of invalid requests
(a span that does not match its grid on both transports; on ZMQ also a payload
whose tensor frame is 8 bytes short) and a share of cancels (ZMQ: an ABORT right
after the ADD; gRPC: the Abort RPC right after the call, or ``timeout_ms=1``).
One model family only: the server runs one profile.

Accounting per transport: ``sent`` is requests handed to the client, ``outcomes``
the outcomes that came back (materialized or aborted, by code), ``errors`` what
ended without one (exception type), ``lost = sent - outcomes``: it must be 0.

The server's resident memory (``VmRSS`` of ``/proc/PID/status``) is read at the
start, after the warm-up (``--warmup`` share of the duration), every
``--interval`` seconds and at the end; growth is end vs after-warm-up, in percent.
With each sample goes glibc's heap from the server's ``/metrics``
(``mmadmit_heap_bytes``: bytes in use, bytes held free): a leak grows the first,
allocator fragmentation only the second.

Exit status: 0 when nothing was lost, every outcome code is one the mix can cause
(``EXPECTED_CODES``: never ``INTERNAL``) and growth <= ``--max-growth``; 1 otherwise;
2 on a usage or start-up problem. Traffic goes to 127.0.0.1 only.

    .venv/bin/python scripts/soak.py --duration 300 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import workloads  # noqa: E402  (bench/ is not a package)
from mmadmit import wire  # noqa: E402
from mmadmit.model import Request  # noqa: E402
from mmadmit.profile import load_profile  # noqa: E402
from mmadmit_client import Client, ClientError, GrpcTransport, Outcome, ZmqTransport  # noqa: E402
from mmadmit_client.proto import admission_pb2 as pb  # noqa: E402

MODEL = REPO / "tests" / "data" / "vectors" / "configs" / "qwen3_5.json"
READY_RE = re.compile(r"^mmadmit ready grpc=(\S+) zmq=(\S+) metrics=(\S+)$")
EXPECTED_CODES = {
    "MATERIALIZED",
    "INVALID_REQUEST",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "OVERLOADED",
}
CALL_TIMEOUT_S = 60.0  # per request, client side: a request unanswered by then is an error


# --------------------------------------------------------------------------- the server


class Server:
    """``python -m mmadmit serve`` on ephemeral loopback ports; a thread drains stderr."""

    def __init__(self, workers: int, extra: list[str]) -> None:
        cmd = [
            sys.executable, "-m", "mmadmit", "serve",
            "--model", str(MODEL), "--device", "cpu", "--workers", str(workers),
            "--grpc-listen", "127.0.0.1:0",
            "--zmq-listen", "tcp://127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0",
            "--log-level", "warning",
            *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.addresses: dict[str, str] | None = None
        self._ready = threading.Event()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            m = READY_RE.match(line)
            if m and self.addresses is None:
                self.addresses = dict(zip(("grpc", "zmq", "metrics"), m.groups(), strict=True))
                self._ready.set()

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, str]:
        end = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > end:
                tail = "\n".join(self.lines)
                raise SystemExit(f"soak: serve not ready (rc={self.proc.poll()}):\n{tail}")
        assert self.addresses is not None
        return self.addresses

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump.join(5)
        return self.proc.returncode


def heap_kib(metrics: str | None) -> dict[str, int]:
    """``mmadmit_heap_bytes`` from ``http://METRICS/metrics`` in KiB by state ({} if none)."""
    if not metrics:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    except OSError:
        return {}
    return {
        f"heap_{s.labels['state']}_kib": int(s.value) // 1024
        for fam in text_string_to_metric_families(body)
        if fam.name == "mmadmit_heap_bytes"
        for s in fam.samples
    }


def sample(pid: int, metrics: str | None, t_s: float, label: str) -> dict[str, Any]:
    return {"t_s": round(t_s, 2), "label": label, "rss_kib": rss_kib(pid), **heap_kib(metrics)}


def growth_pct(samples: list[dict[str, Any]], key: str) -> float | None:
    """End vs after-warm-up of ``key``, in percent (None without both samples)."""
    warm = next((s.get(key) for s in samples if s["label"] == "warmup"), None)
    end = samples[-1].get(key)
    return round((end - warm) / warm * 100, 2) if warm and end else None


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- the mix


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str  # e.g. "8192-hash", "invalid-span", "cancel"
    request: Request
    zmq_only: bool = False
    truncate_aux: bool = False  # ZMQ: the last tensor frame 8 bytes short


def to_proto(req: Request, rid: str, timeout_ms: int = 0) -> pb.AdmitRequest:
    return workloads.admit_request(req, rid, timeout_ms=timeout_ms)  # type: ignore[no-any-return]


def span_mismatch(req: Request) -> Request:
    """The first item's span one token short of what its grid says."""
    out = dataclasses.replace(req, input_ids=req.input_ids.copy())
    assert out.mm is not None and out.mm.items
    items = list(out.mm.items)
    first = items[0]
    assert first.offsets is not None
    offsets = first.offsets.copy()
    offsets[0, 1] -= 1
    items[0] = msgspec.structs.replace(first, offsets=offsets)
    out.mm = dataclasses.replace(out.mm, items=items)
    return out


def build_mix(sizes: list[int], seed: int) -> dict[str, Request]:
    profile = load_profile(str(MODEL))
    mix: dict[str, Request] = {}
    for i, n in enumerate(sizes):
        mix[f"{n}-hash"] = workloads.build_request(profile, n, seed=seed + i)
        mix[f"{n}-nohash"] = workloads.build_request(profile, n, seed=seed + i, with_hash=False)
    return mix


class Picker:
    """What the next request is: invalid, cancel or valid (size x hash), by share."""

    def __init__(self, mix: dict[str, Request], invalid: float, cancel: float, seed: int) -> None:
        self.valid = sorted(mix, key=lambda k: (int(k.split("-")[0]), k))
        self.mix = mix
        self.invalid = invalid
        self.cancel = cancel
        self.rng = random.Random(seed)
        small = mix[self.valid[0]]
        self.bad_span = span_mismatch(small)

    def next(self, transport: str) -> tuple[str, Request]:
        r = self.rng.random()
        if r < self.invalid:
            if transport == "zmq" and self.rng.random() < 0.5:
                return "invalid-frame", self.mix[self.valid[0]]
            return "invalid-span", self.bad_span
        if r < self.invalid + self.cancel:
            sub = "abort" if self.rng.random() < 0.5 else "deadline"
            if transport == "zmq":
                sub = "abort"
            return f"cancel-{sub}", self.mix[self.rng.choice(self.valid)]
        return "valid", self.mix[self.rng.choice(self.valid)]

    def until(
        self, deadline: float, transport: str, prefix: str
    ) -> Iterator[tuple[str, Request, str]]:
        """The next request's kind, request and rid (``PREFIX-0``, ``PREFIX-1``, ...)
        for as long as ``deadline`` (``time.perf_counter()``) has not passed."""
        n = 0
        while time.perf_counter() < deadline:
            kind, req = self.next(transport)
            yield kind, req, f"{prefix}-{n}"
            n += 1


# --------------------------------------------------------------------------- accounting


@dataclasses.dataclass
class Tally:
    transport: str
    sent: int = 0
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    by_kind: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    elapsed_s: float = 0.0

    def record(self, code: str, started: float) -> None:
        self.latencies_ms.append((time.perf_counter() - started) * 1e3)
        self.outcomes[code] += 1

    async def send(
        self,
        kind: str,
        admit: Awaitable[Outcome],
        abort: Callable[[], Awaitable[Any]],
        abort_after_s: float,
    ) -> None:
        """One request of ``kind``, counted sent: ``admit`` runs and, for a
        ``cancel-abort``, ``abort()`` ``abort_after_s`` later (once the request is on its
        way); recorded is its outcome with its latency, or a client error by type."""
        self.sent += 1
        self.by_kind[kind] += 1
        started = time.perf_counter()
        try:
            task = asyncio.ensure_future(admit)
            if kind == "cancel-abort":
                await asyncio.sleep(abort_after_s)
                await abort()
            out = await task
        except ClientError as exc:
            self.errors[type(exc).__name__] += 1
            return
        self.record(outcome_code(out), started)

    @property
    def received(self) -> int:
        return sum(self.outcomes.values())

    def to_json(self) -> dict[str, Any]:
        lat = np.array(self.latencies_ms, dtype=np.float64)
        pct: dict[str, float | None]
        if lat.size:
            p50, p90, p99 = np.percentile(lat, [50, 90, 99]).tolist()
            pct = {
                "p50": round(p50, 2),
                "p90": round(p90, 2),
                "p99": round(p99, 2),
                "max": round(float(lat.max()), 2),
            }
        else:
            pct = {"p50": None, "p90": None, "p99": None, "max": None}
        return {
            "sent": self.sent,
            "outcomes_received": self.received,
            "lost": self.sent - self.received,
            "errors": dict(self.errors),
            "elapsed_s": round(self.elapsed_s, 2),
            "throughput_rps": round(self.received / self.elapsed_s, 2) if self.elapsed_s else 0.0,
            "latency_ms": pct,
            "outcomes": dict(sorted(self.outcomes.items(), key=lambda kv: -kv[1])),
            "sent_by_kind": dict(sorted(self.by_kind.items())),
        }


def outcome_code(out: Outcome) -> str:
    return out.code


# --------------------------------------------------------------------------- the load


async def zmq_worker(
    zc: ZmqTransport, picker: Picker, tally: Tally, deadline: float, prefix: str, w: int
) -> None:
    for kind, req, rid in picker.until(deadline, "zmq", f"{prefix}-z{w}"):
        frames: list[Any] = [
            bytes([wire.MSG_ADD]),
            *wire.encode_request(dataclasses.replace(req, rid=rid)),
        ]
        if kind == "invalid-frame":
            frames[-1] = bytes(frames[-1])[:-8]
        admit = zc.admit_frames(frames, timeout_s=CALL_TIMEOUT_S)
        # the ABORT goes out at the next turn of the loop, after the ADD
        await tally.send(kind, admit, functools.partial(zc.abort, (rid,)), 0)


async def grpc_worker(
    gc: GrpcTransport,
    bases: dict[int, pb.AdmitRequest],
    picker: Picker,
    tally: Tally,
    deadline: float,
    prefix: str,
    w: int,
) -> None:
    for kind, req, rid in picker.until(deadline, "grpc", f"{prefix}-g{w}"):
        base = bases.get(id(req))
        if base is None:
            base = bases[id(req)] = to_proto(req, "")
        msg = pb.AdmitRequest()
        msg.CopyFrom(base)
        msg.request_id = rid
        if kind == "cancel-deadline":
            msg.timeout_ms = 1
        admit = gc.admit_proto(msg, timeout_s=CALL_TIMEOUT_S)
        # the Abort RPC 1 ms after the call: the call is on its way
        await tally.send(kind, admit, functools.partial(gc.abort, (rid,), "soak cancel"), 0.001)


async def sample_rss(
    pid: int,
    metrics: str | None,
    samples: list[dict[str, Any]],
    t0: float,
    warmup_s: float,
    interval_s: float,
    end: float,
) -> None:
    """Samples at start (taken by the caller), after the warm-up, then every interval."""
    next_at = t0 + warmup_s
    label = "warmup"
    while True:
        now = time.perf_counter()
        if next_at >= end:
            return
        await asyncio.sleep(max(0.0, next_at - now))
        samples.append(
            await asyncio.to_thread(sample, pid, metrics, time.perf_counter() - t0, label)
        )
        label = "interval"
        next_at += interval_s


async def soak(args: argparse.Namespace, addr: dict[str, str], pid: int) -> dict[str, Any]:
    mix = build_mix(args.sizes, args.seed)
    prefix = f"soak-{os.getpid()}"
    tallies = {"grpc": Tally("grpc"), "zmq": Tally("zmq")}
    metrics = addr.get("metrics")
    samples: list[dict[str, Any]] = [sample(pid, metrics, 0.0, "start")]
    bases: dict[int, pb.AdmitRequest] = {}
    # Raw messages (malformed frames, timeout_ms edits) go through the transports of
    # two clients: admit_frames / admit_proto.
    async with (
        Client(GrpcTransport(addr["grpc"])) as grpc_client,
        Client(ZmqTransport(addr["zmq"], timeout_s=CALL_TIMEOUT_S)) as zmq_client,
    ):
        await zmq_client.wait_ready(10)
        gc, zc = grpc_client.transport, zmq_client.transport
        assert isinstance(gc, GrpcTransport) and isinstance(zc, ZmqTransport)
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        warmup_s = args.duration * args.warmup
        workers: list[Any] = []
        for w in range(args.concurrency):
            zp = Picker(mix, args.invalid_share, args.cancel_share, args.seed * 1000 + w)
            gp = Picker(mix, args.invalid_share, args.cancel_share, args.seed * 1000 + 500 + w)
            workers.append(zmq_worker(zc, zp, tallies["zmq"], deadline, prefix, w))
            workers.append(grpc_worker(gc, bases, gp, tallies["grpc"], deadline, prefix, w))
        sampler = asyncio.ensure_future(
            sample_rss(pid, metrics, samples, t0, warmup_s, args.interval, deadline)
        )
        progress = (
            asyncio.ensure_future(_progress(tallies, t0, deadline)) if args.progress else None
        )
        try:
            # bounded: each worker stops sending at the deadline, and each call has a timeout
            await asyncio.wait_for(asyncio.gather(*workers), args.duration + CALL_TIMEOUT_S + 30)
        finally:
            for task in (sampler, progress):
                if task is not None:
                    task.cancel()
            await asyncio.gather(sampler, *(p for p in [progress] if p), return_exceptions=True)
        elapsed = time.perf_counter() - t0
        for t in tallies.values():
            t.elapsed_s = elapsed
    await asyncio.sleep(1.0)  # let the server release what the last requests held
    samples.append(sample(pid, metrics, time.perf_counter() - t0, "end"))
    warm = next((s["rss_kib"] for s in samples if s["label"] == "warmup"), None)
    end = samples[-1]["rss_kib"]
    growth = growth_pct(samples, "rss_kib")
    report = {
        "duration_s": args.duration,
        "concurrency_per_transport": args.concurrency,
        "sizes": args.sizes,
        "invalid_share": args.invalid_share,
        "cancel_share": args.cancel_share,
        "workers": args.workers,
        "server_pid": pid,
        "transports": {k: t.to_json() for k, t in tallies.items()},
        "rss": {
            "samples": samples,
            "start_kib": samples[0]["rss_kib"],
            "after_warmup_kib": warm,
            "end_kib": end,
            "growth_after_warmup_pct": growth,
            "max_growth_pct": args.max_growth,
            "heap_in_use_growth_after_warmup_pct": growth_pct(samples, "heap_in_use_kib"),
        },
    }
    lost = sum(t["lost"] for t in report["transports"].values())
    unexpected = sorted(
        {c for t in report["transports"].values() for c in t["outcomes"]} - EXPECTED_CODES
    )
    report["lost_total"] = lost
    report["unexpected_codes"] = unexpected
    report["ok"] = lost == 0 and not unexpected and (growth is None or growth <= args.max_growth)
    return report


async def _progress(tallies: dict[str, Tally], t0: float, end: float) -> None:
    while True:
        await asyncio.sleep(5)
        el = time.perf_counter() - t0
        parts = [f"{k}: {t.received}/{t.sent}" for k, t in tallies.items()]
        print(f"soak {el:6.1f}/{end - t0:.0f}s  " + "  ".join(parts), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- output


def render(report: dict[str, Any]) -> str:
    lines = [
        f"soak: {report['duration_s']:g} s, concurrency {report['concurrency_per_transport']}"
        f" per transport, sizes {report['sizes']}, invalid {report['invalid_share']:.0%},"
        f" cancel {report['cancel_share']:.0%}",
        "",
        f"{'transport':<9} {'sent':>7} {'outcomes':>8} {'lost':>5} {'errors':>6} {'req/s':>8}"
        f" {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}",
    ]
    for name, t in report["transports"].items():
        lat = t["latency_ms"]
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(
            f"{name:<9} {t['sent']:>7} {t['outcomes_received']:>8} {t['lost']:>5}"
            f" {sum(t['errors'].values()):>6} {t['throughput_rps']:>8.1f} {fmt(lat['p50']):>8}"
            f" {fmt(lat['p90']):>8} {fmt(lat['p99']):>8} {fmt(lat['max']):>8}"
        )
    lines.append("")
    for name, t in report["transports"].items():
        codes = ", ".join(f"{c} {n}" for c, n in t["outcomes"].items())
        lines.append(f"{name} outcomes: {codes}")
        if t["errors"]:
            lines.append(f"{name} errors: {t['errors']}")
    rss = report["rss"]
    lines.append("")
    lines.append(
        "server RSS (MiB): "
        + "  ".join(
            f"{s['label']}@{s['t_s']:g}s={s['rss_kib'] / 1024:.1f}"
            for s in rss["samples"]
            if s["rss_kib"] is not None
        )
    )
    heap = [s for s in rss["samples"] if "heap_in_use_kib" in s]
    if heap:
        lines.append(
            "server heap in use / free (MiB): "
            + "  ".join(
                f"{s['label']}@{s['t_s']:g}s={s['heap_in_use_kib'] / 1024:.1f}/"
                f"{s['heap_free_kib'] / 1024:.1f}"
                for s in heap
            )
        )
    lines.append(
        f"growth after warm-up: {rss['growth_after_warmup_pct']}% (limit {rss['max_growth_pct']}%)"
        f"; heap in use: {rss['heap_in_use_growth_after_warmup_pct']}%"
    )
    lines.append(f"lost: {report['lost_total']}  unexpected codes: {report['unexpected_codes']}"
                 f"  -> {'OK' if report['ok'] else 'FAIL'}")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--concurrency", type=int, default=4, help="workers per transport")
    p.add_argument("--sizes", default="1024,8192,32768", help="prompt sizes in tokens")
    p.add_argument("--invalid-share", type=float, default=0.05)
    p.add_argument("--cancel-share", type=float, default=0.05)
    p.add_argument("--interval", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the duration")
    p.add_argument("--max-growth", type=float, default=5.0, help="RSS growth limit, percent")
    p.add_argument("--workers", type=int, default=2, help="server --workers (own server only)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    p.add_argument("--target-grpc", help="HOST:PORT of a running server")
    p.add_argument("--target-zmq", help="tcp://HOST:PORT of a running server")
    p.add_argument("--pid", type=int, help="pid of that server (for its RSS)")
    p.add_argument("--target-metrics", help="HOST:PORT of that server's /metrics (its heap)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error(f"--sizes: not a list of integers: {args.sizes!r}")
    given = [args.target_grpc, args.target_zmq, args.pid]
    if any(v is not None for v in given) and not all(v is not None for v in given):
        p.error("--target-grpc, --target-zmq and --pid go together")
    if not (0 < args.duration <= 24 * 3600) or args.concurrency < 1 or args.interval <= 0:
        p.error("--duration must be in (0, 86400], --concurrency >= 1, --interval > 0")
    if not args.sizes or min(args.sizes) < 256:
        p.error("--sizes: at least one size, each >= 256 tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server: Server | None = None
    if args.pid is None:
        server = Server(args.workers, args.serve_arg)
        addr = server.wait_ready()
        pid = server.proc.pid
    else:
        addr = {"grpc": args.target_grpc, "zmq": args.target_zmq, "metrics": args.target_metrics}
        pid = args.pid
    try:
        report = asyncio.run(soak(args, addr, pid))
    finally:
        if server is not None:
            rc = server.stop()
            if rc not in (0, None):
                print(f"soak: serve exited {rc}", file=sys.stderr)
    if server is not None:
        report["server_exit"] = server.proc.returncode
        report["server_traceback"] = any("Traceback" in line for line in server.lines)
    print(render(report))
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
