"""``mmadmit-client`` as a real command against real servers (docs/spec/CLI.md, ``mmadmit-client``).

Contract pinned here:

* ``admit`` reproduces every wire vector over both transports: a ``.frames``
  file goes out over ZMQ as captured and over gRPC translated into an
  ``AdmitRequest``; ``--json`` prints one object whose ids, items, positions
  and delta equal the vector's ``.npz`` (the error vector: aborted
  ``INVALID_REQUEST``); ``--out`` writes the reply frames, and the frames
  rebuilt from a gRPC outcome decode to what the ZMQ reply carries;
* the JSON example (``examples/request_qwen3_5.json``) materializes over both
  transports with identical results, its bfloat16 feature hashed by the service
  exactly as the file describes it;
* exit status 0 materialized, 1 aborted, 2 unusable arguments or file, 3
  unreachable;
* ``health`` exits 0 only when SERVING: NOT_SERVING during a drain (SIGTERM's
  path, ``server.shutdown``, with a request held in flight) is 1, and
  unreachable is 3;
* ``model-info --json`` is the loaded profile;
* ``bench`` runs over both transports, prints its tables, accounts for every
  request (``sent == received``), and ``--plot`` writes a PNG; without
  matplotlib, ``--plot`` is refused with the extra to install.

Servers are the real wiring (``mmadmit.server.start_server``) in this process on
ephemeral ports, one per vector family, started once for the module; the
command runs as a subprocess (the installed console script) awaited with
asyncio, so the servers keep serving meanwhile. The drain test has a server
of its own whose pool ``before_run`` hook holds one request (no timing).

Run with: python -m pytest tests/test_client_cli.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from client_helpers import CliRun, run_cli, run_cli_many
from conftest import (
    REPO_ROOT,
    Vector,
    config_for_family,
    free_port,
    load_vector,
    serving,
    vector_names,
)
from mmadmit import wire
from mmadmit.model import Request
from mmadmit.server import ServerHandle, shutdown
from mmadmit_client import Client, GrpcTransport, Item, Materialized, grid
from mmadmit_client import Request as ClientRequest
from mmadmit_client._cli_request import UsageError, request_from_json
from mmadmit_client.frames import pack_frames, parse_frames

NAMES = vector_names()
EXAMPLE = REPO_ROOT / "examples" / "request_qwen3_5.json"
TRANSPORTS = ("grpc", "zmq")
MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

pytestmark = [
    pytest.mark.skipif(not NAMES, reason="no wire vectors (set MMADMIT_VECTORS)"),
    pytest.mark.timeout(120),
]


COLUMNS = 140  # rich tables: one stable width, no wrapping


async def cli(*args: str, timeout_s: float = 60.0, argv0: list[str] | None = None) -> CliRun:
    """``mmadmit-client ARGS``, its tables ``COLUMNS`` wide (:func:`run_cli`)."""
    return await run_cli(*args, columns=COLUMNS, timeout_s=timeout_s, argv0=argv0)


async def cli_many(*commands: tuple[str, ...], parallel: int = 4) -> list[CliRun]:
    return await run_cli_many(*commands, parallel=parallel, columns=COLUMNS)


# --------------------------------------------------------------------------- servers


class Hold:
    """``before_run`` hook holding requests whose rid starts with ``hold`` (10 s at most)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, req: Request) -> None:
        if req.rid.startswith("hold"):
            self.entered.release()
            self.gate.wait(10)


