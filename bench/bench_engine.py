"""Engine mode's added latency: SMG -> mmadmit -> scheduler -> mmadmit -> SMG. Not a test.

    python bench/bench_engine.py [--rounds 20] [--per-round 50]

One process plays the test SMG (``tests/engine_peers.Smg``) twice: one
instance is joined by a test scheduler directly (``direct``), the other by
``mmadmit serve`` in engine mode with a second, identical test scheduler
behind it (``via mmadmit``). Both schedulers are ``tests/engine_peers.py
scheduler`` processes (they decode every request with the project's codec and
answer one ``BatchTokenIDOutSlim``). Round trips are measured at concurrency 1
from the ADD leaving SMG to its output arriving at SMG, alternating the two
paths in blocks every round so that both see the same machine.

A third path, ``bare relay``, is a diagnostic floor: a 30-line asyncio pyzmq
relay (``--bare-relay``, same handshake, no decoding, no materializing) in
place of mmadmit, with a third scheduler behind it: what one more Python
process and two more loopback hops cost on this machine before any work.

Also in the same run, in this process, in blocks every round: mmadmit's own
decode, materialize and encode of each workload request (``wire.decode_message``
with ``mmadmit serve``'s limits, the materializer as the pool's inline path runs
it, ``wire.encode_request``), over the same frames SMG sends.

Workloads: a 1K-token text request, and an 8K-token Qwen3.5 multimodal request
with content hashes supplied (so mmadmit materializes it inline, positions
and all). Bounds: text: mmadmit's median (``via mmadmit``) <= the bare relay's
median + 100 us; 8K multimodal: mmadmit's median <= the bare relay's median +
1.2 x mmadmit's own in-process decode + materialize + encode median of that
request.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import engine_peers  # noqa: E402
import workloads  # noqa: E402
from mmadmit import wire  # noqa: E402
from mmadmit.config import ServeConfig, build_config  # noqa: E402
from mmadmit.limits import Limits  # noqa: E402
from mmadmit.materializer import CPU_OPS, Materializer  # noqa: E402
from mmadmit.model import Materialized, Request  # noqa: E402
from mmadmit.profile import ModelProfile  # noqa: E402
from mmadmit.runtime import run_loop  # noqa: E402

MODEL = ROOT / "tests" / "data" / "vectors" / "configs" / "qwen3_5.json"
LISTEN_RE = re.compile(r"^mmadmit engine-handshake (\S+)$")
READY_RE = re.compile(r"^mmadmit ready ")
TEXT_BOUND_US = 100.0
MM_BOUND_FACTOR = 1.2
STAGES = ("decode", "materialize", "encode")


async def bare_relay(smg_handshake: str) -> None:
    """The diagnostic floor: SMG-facing engine + scheduler-facing SMG, frames passed as is."""
    ctx = zmq.asyncio.Context()
    down = engine_peers.Smg(ctx, "tcp://127.0.0.1:0", report=False)
    print(down.handshake, flush=True)
    ready = await down.accept()
    ident = engine_peers.identity_of(0)
    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.IDENTITY, ident)
    hs.connect(smg_handshake)
    await hs.send(engine_peers.status("HELLO"))
    import msgspec

    init = msgspec.msgpack.decode((await hs.recv_multipart())[-1])
    await hs.send(engine_peers.status("READY"))
    up_in = ctx.socket(zmq.DEALER)
    up_in.setsockopt(zmq.IDENTITY, ident)
    up_in.connect(init["addresses"]["inputs"][0])
    await up_in.send(msgspec.msgpack.encode(ready))
    up_out = ctx.socket(zmq.PUSH)
    up_out.connect(init["addresses"]["outputs"][0])

    async def requests() -> None:
        while True:
            await down.send(await up_in.recv_multipart(copy=False))

    async def outputs() -> None:
        while True:
            await up_out.send_multipart(await down.recv_output(), copy=False)

    await asyncio.gather(requests(), outputs())


def print_tables(
    results: dict[tuple[str, str], list[float]], names: Any, stages: dict[str, list[float]]
) -> None:
    """The round-trip table (median, p99 per path and workload) and the in-process
    table (decode + materialize + encode, with each stage's median)."""
    print("| workload | path | median us | p99 us |")
    print("|---|---|---:|---:|")
    for (name, path), times in results.items():
        if path == "in process":
            continue
        us = [t * 1e6 for t in times]
        print(f"| {name} | {path} | {statistics.median(us):.0f} | {percentile(us, 0.99):.0f} |")
    print()
    print(
        "| workload | in process: decode + materialize + encode, median us | p99 us "
        "| decode | materialize | encode |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        us = [t * 1e6 for t in results[(name, "in process")]]
        medians = [statistics.median(stages[f"{name}/{s}"]) * 1e6 for s in STAGES]
        print(
            f"| {name} | {statistics.median(us):.0f} | {percentile(us, 0.99):.0f} | "
            + " | ".join(f"{m:.0f}" for m in medians)
            + " |"
        )
    print()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scheduler(handshake: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "engine_peers.py"), "scheduler",
         "--handshake", handshake, "--quiet"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait_line(proc: subprocess.Popen[str], pattern: re.Pattern[str], timeout_s: float) -> str:
    assert proc.stderr is not None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"mmadmit exited {proc.poll()}")
        m = pattern.match(line.strip())
        if m:
            return line.strip()
    raise RuntimeError(f"no line {pattern.pattern}")


async def round_trip(smg: engine_peers.Smg, frames: list[Any]) -> float:
    t0 = time.perf_counter()
    await smg.send(frames)
    await smg.recv_output()
    return time.perf_counter() - t0


def workload_frames(kind: str, rid: str, base: Request) -> list[Any]:
    return [bytes([wire.MSG_ADD]), *wire.encode_request(dataclasses.replace(base, rid=rid))]


class InProcess:
    """mmadmit's own decode + materialize + encode of one ADD, as engine mode's ingest
    and the pool's inline path run them; times per stage."""

    def __init__(self, config: ServeConfig, profile: ModelProfile) -> None:
        self.materializer = Materializer(profile, config.limits)
        self.limits: Limits = config.limits
        self.stages: dict[str, list[float]] = {}

    def run(self, name: str, frames: list[bytes]) -> float:
        t0 = time.perf_counter()
        req = wire.decode_message(frames, self.limits).request
        t1 = time.perf_counter()
        assert req is not None
        outcome = self.materializer.run(req, CPU_OPS)
        t2 = time.perf_counter()
        assert isinstance(outcome, Materialized), outcome
        encoded = wire.encode_request(outcome.request)
        t3 = time.perf_counter()
        for stage, dt in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            self.stages.setdefault(f"{name}/{stage}", []).append(dt)
        # Diagnostic, not in the total: what the scheduler's decode of the materialized
        # ADD costs over its decode of the original (the bare relay forwards that one).
        out = [b"\x00", *(bytes(memoryview(f).cast("B")) for f in encoded)]
        t4 = time.perf_counter()
        wire.decode_message(out)
        t5 = time.perf_counter()
        wire.decode_message(frames)
        t6 = time.perf_counter()
        self.stages.setdefault(f"{name}/scheduler extra", []).append((t5 - t4) - (t6 - t5))
        return t3 - t0

    def frames(self, name: str, rid: str, base: Request) -> list[bytes]:
        """The ADD as it arrives off the socket: one bytes object per frame."""
        return [bytes(f) for f in workload_frames(name, rid, base)]


async def main_async(args: argparse.Namespace) -> int:
    if args.bare_relay:
        await bare_relay(args.bare_relay)
        return 0
    ctx = zmq.asyncio.Context()
    direct = engine_peers.Smg(ctx, "tcp://127.0.0.1:0", report=False)
    via = engine_peers.Smg(ctx, "tcp://127.0.0.1:0", report=False)
    bare = engine_peers.Smg(ctx, "tcp://127.0.0.1:0", report=False)
    procs: list[subprocess.Popen[Any]] = [scheduler(direct.handshake)]
    relay = subprocess.Popen(
        [sys.executable, __file__, "--bare-relay", bare.handshake],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    procs.append(relay)
    assert relay.stdout is not None
    procs.append(scheduler(relay.stdout.readline().strip()))
    mm = subprocess.Popen(
        [sys.executable, "-m", "mmadmit", "serve", "--model", str(MODEL), "--device", "cpu",
         "--grpc-listen", "off", "--zmq-listen", "off", "--metrics-listen", "off",
         "--log-outcomes", "off", "--log-level", "warning",
         "--smg-handshake", via.handshake, "--engine-handshake-listen", "tcp://127.0.0.1:0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs.append(mm)
    started = time.monotonic()
    try:
        listen = LISTEN_RE.match(wait_line(mm, LISTEN_RE, 60))
        assert listen is not None
        procs.append(scheduler(listen.group(1)))
        await asyncio.wait_for(direct.accept(), 60)
        await asyncio.wait_for(via.accept(), 60)
        await asyncio.wait_for(bare.accept(), 60)
        await asyncio.to_thread(wait_line, mm, READY_RE, 60)
        config = build_config({"model": str(MODEL), "device": "cpu"}, environ={})
        profile = config.load_profile()
        inproc = InProcess(config, profile)
        bases = {
            "text 1K tokens": Request(
                rid="t",
                input_ids=workloads.build_request(profile, 1024, media_fraction=0).input_ids,
            ),
            "multimodal 8K tokens, hashes": workloads.build_request(profile, 8192, seed=5),
        }
        results: dict[tuple[str, str], list[float]] = {}
        serial = 0
        for name, base in bases.items():
            paths = (("direct", direct), ("bare relay", bare), ("via mmadmit", via))
            for _path, smg in paths:  # warm-up
                for _ in range(20):
                    serial += 1
                    await round_trip(smg, workload_frames(name, f"w{serial}", base))
            for _ in range(20):
                serial += 1
                inproc.run(name, inproc.frames(name, f"w{serial}", base))
            for stage in (*STAGES, "scheduler extra"):
                inproc.stages.pop(f"{name}/{stage}", None)  # warm-up runs are not counted
            for r in range(args.rounds):
                order = paths if r % 2 == 0 else paths[::-1]
                for path, smg in order:
                    times = results.setdefault((name, path), [])
                    for _ in range(args.per_round):
                        serial += 1
                        frames = workload_frames(name, f"r{serial}", base)
                        times.append(await round_trip(smg, frames))
                times = results.setdefault((name, "in process"), [])
                batch = []
                for _ in range(args.per_round):
                    serial += 1
                    batch.append(inproc.frames(name, f"r{serial}", base))
                for frames in batch:
                    times.append(inproc.run(name, frames))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        direct.close()
        via.close()
        bare.close()
        ctx.term()
    elapsed = time.monotonic() - started
    print(
        f"command: python bench/bench_engine.py --rounds {args.rounds} --per-round {args.per_round}"
    )
    print(
        f"round trips at concurrency 1, {args.rounds * args.per_round} per path and workload, "
        f"paths alternated every {args.per_round}; total {elapsed:.0f}s\n"
    )
    print_tables(results, bases, inproc.stages)
    print(
        "| workload | added median us | median ratio | added p99 us | p99 ratio "
        "| bare relay adds (median us) | via - bare relay (median us) | bound |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in bases:
        d = [t * 1e6 for t in results[(name, "direct")]]
        v = [t * 1e6 for t in results[(name, "via mmadmit")]]
        b = [t * 1e6 for t in results[(name, "bare relay")]]
        dm, vm = statistics.median(d), statistics.median(v)
        dp, vp = percentile(d, 0.99), percentile(v, 0.99)
        bm = statistics.median(b)
        if name.startswith("text"):
            allowed = TEXT_BOUND_US
            rule = f"via <= bare + {TEXT_BOUND_US:.0f} us"
        else:
            own = statistics.median(results[(name, "in process")]) * 1e6
            allowed = MM_BOUND_FACTOR * own
            rule = f"via <= bare + {MM_BOUND_FACTOR} x in process ({own:.0f} us)"
        bound = f"{rule} = {bm + allowed:.0f} us: " + ("met" if vm <= bm + allowed else "MISSED")
        print(
            f"| {name} | {vm - dm:.0f} | {vm / dm:.2f}x | {vp - dp:.0f} | {vp / dp:.2f}x "
            f"| {bm - dm:.0f} | {vm - bm:.0f} | {bound} |"
        )
    print()
    print(
        "Diagnostic: the scheduler's decode of the materialized ADD (unpadded ids, "
        "positions, pad values: what WIRE.md requires) over its decode of the original "
        "that the bare relay forwards, median us, in process:"
    )
    print("| workload | scheduler's extra decode us | via - bare - that extra us |")
    print("|---|---:|---:|")
    for name in bases:
        extra = statistics.median(inproc.stages[f"{name}/scheduler extra"]) * 1e6
        vb = statistics.median(results[(name, "via mmadmit")]) - statistics.median(
            results[(name, "bare relay")]
        )
        print(f"| {name} | {extra:.0f} | {vb * 1e6 - extra:.0f} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--bare-relay", metavar="SMG_HANDSHAKE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return run_loop(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
