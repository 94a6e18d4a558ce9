"""gRPC admission benchmark (issue 4). Not a test.

    python bench/bench_grpc.py [--seconds 8] [--callers 8] [--window 16] [--model qwen2_5_vl]

Workload: 1K-token requests with one image (grid [1, 32, 32] -> 256
placeholders after the 2x2 merge), a bfloat16 feature [1024, 1176] inline
(2.4 MB) and a supplied content hash, i.e. a typical SMG frontend request.

The server runs in a subprocess (the real ``GrpcServer`` over a real
``MaterializerPool`` built from the ``mmadmit serve`` defaults, uvloop when
installed), the load generator here. On the
same server, through ``extra_handlers``, a trivial echo service takes the very
same request bytes without parsing them and answers a fixed reply as large
as the real ``AdmitResponse`` (the strictest baseline: identical bytes in both
directions, no protobuf, no materialization). Four modes, measured in the same
run, one after the other:

* ``Admit``: ``--callers`` concurrent unary callers;
* ``echo (unary)``: the same, to ``/mmadmit.bench.Echo/Echo``;
* ``AdmitStream``: one stream, ``--window`` requests outstanding;
* ``echo (stream)``: the same, to ``/mmadmit.bench.Echo/EchoStream``.

The modes alternate in ``--rounds`` short rounds, so a drift in background
load (a shared CI box) hits them alike and the ratios stay comparable.

Client-side costs are kept equal and small: requests are pre-serialized bytes
(identity serializers), each one the shared body plus its own ``request_id``
field appended (protobuf allows fields in any order). Prints a markdown table
of admissions/s and median / p99 latency, plus the Admit/echo ratios
(target: AdmitStream >= 60% of echo). Beside them, the server process's CPU
(user + system, ``/proc``) a request in each mode, and what Admit and
AdmitStream cost beyond their echo: steadier than the rates on a shared
machine, since a busy neighbour slows the server without adding to its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from mmadmit_client.proto import admission_pb2 as pb

ECHO_SERVICE = "mmadmit.bench.Echo"
ADMIT = "/mmadmit.v1.Admission/Admit"
ADMIT_STREAM = "/mmadmit.v1.Admission/AdmitStream"
ECHO = f"/{ECHO_SERVICE}/Echo"
ECHO_STREAM = f"/{ECHO_SERVICE}/EchoStream"
MESSAGE_LIMIT = 64 << 20


# --------------------------------------------------------------------------- workload


def workload(model: str) -> tuple[bytes, int]:
    """The request body without its request_id, and the size of its real AdmitResponse."""
    from mmadmit.materializer import Materializer
    from mmadmit.profile import load_profile
    from mmadmit.servicer import encode_response, request_from_proto
    from mmadmit_client import Item, Request, Tensor, grid, request_to_proto

    profile = load_profile(model)
    assert profile.image_token_id is not None
    rng = np.random.default_rng(0)
    n, start, run = 1024, 100, 256
    ids = rng.integers(0, 100_000, n, dtype=np.int64)
    ids[start : start + run] = profile.image_token_id
    if profile.vision_start_token_id is not None:
        ids[start - 1] = profile.vision_start_token_id
    feature = rng.integers(0, 2**16, (1024, 1176), dtype=np.uint16)  # bfloat16 bits
    item = Item.with_placeholders(
        "image",
        [(start, run)],
        feature=Tensor.from_numpy(feature, "bfloat16"),
        hash=0x0123456789ABCDEF,
        side={"image_grid_thw": grid([1, 32, 32])},
    )
    body = request_to_proto(Request("", ids, [item])).SerializeToString()
    # The size of the real answer, for the echo's reply (computed in-process, once).
    msg = pb.AdmitRequest.FromString(body + _rid_field("probe"))
    outcome = Materializer(profile).run(request_from_proto(msg, profile))
    resp = encode_response("probe", outcome, echo_features=False)
    assert pb.AdmitResponse.FromString(resp).WhichOneof("outcome") == "materialized"
    return body, len(resp)


def _varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _rid_field(rid: str) -> bytes:
    raw = rid.encode()
    return b"\x0a" + _varint(len(raw)) + raw  # field 1, length-delimited


# --------------------------------------------------------------------------- server process


async def serve(model: str, reply_bytes: int, workers: int) -> None:
    from mmadmit.config import build_config
    from mmadmit.grpc_server import GrpcServer
    from mmadmit.server import build_pool
    from mmadmit.telemetry import Telemetry

    reply = b"\x0a" + _varint(reply_bytes) + b"\x00" * reply_bytes  # any bytes of that size

    async def echo(request: bytes, context: Any) -> bytes:
        return reply

    async def echo_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield reply

    echo_handler = grpc.method_handlers_generic_handler(
        ECHO_SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream),
        },
    )
    # the `mmadmit serve` defaults (inline runs included); MMADMIT_* variables apply
    config = build_config({"model": model, "device": "cpu", "workers": workers})
    profile = config.load_profile()
    telemetry = Telemetry(profile.family.value)  # metrics as `mmadmit serve` keeps them
    pool = build_pool(config, profile, telemetry=telemetry)
    server = GrpcServer(
        pool,
        profile,
        listen="127.0.0.1:0",
        max_message_bytes=MESSAGE_LIMIT,
        extra_handlers=[echo_handler],
        telemetry=telemetry,
    )
    address = await server.start()
    await server.set_serving()
    print(f"READY {address}", flush=True)
    loop = asyncio.get_running_loop()
    # Run until the parent closes our stdin.
    await loop.run_in_executor(None, sys.stdin.read)
    await server.stop(0)
    pool.close()


# --------------------------------------------------------------------------- load generator


@dataclass
class Result:
    name: str
    count: int
    seconds: float
    latencies_s: list[float]
    round_rates: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0  # the server process's CPU (user + system) in these runs

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    def pct_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1e3


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc``; 0 elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: state is first
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _leading_rid(resp: bytes) -> bytes:
    assert resp[0] == 0x0A, "AdmitResponse.request_id is serialized first"
    length, pos, shift = 0, 1, 0
    while True:
        b = resp[pos]
        length |= (b & 0x7F) << shift
        pos += 1
        shift += 7
        if b < 0x80:
            return resp[pos : pos + length]


def _check(resp: bytes) -> None:
    msg = pb.AdmitResponse.FromString(resp)
    if msg.WhichOneof("outcome") != "materialized":
        raise SystemExit(f"benchmark request was not materialized: {msg.abort}")


async def unary_load(
    channel: grpc.aio.Channel,
    method: str,
    body: bytes,
    callers: int,
    seconds: float,
    check: Callable[[bytes], None] | None,
) -> Result:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    latencies: list[float] = []
    counter = iter(range(1 << 62))
    deadline = time.perf_counter() + seconds

    async def caller() -> None:
        while time.perf_counter() < deadline:
            data = body + _rid_field(f"u{next(counter)}")
            t0 = time.perf_counter()
            resp = await call(data)
            latencies.append(time.perf_counter() - t0)
            if check is not None and len(latencies) % 64 == 1:
                check(resp)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return Result(method, len(latencies), time.perf_counter() - t0, latencies)


async def stream_load(
    channel: grpc.aio.Channel,
    method: str,
    body: bytes,
    window: int,
    seconds: float,
    check: Callable[[bytes], None] | None,
) -> Result:
    call_factory = channel.stream_stream(
        method, request_serializer=None, response_deserializer=None
    )
    slots = asyncio.Semaphore(window)
    sent: dict[bytes, float] = {}
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    in_order: list[bytes] = []

    async def requests() -> AsyncIterator[bytes]:
        k = 0
        while time.perf_counter() < deadline:
            await slots.acquire()
            rid = f"s{k}".encode()
            k += 1
            sent[rid] = time.perf_counter()
            in_order.append(rid)
            yield body + _rid_field(rid.decode())

    t0 = time.perf_counter()
    got = 0
    async for resp in call_factory(requests()):
        now = time.perf_counter()
        # AdmitStream answers out of order: its request_id (field 1, serialized first)
        # names the request; the echo answers in order.
        rid = _leading_rid(resp) if check is not None else in_order[got]
        latencies.append(now - sent.pop(rid))
        got += 1
        if check is not None and got % 64 == 1:
            check(resp)
        slots.release()
    return Result(method, got, time.perf_counter() - t0, latencies)


async def drive(address: str, pid: int, body: bytes, args: argparse.Namespace) -> list[Result]:
    options = [
        ("grpc.max_receive_message_length", MESSAGE_LIMIT),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        plan = [
            ("Admit", lambda s: unary_load(channel, ADMIT, body, args.callers, s, _check)),
            ("echo (unary)", lambda s: unary_load(channel, ECHO, body, args.callers, s, None)),
            (
                "AdmitStream",
                lambda s: stream_load(channel, ADMIT_STREAM, body, args.window, s, _check),
            ),
            (
                "echo (stream)",
                lambda s: stream_load(channel, ECHO_STREAM, body, args.window, s, None),
            ),
        ]
        for _, run in plan:
            await run(args.warmup)  # warm every path (connections, allocator, caches)
        # Modes alternate in short rounds, so a change in background load over the
        # run hits all of them alike and the ratios stay comparable.
        totals = {name: Result(name, 0, 0.0, []) for name, _ in plan}
        for k in range(args.rounds):
            for name, run in plan:
                cpu0 = server_cpu_s(pid)
                part = await run(args.seconds / args.rounds)
                total = totals[name]
                total.server_cpu_s += server_cpu_s(pid) - cpu0
                total.count += part.count
                total.seconds += part.seconds
                total.latencies_s.extend(part.latencies_s)
                total.round_rates.append(part.rate)
            print(
                f"  round {k + 1}/{args.rounds}: "
                + ", ".join(f"{n} {t.rate:.0f}/s" for n, t in totals.items()),
                file=sys.stderr,
                flush=True,
            )
        results = list(totals.values())
    return results


def report(results: list[Result], args: argparse.Namespace, body: bytes, reply: int) -> None:
    by = {r.name: r for r in results}
    print(
        f"\n### gRPC admission: 1K tokens + one image (bf16 [1024, 1176] inline, "
        f"{len(body) / 1e6:.2f} MB request, {reply / 1e3:.1f} kB response), "
        f"{os.cpu_count()} CPU(s), {args.seconds:.0f} s per mode in {args.rounds} "
        "alternating rounds\n"
    )
    print("| mode | concurrency | admissions/s | median ms | p99 ms | server CPU ms a request |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        conc = (
            f"{args.callers} callers"
            if "stream" not in r.name.lower()
            else f"1 stream, window {args.window}"
        )
        cpu = r.server_cpu_s / r.count * 1e3 if r.count else 0.0
        row = f"| {r.name} | {conc} | {r.rate:.0f} | {r.pct_ms(50):.2f} | {r.pct_ms(99):.2f} |"
        print(f"{row} {cpu:.3f} |")

    def ratio(a: str, b: str) -> tuple[float, float]:
        # Overall, and the median of the per-round ratios (robust to load drifts).
        per_round = [x / y for x, y in zip(by[a].round_rates, by[b].round_rates, strict=True)]
        return by[a].rate / by[b].rate, statistics.median(per_round)

    unary, unary_med = ratio("Admit", "echo (unary)")
    stream, stream_med = ratio("AdmitStream", "echo (stream)")
    print(
        f"\nAdmit / echo (unary): {unary:.0%} (median of rounds {unary_med:.0%}); "
        f"AdmitStream / echo (stream): {stream:.0%} (median of rounds {stream_med:.0%}); "
        "target >= 60%"
    )

    def extra_ms(a: str, b: str) -> float:
        return (by[a].server_cpu_s / by[a].count - by[b].server_cpu_s / by[b].count) * 1e3

    print(
        f"server CPU a request beyond the echo's: Admit {extra_ms('Admit', 'echo (unary)'):+.3f} "
        f"ms, AdmitStream {extra_ms('AdmitStream', 'echo (stream)'):+.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2_5_vl", help="preset or config.json")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per mode")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per mode")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per mode")
    parser.add_argument("--callers", type=int, default=8, help="concurrent unary callers")
    parser.add_argument("--window", type=int, default=16, help="outstanding requests on a stream")
    parser.add_argument("--workers", type=int, default=2, help="materializer workers")
    parser.add_argument("--serve", type=int, metavar="REPLY_BYTES", help=argparse.SUPPRESS)
    args = parser.parse_args()

    from mmadmit.runtime import run_loop, tune_process

    if args.serve is not None:
        tune_process()  # as `mmadmit serve` does at start-up
        run_loop(serve(args.model, args.serve, args.workers))
        return

    body, reply = workload(args.model)
    cmd = [
        sys.executable,
        __file__,
        "--serve",
        str(reply),
        "--model",
        args.model,
        "--workers",
        str(args.workers),
    ]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"server did not start: {line!r}")
        address = line.split()[1]
        print(f"server on {address} (pid {proc.pid})", file=sys.stderr)
        try:
            results = run_loop(drive(address, proc.pid, body, args))
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
    report(results, args, body, reply)


if __name__ == "__main__":
    main()
