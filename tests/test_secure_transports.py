"""Secure transports (docs/spec/CLI.md): gRPC over TLS and mutual TLS, ZMQ CURVE with an allow-list.

Contract pinned here:

* **TLS** (``--grpc-tls-cert``, ``--grpc-tls-key``): a client that trusts the
  CA is served (by IP and by DNS name); a plaintext client, and a TLS client
  that trusts another CA, are refused (``ServerUnavailable``, the latter naming
  the handshake).
* **Mutual TLS** (``--grpc-tls-client-ca``): a client without a certificate, or
  with one signed by another CA, is refused; one signed by the CA is served.
* **CURVE** (``--zmq-curve-secret-key``, ``--zmq-curve-clients``): a client key
  in the folder is materialized; a key not in it, and a client without CURVE,
  get no reply (``ServerUnavailable`` quickly, saying why) and nothing of theirs
  reaches the ingest; without a folder any CURVE client with the server key is
  served, a client without CURVE still not. The ZAP thread is gone after a
  stop and after a start that failed.
* ``mmadmit-client`` speaks both: ``admit`` and ``health`` over TLS and mutual
  TLS, ``admit`` over CURVE; a refused handshake is exit 3 with a message that
  says so; unusable security options or files are exit 2 with one line.
* ``mmadmit serve`` refuses every unusable combination or file with exit 2 and
  one line naming the flag;
* ``docs/security.md`` names only flags that exist.

Certificates are made with the ``openssl`` command (EC P-256, a few ms each):
a CA, a server certificate for ``IP:127.0.0.1`` and ``DNS:localhost``, a client
certificate from the CA and one from another CA. CURVE keys come from
``zmq.auth.create_certificates``. Servers are the real wiring
(``mmadmit.server.start_server``) in this process on ephemeral loopback ports;
the command-line client runs as a subprocess, awaited.

Run with: python -m pytest tests/test_secure_transports.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
import zmq
import zmq.auth
from client_helpers import run_cli_many
from conftest import communicate, serving
from mmadmit.config import build_config
from mmadmit.errors import ConfigError
from mmadmit.pool import MaterializerPool
from mmadmit.security import load_curve_server
from mmadmit.server import ServerHandle
from mmadmit.zmq_ingest import ZmqIngest
from mmadmit_client import (
    BlockingClient,
    Client,
    GrpcTransport,
    Materialized,
    RequestTimeout,
    ServerUnavailable,
    ZmqTransport,
    curve_keypair_from_file,
    curve_server_key_from_file,
    tls_credentials,
)
from mmadmit_client import Request as ClientRequest
from zmq.auth.thread import AuthenticationThread

OPENSSL = shutil.which("openssl")
MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
pytestmark = [
    pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command for test certificates"),
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE"),
    pytest.mark.timeout(90),
]
REFUSED_WITHIN_S = 2.0  # a refused handshake must be told well before any request timeout


# --------------------------------------------------------------------------- key material


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run(
        [OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN=mmadmit test {name}", cwd=d)  # fmt: skip


def _make_cert(d: Path, name: str, ca: str, serial: int, san: str | None = None) -> None:
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    ext: list[str] = []
    if san is not None:
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        ext = ["-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-set_serial", str(serial), "-days", "2",
             "-out", f"{name}.pem", *ext, cwd=d)  # fmt: skip


@dataclass(frozen=True)
class Pki:
    dir: Path

    def __getitem__(self, name: str) -> str:
        path = self.dir / name
        assert path.is_file(), path
        return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """TLS: ca, other-ca, server (127.0.0.1 + localhost), client (ca), rogue (other-ca).
    CURVE under curve/: server.key(_secret), allowed/client.key(_secret),
    other/rogue.key(_secret), allowed-public/client.key (the allow-list)."""
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_cert(d, "server", "ca", 2, san="IP:127.0.0.1,DNS:localhost")
    _make_cert(d, "client", "ca", 3)
    _make_cert(d, "rogue", "other-ca", 4)
    curve = d / "curve"
    curve.mkdir()
    zmq.auth.create_certificates(str(curve), "server")
    for folder, name in (("allowed", "client"), ("other", "rogue")):
        (curve / folder).mkdir()
        zmq.auth.create_certificates(str(curve / folder), name)
    # the allow-list folder holds public keys only, as an operator would ship it
    (curve / "allowed-public").mkdir()
    shutil.copy(curve / "allowed" / "client.key", curve / "allowed-public" / "client.key")
    return Pki(d)


# --------------------------------------------------------------------------- servers


@dataclass
class Servers:
    tls: ServerHandle  # TLS, CURVE with the allow-list folder
    mtls: ServerHandle  # mutual TLS, CURVE for any client with the server key


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(pki: Pki) -> AsyncIterator[Servers]:
    async with (
        serving(
            log_outcomes="off",
            grpc_tls_cert=pki["server.pem"],
            grpc_tls_key=pki["server.key"],
            zmq_curve_secret_key=pki["curve/server.key_secret"],
            zmq_curve_clients=str(pki.dir / "curve" / "allowed-public"),
        ) as tls,
        serving(
            log_outcomes="off",
            grpc_tls_cert=pki["server.pem"],
            grpc_tls_key=pki["server.key"],
            grpc_tls_client_ca=pki["ca.pem"],
            zmq_curve_secret_key=pki["curve/server.key_secret"],
        ) as mtls,
    ):
        yield Servers(tls, mtls)


def _ids(n: int = 12) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.int64)


async def grpc_admit(address: str, credentials: grpc.ChannelCredentials | None, rid: str) -> Any:
    async with Client(GrpcTransport(address, credentials=credentials)) as client:
        return await client.admit(ClientRequest(rid, _ids()), timeout_s=5)


async def grpc_refused(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """The ServerUnavailable message of a health check that must fail, within 2 s."""
    t0 = time.monotonic()
    async with Client(GrpcTransport(address, credentials=credentials)) as client:
        with pytest.raises(ServerUnavailable) as info:
            await client.health(timeout_s=5)
    assert time.monotonic() - t0 < REFUSED_WITHIN_S
    return str(info.value)


# --------------------------------------------------------------------------- gRPC TLS


@MODULE_LOOP
async def test_tls_accepted_with_the_ca(servers: Servers, pki: Pki) -> None:
    address = servers.tls.addresses["grpc"]
    creds = tls_credentials(ca=pki["ca.pem"])
    out = await grpc_admit(address, creds, "tls-1")
    assert isinstance(out, Materialized) and out.request_id == "tls-1"
    assert out.input_ids.tolist() == _ids().tolist()
    # by DNS name too: the certificate names localhost
    port = address.rpartition(":")[2]
    async with Client(GrpcTransport(f"localhost:{port}", credentials=creds)) as client:
        assert await client.health(timeout_s=5) == "SERVING"

    # the blocking client, on its own thread (this loop serves)
    def blocking() -> str:
        with BlockingClient(GrpcTransport(address, credentials=creds)) as client:
            return client.health(timeout_s=5)

    assert await asyncio.to_thread(blocking) == "SERVING"


@MODULE_LOOP
async def test_tls_refuses_plaintext_and_an_untrusted_server(servers: Servers, pki: Pki) -> None:
    address = servers.tls.addresses["grpc"]
    await grpc_refused(address, None)  # plaintext at a TLS port
    msg = await grpc_refused(address, tls_credentials(ca=pki["other-ca.pem"]))
    assert "handshake" in msg.lower()  # this side refused the server's certificate


@MODULE_LOOP
async def test_mutual_tls_needs_a_client_certificate_from_the_ca(
    servers: Servers, pki: Pki
) -> None:
    address = servers.mtls.addresses["grpc"]
    await grpc_refused(address, None)
    await grpc_refused(address, tls_credentials(ca=pki["ca.pem"]))  # no client certificate
    rogue = tls_credentials(ca=pki["ca.pem"], cert=pki["rogue.pem"], key=pki["rogue.key"])
    await grpc_refused(address, rogue)  # signed by another CA
    good = tls_credentials(ca=pki["ca.pem"], cert=pki["client.pem"], key=pki["client.key"])
    out = await grpc_admit(address, good, "mtls-1")
    assert isinstance(out, Materialized) and out.request_id == "mtls-1"


def test_tls_credentials_name_unusable_files(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing.pem"):
        tls_credentials(ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="no PEM certificate"):
        tls_credentials(ca=pki["server.key"])
    with pytest.raises(ValueError, match="no PEM private key"):
        tls_credentials(ca=pki["ca.pem"], cert=pki["client.pem"], key=pki["client.pem"])
    with pytest.raises(ValueError, match="needs its key"):
        tls_credentials(cert=pki["client.pem"])


# --------------------------------------------------------------------------- ZMQ CURVE


def _curve(pki: Pki, client: str | None) -> dict[str, Any]:
    keys: dict[str, Any] = {"curve_server_key": curve_server_key_from_file(pki["curve/server.key"])}
    if client is not None:
        keys["curve_keypair"] = curve_keypair_from_file(pki[client])
    return keys


async def zmq_admit(endpoint: str, rid: str, **keys: Any) -> Any:
    async with Client(ZmqTransport(endpoint, timeout_s=5, **keys)) as client:
        await client.wait_ready(5)
        return await client.admit(ClientRequest(rid, _ids()))


async def zmq_refused(endpoint: str, handle: ServerHandle, **keys: Any) -> str:
    """A client that must get nowhere: no connection, no reply, nothing reaches intake."""
    received = handle.zmq.stats.received
    t0 = time.monotonic()
    async with Client(ZmqTransport(endpoint, timeout_s=1.0, **keys)) as client:
        with pytest.raises(ServerUnavailable) as info:
            await client.wait_ready(1.0)
        with pytest.raises((ServerUnavailable, RequestTimeout)):
            await client.admit(ClientRequest("refused", _ids()), timeout_s=0.5)
    assert time.monotonic() - t0 < REFUSED_WITHIN_S + 1.0
    assert handle.zmq.stats.received == received, "a refused peer's message reached intake"
    return str(info.value)


@MODULE_LOOP
async def test_curve_allow_list_admits_a_listed_key(servers: Servers, pki: Pki) -> None:
    endpoint = servers.tls.addresses["zmq"]
    out = await zmq_admit(endpoint, "curve-1", **_curve(pki, "curve/allowed/client.key_secret"))
    assert out.materialized and out.request_id == "curve-1"
    assert out.input_ids.tolist() == _ids().tolist()

    def blocking() -> bool:  # the blocking client takes the same keys
        keys = _curve(pki, "curve/allowed/client.key_secret")
        with BlockingClient(ZmqTransport(endpoint, **keys)) as client:
            client.wait_ready(5)
            return client.admit(ClientRequest("curve-2", _ids())).materialized

    assert await asyncio.to_thread(blocking)


@MODULE_LOOP
async def test_curve_allow_list_refuses_other_keys_and_plain_clients(
    servers: Servers, pki: Pki
) -> None:
    handle = servers.tls
    endpoint = handle.addresses["zmq"]
    t0 = time.monotonic()
    msg = await zmq_refused(endpoint, handle, **_curve(pki, "curve/other/rogue.key_secret"))
    assert "refused this client's CURVE key" in msg
    msg = await zmq_refused(endpoint, handle, **_curve(pki, None))  # an ephemeral key
    assert "refused" in msg
    msg = await zmq_refused(endpoint, handle)  # no CURVE at all
    assert "CURVE" in msg
    assert time.monotonic() - t0 < 10


@MODULE_LOOP
async def test_curve_without_a_folder_admits_any_curve_client(servers: Servers, pki: Pki) -> None:
    handle = servers.mtls
    endpoint = handle.addresses["zmq"]
    for client in (None, "curve/other/rogue.key_secret"):
        out = await zmq_admit(endpoint, f"any-{client is None}", **_curve(pki, client))
        assert out.materialized
    await zmq_refused(endpoint, handle)  # still CURVE only
    wrong_server = {"curve_server_key": curve_server_key_from_file(pki["curve/other/rogue.key"])}
    msg = await zmq_refused(endpoint, handle, **wrong_server)
    assert "server's public key" in msg


async def test_a_connection_reset_mid_handshake_is_named_with_its_errno(pki: Pki) -> None:
    """A peer that resets every connection before its ZMTP greeting (what a
    loaded CURVE server can do to a plain client before the mismatch is read):
    the client says so, and still names CURVE as the likely cause."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def reset_all() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # linger 0: RST, not FIN

    resetter = asyncio.create_task(reset_all())
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        for keys, hint in (({}, "if the server speaks CURVE"), (_curve(pki, None), "public key")):
            async with Client(ZmqTransport(endpoint, timeout_s=1.0, **keys)) as client:
                with pytest.raises(ServerUnavailable) as info:
                    await client.wait_ready(1.0)
            msg = str(info.value)
            assert "handshake failed: " in msg and os.strerror(errno.ECONNRESET) in msg, msg
            assert hint in msg, msg
    finally:
        resetter.cancel()
        listener.close()


