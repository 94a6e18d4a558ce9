"""The SMG gRPC face's added latency: Generate -> mmadmit -> scheduler -> mmadmit. Not a test.

    python bench/bench_smg_grpc.py [--rounds 50] [--per-round 100]

The client here plays SMG on the gRPC transport (docs/spec/SMG_GRPC.md): one
``grpc.aio`` channel per path and ``smg_grpc_proto``'s generated
``TokenSpeedScheduler`` contract. A round trip is one non-stream ``Generate``,
from the call leaving the client until its ``GenerateComplete`` arrives,
measured at concurrency 1; the paths alternate in blocks every round, so that
both see the same machine. Two paths, each with its own test scheduler
process (``tests/engine_peers.py scheduler``: it decodes every ADD with the
project's codec and answers one ``BatchTokenIDOutSlim``) behind it:

* ``bare relay``: this script in a hidden mode (``--bare-relay``): an
  in-process ``SmgGrpcFace`` over a pool whose materializer hands the
  translated request on as it is (``Materialized(req, Rule.TEXT)``, run at
  once on the loop: no worker hop), served by a
  ``GrpcPort`` on loopback. The same decode, translation, ADD encoding,
  sockets and output routing as mmadmit's face; no materializing;
* ``via mmadmit``: ``mmadmit serve --smg-grpc-listen ... --engine-handshake-listen
  ...``, the face over the shared pool, as deployed.

Also in the same run, in this process, in blocks every round: mmadmit's own
decode + materialize + encode of each workload request (``parse_generate`` and
``request_from_generate``, the materializer as the pool's inline path runs it,
``wire.encode_request``), over the same bytes the client sends.

Workloads (model: the Qwen2.5-VL test config): a 1K-token text request, and an
8K-token Qwen2.5-VL multimodal request with content hashes supplied (so
mmadmit materializes it inline, M-RoPE positions and all), sent as SMG sends
it: placeholder runs in ``input_ids``, ``content_hash`` as 8 little-endian
bytes, ``placeholder_token_id`` set, grids as side tensors, no positions.
Requests are serialized once per request id outside the timed region (the
client's cost is the same for both paths).

Bounds: text: mmadmit's median <= the bare relay's median + 100 us; 8K
multimodal: mmadmit's median <= the bare relay's median + 1.2 x mmadmit's own
in-process decode + materialize + encode median of that request; the same
request as SMG sends it to an EPD prefill (no encoder inputs, one
``encode_bootstrap_info`` entry per item): its in-process median (mmadmit's
cost) no more than that of the request with its encoder inputs. Its round
trips are shown, not bounded: they include the test scheduler's decode of the
ADD, which takes the project codec's reference item decoder for an item whose
``encode_handshake`` is set (the compiled walk takes only nil there).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import workloads  # noqa: E402
from bench_engine import print_tables, scheduler, wait_line  # noqa: E402
from mmadmit import wire  # noqa: E402
from mmadmit.config import ServeConfig, build_config  # noqa: E402
from mmadmit.grpc_server import GrpcPort  # noqa: E402
from mmadmit.materializer import CPU_OPS, Materializer  # noqa: E402
from mmadmit.model import Materialized, Modality, Request, Rule  # noqa: E402
from mmadmit.pool import MaterializerPool  # noqa: E402
from mmadmit.profile import ModelProfile  # noqa: E402
from mmadmit.runtime import run_loop, tune_process  # noqa: E402
from mmadmit.scheduler_link import SchedulerLink  # noqa: E402
from mmadmit.smg_grpc import SERVICE, SmgGrpcFace  # noqa: E402
from mmadmit.smg_request import parse_generate, request_from_generate  # noqa: E402
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts  # noqa: E402
from smg_grpc_proto import tokenspeed_scheduler_pb2_grpc as ts_grpc  # noqa: E402

MODEL = ROOT / "tests" / "data" / "vectors" / "configs" / "qwen2_5_vl.json"
LISTEN_RE = re.compile(r"^mmadmit engine-handshake (\S+)$")
READY_RE = re.compile(r"^mmadmit ready .*smg-grpc=(\S+)")
GENERATE = f"/{SERVICE}/Generate"
MESSAGE_LIMIT = 1 << 30
TEXT_BOUND_US = 100.0
MM_BOUND_FACTOR = 1.2
WARMUP = 20
TEXT = "text 1K tokens"
MM = "Qwen2.5-VL 8K tokens, hashes"
EPD = "the same, EPD (no encoder inputs)"


def serve_config() -> ServeConfig:
    """``mmadmit serve``'s defaults for the model (limits, profile) as the bench runs it."""
    return build_config({"model": str(MODEL), "device": "cpu"}, environ={})


