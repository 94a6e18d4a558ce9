"""Every wire vector reproduced exactly through the real ``mmadmit materialize`` command.

The command is run as a subprocess (``python -m mmadmit materialize``), its reply
container decoded with :mod:`mmadmit.wire`, and every derived field compared
with the vector's ``.npz``. Elements of the payload that mmadmit does not
interpret must come back byte-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mmadmit
import msgspec
import numpy as np
import pytest
from conftest import VECTORS, Vector, config_for_family, load_vector, vector_names
from mmadmit import wire
from mmadmit_client.frames import pack_frames, parse_frames

NAMES = vector_names()
# Top-level elements of TokenizedGenerateReqInput that mmadmit interprets.
INTERPRETED = {0, 1, 4, 21, 22, 23}
# Elements of MultimodalInputs / MultimodalDataItem that mmadmit re-encodes.
MM_INTERPRETED = {0, 1, 2, 3, 4, 5}
ITEM_INTERPRETED = {0, 1, 2, 4, 6}

_SPLIT = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _env() -> dict[str, str]:
    """The subprocess imports the same mmadmit as this process (installed or source)."""
    env = dict(os.environ)
    pkg_parent = str(Path(mmadmit.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    for key in [k for k in env if k.startswith("MMADMIT_")]:
        del env[key]  # flags only; no environment leaking into the model config
    return env


def _materialize(
    model: str | Path, src: str | Path, dst: str | Path, *flags: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``mmadmit materialize --model MODEL FLAGS SRC DST``, its output captured."""
    cmd = [sys.executable, "-m", "mmadmit", "materialize", "--model", str(model), *flags]
    return subprocess.run(
        [*cmd, str(src), str(dst)], input=stdin, capture_output=True, env=_env(), timeout=60
    )


def _params() -> list:
    if not NAMES:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no vectors at {VECTORS}"))]
    return NAMES


def _split(raw: bytes | memoryview | msgspec.Raw) -> list[bytes]:
    return [bytes(r) for r in _SPLIT.decode(raw)]


@pytest.fixture(scope="module", params=["on", "off"], ids=["native", "fallback"])
def replies(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple]:
    """Run the command once per vector (module scope keeps the suite fast), with native
    code on and with ``--native off`` (the Python fallbacks only): the same replies."""
    out: dict[str, tuple] = {}
    if not NAMES:
        return out
    tmp = tmp_path_factory.mktemp("replies")
    for name in NAMES:
        vec = load_vector(name)
        dst = tmp / f"{name}.reply"
        proc = _materialize(vec.config, vec.frames_path, dst, "--native", request.param)
        out[name] = (vec, proc, dst)
    return out


def _check_passthrough(req_payload: bytes | memoryview, reply_payload: bytes | memoryview) -> None:
    """Every element mmadmit does not interpret is byte-identical, at every level."""
    req = _split(req_payload)
    rep = _split(reply_payload)
    assert len(rep) == len(req), "the reply must keep every top-level element"
    for i, (a, b) in enumerate(zip(req, rep, strict=True)):
        if i not in INTERPRETED:
            assert a == b, f"top-level element {i} changed"
    # tag and rid are re-encoded from the same values: same bytes.
    assert rep[0] == req[0] and rep[1] == req[1]
    if req[22] == b"\xc0":
        assert rep[22] == b"\xc0"
        return
    mm_req, mm_rep = _split(req[22]), _split(rep[22])
    assert len(mm_rep) == len(mm_req)
    for i, (a, b) in enumerate(zip(mm_req, mm_rep, strict=True)):
        if i not in MM_INTERPRETED:
            assert a == b, f"multimodal_inputs element {i} changed"
    items_req, items_rep = _split(mm_req[0]), _split(mm_rep[0])
    assert len(items_rep) == len(items_req)
    for k, (ira, irb) in enumerate(zip(items_req, items_rep, strict=True)):
        ea, eb = _split(ira), _split(irb)
        assert len(eb) == len(ea)
        for i, (a, b) in enumerate(zip(ea, eb, strict=True)):
            if i not in ITEM_INTERPRETED:
                assert a == b, f"item {k} element {i} changed"
        # model_specific_data is re-emitted through the tensor writer: same values.
        assert msgspec.msgpack.decode(eb[6]) == msgspec.msgpack.decode(ea[6])
        assert msgspec.msgpack.decode(eb[0]) == msgspec.msgpack.decode(ea[0])