def _zap_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)]


async def test_zap_thread_stops_with_the_ingest_and_after_a_failed_start(
    pki: Pki, tmp_path: Path
) -> None:
    before = len(_zap_threads())
    curve = load_curve_server(
        pki["curve/server.key_secret"], str(pki.dir / "curve" / "allowed-public")
    )
    from mmadmit.materializer import Materializer
    from mmadmit.profile import load_profile

    pool = MaterializerPool(Materializer(load_profile("qwen2_5_vl")), workers=1, max_inflight=4)
    try:
        ingest = ZmqIngest(pool, listen="tcp://127.0.0.1:0", max_message_bytes=1 << 20, curve=curve)
        await ingest.start()
        assert len(_zap_threads()) == before + 1
        await asyncio.wait_for(ingest.stop(0.0), 10)  # term() would hang with ZAP running
        assert len(_zap_threads()) == before
        bad = ZmqIngest(pool, listen="tcp://no-such-host.invalid:1", max_message_bytes=1 << 20,
                        curve=curve)  # fmt: skip
        with pytest.raises(OSError):
            await bad.start()
        assert len(_zap_threads()) == before
    finally:
        pool.close()


# --------------------------------------------------------------------------- mmadmit-client


@pytest.fixture(scope="module")
def request_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("req") / "text.json"
    path.write_text('{"request_id": "cli-secure", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8]}\n')
    return str(path)


