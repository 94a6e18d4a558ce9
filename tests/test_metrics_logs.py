"""``/metrics`` and ``--log-format json`` of a real ``mmadmit serve`` process.

Contract: every request a transport ends is counted once in
``mmadmit_requests_total{transport,outcome,code}``, observed once in
``mmadmit_request_duration_seconds`` (by token bucket), and logged as one JSON
line with its rid, transport, outcome, code, tokens, items and latency; bytes
received and sent per transport are exactly the bytes on the wire; feature
bytes hashed are exactly those of the items sent without a hash; every
materializer run is one ``mmadmit_materialize_duration_seconds`` observation.
The exposition is parsed with ``prometheus_client``'s own parser.

Run with: ``.venv/bin/python -m pytest -q tests/test_metrics_logs.py``
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections import Counter
from typing import Any

import grpc
import msgspec
import numpy as np
import pytest
from client_helpers import zmq_admit, zmq_client
from conftest import http_get, load_vector, vector_names
from mmadmit import wire
from mmadmit.model import Request
from mmadmit.telemetry import token_bucket
from mmadmit_client.proto import admission_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families
from test_grpc_api import request_from_vector
from test_server_lifecycle import (
    EPHEMERAL,
    MODEL,
    READY_RE,
    ServeProcess,
    big_request,
    small_request,
    to_proto,
)

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 40_000  # above the 32K requests that are hashed
QWEN35 = [n for n in vector_names() if n.startswith("qwen3_5")]
ADMIT = "/mmadmit.v1.Admission/Admit"
_CODE_NAME = {v: k for k, v in pb.AbortCode.items()}


class JsonServe(ServeProcess):
    """A serve child with ``--log-format json``: every stderr line must be JSON."""

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # asserted on later: the test fails on any non-JSON line
            if obj.get("event") == "ready" and self.addresses is None:
                self.addresses = {k: obj[k] for k in ("grpc", "zmq", "metrics")}
                self._ready.set()

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines if line.strip()]


def families(body: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(body)}


def sample(fams: dict[str, Any], metric: str, suffix: str = "", **labels: str) -> float:
    """Sum of the samples ``metric + suffix`` whose labels include ``labels``."""
    total = 0.0
    for s in fams[metric].samples:
        if s.name == metric + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def hashed_bytes(req: Request) -> int:
    """Feature bytes the service must hash for ``req`` (items without a hash)."""
    items = req.mm.items if req.mm is not None else []
    return sum(it.feature.nbytes for it in items if it.hash is None and it.feature is not None)


def too_long(rid: str) -> Request:
    return Request(rid=rid, input_ids=np.full(MAX_TOKENS + 1, 100, np.int64))


def span_mismatch(rid: str) -> Request:
    req = small_request(rid)
    assert req.mm is not None
    req.mm.items[0].offsets = np.array([[10, 24]], np.int64)  # 15 placeholders for a 16 grid
    return req


@dataclasses.dataclass
class Sent:
    rid: str
    transport: str
    code: str  # OK or the abort code expected
    tokens: int
    items: int
    hashed: int = 0  # feature bytes hashed when materialized


async def test_metrics_and_json_logs_match_what_was_sent() -> None:
    assert QWEN35, "the repository carries the qwen3_5 vectors"
    srv = JsonServe(*EPHEMERAL, "--workers", "1", "--log-format", "json",
                    "--max-tokens", str(MAX_TOKENS), "--log-outcomes", "all")  # fmt: skip
    try:
        addr = await srv.wait_ready()
        sent: list[Sent] = []
        zmq_in = zmq_out = grpc_in = grpc_out = 0

        # ---------------------------------------------------------------- ZMQ
        async with zmq_client(addr["zmq"], timeout_s=30) as zc:
            for name in QWEN35:
                v = load_vector(name)
                zmq_in += sum(len(f) for f in v.frames)
                req = wire.decode_message(list(v.frames)).request
                assert req is not None
                out = await zmq_admit(zc, list(v.frames))
                assert out.materialized, (name, out.message)
                zmq_out += sum(len(f) for f in out.frames)
                mm = req.mm.items if req.mm else []
                sent.append(Sent(req.rid, "zmq", "OK", len(req.input_ids), len(mm),
                                 hashed_bytes(req)))  # fmt: skip

            async def zmq_send(frames: list[Any], rid: str, code: str, tokens: int,
                               items: int) -> None:  # fmt: skip
                nonlocal zmq_in, zmq_out
                zmq_in += sum(len(f) for f in frames)
                out = await zmq_admit(zc, frames)
                assert out.request_id == rid and ("OK" if out.materialized else out.code) == code, (
                    out
                )
                zmq_out += sum(len(f) for f in out.frames)
                sent.append(Sent(rid, "zmq", code, tokens, items))

            add = bytes([wire.MSG_ADD])
            await zmq_send([add, b"\xc1 not msgpack"], "", "INVALID_REQUEST", 0, 0)
            # refused from input_ids' header, never decoded: no token count is known
            await zmq_send([add, *wire.encode_request(too_long("z-long"))], "z-long",
                           "TOO_LARGE", 0, 0)  # fmt: skip
            await zmq_send([add, *wire.encode_request(span_mismatch("z-span"))], "z-span",
                           "INVALID_REQUEST", 40, 1)  # fmt: skip
            # CANCELLED: an ABORT while the worker hashes ~46 MB of features
            big = dataclasses.replace(big_request(2), rid="z-cancel")
            big_frames = [add, *wire.encode_request(big)]
            zmq_in += sum(len(f) for f in big_frames)
            pending = asyncio.ensure_future(zmq_admit(zc, big_frames))
            await asyncio.sleep(0.005)
            zmq_in += 1 + len(msgspec.msgpack.encode(["z-cancel"]))  # the ABORT message
            await zc.abort("z-cancel")
            out = await pending
            assert out.code == "CANCELLED", out
            zmq_out += sum(len(f) for f in out.frames)
            sent.append(Sent("z-cancel", "zmq", "CANCELLED", 32768, len(big.mm.items)))

        # ---------------------------------------------------------------- gRPC
        channel = grpc.aio.insecure_channel(
            addr["grpc"], options=[("grpc.max_receive_message_length", 1 << 30)]
        )
        raw_admit = channel.unary_unary(ADMIT)  # bytes in, bytes out: exact sizes

        async def grpc_send(msg: pb.AdmitRequest, code: str, tokens: int, items: int,
                            hashed: int = 0) -> None:  # fmt: skip
            nonlocal grpc_in, grpc_out
            data = msg.SerializeToString()
            grpc_in += len(data)
            reply = await raw_admit(data, timeout=30)
            grpc_out += len(reply)
            resp = pb.AdmitResponse.FromString(reply)
            got = "OK" if resp.WhichOneof("outcome") != "abort" else _CODE_NAME[resp.abort.code]
            assert (resp.request_id, got) == (msg.request_id, code), resp.abort.message
            sent.append(Sent(msg.request_id, "grpc", code, tokens, items, hashed))

        try:
            for name in QWEN35:
                req = wire.decode_message(list(load_vector(name).frames)).request
                assert req is not None
                mm = req.mm.items if req.mm else []
                msg = request_from_vector(load_vector(name), f"g-{name}")
                await grpc_send(msg, "OK", len(req.input_ids), len(mm), hashed_bytes(req))
            await grpc_send(to_proto(too_long("g"), "g-long"), "TOO_LARGE", MAX_TOKENS + 1, 0)
            await grpc_send(to_proto(span_mismatch("g"), "g-span"), "INVALID_REQUEST", 40, 1)
            late = to_proto(big_request(2), "g-late")
            late.timeout_ms = 1  # expires while the worker hashes
            await grpc_send(late, "DEADLINE_EXCEEDED", 32768, len(late.mm_inputs.items))
        finally:
            await channel.close()

        # every materializer run has finished (the discarded ones included)
        end = time.monotonic() + 30
        while True:
            status, body = await http_get(addr["metrics"])
            assert status == 200
            fams = families(body)
            if sample(fams, "mmadmit_inflight") == 0 or time.monotonic() > end:
                break
            await asyncio.sleep(0.05)
        assert sample(fams, "mmadmit_inflight") == 0

        # ------------------------------------------------------------ counters
        by_key = Counter((s.transport, s.code) for s in sent)
        for (transport, code), n in by_key.items():
            outcome = "materialized" if code == "OK" else "aborted"
            got = sample(fams, "mmadmit_requests", "_total", transport=transport,
                         outcome=outcome, code=code)  # fmt: skip
            assert got == n, (transport, code, got, n)
        for transport in ("zmq", "grpc"):
            mine = [s for s in sent if s.transport == transport]
            assert sample(fams, "mmadmit_requests", "_total", transport=transport) == len(mine)
            # one latency observation per outcome, in the request's token bucket
            for bucket, n in Counter(token_bucket(s.tokens) for s in mine).items():
                got = sample(fams, "mmadmit_request_duration_seconds", "_count",
                             transport=transport, tokens=bucket, family="qwen3_5")  # fmt: skip
                assert got == n, (transport, bucket, got, n)
            hashed = sum(s.hashed for s in mine)
            assert hashed > 0  # qwen3_5_mixed carries engine-hashed items
            got = sample(fams, "mmadmit_feature_hashed_bytes", "_total", transport=transport)
            assert got == hashed, (transport, got, hashed)
            # every outcome reached its caller (the gRPC deadline is answered in band)
            assert sample(fams, "mmadmit_undeliverable_replies", "_total",
                          transport=transport) == 0  # fmt: skip
        # bytes: exactly what crossed each wire
        assert sample(fams, "mmadmit_received_bytes", "_total", transport="zmq") == zmq_in
        assert sample(fams, "mmadmit_sent_bytes", "_total", transport="zmq") == zmq_out
        assert sample(fams, "mmadmit_received_bytes", "_total", transport="grpc") == grpc_in
        assert sample(fams, "mmadmit_sent_bytes", "_total", transport="grpc") == grpc_out

        # every decoded request is admitted (+ the warm-up; a malformed message never
        # is), and each admitted one is one materializer run unless an ABORT removed it
        # from the queue before a worker took it
        admitted = sample(fams, "mmadmit_admitted", "_total")
        assert admitted == len([s for s in sent if s.tokens > 0]) + 1
        runs = admitted - sample(fams, "mmadmit_cancelled_queued", "_total")
        assert sample(fams, "mmadmit_materialize_duration_seconds", "_count") == runs
        inline = sample(fams, "mmadmit_admissions", "_total", path="inline")
        worker = sample(fams, "mmadmit_admissions", "_total", path="worker")
        assert inline + worker == admitted and inline > 0 and worker > 0
        assert sample(fams, "mmadmit_materialize_duration_seconds", "_count",
                      path="inline") == inline  # fmt: skip
        # the counters the pool and transports already kept are still there
        assert (
            sample(fams, "mmadmit_zmq_received", "_total")
            == len([s for s in sent if s.transport == "zmq"]) + 1
        )  # + the ABORT
        assert sample(fams, "mmadmit_grpc_requests", "_total") == len(
            [s for s in sent if s.transport == "grpc"]
        )
        assert sample(fams, "mmadmit_build_info", family="qwen3_5", device="cpu") == 1
        assert fams["mmadmit_request_duration_seconds"].type == "histogram"
        assert "mmadmit_requests_created" not in body  # serve turns the _created series off
        assert fams["mmadmit_inflight"].type == "gauge"
        # glibc's heap: the process holds at least the received ids it decoded
        assert sample(fams, "mmadmit_heap_bytes", state="in_use") > 1 << 20
        assert sample(fams, "mmadmit_heap_bytes", state="free") >= 0

        srv.send()
        rc, _ = await srv.wait_exit(20)
        assert rc == 0, srv.stderr
    finally:
        srv.kill()

    # ---------------------------------------------------------------- JSON lines
    non_json = []
    for line in srv.lines:
        if line.strip():
            try:
                json.loads(line)
            except ValueError:
                non_json.append(line)
    assert not non_json, non_json
    records = srv.records()
    outcomes = [r for r in records if r.get("event") == "outcome"]
    assert len(outcomes) == len(sent), (len(outcomes), len(sent))
    for rec in outcomes:
        assert {"ts", "level", "logger", "rid", "transport", "outcome", "code", "tokens",
                "items", "latency_ms"} <= rec.keys(), rec  # fmt: skip
        assert rec["latency_ms"] >= 0
    got = sorted((r["transport"], r["rid"], r["code"], r["tokens"], r["items"]) for r in outcomes)
    want = sorted((s.transport, s.rid, s.code, s.tokens, s.items) for s in sent)
    assert got == want
    events = [r.get("event") for r in records]
    for event in ("starting", "ready", "drain", "stopped"):
        assert event in events, (event, events)
    ready = next(r for r in records if r.get("event") == "ready")
    assert re.fullmatch(r"mmadmit ready grpc=\S+ zmq=\S+ metrics=\S+", ready["message"])
    assert events.index("ready") < events.index("drain") < events.index("stopped")


async def test_log_outcomes_modes_and_text_format() -> None:
    """``--log-outcomes``: by default (``aborts``) a line per abort, the operator's
    signal, and none per success; ``all`` a line per outcome; ``off`` none. Text
    lines keep their classic shape."""

    async def run(*args: str) -> list[str]:
        srv = ServeProcess(*EPHEMERAL, "--workers", "1", *args)
        try:
            addr = await srv.wait_ready()
            async with zmq_client(addr["zmq"], timeout_s=30) as zc:
                assert (await zmq_admit(zc, small_request("good"))).materialized
                bad = small_request("bad")
                assert bad.mm is not None and bad.mm.items[0].offsets is not None
                bad.mm.items[0].offsets[0, 1] -= 1  # one placeholder short of its grid
                assert (await zmq_admit(zc, bad)).code == "INVALID_REQUEST"
            srv.send()
            assert (await srv.wait_exit(20))[0] == 0, srv.stderr
        finally:
            srv.kill()
        assert any(re.match(r"\S+ \S+ INFO mmadmit.server: ready: mmadmit ready", line)
                   for line in srv.lines), srv.stderr  # fmt: skip
        return [line for line in srv.lines if "mmadmit.outcome:" in line]

    default = await run()
    assert len(default) == 1 and "rid=bad transport=zmq outcome=aborted" in default[0], default
    assert re.search(r"INFO mmadmit\.outcome: rid=bad transport=zmq outcome=aborted "
                     r"code=INVALID_REQUEST tokens=40 items=1 latency_ms=\d+\.\d{3}$",
                     default[0])  # fmt: skip
    every = await run("--log-outcomes", "all")
    assert [line.split("rid=")[1].split()[0] for line in every] == ["good", "bad"], every
    assert re.search(r"INFO mmadmit\.outcome: rid=good transport=zmq outcome=materialized "
                     r"code=OK tokens=40 items=1 latency_ms=\d+\.\d{3}$", every[0])  # fmt: skip
    assert await run("--log-outcomes", "off") == []


async def test_metrics_http_contract_on_a_live_process() -> None:
    """Only GET /metrics answers; the scrape is prometheus_client's (gzip too)."""
    import gzip
    import urllib.error
    import urllib.request

    srv = ServeProcess(*EPHEMERAL, "--workers", "1", "--zmq-listen", "off")
    try:
        addr = await srv.wait_ready()
        base = f"http://{addr['metrics']}"

        def fetch(path: str, method: str = "GET", **headers: str) -> tuple[int, bytes]:
            req = urllib.request.Request(base + path, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, resp.read()
            except urllib.error.HTTPError as exc:
                return exc.code, b""

        status, body = await asyncio.to_thread(fetch, "/metrics", "GET",
                                               **{"Accept-Encoding": "gzip"})  # fmt: skip
        assert status == 200
        text = gzip.decompress(body).decode()
        fams = families(text)
        assert "mmadmit_requests" in fams and "zmq" not in {
            s.labels.get("transport") for s in fams["mmadmit_received_bytes"].samples
        }  # a transport that is off has no series
        assert (await asyncio.to_thread(fetch, "/"))[0] == 404
        assert (await asyncio.to_thread(fetch, "/metrics", "POST"))[0] == 405
        assert (await asyncio.to_thread(fetch, "/metrics", "HEAD"))[0] == 405
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr
    finally:
        srv.kill()


async def test_a_stderr_nobody_reads_never_stalls_the_service() -> None:
    """Logging never blocks the event loop: with every outcome logged and a stderr
    pipe that nobody reads after the ready line (the pipe holds ~64 KiB, about 430
    outcome lines), 3,000 requests are all answered; then SIGTERM still exits 0
    within the bounded flush."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "mmadmit", "serve", "--model", str(MODEL), "--device", "cpu",
         *EPHEMERAL, "--workers", "1", "--log-outcomes", "all"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        zmq_addr = metrics_addr = None
        while zmq_addr is None:  # read up to the ready line, then never again
            line = await asyncio.to_thread(proc.stderr.readline)
            assert line, f"serve exited {proc.poll()} before ready"
            m = READY_RE.match(line.strip())
            if m:
                zmq_addr, metrics_addr = m.group(2), m.group(3)
        n = 3000
        started = time.monotonic()
        async with zmq_client(zmq_addr, timeout_s=30) as zc:
            for base in range(0, n, 50):  # within --max-inflight (64)
                outs = await asyncio.gather(
                    *(zmq_admit(zc, small_request(f"q{base + i}")) for i in range(50))
                )
                assert all(o.materialized for o in outs)
        assert time.monotonic() - started < 60
        assert metrics_addr is not None
        status, body = await http_get(metrics_addr)
        assert status == 200 and "mmadmit_log_records_dropped_total" in body
        proc.terminate()
        rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), 30)
        assert rc == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            rest = proc.stderr.read()  # what the writer got out before the exit
            proc.stderr.close()
    assert "rid=q0 " in rest  # the first lines were written, in order, once read