# --------------------------------------------------------------------------- workloads


def contiguous_videos(req: Request, profile: ModelProfile) -> Request:
    """Qwen2.5-VL lays a video out as one placeholder run (one span per grid row);
    ``workloads.build_request`` writes Qwen3.5's run per frame with timestamp text
    between. Join each video's runs at the start of its extent, text after."""
    assert req.mm is not None and profile.video_token_id is not None
    ids = req.input_ids
    for item in req.mm.items:
        if item.modality != int(Modality.VIDEO) or item.offsets is None:
            continue
        if len(item.offsets) == 1:
            continue
        start, end = int(item.offsets[0, 0]), int(item.offsets[-1, 1])
        n = int((item.offsets[:, 1] - item.offsets[:, 0] + 1).sum())
        ids[start : end + 1] = 100  # ordinary text tokens
        ids[start : start + n] = profile.video_token_id
        item.offsets = np.array([[start, start + n - 1]], np.int64)
    return req


def generate_from_request(req: Request, profile: ModelProfile) -> ts.GenerateRequest:
    """The request as SMG sends it over gRPC, with every item's hash and placeholder."""
    assert req.mm is None or all(item.hash is not None for item in req.mm.items)
    tokens = {}
    for i, item in enumerate(req.mm.items if req.mm is not None else []):
        token = profile.video_token_id if item.modality == Modality.VIDEO else None
        token = profile.image_token_id if item.modality == Modality.IMAGE else token
        assert token is not None
        tokens[i] = token
    return workloads.generate_request(req, "x", placeholders=tokens)


def build_workloads(profile: ModelProfile) -> dict[str, ts.GenerateRequest]:
    text = workloads.build_request(profile, 1024, media_fraction=0)
    mm = contiguous_videos(workloads.build_request(profile, 8192, seed=5), profile)
    with_inputs = generate_from_request(mm, profile)
    return {
        TEXT: generate_from_request(Request(rid="t", input_ids=text.input_ids), profile),
        MM: with_inputs,
        EPD: epd_from(with_inputs),
    }


def epd_from(msg: ts.GenerateRequest) -> ts.GenerateRequest:
    """``msg`` as SMG sends it to the prefill in EPD mode: every item without its
    encoder input, one ``encode_bootstrap_info`` entry per item."""
    epd = ts.GenerateRequest()
    epd.CopyFrom(msg)
    for i, item in enumerate(epd.mm_inputs.items):
        item.ClearField("encoder_input")
        epd.encode_bootstrap_info.items.add(
            item_index=i, bootstrap_host="10.0.0.9", bootstrap_port=8998, bootstrap_room=2**62 + i
        )
    return epd


def serialized(base: ts.GenerateRequest, rid: str) -> bytes:
    base.request_id = rid
    return base.SerializeToString()


# --------------------------------------------------------------------------- bare relay


class PassThrough(Materializer):
    """Materializes nothing: the translated request goes on as it is."""

    def materialize(self, req: Request, ops: Any = None, hash_many: Any = None) -> Materialized:
        return Materialized(req, Rule.TEXT)