@dataclass
class Servers:
    by_family: dict[str, ServerHandle]

    def target(self, family: str, transport: str) -> str:
        addresses = self.by_family[family].addresses
        return f"grpc://{addresses['grpc']}" if transport == "grpc" else addresses["zmq"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers() -> AsyncIterator[Servers]:
    families = sorted({load_vector(n).meta["family"] for n in NAMES} | {"qwen3_5"})
    async with contextlib.AsyncExitStack() as stack:
        handles = {}
        for family in families:
            handles[family] = await stack.enter_async_context(
                serving(model=str(config_for_family(family)))
            )
        yield Servers(handles)


# --------------------------------------------------------------------------- admit: vectors


@dataclass
class Admitted:
    vec: Vector
    sent: Request  # the vector decoded by the codec
    runs: dict[str, CliRun]
    replies: dict[str, list[memoryview]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def admitted(
    servers: Servers, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Admitted]:
    """``admit --json --out`` of every vector over both transports, run once."""
    tmp = tmp_path_factory.mktemp("replies")
    vectors = {n: load_vector(n) for n in NAMES}
    commands = []
    for name, vec in vectors.items():
        for transport in TRANSPORTS:
            target = servers.target(vec.meta["family"], transport)
            out = tmp / f"{name}.{transport}.frames"
            commands.append(("admit", target, str(vec.frames_path), "--json", "--out", str(out)))
    runs = iter(await cli_many(*commands))
    result = {}
    for name, vec in vectors.items():
        msg = wire.decode_message(list(vec.frames))
        assert msg.request is not None
        got = {t: next(runs) for t in TRANSPORTS}
        replies = {
            t: parse_frames((tmp / f"{name}.{t}.frames").read_bytes())
            for t in TRANSPORTS
            if (tmp / f"{name}.{t}.frames").is_file()
        }
        result[name] = Admitted(vec, msg.request, got, replies)
    return result


def _check_outcome(vec: Vector, sent: Request, doc: dict[str, Any], transport: str) -> None:
    arrays = vec.arrays
    assert doc["transport"] == transport
    assert doc["request_id"] == sent.rid
    if vec.error:
        assert doc["status"] == "aborted"
        assert doc["abort"]["code"] == "INVALID_REQUEST", doc["abort"]
        assert doc["input_ids"] is None
        return
    assert doc["status"] == "materialized" and doc["abort"] is None
    assert doc["num_tokens"] == len(arrays["input_ids_padded"])
    np.testing.assert_array_equal(doc["input_ids"], arrays["input_ids_padded"])
    if transport == "grpc":
        assert doc["passthrough"] is (sent.input_ids_unpadded is not None)
    else:
        assert doc["passthrough"] is None  # not on the msgpack wire
    if "item_pad_values" not in arrays:  # text
        assert doc["items"] == [] and doc["mrope_positions"] is None
        assert doc["input_ids_unpadded"] is None
        return
    np.testing.assert_array_equal(doc["input_ids_unpadded"], arrays["input_ids_unpadded"])
    items = doc["items"]
    assert len(items) == len(arrays["item_pad_values"])
    for i, item in enumerate(items):
        want_pad = int(arrays["item_pad_values"][i])
        assert item["pad_value"] == (None if want_pad == -1 else want_pad), f"item {i} pad"
        want_hash = None if arrays["item_hash_is_none"][i] else int(arrays["item_hashes"][i])
        assert item["hash"] == want_hash, f"item {i} hash"
    rows = sorted((i, s, e) for i, it in enumerate(items) for s, e in it["offsets"])
    assert rows == sorted(map(tuple, arrays["item_offsets"].tolist()))
    if "mrope_positions" in arrays:
        np.testing.assert_array_equal(doc["mrope_positions"], arrays["mrope_positions"])
        assert doc["mrope_position_delta"] == int(arrays["mrope_position_delta"][0, 0])
    else:
        assert doc["mrope_positions"] is None


@MODULE_LOOP
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", NAMES)
async def test_admit_vector(name: str, transport: str, admitted: dict[str, Admitted]) -> None:
    a = admitted[name]
    run = a.runs[transport]
    assert run.rc == (1 if a.vec.error else 0), run
    _check_outcome(a.vec, a.sent, run.json(), transport)
    assert "reply written to" in run.stderr
    reply = a.replies[transport]
    assert bytes(reply[0]) == (b"\x01" if a.vec.error else b"\x00")
    decoded = wire.decode_request(reply[1], list(reply[2:]))
    assert decoded.rid == a.sent.rid
    if a.vec.error:
        assert decoded.validation_error is not None
        assert decoded.validation_error.startswith("INVALID_REQUEST: ")
        assert decoded.mm is not None and all(it.feature is None for it in decoded.mm.items)
    else:
        assert decoded.validation_error is None
        np.testing.assert_array_equal(decoded.input_ids, a.vec.arrays["input_ids_padded"])


def _reply_fields(frames: list[memoryview]) -> dict[str, Any]:
    req = wire.decode_request(frames[1], list(frames[2:]))
    mm = req.mm
    out: dict[str, Any] = {
        "status": bytes(frames[0]),
        "rid": req.rid,
        "validation_error": req.validation_error,
        "input_ids": req.input_ids.tolist(),
        "unpadded": None if req.input_ids_unpadded is None else req.input_ids_unpadded.tolist(),
    }
    if mm is not None:
        out["items"] = [
            (it.modality, it.hash, it.pad_value, it.offsets.tolist(), it.feature is None)
            for it in mm.items
        ]
        out["positions"] = (
            None if mm.mrope_positions is None else mm.mrope_positions.to_numpy().tolist()
        )
        out["delta"] = (
            None if mm.mrope_position_delta is None else mm.mrope_position_delta.to_numpy().tolist()
        )
        out["delta_scalar"] = mm.mrope_position_delta_scalar
    return out


@MODULE_LOOP
@pytest.mark.parametrize("name", NAMES)
async def test_grpc_reply_frames_match_the_zmq_reply(
    name: str, admitted: dict[str, Admitted]
) -> None:
    """``--out`` over gRPC rebuilds, with the codec, the reply the ZMQ reply mode sends."""
    a = admitted[name]
    assert set(a.replies) == set(TRANSPORTS)
    assert _reply_fields(a.replies["grpc"]) == _reply_fields(a.replies["zmq"])


# --------------------------------------------------------------------------- admit: JSON


@MODULE_LOOP
async def test_example_json_materializes_over_both_transports(servers: Servers) -> None:
    runs = await cli_many(
        *(("admit", servers.target("qwen3_5", t), str(EXAMPLE), "--json") for t in TRANSPORTS)
    )
    docs = []
    for run in runs:
        assert run.rc == 0, run
        docs.append(run.json())
    g, z = docs
    for key in ("request_id", "input_ids", "input_ids_unpadded", "items", "mrope_positions",
                "mrope_position_delta"):  # fmt: skip
        assert g[key] == z[key], key
    spec = json.loads(EXAMPLE.read_text())
    assert g["request_id"] == spec["request_id"]
    expanded = [
        tok
        for e in spec["input_ids"]
        for tok in ([e["token"]] * e["count"] if isinstance(e, dict) else [e])
    ]
    assert g["input_ids_unpadded"] == expanded and len(expanded) == 66
    image, video = g["items"]
    # the image's feature: 64 x 4 bfloat16 0.25 (0x3E80), hashed by the service (BLAKE2b-8)
    feature = np.full(256, 0x3E80, "<u2").tobytes()
    assert image["hash"] == int.from_bytes(hashlib.blake2b(feature, digest_size=8).digest(), "big")
    assert video["hash"] == 0x9E3779B97F4A7C15
    assert image["offsets"] == [[5, 20]] and video["offsets"] == [[28, 43], [47, 62]]
    ids = np.array(g["input_ids"])
    unpadded = np.array(g["input_ids_unpadded"])
    for it in (image, video):
        for s, e in it["offsets"]:
            assert (ids[s : e + 1] == it["pad_value"]).all()
    changed = np.flatnonzero(ids != unpadded).tolist()
    assert changed == [*range(5, 21), *range(28, 44), *range(47, 63)]
    assert np.array(g["mrope_positions"]).shape == (3, len(ids))


@MODULE_LOOP
async def test_admit_readable_output_rid_and_aborts(servers: Servers, tmp_path: Path) -> None:
    """Readable output, ``--rid``, and a JSON request the service refuses (exit 1)."""
    bad = json.loads(EXAMPLE.read_text())
    bad["items"][0]["offsets"] = [[4, 19]]  # starts on vision_start: not a placeholder
    bad["request_id"] = "example-qwen3_5-bad"  # sent alongside the example: not a duplicate
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(json.dumps(bad))
    frames = str(load_vector("qwen3_5_image1").frames_path) if "qwen3_5_image1" in NAMES else None
    commands: list[tuple[str, ...]] = []
    for t in TRANSPORTS:
        target = servers.target("qwen3_5", t)
        commands += [("admit", target, str(EXAMPLE)), ("admit", target, str(bad_path), "--json")]
        if frames is not None:
            commands.append(("admit", target, frames, "--json", "--rid", f"renamed-{t}"))
    runs = await cli_many(*commands)
    per = len(commands) // len(TRANSPORTS)
    for k, t in enumerate(TRANSPORTS):
        readable, refused, *renamed = runs[k * per : (k + 1) * per]
        assert readable.rc == 0, readable
        assert "MATERIALIZED" in readable.stdout and "example-qwen3_5" in readable.stdout
        assert "video" in readable.stdout and "0x9e3779b97f4a7c15" in readable.stdout
        assert refused.rc == 1, refused
        doc = refused.json()
        assert doc["status"] == "aborted" and doc["abort"]["code"] == "INVALID_REQUEST"
        assert "item 0" in doc["abort"]["message"]
        for run in renamed:
            assert run.rc == 0, run
            assert run.json()["request_id"] == f"renamed-{t}"


# --------------------------------------------------------------------------- exit codes


@MODULE_LOOP
async def test_exit_codes_unusable_and_unreachable(servers: Servers, tmp_path: Path) -> None:
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello\n")
    typo = json.loads(EXAMPLE.read_text())
    typo["items"][0]["ofsets"] = typo["items"][0].pop("offsets")
    typo_path = tmp_path / "typo.json"
    typo_path.write_text(json.dumps(typo))
    vec = load_vector(NAMES[0])
    truncated = tmp_path / "cut.frames"
    truncated.write_bytes(vec.blob[:-7])
    marked = tmp_path / "marked.frames"  # validation_error set: gRPC cannot express it
    msg = wire.decode_message(list(vec.frames))
    assert msg.request is not None
    marked.write_bytes(
        pack_frames([b"\x00", *wire.encode_request(msg.request, validation_error="x")])
    )
    garbage = tmp_path / "garbage.frames"  # an ADD whose payload does not decode
    garbage.write_bytes(pack_frames([b"\x00", b"\xc1"]))
    g = servers.target("qwen3_5", "grpc")
    z = servers.target("qwen3_5", "zmq")
    dead = free_port()
    ex = str(EXAMPLE)
    # over ZMQ a captured message goes out as it is: the service answers it
    aborted = await cli("admit", z, str(garbage), "--json")
    assert aborted.rc == 1, aborted
    assert aborted.json()["abort"]["code"] == "INVALID_REQUEST"
    usage = [
        ("admit", g, str(not_json)),
        ("admit", z, str(typo_path)),
        ("admit", g, str(truncated)),
        ("admit", g, str(tmp_path / "missing.json")),
        ("admit", g, str(marked)),
        ("admit", g, str(garbage)),  # gRPC needs the decoded request
        ("admit", z, ex, "--out", str(tmp_path / "no" / "such" / "dir.frames")),
        ("admit", "http://127.0.0.1:1", ex),
        ("admit", "grpc://localhost", ex),
        ("admit", g),  # argparse: FILE missing
        ("health", z),  # gRPC only
        ("model-info", z),
        ("bench", g, ex, "--duration", "1", "--requests", "3"),  # exclusive
        ("bench", g, ex, "--concurrency", "0"),
    ]
    unreachable = [
        ("admit", f"grpc://127.0.0.1:{dead}", ex),
        ("admit", f"tcp://127.0.0.1:{dead}", ex, "--timeout", "0.5"),
        ("admit", f"ipc:///tmp/mmadmit-cli-test-{os.getpid()}.sock", ex, "--timeout", "0.5"),
        ("health", f"grpc://127.0.0.1:{dead}"),
        ("model-info", f"grpc://127.0.0.1:{dead}"),
        ("bench", f"tcp://127.0.0.1:{dead}", ex, "--requests", "2", "--timeout", "0.5"),
    ]
    runs = await cli_many(*usage, *unreachable, parallel=6)
    for run in runs[: len(usage)]:
        assert run.rc == 2, run
        assert run.stderr.strip() and not run.stdout.strip(), run
    assert "ofsets" in runs[1].stderr and "items[0]" in runs[1].stderr
    assert "validation_error" in runs[4].stderr
    assert "does not decode" in runs[5].stderr and "cannot write" in runs[6].stderr
    for run in runs[len(usage) :]:
        assert run.rc == 3, run
        assert "unreachable" in run.stderr.lower() or "no connection" in run.stderr, run


# --------------------------------------------------------------------------- health, model-info


@MODULE_LOOP
async def test_health_and_model_info(servers: Servers) -> None:
    g = servers.target("qwen3_5", "grpc")
    ok, quiet, info, readable = await cli_many(
        ("health", g),
        ("health", g, "--quiet"),
        ("model-info", g, "--json"),
        ("model-info", g),
    )
    assert (ok.rc, ok.stdout) == (0, "SERVING\n"), ok
    assert (quiet.rc, quiet.stdout) == (0, ""), quiet
    assert info.rc == 0, info
    doc = info.json()
    profile = servers.by_family["qwen3_5"].profile
    assert doc["family"] == profile.family.value == "qwen3_5"
    assert doc["image_token_id"] == 248056 and doc["video_token_id"] == 248057
    assert doc["audio_token_id"] is None and doc["uses_mrope"] is True
    assert doc["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert doc["vocab_size"] == profile.vocab_size and doc["role"] == "aggregated"
    assert readable.rc == 0 and "Qwen3_5ForConditionalGeneration" in readable.stdout


@MODULE_LOOP
async def test_health_not_serving_while_draining() -> None:
    """SIGTERM's drain (``server.shutdown``) with a request held on the worker: health
    exits 1 with NOT_SERVING, a new request is answered SHUTTING_DOWN (exit 1) on both
    transports, and the held request still materializes."""
    hold = Hold()
    model = config_for_family("qwen3_5")
    async with serving(
        model=str(model), before_run=hold, release=hold.gate.set, drain_timeout=10
    ) as handle:
        g = f"grpc://{handle.addresses['grpc']}"
        assert (await cli("health", g)).rc == 0
        async with Client(GrpcTransport(handle.addresses["grpc"])) as client:
            ids = np.full(40, 100, np.int64)
            ids[10:26] = 248056
            item = Item(
                "image", [(10, 25)], feature=np.ones((64, 4), np.float32),
                side={"image_grid_thw": grid([1, 8, 8])},
            )  # fmt: skip
            held = asyncio.ensure_future(
                client.admit(ClientRequest("hold-1", ids, [item]), timeout_s=20)
            )
            stopping: asyncio.Future[None] | None = None
            try:
                assert await asyncio.to_thread(hold.entered.acquire, True, 10), "not held"
                stopping = asyncio.ensure_future(shutdown(handle))
                for _ in range(500):
                    if handle.pool.draining:
                        break
                    await asyncio.sleep(0.01)
                assert handle.pool.draining
                health, late_g, late_z = await cli_many(
                    ("health", g),
                    ("admit", g, str(EXAMPLE), "--json"),
                    ("admit", handle.addresses["zmq"], str(EXAMPLE), "--json"),
                )
                assert (health.rc, health.stdout) == (1, "NOT_SERVING\n"), health
                for late in (late_g, late_z):
                    assert late.rc == 1, late
                    assert late.json()["abort"]["code"] == "SHUTTING_DOWN"
                assert not held.done()
            finally:
                hold.gate.set()
                outcome = await asyncio.wait_for(held, 10)
                if stopping is not None:
                    await asyncio.wait_for(stopping, 15)
            assert isinstance(outcome, Materialized)


# --------------------------------------------------------------------------- bench


def _bench_files() -> list[str]:
    files = [str(load_vector(n).frames_path) for n in NAMES if n.startswith("qwen3_5")]
    if "qwen3_omni_err_span_mismatch" in NAMES:  # aborts on a Qwen3.5 server: a second code
        files.append(str(load_vector("qwen3_omni_err_span_mismatch").frames_path))
    return [*files, str(EXAMPLE)]


@MODULE_LOOP
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bench(transport: str, servers: Servers, tmp_path: Path) -> None:
    target = servers.target("qwen3_5", transport)
    files = _bench_files()
    png = tmp_path / "bench.png"
    timed = await cli(
        "bench", target, *files, "--duration", "2", "--concurrency", "4", "--json",
        "--plot", str(png),
    )  # fmt: skip
    assert timed.rc == 0, timed
    doc = timed.json()
    assert doc["transport"] == transport and doc["concurrency"] == 4
    assert doc["sent"] == doc["received"] > len(files), doc
    assert doc["lost"] == 0 and doc["errors"] == {} and doc["all_received"] is True
    assert sum(doc["outcomes"].values()) == doc["received"]
    if any("err_span" in f for f in files):
        assert set(doc["outcomes"]) == {"MATERIALIZED", "INVALID_REQUEST"}, doc["outcomes"]
    else:
        assert set(doc["outcomes"]) == {"MATERIALIZED"}
    lat = doc["latency_ms"]
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert 1.9 < doc["elapsed_s"] < 30 and doc["throughput_rps"] > 0
    if transport == "zmq":
        assert doc["transport_counters"] == {"unmatched_replies": 0, "connection_resets": 0}
    blob = png.read_bytes()
    assert blob.startswith(b"\x89PNG\r\n\x1a\n") and len(blob) > 10_000

    counted = await cli("bench", target, *files, "--requests", "30", "--concurrency", "3")
    assert counted.rc == 0, counted
    for text in ("throughput", "p50", "p90", "p99", "max", "MATERIALIZED", "outcomes"):
        assert text in counted.stdout, counted
    assert "sent 30, received 30: every request got exactly one outcome" in counted.stdout


@MODULE_LOOP
async def test_bench_plot_without_matplotlib(tmp_path: Path) -> None:
    """``--plot`` without matplotlib: exit 2 naming the extra, before any connection."""
    argv0 = [
        sys.executable,
        "-c",
        "import sys; sys.modules['matplotlib'] = None; "
        "from mmadmit_client.cli import main; sys.exit(main())",
    ]
    run = await cli(
        "bench", f"grpc://127.0.0.1:{free_port()}", str(EXAMPLE), "--requests", "1",
        "--plot", str(tmp_path / "x.png"), argv0=argv0,
    )  # fmt: skip
    assert run.rc == 2, run
    assert "pip install 'mmadmit-client[plot]'" in run.stderr
    assert not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------- the JSON schema


def test_json_schema_runs_spans_hashes_and_tensors(tmp_path: Path) -> None:
    np.save(tmp_path / "f.npy", np.arange(6, dtype=np.float32).reshape(3, 2))
    doc = {
        "request_id": "s1",
        "input_ids": [1, {"token": 7, "count": 3}, 2, {"token": 8, "count": 0}],
        "placeholder_token_ids": {"image": 7},
        "mrope": {"delta": -2},
        "items": [
            {
                "modality": "IMAGE",
                "placeholders": [[1, 3]],
                "hash": "0xffffffffffffffff",
                "image_grid_thw": [1, 2, 6],
                "feature": {"dtype": "bfloat16", "values": [[1.0, -2.5], [3.0, 0.1]]},
                "side": {"extra": {"dtype": "int32", "shape": [2], "base64": "AQAAAAIAAAA="}},
                "encode_handshake": HANDSHAKE,
            },
            {
                "modality": "audio",
                "offsets": [[4, 4]],
                "pad_value": 5,
                "feature": {"npy": "f.npy"},
                "comment": "ignored",
            },
        ],
    }
    req = request_from_json(doc, base_dir=tmp_path)
    assert req.request_id == "s1" and req.input_ids.tolist() == [1, 7, 7, 7, 2]
    assert req.multimodal and req.mrope_position_delta == -2
    image, audio = req.items
    assert image.placeholder_token_id == 7 and audio.placeholder_token_id is None
    assert image.hash == 2**64 - 1 and image.offsets.tolist() == [[1, 3]]
    assert image.side["image_grid_thw"].to_numpy().tolist() == [[1, 2, 6]]
    assert image.feature is not None and image.feature.dtype == "bfloat16"
    # bfloat16 bits, rounded to nearest even: 1.0, -2.5, 3.0, 0.1 (0x3DCCCCCD -> 0x3DCD)
    assert np.frombuffer(image.feature.data, "<u2").tolist() == [0x3F80, 0xC020, 0x4040, 0x3DCD]
    assert image.side["extra"].to_numpy().tolist() == [1, 2]
    assert audio.pad_value == 5 and audio.offsets.tolist() == [[4, 4]]
    assert audio.feature is not None and audio.feature.to_numpy().tolist() == [  # type: ignore[union-attr]
        [0, 1],
        [2, 3],
        [4, 5],
    ]
    # the client's encoding of a JSON request decodes in the service's codec
    from mmadmit_client import wire as client_wire

    back = wire.decode_message(client_wire.encode_add(req)).request
    assert back is not None and back.input_ids.tolist() == req.input_ids.tolist()
    assert back.mm is not None and back.mm.im_token_id == 7
    assert back.mm.mrope_position_delta_scalar == -2
    assert [it.hash for it in back.mm.items] == [2**64 - 1, None]
    assert bytes(back.mm.items[0].feature.data) == bytes(image.feature.data)  # type: ignore[union-attr]
    assert image.encode_handshake == back.mm.items[0].encode_handshake == HANDSHAKE
    assert audio.encode_handshake is None is back.mm.items[1].encode_handshake


HANDSHAKE = {"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 2**62}


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"input_ids": [1], "itemz": []}, "unknown key(s) itemz"),
        ({"input_ids": [1, "x"]}, "input_ids[1]: must be an integer"),
        ({"input_ids": [1], "items": [{"modality": "smell", "offsets": []}]}, "items[0].modality"),
        ({"input_ids": [1], "items": [{"modality": "image"}]}, "exactly one of offsets"),
        ({"input_ids": [1], "items": [{"modality": "image", "offsets": [], "hash": 2**64}]},
         "items[0].hash"),
        ({"input_ids": [1], "items": [{"modality": "image", "offsets": [],
          "feature": {"dtype": "float32", "fill": 1}}]}, "'shape' is required with fill"),
        ({"input_ids": [1], "items": [{"modality": "image", "offsets": [],
          "feature": {"dtype": "int8", "values": [300]}}]}, "do not fit int8"),
        ({"input_ids": [1], "items": [{"modality": "image", "placeholders": [[0, 0]]}]},
         "at least one token"),
        ({"input_ids": [1], "items": [{"modality": "image", "offsets": [],
          "encode_handshake": {"bootstrap_host": "h", "bootstrap_port": 1}}]},
         "items[0].encode_handshake: 'bootstrap_room' is required"),
        ({"input_ids": [1], "items": [{"modality": "image", "offsets": [],
          "encode_handshake": {**HANDSHAKE, "bootstrap_port": -1}}]},
         "items[0].encode_handshake.bootstrap_port: -1 is below 0"),
    ],
)  # fmt: skip
def test_json_schema_errors_name_the_path(doc: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError) as info:
        request_from_json(doc, where="req.json")
    assert needle in str(info.value) and str(info.value).startswith("req.json: ")