@contextlib.asynccontextmanager
async def plaintext_grpc() -> AsyncIterator[str]:
    """A bare plaintext gRPC server (health only) on loopback."""
    from grpc_health.v1 import health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@MODULE_LOOP
async def test_cli_speaks_tls_mutual_tls_and_curve(
    servers: Servers, pki: Pki, request_file: str
) -> None:
    tls = f"grpc://{servers.tls.addresses['grpc']}"
    mtls = f"grpc://{servers.mtls.addresses['grpc']}"
    ca = ("--tls-ca", pki["ca.pem"])
    cert = ("--tls-cert", pki["client.pem"], "--tls-key", pki["client.key"])
    server_key = ("--curve-server-key", pki["curve/server.key"])
    ok = [
        ("health", tls, *ca),
        ("admit", tls, request_file, "--json", *ca),
        ("health", mtls, *ca, *cert),
        ("model-info", mtls, "--json", *ca, *cert),
        ("admit", mtls, request_file, "--json", *ca, *cert),
        ("admit", servers.tls.addresses["zmq"], request_file, "--json", *server_key,
         "--curve-client-key", pki["curve/allowed/client.key_secret"]),
        ("admit", servers.mtls.addresses["zmq"], request_file, "--json", *server_key),
    ]  # fmt: skip
    refused = [
        ("health", tls),  # plaintext at a TLS port
        ("health", tls, "--tls-ca", pki["other-ca.pem"]),
        ("health", mtls, *ca),  # no client certificate
        ("admit", servers.tls.addresses["zmq"], request_file, *server_key,
         "--curve-client-key", pki["curve/other/rogue.key_secret"]),
        ("admit", servers.tls.addresses["zmq"], request_file, "--timeout", "1"),
    ]  # fmt: skip
    async with plaintext_grpc() as address:  # a TLS client at a plaintext port
        refused.append(("health", f"grpc://{address}", *ca))
        runs = await run_cli_many(*ok, *refused)
    for run in runs[: len(ok)]:
        assert run.rc == 0, run
    for run in runs[1 : len(ok)]:
        if run.args[0] == "admit":
            assert '"status": "materialized"' in run.stdout, run
    plain, untrusted, no_cert, rogue, no_curve, tls_at_plain = runs[len(ok) :]
    for run in runs[len(ok) :]:
        assert run.rc == 3, run
        assert "unreachable" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run
    assert "--tls-ca" in plain.stderr
    assert "certificate was not accepted" in untrusted.stderr
    assert "does not speak TLS" in tls_at_plain.stderr
    assert "client certificate" in no_cert.stderr
    assert "refused this client's CURVE key" in rogue.stderr
    assert "speaks CURVE" in no_curve.stderr  # the mismatch, or a reset before it was read


@MODULE_LOOP
async def test_cli_refuses_unusable_security_options(
    servers: Servers, pki: Pki, request_file: str, tmp_path: Path
) -> None:
    g = f"grpc://{servers.tls.addresses['grpc']}"
    z = servers.tls.addresses["zmq"]
    missing = str(tmp_path / "missing.pem")
    usage = [
        (("health", g, "--tls-ca", missing), "missing.pem"),
        (("health", g, "--tls-ca", pki["server.key"]), "no PEM certificate"),
        (("health", g, "--tls-cert", pki["client.pem"]), "--tls-key"),
        (("admit", g, request_file, "--curve-server-key", pki["curve/server.key"]), "ZMQ"),
        (("admit", z, request_file, "--tls-ca", pki["ca.pem"]), "gRPC"),
        (("admit", z, request_file, "--curve-client-key", pki["curve/allowed/client.key"]),
         "--curve-server-key"),
        (("admit", z, request_file, "--curve-server-key", pki["curve/server.key"],
          "--curve-client-key", pki["curve/allowed/client.key"]), "no secret key"),
        (("admit", z, request_file, "--curve-server-key", missing), "missing.pem"),
    ]  # fmt: skip
    runs = await run_cli_many(*(args for args, _ in usage))
    for run, (_, needle) in zip(runs, usage, strict=True):
        assert run.rc == 2, run
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], run


