"""Test peers for engine mode: a test SMG and a test scheduler, as real processes.

    python tests/engine_peers.py smg --handshake tcp://127.0.0.1:0 [--init malformed]
    python tests/engine_peers.py scheduler --handshake tcp://127.0.0.1:PORT [--trailing N]

Both speak the engine handshake of docs/spec/WIRE.md ("Engine mode") with plain pyzmq
and report on standard output, one JSON object a line (``{"event": ...}``),
so that a test can follow them; ``time`` fields are ``time.monotonic()``
(system-wide on Linux, so comparable across processes).

* **smg** binds a handshake ROUTER, an input ROUTER and an output PULL, answers
  HELLO with INIT, waits for READY and the engine's ready response, then takes
  commands on standard input (one JSON object a line): ``send`` a vector (or a
  synthetic ``text`` / ``big`` request) under a rid, ``abort`` rids, ``quit``.
  Every output it receives is reported with the SHA-256 of its frames; the
  ``ENGINE_CORE_DEAD`` frame as ``dead``.
* **scheduler** connects as engine ``--engine-index`` (HELLO, INIT, READY, its
  ready response on the input socket, a PUSH to the output), decodes every
  request with the project's codec (``mmadmit.wire``), optionally saves it
  (``--save DIR``, a frames container per ADD), and answers each ADD with a
  tagged ``BatchTokenIDOutSlim`` exactly as TokenSpeed's scheduler sends it
  (:func:`output_frames`; ``"abort"`` when ``validation_error`` is set, else
  ``"stop"``), optionally with ``--trailing`` extra fields after TokenSpeed's
  14 and an aux frame (``--aux-bytes``); ``--delay`` holds each answer that long.

:class:`Smg` and :func:`run_scheduler` are also imported by
``bench/bench_engine.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR.parent / "bench"))

from mmadmit import wire  # noqa: E402
from mmadmit.runtime import run_loop  # noqa: E402
from mmadmit_client.frames import pack_frames, parse_frames  # noqa: E402

VECTORS = TESTS_DIR / "data" / "vectors"
DEAD = b"ENGINE_CORE_DEAD"
_ENC = msgspec.msgpack.Encoder()

READY_RESPONSE: dict[str, Any] = {
    "max_model_len": 262144,
    "num_gpu_blocks": 4096,
    "prefix_granularity": 16,
    "dp_stats_address": None,
    "dtype": "bfloat16",
    "multimodal_encoder_dtype": "bfloat16",
    "vllm_version": "test-scheduler-0",
    "world_size": 1,
    "data_parallel_size": 1,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "decode_context_parallel_size": 1,
    "data_parallel_rank": 0,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "instance_id": "test-scheduler",
    "kv_cache_size_tokens": None,
    "kv_cache_max_concurrency": None,
    "kv_events_config": None,
}


def emit(**event: Any) -> None:
    print(json.dumps(event, separators=(",", ":")), flush=True)


def digest(frames: list[Any]) -> str:
    """SHA-256 over the frames and their lengths (what byte-identical means here)."""
    h = hashlib.sha256()
    for f in frames:
        data = f.bytes if isinstance(f, zmq.Frame) else bytes(f)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def identity_of(index: int) -> bytes:
    return index.to_bytes(2, "little")


def status(kind: str) -> bytes:
    return _ENC.encode(
        {"status": kind, "local": True, "headless": True, "parallel_config_hash": None}
    )


# --------------------------------------------------------------------------- requests


def vector_frames(name: str, rid: str | None = None) -> list[Any]:
    frames = parse_frames((VECTORS / f"{name}.frames").read_bytes())
    if rid is None:
        return list(frames)
    req = wire.decode_message(frames).request
    assert req is not None
    return [b"\x00", *wire.encode_request(dataclasses.replace(req, rid=rid))]


def synthetic_frames(kind: str, rid: str, tokens: int, feature_kb: int = 0) -> list[Any]:
    """``text``: a text-only request; ``mm``: a Qwen3.5 multimodal one with hashes supplied;
    ``big``: the same without hashes and with features, so the service hashes them on a
    worker (an ADD that takes a while)."""
    import numpy as np
    import workloads
    from mmadmit.model import Request
    from mmadmit.profile import load_profile

    if kind == "text":
        ids = (np.arange(tokens, dtype=np.int64) * 7919) % 150_000
        return [b"\x00", *wire.encode_request(Request(rid=rid, input_ids=ids))]
    profile = load_profile(str(VECTORS / "configs" / "qwen3_5.json"))
    req = workloads.build_request(
        profile,
        tokens,
        seed=3,
        with_hash=kind != "big",
        feature_bytes=(feature_kb << 10) if feature_kb else None,
    )
    return [b"\x00", *wire.encode_request(dataclasses.replace(req, rid=rid))]


# --------------------------------------------------------------------------- SMG


class Smg:
    """The gateway side: binds, answers HELLO with INIT, publishes, collects outputs."""

    def __init__(
        self, ctx: zmq.asyncio.Context, handshake: str, *, init: str = "ok", report: bool = True
    ) -> None:
        self.ctx = ctx
        self.init_kind = init
        self.report = report
        self.hs = ctx.socket(zmq.ROUTER)
        self.hs.setsockopt(zmq.LINGER, 0)
        self.hs.bind(handshake)
        self.handshake = self.hs.getsockopt_string(zmq.LAST_ENDPOINT)
        self.inp = ctx.socket(zmq.ROUTER)
        self.inp.setsockopt(zmq.LINGER, 0)
        self.inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.inp.bind("tcp://127.0.0.1:0")
        self.out = ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.bind("tcp://127.0.0.1:0")
        self.engine: bytes | None = None
        self.ready_response: dict[str, Any] | None = None

    def init_message(self) -> bytes:
        inputs = [self.inp.getsockopt_string(zmq.LAST_ENDPOINT)]
        outputs = [self.out.getsockopt_string(zmq.LAST_ENDPOINT)]
        if self.init_kind == "malformed":
            return _ENC.encode({"addresses": {"inputs": "not-a-list", "outputs": outputs}})
        return _ENC.encode(
            {
                "addresses": {
                    "inputs": inputs,
                    "outputs": outputs,
                    "coordinator_input": None,
                    "coordinator_output": None,
                    "frontend_stats_publish_address": None,
                    "a_newer_key": 1,  # unknown keys must be ignored
                },
                "parallel_config": {"data_parallel_size": 1},
            }
        )

    async def accept(self) -> dict[str, Any]:
        """HELLO -> INIT -> READY -> ready response; returns the ready response."""
        ident, hello = await self.hs.recv_multipart()
        if self.report:
            emit(event="hello", identity=ident.hex(), message=msgspec.msgpack.decode(hello))
        await self.hs.send_multipart([ident, self.init_message()])
        _, ready = await self.hs.recv_multipart()
        if self.report:
            emit(event="READY", message=msgspec.msgpack.decode(ready))
        engine, response = await self.inp.recv_multipart()
        self.engine = engine
        self.ready_response = msgspec.msgpack.decode(response)
        if self.report:
            emit(event="ready", identity=engine.hex(), ready_response=self.ready_response)
        return self.ready_response

    async def send(self, frames: list[Any]) -> None:
        assert self.engine is not None
        await self.inp.send_multipart([self.engine, *frames], copy=False)

    async def abort(self, rids: list[str]) -> None:
        await self.send([b"\x01", _ENC.encode(rids)])

    async def recv_output(self) -> list[zmq.Frame]:
        return await self.out.recv_multipart(copy=False)

    def close(self) -> None:
        for s in (self.hs, self.inp, self.out):
            s.close(linger=0)


def read_output(frames: list[zmq.Frame]) -> tuple[list[str], list[Any]]:
    """(rids, finished_reasons) of a BatchTokenIDOutSlim output (lenient)."""
    value = msgspec.msgpack.decode(frames[0].bytes)
    return list(value[1]), list(value[3])


async def _smg_main(args: argparse.Namespace) -> int:
    ctx = zmq.asyncio.Context()
    smg = Smg(ctx, args.handshake, init=args.init)
    emit(event="bound", handshake=smg.handshake)
    try:
        await smg.accept()
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        emit(event="error", error=repr(exc))
        return 1

    async def outputs() -> None:
        while True:
            frames = await smg.recv_output()
            t = time.monotonic()
            if len(frames) == 1 and frames[0].bytes == DEAD:
                emit(event="dead", time=t)
                continue
            try:
                rids, reasons = read_output(frames)
            except Exception as exc:  # noqa: BLE001
                emit(event="bad_output", error=repr(exc), time=t)
                continue
            emit(
                event="output",
                rids=rids,
                reasons=reasons,
                sha=digest(frames),
                frames=len(frames),
                time=t,
            )

    task = asyncio.ensure_future(outputs())
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = json.loads(line)
            op = cmd["cmd"]
            if op == "quit":
                break
            if op == "abort":
                await smg.abort(cmd["rids"])
            elif op == "send":
                if "vector" in cmd:
                    frames = vector_frames(cmd["vector"], cmd.get("rid"))
                else:
                    frames = synthetic_frames(
                        cmd["kind"], cmd["rid"], cmd.get("tokens", 64), cmd.get("feature_kb", 0)
                    )
                await smg.send(frames)
            emit(event="done", cmd=op, rid=cmd.get("rid"), time=time.monotonic())
    finally:
        task.cancel()
        smg.close()
        ctx.term()
    return 0


# --------------------------------------------------------------------------- scheduler


# The load snapshot TokenSpeed's scheduler appends after ``engine_index``
# (``num_running, num_waiting, kv_active_pages, kv_total_pages``); a real one
# reports ``kv_total_pages`` > 0 once it has observed its pool, and SMG ignores
# the four counters when ``kv_total_pages`` is 0.
KV_PAGE_SIZE = 16


def logprob_of(token: int) -> float:
    """The logprob the test scheduler reports for ``token`` (``logprobs=True``)."""
    return -token / 100


def envelope_field(req: Any, index: int) -> Any:
    """Element ``index`` of an ADD's ``TokenizedGenerateReqInput`` array (docs/spec/WIRE.md)
    as the scheduler received it, decoded from its raw bytes; None when absent."""
    extra = getattr(req, "extra", None)
    raw = getattr(extra, "raw", None)
    if not raw or len(raw) <= index:
        return None
    return msgspec.msgpack.decode(raw[index])


def asked_logprobs(req: Any) -> bool:
    """Whether an ADD asked for logprobs (``return_logprob``, element 6)."""
    return envelope_field(req, 6) is True


def kv_bootstrap(req: Any) -> tuple[Any, Any, Any]:
    """An ADD's PD rendezvous as received: ``(bootstrap_host, bootstrap_port,
    bootstrap_room)``, elements 16, 17 and 18."""
    return envelope_field(req, 16), envelope_field(req, 17), envelope_field(req, 18)


def wire_items(req: Any) -> list[list[Any]]:
    """An ADD's ``mm_items`` as received, each item its decoded element array
    (``MultimodalDataItem``, docs/spec/WIRE.md; tensors as msgpack decodes them);
    empty without ``multimodal_inputs`` (element 22)."""
    mm = envelope_field(req, 22)
    return list(mm[0] or []) if mm else []


def load_snapshot(running: int, prompt_tokens: int) -> tuple[int, int, int, int]:
    """A plausible load tail: ``running`` requests of ``prompt_tokens`` each."""
    total = int(READY_RESPONSE["num_gpu_blocks"])
    pages = -(-(prompt_tokens + 3) // KV_PAGE_SIZE)
    return running, 0, min(total, running * pages), total


def output_frames(
    rid: str,
    reason: str,
    prompt_tokens: int,
    engine_index: int,
    trailing: int = 0,
    aux_bytes: int = 0,
    *,
    load: tuple[int, int, int, int] = (0, 0, 0, 0),
    tokens: tuple[int, ...] = (11, 12, 13),
    completion_tokens: int | None = None,
    logprobs: bool = False,
) -> list[bytes]:
    """TokenSpeed's ``BatchTokenIDOutSlim`` for one request, as its scheduler sends it
    (``tokens``: the ids this output carries; ``reason`` "" while unfinished).

    The msgspec struct is ``tag=True, array_like=True``: a 14-element msgpack
    array, the class name first, then every field in declaration order::

        0  "BatchTokenIDOutSlim"
        1  rids                       [rid]
        2  output_ids                 [[11, 12, 13]]
        3  finished_reasons           [reason]            ("stop" / "abort")
        4  prompt_tokens              [prompt_tokens]
        5  completion_tokens          [3]
        6  cached_tokens              [0]
        7  output_token_logprobs_val  [[]]   one (empty) list per rid
        8  output_token_logprobs_idx  [[]]   one (empty) list per rid
        9  engine_index               uint (SMG reads u32)
        10 num_running                uint (SMG reads u64)
        11 num_waiting                uint (u64)
        12 kv_active_pages            uint (u64)
        13 kv_total_pages             uint (u64; 0 = no snapshot)

    (TokenSpeed ``io_struct.BatchTokenIDOutSlim`` / ``MsgpackSendSocket``; SMG
    ``engine_zmq_client::protocol::tokenspeed::output``, which reads 9..13 as
    integers and rejects columns whose length differs from ``rids``.)

    ``trailing`` appends that many extra fields after element 13, fields a
    newer gateway might read and SMG 1.13 skips; ``aux_bytes`` adds an aux frame
    (SMG ignores aux frames on a TokenSpeed output). Both are off by default:
    the default is exactly what TokenSpeed sends.
    """
    if len(load) != 4 or any(not isinstance(v, int) or v < 0 for v in load):
        raise ValueError(f"load must be four non-negative ints, got {load!r}")
    body: list[Any] = [
        "BatchTokenIDOutSlim",
        [rid],
        [list(tokens)],
        [reason],
        [prompt_tokens],
        [len(tokens) if completion_tokens is None else completion_tokens],
        [0],
        [[logprob_of(t) for t in tokens] if logprobs else []],
        [list(tokens) if logprobs else []],
        engine_index,
        *load,
    ]
    for k in range(trailing):
        body.append({"load": k, "queue": [k, k + 1]} if k % 2 == 0 else [float(k), "x" * k])
    frames = [_ENC.encode(body)]
    if aux_bytes:
        frames.append(bytes((i * 31 + len(rid)) % 251 for i in range(aux_bytes)))
    return frames


def _socket(
    ctx: zmq.asyncio.Context, opened: list[zmq.asyncio.Socket], kind: int
) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    opened.append(sock)
    return sock


async def run_scheduler(
    ctx: zmq.asyncio.Context,
    handshake: str,
    *,
    engine_index: int = 0,
    hello_index: int | None = None,
    ready: str = "ok",
    trailing: int = 0,
    aux_bytes: int = 0,
    delay_s: float = 0.0,
    save: Path | None = None,
    report: bool = True,
    quiet_adds: bool = False,
    dead_after: int | None = None,
    seen: list[tuple[str, Any]] | None = None,
    chunks: int = 1,
    chunk_interval_s: float = 0.0,
    stall_after: int | None = None,
    stall_s: float = 0.0,
    rcvhwm: int | None = None,
) -> None:
    """The scheduler side, until cancelled (or its peer stops answering the handshake).

    ``dead_after=N``: after answering N ADDs, send ``ENGINE_CORE_DEAD`` and go
    quiet (sockets kept open); ``seen`` collects ``("ADD", Request)``,
    ``("ABORT", rids)`` and ``("OTHER", frames)`` in arrival order.
    ``chunks=N``: each ADD is answered by N outputs ``chunk_interval_s`` apart, one
    token each, the last one finished (an ABORT for the rid ends them with an
    ``"abort"`` output, as a scheduler does). ``stall_after=N``: after its N-th input
    message the scheduler stops reading its input for ``stall_s`` (once); ``rcvhwm`` sets
    its input socket's receive high-water mark, so that a stall pushes back soon.
    """
    ident = identity_of(engine_index if hello_index is None else hello_index)
    opened: list[zmq.asyncio.Socket] = []  # closed however the task ends
    pending: set[asyncio.Task[None]] = set()
    streaming: dict[str, asyncio.Task[None]] = {}
    try:
        hs = _socket(ctx, opened, zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, ident)
        hs.setsockopt(zmq.LINGER, 0)
        hs.connect(handshake)
        await hs.send(status("HELLO"))
        init = msgspec.msgpack.decode((await hs.recv_multipart())[-1])
        if report:
            emit(event="init", init=init)
        await hs.send(status("READY"))
        inp = _socket(ctx, opened, zmq.DEALER)
        inp.setsockopt(zmq.IDENTITY, ident)
        inp.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            inp.setsockopt(zmq.RCVHWM, rcvhwm)
        inp.connect(init["addresses"]["inputs"][0])
        if ready == "malformed":
            response = dict(READY_RESPONSE, max_model_len="lots")
            await inp.send(_ENC.encode(response))
        elif ready == "array":
            await inp.send(_ENC.encode([1, 2, 3]))
        else:
            await inp.send(_ENC.encode(dict(READY_RESPONSE, data_parallel_rank=engine_index)))
        push = _socket(ctx, opened, zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(init["addresses"]["outputs"][0])
        if report:
            emit(event="connected")
        seq = 0

        async def answer(frames: list[bytes], at: float) -> None:
            if at:
                await asyncio.sleep(max(0.0, at - time.monotonic()))
            await push.send_multipart(frames, copy=False)

        async def stream(rid: str, prompt_tokens: int, logprobs: bool) -> None:
            try:
                for k in range(chunks):
                    await asyncio.sleep(chunk_interval_s)
                    last = k == chunks - 1
                    out = output_frames(
                        rid, "stop" if last else "", prompt_tokens, engine_index,
                        tokens=(11 + k,), completion_tokens=k + 1,
                        load=load_snapshot(len(streaming), prompt_tokens), logprobs=logprobs,
                    )  # fmt: skip
                    await push.send_multipart(out, copy=False)
            except asyncio.CancelledError:  # aborted: the scheduler's terminal output
                if not push.closed:
                    out = output_frames(rid, "abort", prompt_tokens, engine_index, tokens=())
                    with contextlib.suppress(zmq.ZMQError):
                        await push.send_multipart(out, copy=False)
            finally:
                streaming.pop(rid, None)

        stalled = False

        while True:
            if stall_after is not None and not stalled and seq >= stall_after:
                stalled = True
                if report:
                    emit(event="stall", seconds=stall_s)
                await asyncio.sleep(stall_s)  # reads nothing meanwhile
            frames = await inp.recv_multipart(copy=False)
            seq += 1
            kind = frames[0].bytes
            if kind == b"\x01":
                rids = msgspec.msgpack.decode(frames[1].bytes)
                if seen is not None:
                    seen.append(("ABORT", rids))
                if report:
                    emit(event="abort", seq=seq, rids=rids)
                for rid in rids:
                    if rid in streaming:
                        streaming[rid].cancel()
                continue
            if kind != b"\x00":
                if seen is not None:
                    seen.append(("OTHER", frames))
                if report:
                    emit(event="other", seq=seq, type=kind.hex())
                continue
            try:
                msg = wire.decode_message(frames)
            except wire.WireError as exc:  # a real scheduler drops it: the test must see that
                if report:
                    emit(event="undecodable", seq=seq, error=exc.message)
                continue
            req = msg.request
            assert req is not None
            if seen is not None:
                seen.append(("ADD", req))
            reason = "abort" if req.validation_error else "stop"
            if report and not quiet_adds:
                path = None
                if save is not None:
                    path = save / f"{seq:05d}.frames"
                    path.write_bytes(pack_frames(frames))
                emit(
                    event="add",
                    seq=seq,
                    rid=req.rid,
                    validation_error=req.validation_error,
                    positions=req.mm is not None and req.mm.mrope_positions is not None,
                    file=str(path) if path else None,
                )
            out = output_frames(
                req.rid,
                reason,
                len(req.input_ids),
                engine_index,
                trailing,
                aux_bytes,
                load=load_snapshot(len(pending) + 1, len(req.input_ids)),
                logprobs=asked_logprobs(req),
            )
            if report and not quiet_adds:
                emit(event="sent", rid=req.rid, sha=digest(out), reason=reason)
            if chunks > 1 and not req.validation_error:
                streaming[req.rid] = asyncio.ensure_future(
                    stream(req.rid, len(req.input_ids), asked_logprobs(req))
                )
            elif delay_s:
                task = asyncio.ensure_future(answer(out, time.monotonic() + delay_s))
                pending.add(task)
                task.add_done_callback(pending.discard)
            else:
                await push.send_multipart(out, copy=False)
            if dead_after is not None and seq >= dead_after:
                await push.send(DEAD)
                if report:
                    emit(event="sent_dead")
                await asyncio.sleep(3600)  # dead, but its sockets stay open
    finally:
        for task in [*pending, *streaming.values()]:
            task.cancel()
        for s in opened:
            s.close(linger=0)


@dataclasses.dataclass
class SchedulerSockets:
    """A scheduler driven by the test itself (:func:`connect_scheduler`): it reads
    the face's requests and sends whatever outputs the test makes."""

    hs: zmq.asyncio.Socket
    inp: zmq.asyncio.Socket
    push: zmq.asyncio.Socket
    init: dict[str, Any]

    async def recv(self) -> tuple[str, Any]:
        """The next input message: ``("ADD", Request)``, ``("ABORT", rids)`` or
        ``("OTHER", frames)``."""
        frames = await self.inp.recv_multipart(copy=False)
        kind = frames[0].bytes
        if kind == b"\x00":
            return "ADD", wire.decode_message(frames).request
        if kind == b"\x01":
            return "ABORT", msgspec.msgpack.decode(frames[1].bytes)
        return "OTHER", frames

    async def send(self, body: Any) -> None:
        """One output: ``body`` msgpack-encoded, or as it is when bytes."""
        data = body if isinstance(body, bytes) else _ENC.encode(body)
        await self.push.send(data)

    def close(self) -> None:
        for s in (self.hs, self.inp, self.push):
            s.close(linger=0)


