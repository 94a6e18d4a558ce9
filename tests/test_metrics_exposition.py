"""``/metrics`` after traffic on every transport is a well-formed, self-describing exposition.

Contract: every family is typed (counter, gauge or histogram, never untyped), its
help text says what it counts (no generic text), a counter's samples end in
``_total``; and Prometheus' own ``promtool check metrics`` accepts the scrape
(run when ``promtool`` is installed: Debian's ``prometheus`` package, which
``.ci/run`` installs when it can). One scrape per transport: grpc and zmq (one
``mmadmit serve``), engine (serve between a fake SMG and scheduler) and
smg_grpc (the face with its own ``/metrics`` server, in process).

Run with: ``.venv/bin/python -m pytest -q tests/test_metrics_exposition.py``
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Awaitable, Callable

import grpc
import pytest
from client_helpers import zmq_admit, zmq_client
from conftest import http_get
from mmadmit.metrics import MetricsServer
from mmadmit.telemetry import StatsCollector, Telemetry
from mmadmit_client.proto import admission_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
from test_engine_mode import start_all, trio
from test_server_lifecycle import EPHEMERAL, ServeProcess, small_request, to_proto
from test_smg_grpc import collect, face_env

pytestmark = pytest.mark.timeout(120)


async def _grpc_and_zmq() -> str:
    srv = ServeProcess(*EPHEMERAL, "--workers", "1")
    try:
        addr = await srv.wait_ready()
        async with zmq_client(addr["zmq"], timeout_s=30) as zc:
            assert (await zmq_admit(zc, small_request("z1"))).materialized
            assert (await zmq_admit(zc, [b"\x00", b"\xc1 not msgpack"])).code == "INVALID_REQUEST"
        async with grpc.aio.insecure_channel(addr["grpc"]) as channel:
            stub = pb_grpc.AdmissionStub(channel)
            reply = await stub.Admit(to_proto(small_request("g"), "g1"), timeout=30)
            assert reply.request_id == "g1"
        status, body = await http_get(addr["metrics"])
        assert status == 200
        return body
    finally:
        srv.kill()


async def _engine() -> str:
    with trio() as t:
        addr = await start_all(t)
        assert t.smg is not None
        t.smg.command(cmd="send", vector="qwen3_5_image1")
        await t.smg.count("output", 1)
        status, body = await http_get(addr["metrics"])
        assert status == 200
        return body


async def _smg_grpc() -> str:
    telemetry = Telemetry("qwen3_5", log_outcomes=False)
    async with face_env(scheduler={}, telemetry=telemetry) as env:
        telemetry.registry.register(StatsCollector([env.face.pool, env.face], {"family": "x"}))
        ok = ts.GenerateRequest(request_id="m1")
        ok.tokenized.input_ids.extend([1, 2, 3])
        await collect(env.stub.Generate(ok))
        metrics = MetricsServer(telemetry.registry, listen="127.0.0.1:0")
        address = await metrics.start()
        try:
            status, body = await http_get(address)
        finally:
            await metrics.stop()
        assert status == 200
        return body


SCRAPES: dict[str, Callable[[], Awaitable[str]]] = {
    "grpc+zmq": _grpc_and_zmq,
    "engine": _engine,
    "smg_grpc": _smg_grpc,
}
_bodies: dict[str, str] = {}  # one scrape per transport for both tests


async def scrape(transport: str) -> str:
    if transport not in _bodies:
        _bodies[transport] = await SCRAPES[transport]()
    return _bodies[transport]


@pytest.mark.parametrize("transport", sorted(SCRAPES))
async def test_every_family_is_typed_and_says_what_it_counts(transport: str) -> None:
    body = await scrape(transport)
    families = list(text_string_to_metric_families(body))
    names = {f.name for f in families}
    assert "mmadmit_requests" in names and "mmadmit_inflight" in names, sorted(names)
    for family in families:
        assert family.name.startswith("mmadmit_"), family.name
        assert family.type in ("counter", "gauge", "histogram"), (family.name, family.type)
        doc = family.documentation
        assert len(doc.split()) >= 3 and family.name not in doc, (family.name, doc)
        assert not doc.startswith("Transport counter"), family.name
        if family.type == "counter":
            for s in family.samples:  # _created: only where serve did not turn it off
                assert s.name in (f"{family.name}_total", f"{family.name}_created"), s.name
    helps = [line for line in body.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len({line.split()[2] for line in helps}), "a family twice"


@pytest.mark.parametrize("transport", sorted(SCRAPES))
async def test_promtool_accepts_the_scrape(transport: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus; .ci/run does)")
    body = await scrape(transport)
    check = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr
