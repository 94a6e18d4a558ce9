"""``mmadmit_client``: one model, one ``Client`` over every transport, its own distribution.

Contract pinned here:

* one :class:`~mmadmit_client.Request` goes over the gRPC and the ZMQ transport
  to the real server (ephemeral loopback ports) and both give the same
  :class:`~mmadmit_client.Materialized` (ids, items' hash / pad value / spans,
  M-RoPE positions and delta); ``admit_many`` answers each request once on
  both (gRPC: one ``AdmitStream``); ``abort`` cancels a held request, which
  still gets its one outcome, ``CANCELLED``; what a transport cannot do is
  :class:`~mmadmit_client.UnsupportedOperation`, what gRPC cannot express a
  ``ValueError`` before anything is sent;
* the client's codec round-trips every wire vector through the service's
  codec: decoded by the client and re-encoded, the service decodes the same
  request, passthrough fields included;
* :class:`~mmadmit_client.MemoryTransport` hands the very request to a handler
  and its outcome back, times out as :class:`~mmadmit_client.RequestTimeout`,
  passes the handler's exceptions through, and the client's state machine
  holds over it;
* :class:`~mmadmit_client.BlockingClient` has the same methods, over the
  in-memory and the ZMQ transport;
* the client's import graph holds nothing of the service (``mmadmit``) and no
  torch, with every module of the library and CLI loaded (a fresh interpreter);
* the wheel built from ``clients/`` alone is ``mmadmit-client``, carries the
  generated protobuf modules, and requires neither torch nor ``mmadmit``.

Run with: python -m pytest tests/test_client.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import mmadmit_client as mc
import numpy as np
import pytest
from conftest import CONFIGS, REPO_ROOT, load_vector, until, vector_names
from conftest import serving as in_process_server
from mmadmit import wire as server_wire
from mmadmit.server import ServerHandle
from mmadmit_client import wire as client_wire

QWEN35_IMAGE = 248056  # Qwen3.5 <|image_pad|>
NAMES = vector_names()


class Hold:
    """The pool's ``before_run`` hook: requests whose id starts with ``hold`` wait for
    :meth:`release` (so an abort finds them in flight)."""

    def __init__(self) -> None:
        self._gate = threading.Event()

    def __call__(self, req: Any) -> None:
        if req.rid.startswith("hold"):
            self._gate.wait(30)

    def release(self) -> None:
        self._gate.set()

    def arm(self) -> None:
        """Hold the next ``hold*`` requests again (after a :meth:`release`)."""
        self._gate = threading.Event()


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[ServerHandle]:
    hold = Hold()
    async with in_process_server(
        model=str(CONFIGS / "qwen3_5.json"),
        metrics_listen="127.0.0.1:0",
        workers=2,
        before_run=hold,
        release=hold.release,
    ) as handle:
        handle.hold = hold  # type: ignore[attr-defined]
        yield handle


def image_request(rid: str, *, content_hash: int | None = None) -> mc.Request:
    """Qwen3.5, 40 tokens, one 8x8-patch image (16 placeholders)."""
    ids = np.full(40, 100, np.int64)
    ids[10:26] = QWEN35_IMAGE
    item = mc.Item(
        "image",
        [(10, 25)],
        feature=np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
        hash=content_hash,
        side={"image_grid_thw": mc.grid([1, 8, 8])},
    )
    return mc.Request(rid, ids, [item])


def transports(handle: ServerHandle) -> dict[str, Any]:
    return {
        "grpc": mc.GrpcTransport(handle.addresses["grpc"]),
        "zmq": mc.ZmqTransport(handle.addresses["zmq"], timeout_s=10),
    }


def derived(out: mc.Outcome) -> dict[str, Any]:
    assert isinstance(out, mc.Materialized), out
    return {
        "input_ids": out.input_ids.tolist(),
        "unpadded": None if out.input_ids_unpadded is None else out.input_ids_unpadded.tolist(),
        "items": [(it.modality, it.hash, it.pad_value, it.offsets.tolist()) for it in out.items],
        "positions": None if out.mrope_positions is None else out.mrope_positions.tolist(),
        "delta": out.mrope_position_delta,
    }


# --------------------------------------------------------------------------- real server


async def test_one_request_over_both_transports_gives_one_outcome() -> None:
    async with serving() as handle:
        got = {}
        for name, transport in transports(handle).items():
            async with mc.Client(transport, timeout_s=10) as client:
                await client.wait_ready(5)
                got[name] = await client.admit(image_request(f"both-{name}"))
                hashed = await client.admit(image_request(f"h-{name}", content_hash=2**64 - 1))
                assert isinstance(hashed, mc.Materialized) and hashed.items[0].hash == 2**64 - 1
        assert derived(got["grpc"]) == derived(got["zmq"])
        g, z = got["grpc"], got["zmq"]
        assert (g.request_id, z.request_id) == ("both-grpc", "both-zmq")
        assert isinstance(g, mc.Materialized) and isinstance(z, mc.Materialized)
        assert g.passthrough is False and z.passthrough is None  # not on the msgpack wire
        assert z.frames and not g.frames  # the ZMQ reply as received
        pad = g.items[0].pad_value
        assert g.input_ids[10:26].tolist() == [pad] * 16
        assert g.input_ids_unpadded is not None and g.input_ids_unpadded[10] == QWEN35_IMAGE
        assert g.mrope_positions is not None and g.mrope_positions.shape == (3, 40)
        assert g.code == z.code == "MATERIALIZED"


async def test_admit_many_abort_and_what_a_transport_cannot_do() -> None:
    async with serving() as handle:
        for name, transport in transports(handle).items():
            async with mc.Client(transport, timeout_s=10) as client:
                requests = [image_request(f"{name}-m{i}") for i in range(6)]
                requests.append(mc.Request(f"{name}-bad", [1, 2], [mc.Item("image", [(5, 9)])]))
                outcomes = [o async for o in client.admit_many(requests)]
                by_id = {o.request_id: o for o in outcomes}
                assert sorted(by_id) == sorted(r.request_id for r in requests)
                bad = by_id[f"{name}-bad"]
                assert isinstance(bad, mc.Aborted) and bad.code == "INVALID_REQUEST", bad
                assert all(o.materialized for k, o in by_id.items() if k != f"{name}-bad")

                hold = handle.hold  # type: ignore[attr-defined]
                hold.arm()
                await until(lambda: handle.pool.inflight == 0)
                held = asyncio.ensure_future(client.admit(image_request(f"hold-{name}")))
                await until(lambda: handle.pool.inflight == 1)  # taken, held by the hook
                assert await client.abort(f"hold-{name}") is True
                out = await asyncio.wait_for(held, 10)
                assert isinstance(out, mc.Aborted) and out.code == "CANCELLED", out
                hold.release()

                if name == "zmq":
                    with pytest.raises(mc.UnsupportedOperation):
                        await client.health()
                    with pytest.raises(mc.UnsupportedOperation):
                        await client.model_info()
                    marked = dataclasses.replace(image_request("marked"), validation_error="x")
                    out = await client.admit(marked)
                    assert isinstance(out, mc.Aborted) and out.code == "INVALID_REQUEST"
                else:
                    assert await client.health() == "SERVING"
                    info = await client.model_info()
                    assert isinstance(info, mc.ModelInfo) and info.family == "qwen3_5"
                    marked = dataclasses.replace(image_request("marked"), validation_error="x")
                    with pytest.raises(ValueError, match="validation_error"):
                        await client.admit(marked)  # nothing sent: gRPC has no such field
                    with pytest.raises(ValueError, match="uint32"):
                        await client.admit(mc.Request("neg", [-1, 2]))


async def test_nothing_listening_is_server_unavailable() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for transport in (
        mc.GrpcTransport(f"127.0.0.1:{port}"),
        mc.ZmqTransport(f"tcp://127.0.0.1:{port}"),
    ):
        async with mc.Client(transport) as client:
            with pytest.raises(mc.ServerUnavailable):
                await client.wait_ready(0.5)


# --------------------------------------------------------------------------- the codec


@pytest.mark.skipif(not NAMES, reason="no wire vectors (set MMADMIT_VECTORS)")
@pytest.mark.parametrize("name", NAMES)
def test_client_codec_round_trips_every_vector_through_the_service_codec(name: str) -> None:
    v = load_vector(name)
    sent = server_wire.decode_message(list(v.frames)).request
    assert sent is not None
    req = client_wire.decode_add(v.frames)
    assert req.request_id == sent.rid
    assert req.input_ids.tolist() == sent.input_ids.tolist()
    assert len(req.items) == (len(sent.mm.items) if sent.mm is not None else 0)
    # under a new id: every other field as received, what the model does not carry included
    back = server_wire.decode_message(client_wire.encode_add(req.with_request_id("again")))
    assert back.request is not None and back.request.rid == "again"
    renamed = dataclasses.replace(sent, rid="again")
    assert server_wire.encode_request(back.request)[0] == server_wire.encode_request(renamed)[0]
    # and built afresh (no wire fields): the same request for the service
    fresh = dataclasses.replace(req, wire_fields=None, items=tuple(
        dataclasses.replace(it, wire_elements=None) for it in req.items
    ))  # fmt: skip
    rebuilt = server_wire.decode_message(client_wire.encode_add(fresh)).request
    assert rebuilt is not None
    assert rebuilt.input_ids.tolist() == sent.input_ids.tolist()
    if sent.mm is not None:
        assert rebuilt.mm is not None
        for a, b in zip(rebuilt.mm.items, sent.mm.items, strict=True):
            assert (a.modality, a.hash, a.pad_value) == (b.modality, b.hash, b.pad_value)
            assert a.offsets.tolist() == b.offsets.tolist()
            assert (a.feature is None) == (b.feature is None)
            if a.feature is not None and b.feature is not None:
                assert bytes(a.feature.data) == bytes(b.feature.data)
            assert sorted(a.side) == sorted(b.side)


def test_client_codec_refuses_pickle_and_reports_broken_replies() -> None:
    import msgspec

    ext = msgspec.msgpack.Ext
    item = [1, None, None, [[0, 0]], ["float32", [1], ext(1, b"x")]]
    payload = [client_wire.TAG, "p", None, None, [1]] + [None] * 17 + [[[item]]]
    pickled = msgspec.msgpack.encode(payload)
    with pytest.raises(client_wire.WireFormatError, match="pickle"):
        client_wire.decode_request(pickled)
    rid, err = client_wire.decode_reply(
        [b"\x07", msgspec.msgpack.encode([client_wire.TAG, "r", None, None, []])]
    )
    assert rid == "r" and isinstance(err, client_wire.WireFormatError)
    assert client_wire.decode_reply([b"\x00"])[0] == ""


# --------------------------------------------------------------------------- in memory


async def test_memory_transport_hands_the_request_to_the_handler() -> None:
    seen: list[mc.Request] = []

    async def handler(request: mc.Request) -> mc.Outcome:
        seen.append(request)
        if request.request_id == "slow":
            await asyncio.sleep(10)
        if request.request_id == "down":
            raise mc.ServerUnavailable("nobody home")
        if not request.items:
            return mc.Aborted(request.request_id, "INVALID_REQUEST", "no items")
        return mc.Materialized(request.request_id, request.input_ids + 1, request.input_ids)

    transport = mc.MemoryTransport(handler)
    client = mc.Client(transport)
    assert client.state is mc.ClientState.UNOPENED
    with pytest.raises(mc.ClientStateError):
        await client.admit(image_request("early"))
    async with client:
        assert client.state is mc.ClientState.OPENED
        req = image_request("r1")
        out = await client.admit(req)
        assert seen[-1] is req  # the very request, nothing encoded in between
        assert (
            isinstance(out, mc.Materialized)
            and out.input_ids.tolist() == (req.input_ids + 1).tolist()
        )
        text = await client.admit(mc.Request("t", [1, 2]))
        assert isinstance(text, mc.Aborted) and (text.code, text.message) == (
            "INVALID_REQUEST",
            "no items",
        )
        with pytest.raises(mc.RequestTimeout):
            await client.admit(mc.Request("slow", [1]), timeout_s=0.05)
        with pytest.raises(mc.ServerUnavailable, match="nobody home"):
            await client.admit(mc.Request("down", [1]))
        many = [
            o.request_id
            async for o in client.admit_many([image_request("a"), mc.Request("b", [1])])
        ]
        assert sorted(many) == ["a", "b"]
        assert await client.abort("a", "b") is True and transport.aborted == ["a", "b"]
        assert await client.health() == "SERVING"
        with pytest.raises(mc.UnsupportedOperation):
            await client.model_info()
    assert client.state is mc.ClientState.CLOSED
    with pytest.raises(mc.ClientStateError):
        await client.open()
    assert [r.request_id for r in transport.requests][:2] == ["r1", "t"]


def test_blocking_client_same_methods_in_memory() -> None:
    async def handler(request: mc.Request) -> mc.Outcome:
        return mc.Materialized(request.request_id, request.input_ids, None)

    info = mc.ModelInfo("f", "t", ("A",), 10, None, None, None, None, "both", False, True, False)
    with mc.BlockingClient(mc.MemoryTransport(handler, model_info_value=info)) as client:
        assert client.state is mc.ClientState.OPENED
        assert client.admit(mc.Request("one", [1])).request_id == "one"
        assert sorted(
            o.request_id for o in client.admit_many([mc.Request("x", [1]), mc.Request("y", [2])])
        ) == ["x", "y"]
        assert client.model_info() == info and client.health() == "SERVING"
        assert client.abort("x") is True
    assert client.state is mc.ClientState.CLOSED
    with pytest.raises(mc.ClientStateError):
        client.admit(mc.Request("late", [1]))


async def test_blocking_client_over_zmq() -> None:
    async with serving() as handle:

        def blocking() -> list[str]:
            transport = mc.ZmqTransport(handle.addresses["zmq"], timeout_s=10)
            with mc.BlockingClient(transport) as client:
                client.wait_ready(5)
                one = client.admit(image_request("sync-1"))
                bad = mc.Request("sync-3", [1, 2], [mc.Item("image", [(5, 9)])])  # past the ids
                many = list(client.admit_many([image_request("sync-2"), bad]))
            return [one.code, *sorted(o.code for o in many)]

        assert await asyncio.to_thread(blocking) == [
            "MATERIALIZED",
            "INVALID_REQUEST",
            "MATERIALIZED",
        ]


# --------------------------------------------------------------------------- its own distribution


def test_import_graph_has_no_service_and_no_torch() -> None:
    """Every module of the library and its CLI, loaded in a fresh interpreter where
    importing the service or torch fails: none is needed, none is loaded."""
    code = """
import sys
for name in ("mmadmit", "torch"):
    sys.modules[name] = None  # any import of it raises ImportError
import mmadmit_client
from mmadmit_client import GrpcTransport, ZmqTransport, request_to_proto, tls_credentials
import mmadmit_client.wire, mmadmit_client.frames, mmadmit_client.cli
import mmadmit_client._cli_request, mmadmit_client._cli_transport, mmadmit_client._bench
import mmadmit_client._transports.memory, mmadmit_client.proto.admission_pb2_grpc
loaded = sorted(m for m, v in sys.modules.items() if v is not None and (
    m == "mmadmit" or m.startswith("mmadmit.") or m == "torch" or m.startswith("torch.")))
assert not loaded, loaded
print("ok", len([m for m in sys.modules if m.startswith("mmadmit_client")]))
"""
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ok ")
    # `health` (a compose healthcheck) loads neither rich nor the codec
    health = """
import sys
from mmadmit_client.cli import main
assert main(["health", "grpc://127.0.0.1:1", "--timeout", "0.3"]) == 3
print(sorted(m for m in ("rich", "msgspec", "zmq", "mmadmit_client.wire") if m in sys.modules))
"""
    run = subprocess.run([sys.executable, "-c", health], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", (run.stdout, run.stderr)
    # the lazy exports: importing the package alone loads neither grpc nor zmq
    lazy = (
        "import sys, mmadmit_client; print(sorted(m for m in ('grpc', 'zmq') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", (run.stdout, run.stderr)


def _client_tree(dst: Path) -> Path:
    """``clients/``, ``protos/`` and the generator, as in the repository, without
    anything built (the generated modules included): the build must make them."""
    ignore = shutil.ignore_patterns("proto", "build", "*.egg-info", "__pycache__", "dist")
    shutil.copytree(REPO_ROOT / "clients", dst / "clients", ignore=ignore)
    shutil.copytree(REPO_ROOT / "protos", dst / "protos")
    (dst / "scripts").mkdir()
    shutil.copy(REPO_ROOT / "scripts" / "gen_protos.py", dst / "scripts" / "gen_protos.py")
    return dst / "clients"


@pytest.mark.timeout(300)
def test_client_wheel_requires_neither_torch_nor_the_service(tmp_path: Path) -> None:
    src = _client_tree(tmp_path / "tree")
    out = tmp_path / "dist"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = out.glob("mmadmit_client-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(meta).decode()
        entry_points = zf.read(meta.replace("METADATA", "entry_points.txt")).decode()
    assert "Name: mmadmit-client" in metadata
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]  # fmt: skip
    base = {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requires}
    assert not any(name.lower().startswith(("torch", "mmadmit")) for name in base), requires
    assert {"numpy", "msgspec", "pyzmq", "grpcio", "protobuf"} <= base, requires
    assert "mmadmit-client = mmadmit_client.cli:main" in entry_points
    assert "mmadmit_client/proto/admission_pb2.py" in names  # generated by the build
    assert "mmadmit_client/_transports/grpc.py" in names
    assert not [n for n in names if n.startswith("mmadmit/") or n.endswith((".so", ".c"))]