async def _connected(sock: zmq.asyncio.Socket, address: str) -> None:
    """Connect ``sock`` and wait for the ZMTP handshake with its peer (from then on
    the peer sees the connection, and its drop)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(address)
        await monitor.recv_multipart()
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


async def connect_scheduler(
    ctx: zmq.asyncio.Context, handshake: str, *, engine_index: int = 0, ready: bool = True
) -> SchedulerSockets:
    """A scheduler's handshake, step by step: HELLO, INIT, its input and output
    connected; with ``ready``, READY and the ready response (the face's handshake
    completes). Without it the scheduler stops before READY, as one that dies
    there: :meth:`SchedulerSockets.close` drops its connections."""
    ident = identity_of(engine_index)
    socks = [ctx.socket(kind) for kind in (zmq.DEALER, zmq.DEALER, zmq.PUSH)]
    for sock in socks:
        sock.setsockopt(zmq.LINGER, 0)
    hs, inp, push = socks
    hs.setsockopt(zmq.IDENTITY, ident)
    inp.setsockopt(zmq.IDENTITY, ident)
    try:
        hs.connect(handshake)
        await hs.send(status("HELLO"))
        init = msgspec.msgpack.decode((await hs.recv_multipart())[-1])
        await _connected(inp, init["addresses"]["inputs"][0])
        await _connected(push, init["addresses"]["outputs"][0])
        if ready:
            await hs.send(status("READY"))
            await inp.send(_ENC.encode(dict(READY_RESPONSE, data_parallel_rank=engine_index)))
    except BaseException:
        for sock in socks:
            sock.close(linger=0)
        raise
    return SchedulerSockets(hs, inp, push, init)


async def _scheduler_main(args: argparse.Namespace) -> int:
    ctx = zmq.asyncio.Context()
    save = Path(args.save) if args.save else None
    try:
        await run_scheduler(
            ctx,
            args.handshake,
            engine_index=args.engine_index,
            hello_index=args.hello_index,
            ready=args.ready,
            trailing=args.trailing,
            aux_bytes=args.aux_bytes,
            delay_s=args.delay,
            save=save,
            quiet_adds=args.quiet,
            dead_after=args.dead_after,
        )
    finally:
        ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    smg = sub.add_parser("smg")
    smg.add_argument("--handshake", default="tcp://127.0.0.1:0")
    smg.add_argument("--init", choices=("ok", "malformed"), default="ok")
    sch = sub.add_parser("scheduler")
    sch.add_argument("--handshake", required=True)
    sch.add_argument("--engine-index", type=int, default=0)
    sch.add_argument("--hello-index", type=int, default=None)
    sch.add_argument("--ready", choices=("ok", "malformed", "array"), default="ok")
    sch.add_argument(
        "--trailing",
        type=int,
        default=0,
        help="extra fields after TokenSpeed's 14 (a newer gateway's); default none",
    )
    sch.add_argument("--aux-bytes", type=int, default=0)
    sch.add_argument("--delay", type=float, default=0.0)
    sch.add_argument("--save", default=None)
    sch.add_argument("--quiet", action="store_true", help="no line per ADD (benchmarks)")
    sch.add_argument("--dead-after", type=int, default=None, help="ENGINE_CORE_DEAD after N")
    args = parser.parse_args(argv)
    runner = _smg_main if args.role == "smg" else _scheduler_main
    return run_loop(runner(args))


if __name__ == "__main__":
    sys.exit(main())