def _check_materialized(vec: Vector, reply: list[memoryview]) -> None:
    arrays = vec.arrays
    assert bytes(reply[0]) == b"\x00"
    req = wire.decode_request(reply[1], list(reply[2:]))
    assert req.validation_error is None
    assert req.rid == vec.meta.get("decoded_request", {}).get("rid", req.rid)
    np.testing.assert_array_equal(req.input_ids, arrays["input_ids_padded"])
    assert req.input_ids.dtype == np.int64
    _check_passthrough(vec.frames[1], reply[1])

    if "item_pad_values" not in arrays:  # text request
        np.testing.assert_array_equal(arrays["input_ids_unpadded"], arrays["input_ids_padded"])
        assert req.input_ids_unpadded is None or np.array_equal(
            req.input_ids_unpadded, arrays["input_ids_unpadded"]
        )
        assert req.mm is None or (not req.mm.items and req.mm.mrope_positions is None)
        return

    assert req.input_ids_unpadded is not None
    np.testing.assert_array_equal(req.input_ids_unpadded, arrays["input_ids_unpadded"])
    assert req.mm is not None
    items = req.mm.items
    assert len(items) == len(arrays["item_pad_values"])
    for i, item in enumerate(items):
        want_pad = int(arrays["item_pad_values"][i])
        assert item.pad_value == (None if want_pad == -1 else want_pad), f"item {i} pad_value"
        if arrays["item_hash_is_none"][i]:
            assert item.hash is None, f"item {i} hash"
        else:
            assert item.hash == int(arrays["item_hashes"][i]), f"item {i} hash"
    rows = [(i, int(s), int(e)) for i, it in enumerate(items) for s, e in it.offsets]
    assert sorted(rows) == sorted(map(tuple, arrays["item_offsets"].tolist()))

    # Every placeholder span holds its item's pad value in the padded ids.
    for i, s, e in rows:
        assert (req.input_ids[s : e + 1] == items[i].pad_value).all()

    if "mrope_positions" in arrays:
        pos = req.mm.mrope_positions
        assert pos is not None and pos.dtype.name == "int64"
        np.testing.assert_array_equal(pos.to_numpy(), arrays["mrope_positions"])
        delta = req.mm.mrope_position_delta
        assert delta is not None and delta.shape == (1, 1)
        np.testing.assert_array_equal(delta.to_numpy(), arrays["mrope_position_delta"])
        assert req.mm.mrope_position_delta_scalar == int(arrays["mrope_position_delta"][0, 0])
        meta_mm = vec.meta.get("multimodal", {})
        if "mrope_position_delta_scalar" in meta_mm:
            assert req.mm.mrope_position_delta_scalar == meta_mm["mrope_position_delta_scalar"]
    else:
        assert req.mm.mrope_positions is None

    # Received aux frames keep their indices: the same bytes at the same places.
    for k, frame in enumerate(vec.frames[2:]):
        if bytes(frame):
            assert bytes(reply[2 + k]) == bytes(frame), f"aux frame {k + 1} moved or changed"


@pytest.mark.parametrize("name", _params())
def test_vector_through_cli(name: str, replies: dict[str, tuple]) -> None:
    vec, proc, dst = replies[name]
    reply = parse_frames(dst.read_bytes())
    if vec.error:
        assert proc.returncode == 1, proc.stderr.decode()
        assert b"INVALID_REQUEST" in proc.stderr
        assert bytes(reply[0]) == b"\x01"
        req = wire.decode_request(reply[1], list(reply[2:]))
        assert req.validation_error is not None
        assert req.validation_error.startswith("INVALID_REQUEST: ")
        assert req.rid == vec.meta["decoded_request"]["rid"]
        # features removed from an aborted reply
        assert req.mm is not None and all(it.feature is None for it in req.mm.items)
        np.testing.assert_array_equal(req.input_ids, vec.arrays["input_ids_unpadded"])
        return
    assert proc.returncode == 0, proc.stderr.decode()
    _check_materialized(vec, reply)


def test_prefill_role_reproduces_vectors(tmp_path: Path) -> None:
    """The prefill role behaves exactly like aggregated (docs/spec/MATERIALIZE.md definitions)."""
    if not NAMES:
        pytest.skip(f"no vectors at {VECTORS}")
    name = "qwen3_5_mixed" if "qwen3_5_mixed" in NAMES else NAMES[0]
    vec = load_vector(name)
    dst = tmp_path / "out"
    proc = _materialize(vec.config, vec.frames_path, dst, "--role", "prefill")
    assert proc.returncode == (1 if vec.error else 0), proc.stderr.decode()
    if not vec.error:
        _check_materialized(vec, parse_frames(dst.read_bytes()))