# --------------------------------------------------------------------------- serve: configuration


def _bad_configs(pki: Pki, tmp: Path) -> list[tuple[dict[str, str], str]]:
    """(settings, a fragment of the one error line); every one is exit 2."""
    empty = tmp / "empty-folder"
    empty.mkdir(exist_ok=True)
    garbage = tmp / "garbage.key"
    garbage.write_text("not a key\n")
    cert, key = pki["server.pem"], pki["server.key"]
    return [
        ({"grpc_tls_cert": cert}, "--grpc-tls-cert needs --grpc-tls-key"),
        ({"grpc_tls_key": key}, "--grpc-tls-key needs --grpc-tls-cert"),
        ({"grpc_tls_client_ca": pki["ca.pem"]}, "--grpc-tls-client-ca needs"),
        ({"grpc_tls_cert": str(tmp / "nope.pem"), "grpc_tls_key": key}, "nope.pem: no such file"),
        ({"grpc_tls_cert": str(tmp), "grpc_tls_key": key}, "is not a file"),
        ({"grpc_tls_cert": key, "grpc_tls_key": key}, "no PEM certificate"),
        ({"grpc_tls_cert": cert, "grpc_tls_key": pki["client.key"]}, "unusable pair"),
        ({"grpc_tls_cert": cert, "grpc_tls_key": key, "grpc_tls_client_ca": key},
         "--grpc-tls-client-ca"),
        ({"grpc_tls_cert": cert, "grpc_tls_key": key, "grpc_listen": "off"}, "--grpc-listen off"),
        ({"zmq_curve_clients": str(pki.dir / "curve" / "allowed-public")},
         "--zmq-curve-clients needs"),
        ({"zmq_curve_secret_key": pki["curve/server.key_secret"], "zmq_listen": "off"},
         "--zmq-listen off"),
        ({"zmq_curve_secret_key": pki["curve/server.key"]}, "holds no secret key"),
        ({"zmq_curve_secret_key": str(garbage)}, "not a zmq.auth key file"),
        ({"zmq_curve_secret_key": pki["curve/server.key_secret"], "zmq_curve_clients": str(empty)},
         "no client public key"),
        ({"zmq_curve_secret_key": pki["curve/server.key_secret"],
          "zmq_curve_clients": str(tmp / "none")}, "no such folder"),
    ]  # fmt: skip


def test_build_config_refuses_each_unusable_setting(pki: Pki, tmp_path: Path) -> None:
    for settings, fragment in _bad_configs(pki, tmp_path):
        with pytest.raises(ConfigError) as info:
            build_config(settings, environ={})
        assert fragment in str(info.value), (settings, str(info.value))
    # through the environment too, and the good combinations pass
    env = {"MMADMIT_GRPC_TLS_CERT": pki["server.pem"], "MMADMIT_GRPC_TLS_KEY": pki["server.key"]}
    assert build_config({}, environ=env).grpc_tls_key == pki["server.key"]
    with pytest.raises(ConfigError, match="--grpc-tls-cert needs"):
        build_config({}, environ={"MMADMIT_GRPC_TLS_CERT": pki["server.pem"]})


def _flag_args(settings: dict[str, str]) -> list[str]:
    return [x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), v)]


@pytest.fixture
def no_mmadmit_env() -> Iterator[dict[str, str]]:
    yield {k: v for k, v in os.environ.items() if not k.startswith("MMADMIT_")}


