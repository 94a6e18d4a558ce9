"""Materializer pool scaling benchmark (issue 5). Not a test.

    python bench/bench_pool.py [--rounds 5] [--requests 24] [--callers 4] [--only share]

What it measures: admissions per second of one ``mmadmit serve`` process with
``--workers 1`` and with ``--workers 2`` (CPU), both started here as
subprocesses and measured in the same run, as a ratio to the single worker.

Workload: Qwen3.5 requests of 8K and 32K tokens (``bench/workloads.py``: images
and 4-frame videos, 22-23 items) whose float16 features carry *no* content hash,
so the service hashes every feature (BLAKE2b): 512 KiB per item at 8K (about
11.5 MB per request), 1 MiB per item at 32K (about 24 MB). Hashing dominates the
work; ``hashlib`` releases the GIL on buffers over 2 KiB, so two worker threads
hash in parallel.

Each measurement sends ``--requests`` requests, half over ZMQ (the client
library's ``ZmqTransport``, raw frames sharing the feature buffers) and half
over gRPC (``Admit`` on a raw channel with pre-serialized bytes, so the client
does not spend its CPU serializing 24 MB messages), with ``--callers``
concurrent callers per transport, and times the first send to the last outcome.
Worker counts and sizes alternate within each round (so a drift in background
load hits them alike); the table shows medians over ``--rounds``.

Two references put the ratio in context: what bare ``hashlib.blake2b`` does in
this process on one and on two threads (the ceiling of the scaling on this
machine), and the pool alone (a ``MaterializerPool`` in this process, the same
requests submitted directly, no transport). The table also gives the CPU cores
the server process and the load generator used: the load generator, the
server's event loop, libzmq's and gRPC's I/O threads and the kernel's loopback
copies share the machine's cores with the workers, so on a 2-core box the
mixed-transport ratio stays well below the pool's own.

``--only share`` (issue 35 item 8): one request's hashing shared with the idle
workers, in process, at concurrency 1. A ``MaterializerPool`` with 2 workers
materializes Qwen3-Omni 32K requests (``workloads.mixed_hash_request``: 22
items, 17 of them to hash, of 8 to 256 KiB each; 37 KiB is issue 35's), on
the event loop and on a worker, with an idle
gap of 3 ms before each (as a server sees between requests from one caller)
and back to back. Three ways, rotated per round: ``alone`` (no sharing: the
baseline), ``unsteered`` (shared, the helpers placed by the OS scheduler) and
``steered`` (shared, the other workers kept off the requester's CPU for the
share: the pool's way); the shared ways share every size, whatever the pool's
thresholds (``SHARE_MIN_ITEM_BYTES``, ``SHARE_MIN_BYTES``), so that the table
shows where sharing starts to pay. Medians of the per-request times, and their ratio to
``alone``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from mmadmit import wire  # noqa: E402
from mmadmit.model import Request  # noqa: E402
from mmadmit_client import Aborted, Client, ZmqTransport  # noqa: E402
from mmadmit_client.proto import admission_pb2 as pb  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "tests" / "data" / "vectors" / "configs" / "qwen3_5.json"
READY_RE = re.compile(r"^mmadmit ready grpc=(\S+) zmq=(\S+) metrics=(\S+)$")
ADMIT = "/mmadmit.v1.Admission/Admit"
MESSAGE_LIMIT = 1 << 30
SIZES = {8192: 512 << 10, 32768: 1 << 20}  # tokens -> feature bytes per item


# --------------------------------------------------------------------------- servers


@dataclasses.dataclass
class Server:
    workers: int
    proc: subprocess.Popen[str]
    grpc: str
    zmq: str


@contextmanager
def server(model: str, workers: int) -> Iterator[Server]:
    cmd = [
        sys.executable, "-m", "mmadmit", "serve", "--model", model, "--device", "cpu",
        "--workers", str(workers), "--max-inflight", "64", "--log-level", "warning",
        "--grpc-listen", "127.0.0.1:0", "--zmq-listen", "tcp://127.0.0.1:0",
        "--metrics-listen", "off",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            m = READY_RE.match(line.strip())
            if m:
                break
        else:
            raise SystemExit(f"server ({workers} workers) did not start:\n{''.join(lines)}")
        # keep draining stderr so the child never blocks on a full pipe
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield Server(workers, proc, m.group(1), m.group(2))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- requests


def _varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if not x:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def _rid_field(rid: str) -> bytes:
    raw = rid.encode()
    return b"\x0a" + _varint(len(raw)) + raw  # AdmitRequest.request_id (field 1)


def grpc_body(req: Request) -> bytes:
    """The request as ``AdmitRequest`` bytes without a request_id (appended per call)."""
    return workloads.admit_request(req, "").SerializeToString()  # type: ignore[no-any-return]


@dataclasses.dataclass
class Workload:
    tokens: int
    request: Request
    grpc_body: bytes
    feature_bytes: int  # per request: what the service hashes


def make_workload(model: str, tokens: int) -> Workload:
    profile = workloads.profile_for(model)
    req = workloads.build_request(
        profile, tokens, seed=tokens, with_hash=False, feature_bytes=SIZES[tokens]
    )
    assert req.mm is not None
    nbytes = sum(it.feature.nbytes for it in req.mm.items if it.feature is not None)
    return Workload(tokens, req, grpc_body(req), nbytes)


# --------------------------------------------------------------------------- load


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Sample:
    rate: float  # admissions per second
    server_cores: float  # CPU seconds of the server process per wall second
    client_cores: float  # the same for this (load generator) process


async def run_load(srv: Server, wl: Workload, n: int, callers: int, tag: str) -> Sample:
    """``n`` requests (n/2 per transport), timed from the first send to the last outcome."""
    n_zmq = n // 2
    n_grpc = n - n_zmq
    zmq_frames = [
        [
            bytes([wire.MSG_ADD]),
            *wire.encode_request(dataclasses.replace(wl.request, rid=f"{tag}z{i}")),
        ]
        for i in range(n_zmq)
    ]
    grpc_bodies = [wl.grpc_body + _rid_field(f"{tag}g{i}") for i in range(n_grpc)]
    options = [
        ("grpc.max_receive_message_length", MESSAGE_LIMIT),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ]
    async with (
        grpc.aio.insecure_channel(srv.grpc, options=options) as channel,
        Client(ZmqTransport(srv.zmq, timeout_s=120)) as zmq_client,
    ):
        zc = zmq_client.transport
        assert isinstance(zc, ZmqTransport)
        admit = channel.unary_unary(
            ADMIT, request_serializer=None, response_deserializer=pb.AdmitResponse.FromString
        )
        await channel.channel_ready()

        async def zmq_caller(k: int) -> None:
            for frames in zmq_frames[k::callers]:
                out = await zc.admit_frames(frames)
                if isinstance(out, Aborted):
                    raise SystemExit(f"ZMQ request aborted: {out.code}: {out.message}")

        async def grpc_caller(k: int) -> None:
            for body in grpc_bodies[k::callers]:
                resp = await admit(body, timeout=120)
                if resp.WhichOneof("outcome") != "materialized":
                    raise SystemExit(f"gRPC request aborted: {resp.abort}")

        cpu0, own0 = cpu_seconds(srv.proc.pid), time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(
            *(zmq_caller(k) for k in range(callers)), *(grpc_caller(k) for k in range(callers))
        )
        wall = time.perf_counter() - t0
        return Sample(
            n / wall,
            (cpu_seconds(srv.proc.pid) - cpu0) / wall,
            (time.process_time() - own0) / wall,
        )


# --------------------------------------------------------------------------- reference


async def run_pool_only(model: str, wl: Workload, workers: int, n: int, rounds: int) -> float:
    """Median admissions/s of a bare ``MaterializerPool`` in this process: the same
    requests submitted directly, no transport, no second process."""
    from mmadmit.materializer import Materializer
    from mmadmit.pool import MaterializerPool

    pool = MaterializerPool(
        Materializer(workloads.profile_for(model)), workers=workers, max_inflight=n
    )
    try:
        reqs = [dataclasses.replace(wl.request, rid=f"p{i}") for i in range(n)]
        await pool.materialize(reqs[0])  # threads started, pages touched
        rates = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await asyncio.gather(*(pool.materialize(r) for r in reqs))
            rates.append(n / (time.perf_counter() - t0))
        return statistics.median(rates)
    finally:
        pool.close()


def hash_ceiling(total_mb: int = 256, chunk_mb: int = 1) -> tuple[float, float]:
    """MB/s of bare blake2b in this process on one and on two threads (best of 3)."""
    buf = np.zeros(chunk_mb << 20, np.uint8)
    count = total_mb // chunk_mb

    def work(k: int) -> None:
        for _ in range(k):
            hashlib.blake2b(memoryview(buf), digest_size=8).digest()

    one = two = 0.0
    with ThreadPoolExecutor(2) as ex:
        for _ in range(3):  # best of 3: a short burst of background load skews one trial
            t0 = time.perf_counter()
            work(count)
            one = max(one, total_mb / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            list(ex.map(work, [count // 2, count // 2]))
            two = max(two, total_mb / (time.perf_counter() - t0))
    return one, two


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# --------------------------------------------------------------------------- share

SHARE_WAYS = ("alone", "unsteered", "steered")
SHARE_ITEM_KIB = (8, 16, 37, 64, 256)


async def _share_times(
    pool_mod: Any, pool: Any, req: Request, way: str, n: int, gap_s: float, saved: dict[str, Any]
) -> list[float]:
    """``n`` timed materializations of ``req`` by ``pool``, sharing as ``way`` says."""
    for name, value in saved.items():
        setattr(pool_mod, name, value)
    if way == "alone":
        pool_mod.SHARE_MIN_BYTES = 1 << 62
    else:  # every size shared, so that the table shows where the pool's thresholds sit
        pool_mod.SHARE_MIN_BYTES, pool_mod.SHARE_MIN_ITEM_BYTES = 0, 1
        if way == "unsteered":
            pool_mod._this_cpu = None
    times = []
    for _ in range(n):
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        outcome = await pool.materialize(req)
        times.append(time.perf_counter() - t0)
        assert type(outcome).__name__ == "Materialized", outcome
    return times


def run_share(rounds: int, per_round: int = 40) -> None:
    from mmadmit import pool as pool_mod
    from mmadmit.materializer import Materializer

    saved = {
        name: getattr(pool_mod, name)
        for name in ("SHARE_MIN_BYTES", "SHARE_MIN_ITEM_BYTES", "_this_cpu")
    }
    profile = workloads.profile_for(workloads.MIXED_FAMILY)
    reqs = {kib: workloads.mixed_hash_request(feature_bytes=kib * 1024) for kib in SHARE_ITEM_KIB}
    where = {"loop": 1 << 20, "worker": 0}  # inline_max_tokens: on the loop / never
    cells: dict[tuple[int, str, float, str], list[float]] = {}

    async def measure() -> None:
        for place, inline_tokens in where.items():
            pool = pool_mod.MaterializerPool(
                Materializer(profile),
                workers=2,
                inline_max_tokens=inline_tokens,
                inline_max_us=1e9,  # on the loop: whatever its estimate
            )
            try:
                for r in range(rounds):
                    for kib, req in reqs.items():
                        for gap in (0.003, 0.0):
                            ways = SHARE_WAYS[r % 3 :] + SHARE_WAYS[: r % 3]
                            for way in ways:
                                await _share_times(pool_mod, pool, req, way, 3, gap, saved)
                                cells.setdefault((kib, place, gap, way), []).extend(
                                    await _share_times(
                                        pool_mod, pool, req, way, per_round, gap, saved
                                    )
                                )
            finally:
                pool.close()
                for name, value in saved.items():
                    setattr(pool_mod, name, value)

    asyncio.run(measure())
    print(
        f"one request's hashing shared with the idle workers: a pool of 2 workers in process, "
        f"{rounds} rounds x {per_round} requests per cell, ways rotated per round; "
        f"{pool_mod._CPUS} CPUs, steering {'on' if saved['_this_cpu'] else 'unavailable'}; "
        f"the pool shares from {saved['SHARE_MIN_BYTES'] >> 10} KiB in items of at least "
        f"{saved['SHARE_MIN_ITEM_BYTES'] >> 10} KiB"
    )
    print()
    print(
        "| items to hash | runs on | gap before each | alone us | unsteered us | steered us "
        "| unsteered / alone | steered / alone |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for kib in SHARE_ITEM_KIB:
        for place in where:
            for gap in (0.003, 0.0):
                med = {
                    way: statistics.median(cells[(kib, place, gap, way)]) * 1e6
                    for way in SHARE_WAYS
                }
                print(
                    f"| 17 x {kib} KiB | {place} | {gap * 1e3:.0f} ms | {med['alone']:.0f} "
                    f"| {med['unsteered']:.0f} | {med['steered']:.0f} "
                    f"| {med['unsteered'] / med['alone']:.2f} "
                    f"| {med['steered'] / med['alone']:.2f} |"
                )


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=str(DEFAULT_MODEL),
        help="Qwen3.5 profile (a config.json path or a preset name)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=24, help="per measurement")
    parser.add_argument("--callers", type=int, default=4, help="concurrent callers per transport")
    parser.add_argument(
        "--only",
        choices=["share"],
        help="share: one request's hashing shared with the idle workers, in process",
    )
    args = parser.parse_args()
    if args.only == "share":
        run_share(args.rounds)
        return

    t_start = time.perf_counter()
    print(
        f"machine: {os.cpu_count()} CPU cores ({cpu_model()}), Python "
        f"{platform.python_version()}, {platform.system()} {platform.release()}"
    )
    one, two = hash_ceiling()
    print(
        f"bare blake2b here: {one:.0f} MB/s on 1 thread, {two:.0f} MB/s on 2 threads "
        f"({two / one:.2f}x; hashlib releases the GIL on buffers > 2 KiB)"
    )
    if two / one < 1.3:
        print(
            "WARNING: two hashing threads do not get two cores here: the machine is busy, "
            "the worker ratios below are not meaningful"
        )
    wls = {tokens: make_workload(args.model, tokens) for tokens in SIZES}
    samples: dict[tuple[int, int], list[Sample]] = {}

    with ExitStack() as stack:
        servers = {w: stack.enter_context(server(args.model, w)) for w in (1, 2)}

        async def measure() -> None:
            for tokens, wl in wls.items():  # warm-up: first connections, page faults
                for w, srv in servers.items():
                    await run_load(srv, wl, 4, 2, f"warm{tokens}-{w}-")
            for r in range(args.rounds):
                for tokens, wl in wls.items():
                    order = (1, 2) if r % 2 == 0 else (2, 1)
                    for w in order:
                        sample = await run_load(
                            servers[w], wl, args.requests, args.callers, f"r{r}-{tokens}-{w}-"
                        )
                        samples.setdefault((tokens, w), []).append(sample)

        asyncio.run(measure())

    pool_only = {
        (tokens, w): asyncio.run(run_pool_only(args.model, wl, w, args.requests, args.rounds))
        for tokens, wl in wls.items()
        for w in (1, 2)
    }

    print()
    print(
        f"{args.requests} requests per measurement (half ZMQ, half gRPC, {args.callers} "
        f"callers per transport), median of {args.rounds} rounds:"
    )
    print()
    print(
        "| request | features hashed per request | workers | admissions/s | feature MB/s "
        "| vs 1 worker | server CPU cores | load-generator CPU cores |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tokens, wl in wls.items():
        base = statistics.median(x.rate for x in samples[(tokens, 1)])
        for w in (1, 2):
            runs = samples[(tokens, w)]
            med = statistics.median(x.rate for x in runs)
            server_cores = statistics.median(x.server_cores for x in runs)
            client_cores = statistics.median(x.client_cores for x in runs)
            mb = wl.feature_bytes / 1e6
            print(
                f"| Qwen3.5 {tokens // 1024}K tokens, {len(wl.request.mm.items)} items "
                f"| {mb:.1f} MB | {w} | {med:.1f} | {med * mb:.0f} | {med / base:.2f}x "
                f"| {server_cores:.2f} | {client_cores:.2f} |"
            )
    print()
    print("Reference, the pool alone (same requests submitted in process, no transport):")
    print()
    print("| request | workers | admissions/s | feature MB/s | vs 1 worker |")
    print("|---|---|---|---|---|")
    for tokens, wl in wls.items():
        for w in (1, 2):
            rate = pool_only[(tokens, w)]
            mb = wl.feature_bytes / 1e6
            print(
                f"| Qwen3.5 {tokens // 1024}K tokens | {w} | {rate:.1f} | {rate * mb:.0f} "
                f"| {rate / pool_only[(tokens, 1)]:.2f}x |"
            )
    one, two = hash_ceiling()
    print()
    print(
        f"bare blake2b again at the end: {one:.0f} MB/s on 1 thread, {two:.0f} MB/s on 2 "
        f"threads ({two / one:.2f}x)"
    )
    print(f"(bench ran {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