def test_stdin_stdout(replies: dict[str, tuple]) -> None:
    if not NAMES:
        pytest.skip(f"no vectors at {VECTORS}")
    name = "qwen3_5_image1" if "qwen3_5_image1" in NAMES else NAMES[0]
    vec, _proc, dst = replies[name]
    proc = _materialize(vec.config, "-", "-", stdin=vec.blob)
    assert proc.returncode == (1 if vec.error else 0), proc.stderr.decode()
    assert proc.stdout == dst.read_bytes()  # same bytes as the file-to-file run
    parse_frames(proc.stdout)


def test_error_vector_stdout_and_message() -> None:
    errs = [n for n in NAMES if load_vector(n).error]
    if not errs:
        pytest.skip("no error vector")
    vec = load_vector(errs[0])
    proc = _materialize(vec.config, "-", "-", stdin=vec.blob)
    assert proc.returncode == 1
    err = proc.stderr.decode()
    assert "INVALID_REQUEST" in err
    assert "item 0" in err and "span 0" in err  # names what is wrong
    reply = parse_frames(proc.stdout)
    assert bytes(reply[0]) == b"\x01"
    # the feature frame is blanked, other indices stay valid
    assert len(reply) == len(vec.frames)
    assert all(len(f) == 0 for f in reply[2:])


def test_missing_input_file_exits_2(tmp_path: Path) -> None:
    proc = _materialize(config_for_family("qwen3_5"), tmp_path / "nope.frames", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip()
    assert not (tmp_path / "out").exists()


def test_bad_role_exits_2_with_one_line(tmp_path: Path) -> None:
    src = tmp_path / "in.frames"
    src.write_bytes(pack_frames([b"\x00", b"\x90"]))
    proc = _materialize(config_for_family("qwen3_5"), src, tmp_path / "out", "--role", "bogus")
    assert proc.returncode == 2
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "role" in lines[0]
    assert not (tmp_path / "out").exists()


def test_not_a_frames_container_exits_2(tmp_path: Path) -> None:
    src = tmp_path / "in.frames"
    src.write_bytes(b"garbage")
    proc = _materialize("qwen3_5", src, tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip()


def test_broken_message_answers_minimal_abort(tmp_path: Path) -> None:
    """A message too broken to decode still gets a reply that decodes (exit 1)."""
    src = tmp_path / "in.frames"
    src.write_bytes(
        pack_frames([b"\x07", msgspec.msgpack.encode(["TokenizedGenerateReqInput", "r1"])])
    )
    dst = tmp_path / "out"
    proc = _materialize("qwen3_5", src, dst)
    assert proc.returncode == 1
    assert b"INVALID_REQUEST" in proc.stderr
    reply = parse_frames(dst.read_bytes())
    assert bytes(reply[0]) == b"\x01"
    req = wire.decode_request(reply[1], list(reply[2:]))
    assert req.rid == "r1"
    assert req.validation_error.startswith("INVALID_REQUEST: ")


def test_decode_exemption_through_cli(tmp_path: Path) -> None:
    """--role decode --language-model-only: items dropped, the vector's delta, no positions."""
    if "qwen3_5_mixed" not in NAMES:
        pytest.skip("qwen3_5_mixed vector absent")
    vec = load_vector("qwen3_5_mixed")
    dst = tmp_path / "out"
    proc = _materialize(
        vec.config, vec.frames_path, dst, "--role", "decode", "--language-model-only"
    )
    assert proc.returncode == 0, proc.stderr.decode()
    reply = parse_frames(dst.read_bytes())
    assert bytes(reply[0]) == b"\x00"
    req = wire.decode_request(reply[1], list(reply[2:]))
    np.testing.assert_array_equal(req.input_ids, vec.arrays["input_ids_unpadded"])  # as received
    assert req.input_ids_unpadded is None
    assert req.mm is not None and req.mm.items == [] and req.mm.mrope_positions is None
    want = int(vec.arrays["mrope_position_delta"][0, 0])
    assert req.mm.mrope_position_delta_scalar == want
    np.testing.assert_array_equal(req.mm.mrope_position_delta.to_numpy(), [[want]])


def test_text_only_model_through_cli(tmp_path: Path) -> None:
    if "qwen3_5_image1" not in NAMES:
        pytest.skip("qwen3_5_image1 vector absent")
    vec = load_vector("qwen3_5_image1")
    cfg = tmp_path / "config.json"  # a text-only model with room for Qwen3.5's ids
    cfg.write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300000}'
    )
    proc = _materialize(tmp_path, vec.frames_path, tmp_path / "out")
    assert proc.returncode == 1
    assert b"TEXT_ONLY_MODEL" in proc.stderr
    reply = parse_frames((tmp_path / "out").read_bytes())
    req = wire.decode_request(reply[1], list(reply[2:]))
    assert req.validation_error == (
        "TEXT_ONLY_MODEL: multimodal inputs were provided for a text-only model"
    )
