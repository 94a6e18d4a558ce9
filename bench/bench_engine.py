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

Workloads: a 1K-token text request, and an 8K-token Qwen3.5 multimodal request
with content hashes supplied (so mmadmit materializes it inline, positions
and all). Targets (issue #11): the hop adds under 200 us to the median text
round trip; under 1.3x of the direct round trip for 8K multimodal.
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
from mmadmit.model import Request  # noqa: E402
from mmadmit.profile import load_profile  # noqa: E402

MODEL = ROOT / "tests" / "data" / "vectors" / "configs" / "qwen3_5.json"
LISTEN_RE = re.compile(r"^mmadmit engine-handshake (\S+)$")
READY_RE = re.compile(r"^mmadmit ready ")
TEXT_TARGET_US = 200.0
MM_TARGET_RATIO = 1.3


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
        profile = load_profile(str(MODEL))
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
            for r in range(args.rounds):
                order = paths if r % 2 == 0 else paths[::-1]
                for path, smg in order:
                    times = results.setdefault((name, path), [])
                    for _ in range(args.per_round):
                        serial += 1
                        frames = workload_frames(name, f"r{serial}", base)
                        times.append(await round_trip(smg, frames))
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
        f"command: python bench/bench_engine.py --rounds {args.rounds} "
        f"--per-round {args.per_round}"
    )
    print(
        f"round trips at concurrency 1, {args.rounds * args.per_round} per path and workload, "
        f"paths alternated every {args.per_round}; total {elapsed:.0f}s\n"
    )
    print("| workload | path | median us | p99 us |")
    print("|---|---|---:|---:|")
    for (name, path), times in results.items():
        us = [t * 1e6 for t in times]
        print(f"| {name} | {path} | {statistics.median(us):.0f} | {percentile(us, 0.99):.0f} |")
    print()
    print(
        "| workload | added median us | median ratio | added p99 us | p99 ratio "
        "| bare relay adds (median us) | target |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in bases:
        d = [t * 1e6 for t in results[(name, "direct")]]
        v = [t * 1e6 for t in results[(name, "via mmadmit")]]
        b = [t * 1e6 for t in results[(name, "bare relay")]]
        dm, vm = statistics.median(d), statistics.median(v)
        dp, vp = percentile(d, 0.99), percentile(v, 0.99)
        if name.startswith("text"):
            target = f"added < {TEXT_TARGET_US:.0f} us: " + (
                "met" if vm - dm < TEXT_TARGET_US else "MISSED"
            )
        else:
            target = f"ratio < {MM_TARGET_RATIO}x: " + (
                "met" if vm / dm < MM_TARGET_RATIO else "MISSED"
            )
        print(
            f"| {name} | {vm - dm:.0f} | {vm / dm:.2f}x | {vp - dp:.0f} | {vp / dp:.2f}x "
            f"| {statistics.median(b) - dm:.0f} | {target} |"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--bare-relay", metavar="SMG_HANDSHAKE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import uvloop

        return uvloop.run(main_async(args))
    except ImportError:  # pragma: no cover
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