async def bare_relay() -> None:
    """Serve the face over ``PassThrough`` on loopback; print its two addresses."""
    config = serve_config()
    profile = config.load_profile()
    # every request "materialized" at once on the loop: no worker hop, no rules
    pool = MaterializerPool(
        PassThrough(profile, config.limits), workers=1, inline_max_tokens=1 << 40
    )
    stop = asyncio.Event()
    link = SchedulerLink(
        listen="tcp://127.0.0.1:0",
        engine_index=0,
        handshake_timeout_s=60,
        on_gone=lambda why: stop.set(),
    )
    face = SmgGrpcFace(pool, profile, link, served_model_name="bare-relay", model_path="bare-relay")
    engine = await link.bind()
    port = GrpcPort(
        {SERVICE: face.handlers()},
        listen="127.0.0.1:0",
        max_message_bytes=config.max_message_bytes,
        max_streams=config.max_grpc_streams,
    )
    address = await port.start()
    print(address, flush=True)
    print(engine, flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await link.handshake()
        await face.start()
        await stop.wait()
    finally:
        await face.stop()
        await link.close()
        await port.stop(0)
        pool.close()


# --------------------------------------------------------------------------- measuring


async def wait_healthy(channel: grpc.aio.Channel, timeout_s: float) -> None:
    stub = ts_grpc.TokenSpeedSchedulerStub(channel)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            resp = await stub.HealthCheck(ts.HealthCheckRequest(), timeout=5)
            if resp.healthy:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError("the face never became healthy")


async def round_trip(generate: Any, data: bytes) -> float:
    """One non-stream Generate until its GenerateComplete; the call's end is not timed."""
    t0 = time.perf_counter()
    call = generate(data)
    while True:
        resp = await call.read()
        if resp is grpc.aio.EOF:
            raise RuntimeError(f"stream ended without GenerateComplete ({await call.details()})")
        if resp.HasField("complete"):
            break
    elapsed = time.perf_counter() - t0
    assert list(resp.complete.output_ids) == [11, 12, 13], resp
    while await call.read() is not grpc.aio.EOF:
        pass
    return elapsed


class InProcess:
    """mmadmit's own decode + materialize + encode of one request, as the face and
    the pool's inline path run them; times per stage."""

    def __init__(self, config: ServeConfig, profile: ModelProfile) -> None:
        self.profile = profile
        self.materializer = Materializer(profile, config.limits)
        self.limits = config.limits
        self.stages: dict[str, list[float]] = {}

    def run(self, name: str, data: bytes) -> float:
        t0 = time.perf_counter()
        req = request_from_generate(parse_generate(data, self.limits), self.profile, self.limits)
        t1 = time.perf_counter()
        outcome = self.materializer.run(req, CPU_OPS)
        t2 = time.perf_counter()
        assert isinstance(outcome, Materialized), outcome
        wire.encode_request(outcome.request)
        t3 = time.perf_counter()
        for stage, dt in (("decode", t1 - t0), ("materialize", t2 - t1), ("encode", t3 - t2)):
            self.stages.setdefault(f"{name}/{stage}", []).append(dt)
        return t3 - t0


async def main_async(args: argparse.Namespace) -> int:
    if args.bare_relay:
        await bare_relay()
        return 0
    print(
        f"command: python bench/bench_smg_grpc.py --rounds {args.rounds} "
        f"--per-round {args.per_round}",
        flush=True,
    )
    config = serve_config()
    profile = config.load_profile()
    bases = build_workloads(profile)
    inproc = InProcess(config, profile)
    procs: list[subprocess.Popen[Any]] = []
    channels: list[grpc.aio.Channel] = []
    started = time.monotonic()
    results: dict[tuple[str, str], list[float]] = {}
    sizes = {name: len(serialized(base, "r0")) for name, base in bases.items()}
    try:
        relay = subprocess.Popen(
            [sys.executable, __file__, "--bare-relay"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        procs.append(relay)
        assert relay.stdout is not None
        bare_address = relay.stdout.readline().strip()
        procs.append(scheduler(relay.stdout.readline().strip()))
        mm = subprocess.Popen(
            [sys.executable, "-m", "mmadmit", "serve", "--model", str(MODEL), "--device", "cpu",
             "--grpc-listen", "off", "--zmq-listen", "off", "--metrics-listen", "off",
             "--log-outcomes", "off", "--log-level", "warning",
             "--smg-grpc-listen", "127.0.0.1:0",
             "--engine-handshake-listen", "tcp://127.0.0.1:0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        procs.append(mm)
        listen = LISTEN_RE.match(wait_line(mm, LISTEN_RE, 60))
        assert listen is not None
        procs.append(scheduler(listen.group(1)))
        ready = READY_RE.match(await asyncio.to_thread(wait_line, mm, READY_RE, 60))
        assert ready is not None
        options = [
            ("grpc.max_receive_message_length", MESSAGE_LIMIT),
            ("grpc.max_send_message_length", MESSAGE_LIMIT),
        ]
        paths: list[tuple[str, Callable[[bytes], Any]]] = []
        for path, address in (("bare relay", bare_address), ("via mmadmit", ready.group(1))):
            channel = grpc.aio.insecure_channel(address, options=options)
            channels.append(channel)
            await wait_healthy(channel, 60)
            # the generated stub's Generate, with the request bytes serialized beforehand
            generate = channel.unary_stream(
                GENERATE, response_deserializer=ts.GenerateResponse.FromString
            )
            paths.append((path, generate))
        serial = 0
        for name, base in bases.items():
            for _path, generate in paths:  # warm-up
                for _ in range(WARMUP):
                    serial += 1
                    await round_trip(generate, serialized(base, f"w{serial}"))
            for _ in range(WARMUP):
                serial += 1
                inproc.run(name, serialized(base, f"w{serial}"))
            for stage in ("decode", "materialize", "encode"):
                inproc.stages.pop(f"{name}/{stage}", None)  # warm-up runs are not counted
            for r in range(args.rounds):
                order = paths if r % 2 == 0 else paths[::-1]
                for path, generate in order:
                    times = results.setdefault((name, path), [])
                    batch = []
                    for _ in range(args.per_round):
                        serial += 1
                        batch.append(serialized(base, f"r{serial}"))
                    for data in batch:
                        times.append(await round_trip(generate, data))
                times = results.setdefault((name, "in process"), [])
                batch = []
                for _ in range(args.per_round):
                    serial += 1
                    batch.append(serialized(base, f"r{serial}"))
                for data in batch:
                    times.append(inproc.run(name, data))
    finally:
        for channel in channels:
            await channel.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    elapsed = time.monotonic() - started
    n = args.rounds * args.per_round
    print(
        f"round trips at concurrency 1, {n} per path and workload, paths alternated every "
        f"{args.per_round}; in process: {n} per workload in the same blocks; total {elapsed:.0f}s"
    )
    print(
        "request sizes: "
        + ", ".join(f"{name} {size / 1024:.1f} KiB" for name, size in sizes.items())
        + "\n"
    )
    print_tables(results, bases, inproc.stages)
    print(
        "| workload | bare relay median us | via mmadmit median us | added us | bound us | bound |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name in bases:
        bm = statistics.median(results[(name, "bare relay")]) * 1e6
        vm = statistics.median(results[(name, "via mmadmit")]) * 1e6
        if name == TEXT:
            allowed = TEXT_BOUND_US
            rule = f"via <= bare + {TEXT_BOUND_US:.0f} us"
        elif name == EPD:
            # the same request without its encoder inputs costs no more than with them
            own = statistics.median(results[(name, "in process")]) * 1e6
            full = statistics.median(results[(MM, "in process")]) * 1e6
            print(
                f"| {name} | {bm:.0f} | {vm:.0f} | {vm - bm:.0f} | - "
                f"| in process {own:.0f} us <= {full:.0f} us with encoder inputs: "
                f"{'met' if own <= full else 'MISSED'} |"
            )
            continue
        else:
            own = statistics.median(results[(name, "in process")]) * 1e6
            allowed = MM_BOUND_FACTOR * own
            rule = f"via <= bare + {MM_BOUND_FACTOR} x in process ({own:.0f} us)"
        verdict = "met" if vm <= bm + allowed else "MISSED"
        print(
            f"| {name} | {bm:.0f} | {vm:.0f} | {vm - bm:.0f} | {bm + allowed:.0f} "
            f"| {rule}: {verdict} |"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--bare-relay", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tune_process()  # as mmadmit serve does; the same allocator and collector in every process
    return run_loop(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