async def test_serve_exits_2_with_one_line_for_each(
    pki: Pki, tmp_path: Path, no_mmadmit_env: dict[str, str]
) -> None:
    cases = _bad_configs(pki, tmp_path)
    gate = asyncio.Semaphore(4)

    async def serve(settings: dict[str, str]) -> tuple[int, str]:
        async with gate:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mmadmit", "serve", "--metrics-listen", "off",
                *_flag_args(settings), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                env=no_mmadmit_env,
            )  # fmt: skip
            _, err = await communicate(proc, 30, f"serve {settings}")
            assert proc.returncode is not None
            return proc.returncode, err.decode()

    results = await asyncio.gather(*(serve(s) for s, _ in cases))
    for (settings, fragment), (rc, err) in zip(cases, results, strict=True):
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1, (settings, rc, err)
        assert fragment in lines[0] and "Traceback" not in err, (settings, err)


async def test_refused_tls_clients_leave_json_logs_json(
    pki: Pki, no_mmadmit_env: dict[str, str]
) -> None:
    """gRPC's core would log each failed TLS handshake as a plain line of its own:
    serve keeps it to errors, so every line of ``--log-format json`` stays JSON."""
    env = {k: v for k, v in no_mmadmit_env.items() if k != "GRPC_VERBOSITY"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mmadmit", "serve", "--device", "cpu", "--workers", "1",
        "--grpc-listen", "127.0.0.1:0", "--zmq-listen", "off", "--metrics-listen", "off",
        "--log-format", "json", "--log-outcomes", "all", "--grpc-tls-cert", pki["server.pem"],
        "--grpc-tls-key", pki["server.key"], stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        while True:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            assert line, "serve exited before ready: " + "".join(lines)
            lines.append(line)
            record = json.loads(line)
            if record.get("event") == "ready":
                break
        address = record["grpc"]
        for _ in range(3):  # plaintext at a TLS port: refused handshakes
            await grpc_refused(address, None)
        await grpc_admit(address, tls_credentials(pki["ca.pem"]), "json-ok")
        proc.send_signal(signal.SIGTERM)
        _, rest = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines += rest.decode().splitlines(keepends=True)
    assert proc.returncode == 0, "".join(lines)
    records = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
    assert any(r.get("rid") == "json-ok" for r in records)


# --------------------------------------------------------------------------- docs


def test_security_doc_names_only_real_flags() -> None:
    """docs/security.md's flags are those of ``mmadmit serve`` and ``mmadmit-client``."""
    import argparse
    import re

    from mmadmit.cli import build_parser as serve_parser
    from mmadmit_client.cli import build_parser as client_parser

    def flags(parser: argparse.ArgumentParser) -> set[str]:
        found = {s for a in parser._actions for s in a.option_strings}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found |= flags(sub)
        return found

    known = flags(serve_parser()) | flags(client_parser())
    doc = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w*-])", doc))
    assert {
        "--grpc-tls-client-ca",
        "--zmq-curve-clients",
        "--tls-ca",
        "--curve-client-key",
    } <= named
    assert named <= known, sorted(named - known)


async def test_the_smg_face_speaks_the_same_tls(pki: Pki) -> None:
    """``--smg-grpc-listen`` uses the gRPC TLS settings too (SMG's ``grpcs://``
    workers): a client with the CA gets the face's HealthCheck, a plaintext one is
    refused; the face may be the only gRPC server."""
    from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
    from smg_grpc_proto import tokenspeed_scheduler_pb2_grpc as ts_grpc

    async with serving(
        log_outcomes="off",
        grpc_listen="off",
        zmq_listen="off",
        smg_grpc_listen="127.0.0.1:0",
        engine_handshake_listen="tcp://127.0.0.1:0",
        grpc_tls_cert=pki["server.pem"],
        grpc_tls_key=pki["server.key"],
    ) as handle:
        address = handle.addresses["smg-grpc"]
        assert handle.smg_port.security == "TLS"
        creds = tls_credentials(ca=pki["ca.pem"])
        async with grpc.aio.secure_channel(address, creds) as channel:
            health = await ts_grpc.TokenSpeedSchedulerStub(channel).HealthCheck(
                ts.HealthCheckRequest(), timeout=5
            )
            assert not health.healthy  # no scheduler yet: but it answered over TLS
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ts_grpc.TokenSpeedSchedulerStub(channel).HealthCheck(
                    ts.HealthCheckRequest(), timeout=2
                )
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
