"""The wire codec's shortcuts held to plain encoding and to the pure-Python intcodec
(docs/spec/WIRE.md).

The codec splits every array natively (decoding the token arrays in the same
walk) and builds every multimodal item in one walk that words its refusals
(held to the reference decoder of ``tests/wire_oracle.py``); it re-encodes a
received item by splicing new ``hash`` / ``pad_value`` bytes into its received
bytes, and re-emits a token array from its received bytes while the request
still holds the very array decoded from them. None of that may change what is
decoded, what goes out, or what is refused. Three modes:

* ``codec``: the codec as it runs;
* ``encoded``: splicing and verbatim token arrays off (every item encoded by
  the reference encoder, every token array from the decoded model, the
  payload assembled from its element list instead of slices of the received
  payload);
* ``fallback``: every ``mmadmit.intcodec`` routine in pure Python (the walker
  interpreted, no C extension), the shortcuts on.

On every vector and on generated requests all three decode the same fields
and emit the same bytes (received encodings here are canonical, so verbatim
and re-encoded bytes coincide); on malformed input all three refuse.

Run with: python -m pytest tests/test_wire_fast.py -q
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import wire_oracle
from conftest import REPO_ROOT, SESSION_NATIVE, load_vector, vector_names
from mmadmit import intcodec as ic
from mmadmit import msgpack_walk, rules, wire
from mmadmit.errors import Abort, AbortCode, InvalidRequest, TooLarge
from mmadmit.limits import DEFAULT_LIMITS, Limits
from mmadmit.materializer import Materializer
from mmadmit.model import Item, Materialized, MultimodalInputs, Request, Tensor
from mmadmit.profile import load_profile
from prompt_gen import gen_prompt
from wire_oracle import decode_items as reference_items

sys.path.insert(0, str(REPO_ROOT / "bench"))
import workloads  # noqa: E402  (bench/ is not a package)

TAG = "TokenizedGenerateReqInput"
ENC = msgspec.msgpack.Encoder()
Ext = msgspec.msgpack.Ext
NAMES = vector_names()
needs_vectors = pytest.mark.skipif(not NAMES, reason="no wire vectors")
MODES = ("codec", "encoded", "fallback")
FAMILY_PROFILE = {"qwen3_5": "qwen3_5", "qwen3_omni": "qwen3_omni_moe", "llama": "llama"}


# --------------------------------------------------------------------------- modes


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Run the codec in one of MODES (see the module docstring)."""
    with pytest.MonkeyPatch.context() as mp:
        if name == "encoded":
            mp.setattr(wire, "_encode_items", wire_oracle.encode_items)
            mp.setattr(
                wire,
                "_int_array",
                lambda extra, values, padding=None: msgspec.Raw(ic.encode_int_array(values)),
            )
            mp.setattr(wire, "_spliced", _spliced_by_elements)
        if name == "fallback":
            was = ic.HAVE_NATIVE
            ic._use_native(False)
        try:
            yield
        finally:
            if name == "fallback":
                ic._use_native(was)


def _spliced_by_elements(buf: memoryview, offsets: list[int], written: tuple[Any, ...]) -> bytes:
    """The payload as one element each, the written ones replaced (what ``_spliced``
    makes with runs of slices)."""
    out: list[Any] = [msgspec.Raw(buf[a:b]) for a, b in zip(offsets, offsets[1:], strict=False)]
    for i, value in zip(wire._WRITTEN, written, strict=True):
        out[i] = value
    return wire._joined(out)


# --------------------------------------------------------------------------- snapshots


def _aux_index(req: Request, buf: Any) -> int | None:
    """Which received aux frame a tensor's data *is* (None: inline or new)."""
    aux = req.extra.aux if isinstance(req.extra, wire.WireExtra) else []
    for k, frame in enumerate(aux):
        if frame is buf:
            return k + 1
    return None


def _tensor(req: Request, t: Any) -> Any:
    if not isinstance(t, Tensor):
        return ("value", t)
    return (t.dtype.name, t.shape, bytes(t.data), _aux_index(req, t.data))


def _array(a: np.ndarray | None) -> Any:
    return None if a is None else (a.dtype.str, a.shape, a.tolist())


def snapshot(req: Request) -> dict[str, Any]:
    """Everything a decode produced, in comparable form (buffers as bytes + aux index)."""
    out: dict[str, Any] = {
        "rid": req.rid,
        "input_ids": _array(req.input_ids),
        "unpadded": _array(req.input_ids_unpadded),
        "validation_error": req.validation_error,
        "mm": None,
    }
    if isinstance(req.extra, wire.WireExtra):
        out["raw"] = [bytes(r) for r in req.extra.raw]
        out["aux"] = [bytes(a) for a in req.extra.aux]
        out["feature_aux"] = sorted(req.extra.feature_aux)
    mm = req.mm
    if mm is not None:
        out["mm"] = {
            "im": mm.im_token_id,
            "vid": mm.video_token_id,
            "positions": None if mm.mrope_positions is None else _tensor(req, mm.mrope_positions),
            "delta": None
            if mm.mrope_position_delta is None
            else _tensor(req, mm.mrope_position_delta),
            "scalar": mm.mrope_position_delta_scalar,
            "items": [
                (
                    type(it.modality),
                    it.modality,
                    it.hash,
                    it.pad_value,
                    _array(it.offsets),
                    None if it.feature is None else _tensor(req, it.feature),
                    None
                    if it.feature_shm is None
                    else (it.feature_shm.name, it.feature_shm.shape, it.feature_shm.dtype),
                    {k: _tensor(req, v) for k, v in it.side.items()},
                )
                for it in mm.items
            ],
        }
    return out


def _frames(frames: list[Any], req: Request) -> list[Any]:
    """Encoded frames in comparable form: bytes, and for aux frames whether each
    is the received buffer object itself (and which)."""
    out: list[Any] = [bytes(frames[0])]
    for f in frames[1:]:
        out.append((bytes(f), _aux_index(req, f)))
    return out


def _outputs(req: Request, profile: str | None) -> dict[str, Any]:
    """Every encoding of a decoded request: as is, aborted, and materialized."""
    out = {
        "plain": _frames(wire.encode_request(req), req),
        "aborted": _frames(wire.encode_aborted(req, Abort(AbortCode.TOO_LARGE, "x"))[1:], req),
    }
    if profile is not None:
        outcome = Materializer(load_profile(profile)).run(req)
        if isinstance(outcome, Materialized):
            out["materialized"] = _frames(wire.encode_materialized(outcome)[1:], req)
            out["materialized_request"] = snapshot(outcome.request)
        else:
            out["aborted_outcome"] = (outcome.code, outcome.message)
            out["aborted_frames"] = _frames(wire.encode_aborted(req, outcome)[1:], req)
    return out


def check_modes_agree(frames: list[Any], profile: str | None) -> dict[str, Any]:
    """Decode and encode ``frames`` in every mode; all results must be equal."""
    results = {}
    for name in MODES:
        with mode(name):
            req = wire.decode_message(list(frames)).request
            assert req is not None
            results[name] = (snapshot(req), _outputs(req, profile))
    codec = results["codec"]
    for name in MODES[1:]:
        assert results[name][0] == codec[0], f"decoded fields differ: codec vs {name}"
        for key in codec[1]:
            assert results[name][1][key] == codec[1][key], f"{key} differs: codec vs {name}"
    return codec[1]


def _spliceable(frames: list[Any]) -> bool:
    req = wire.decode_message(list(frames)).request
    assert req is not None
    return req.mm is None or all(isinstance(it.extra, wire._ItemSrc) for it in req.mm.items)


# --------------------------------------------------------------------------- equivalence


@needs_vectors
@pytest.mark.parametrize("name", NAMES or ["-"])
def test_vectors_all_modes_agree(name: str) -> None:
    vec = load_vector(name)
    out = check_modes_agree(vec.frames, FAMILY_PROFILE[vec.meta["family"]])
    assert out["plain"][0] == bytes(vec.frames[1])  # nothing changed: byte-identical
    assert _spliceable(vec.frames)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_omni_moe"])
@pytest.mark.parametrize("n", [1024, 8192, 32768])
@pytest.mark.parametrize("with_hash", [True, False])
def test_generated_requests_all_modes_agree(family: str, n: int, with_hash: bool) -> None:
    profile = workloads.profile_for(family)
    req = workloads.build_request(
        profile, n, seed=n, with_hash=with_hash, feature_bytes=None if with_hash else 4096
    )
    frames = workloads.frames_of(req)
    out = check_modes_agree(frames, family)
    assert "materialized" in out
    assert _spliceable(frames)


def _prompt_request(family: str, seed: int) -> Request:
    prompt = gen_prompt(family, seed, hf_compatible=False)
    rng = np.random.default_rng(seed)
    profile = load_profile(family)
    for item in prompt.items:
        if rng.random() < 0.5:
            item.hash = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))
        if rng.random() < 0.7:
            rows = int(rng.integers(1, 80))  # inline below 256 bytes, an aux frame above
            item.feature = Tensor.from_numpy(rng.random((rows, 2), np.float32))
    mm = MultimodalInputs(
        items=prompt.items,
        im_token_id=profile.image_token_id,
        video_token_id=profile.video_token_id,
    )
    return Request(rid=f"{family}-{seed}", input_ids=prompt.input_ids, mm=mm)


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_omni_moe"]
)
@pytest.mark.parametrize("seed", range(4))
def test_generated_prompts_all_modes_agree(family: str, seed: int) -> None:
    frames = workloads.frames_of(_prompt_request(family, seed))
    check_modes_agree(frames, family)
    assert _spliceable(frames)


def test_text_request_all_modes_agree() -> None:
    req = Request(rid="t", input_ids=(np.arange(40000, dtype=np.int64) * 7) % 150_000)
    frames = workloads.frames_of(req)
    out = check_modes_agree(frames, "qwen3_5")
    assert out["materialized"] == out["plain"]  # rule 1: passed through as received


# --------------------------------------------------------------------------- token arrays


def _ids_payload(ids_raw: bytes, unpadded_raw: bytes | None = None, mm: Any = None) -> bytes:
    """A payload whose element 4 (and 21) are the given raw bytes."""
    elems: list[Any] = [TAG, "rid-v", None, None, msgspec.Raw(ids_raw), [], False, -1, 0, None]
    elems += [False, None, None, None, False, 0.5, None, None, None, None, None]
    elems += [msgspec.Raw(unpadded_raw) if unpadded_raw else None, mm, None]
    return ENC.encode(elems)


def _noncanonical(ids: list[int]) -> bytes:
    """An array16 header and every id as a uint32 (legal, not what msgpack.packb writes)."""
    out = b"\xdc" + len(ids).to_bytes(2, "big")
    return out + b"".join(b"\xce" + v.to_bytes(4, "big") for v in ids)


def test_decoded_ids_reemitted_verbatim_until_replaced() -> None:
    ids = list(range(5, 45))
    raw_ids = _noncanonical(ids)
    req = wire.decode_request(_ids_payload(raw_ids), [])
    assert req.input_ids.tolist() == ids
    assert _element(wire.encode_request(req)[0], 4) == raw_ids  # the very array: as received
    # a new array (the same values, or some replaced, or another length): encoded,
    # every int in its smallest form
    changed = [*ids[:16], *[7] * 8, *ids[24:]]
    for new in (ids, changed, ids[:-1]):
        req.input_ids = np.array(new, dtype=np.int64)
        assert _element(wire.encode_request(req)[0], 4) == msgpack.packb(new)


def _element(payload: Any, i: int) -> bytes:
    offsets, _ = ic.split_array(payload)
    return bytes(payload)[offsets[i] : offsets[i + 1]]


def test_materialized_unpadded_is_received_bytes() -> None:
    # image prompt of Qwen3.5: text, <vs>, 6 image pads, <ve>, text; hash given
    vs, ve, img = 248053, 248054, 248056
    ids = [11, 12, vs, *([img] * 6), ve, 13]
    grid = ["int64", [1, 3], Ext(3, np.array([1, 4, 6], np.int64).tobytes())]
    item = [1, 5, None, [[3, 8]], None, None, {"image_grid_thw": grid}, None, None, None]
    raw_ids = _noncanonical(ids)
    payload = _ids_payload(raw_ids, mm=[[item], img, 248057, None, None, None, None])
    req = wire.decode_request(payload, [])
    out = Materializer(load_profile("qwen3_5")).run(req)
    assert isinstance(out, Materialized)
    assert out.request.input_ids_unpadded is req.input_ids
    frames = wire.encode_materialized(out)
    assert _element(frames[1], 21) == raw_ids  # verbatim, non-canonical kept
    padded = msgpack.unpackb(_element(frames[1], 4))
    assert padded[3:9] == [out.request.mm.items[0].pad_value] * 6
    # written from the materializer's Padding: every id outside the pad run as
    # received (5 bytes each here), the run in its value's smallest form
    padding = out.request.padding
    assert padding is not None and padding.result is out.request.input_ids
    assert padding.unpadded is req.input_ids
    assert (padding.starts.tolist(), padding.stops.tolist()) == ([3], [9])
    pad = msgpack.packb(out.request.mm.items[0].pad_value)
    assert _element(frames[1], 4) == b"\x9b" + raw_ids[3:18] + pad * 6 + raw_ids[48:]
    # the item: received bytes with hash / pad_value replaced
    again = wire.decode_request(frames[1], frames[2:])
    assert again.mm.items[0].pad_value == out.request.mm.items[0].pad_value
    assert again.input_ids_unpadded.tolist() == ids


def test_padding_is_used_only_while_it_describes_the_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The padded ids are written from the Padding (no array compared) while the
    request's input_ids is still the array it describes; replaced, they are
    encoded as any other array, never from stale spans."""
    req = workloads.build_request(workloads.profile_for("qwen3_5"), 4096, with_hash=True)
    frames = [bytes([wire.MSG_ADD]), *wire.encode_request(req)]
    got = wire.decode_message(frames)
    out = Materializer(load_profile("qwen3_5")).run(got.request)
    assert isinstance(out, Materialized) and out.request.padding is not None
    padded = out.request.input_ids
    expected = msgpack.packb(padded.tolist())  # the received ids are smallest forms
    with monkeypatch.context() as mp:  # only the filled path may run
        mp.setattr(wire, "encode_int_array", _never)
        assert _element(wire.encode_materialized(out)[1], 4) == expected
    # another array of the same length: the Padding no longer describes it
    other = padded.copy()
    other[::7] = 3
    replaced = dataclasses.replace(out.request, input_ids=other)
    with monkeypatch.context() as mp:
        mp.setattr(wire, "encode_int_array_filled", _never)
        assert _element(wire.encode_request(replaced)[0], 4) == msgpack.packb(other.tolist())
    # input_ids_unpadded replaced: the padded ids are still the Padding's result,
    # made from the received array it names (whose bytes are copied)
    moved = dataclasses.replace(out.request, input_ids_unpadded=got.request.input_ids.copy())
    with monkeypatch.context() as mp:
        calls: list[Any] = []
        mp.setattr(wire, "encode_int_array_filled", _counted(wire.encode_int_array_filled, calls))
        payload = wire.encode_request(moved)[0]
    assert _element(payload, 4) == expected and len(calls) == 1
    assert _element(payload, 21) == msgpack.packb(got.request.input_ids.tolist())


def _never(*args: Any) -> Any:
    raise AssertionError("this encoder must not run")


def _counted(f: Any, calls: list[Any]) -> Any:
    def counted(*args: Any) -> Any:
        calls.append(args)
        return f(*args)

    return counted


@needs_vectors
def test_upstream_request_keeps_both_token_arrays_verbatim() -> None:
    vec = load_vector("qwen3_5_smg_style")
    req = wire.decode_request(vec.frames[1], list(vec.frames[2:]))
    assert req.input_ids_unpadded is not None
    out = Materializer(load_profile("qwen3_5")).run(req)
    assert isinstance(out, Materialized)
    frames = wire.encode_materialized(out)
    assert _element(frames[1], 4) == bytes(req.extra.raw[4])
    assert _element(frames[1], 21) == bytes(req.extra.raw[21])


# --------------------------------------------------------------------------- splicing


def _decoded(family: str = "qwen3_5", n: int = 8192) -> tuple[list[Any], Request]:
    req = workloads.build_request(workloads.profile_for(family), n, seed=3)
    frames = workloads.frames_of(req)
    decoded = wire.decode_message(frames).request
    assert decoded is not None and decoded.mm is not None
    return frames, decoded


def _reencode(req: Request) -> Request:
    frames = wire.encode_request(req)
    return wire.decode_request(frames[0], frames[1:])


def _general_bytes(req: Request) -> list[Any]:
    with mode("encoded"):
        return _frames(wire.encode_request(req), req)


# (hash, pad_value) pairs around every msgpack int form's bounds
_HASH_PAD = [
    (2**64 - 1, 7),
    (None, -(2**40)),
    (2**63, -(2**63)),
    (2**63 - 1, -33),
    (0, -32),
    (127, -129),
    (128, None),
    (255, -(2**15) - 1),
    (256, 2**32),
    (2**32 - 1, -(2**31) - 1),
]


@pytest.mark.parametrize("name", ["codec", "fallback"])
def test_splice_changes_only_hash_and_pad(name: str) -> None:
    _, req = _decoded()
    items = req.mm.items
    assert len(items) > len(_HASH_PAD)
    for k, (h, pad) in enumerate(_HASH_PAD):
        items[k].hash, items[k].pad_value = h, pad
    items[len(_HASH_PAD)] = rules.with_pad(items[len(_HASH_PAD)], 123, 456)
    with mode(name):
        got = _frames(wire.encode_request(req), req)
    assert got == _general_bytes(req)
    back = _reencode(req)
    assert [(it.hash, it.pad_value) for it in back.mm.items[: len(_HASH_PAD) + 1]] == [
        *_HASH_PAD,
        (123, 456),
    ]


@pytest.mark.parametrize("name", ["codec", "fallback"])
@pytest.mark.parametrize("value", [True, 2**64, -(2**63) - 1, 1.0])
def test_splice_leaves_other_values_to_the_encoder(name: str, value: Any) -> None:
    """A hash or pad_value that is not an int of the msgpack range is not written by
    the splice: the item goes to the general encoder, which encodes it or refuses
    it as before."""
    _, req = _decoded()
    it = req.mm.items[0]
    encoded: list[Any] = []

    def encode_item(item: Any) -> bytes:
        encoded.append(item)
        return b"\xc0"

    for field in ("hash", "pad_value"):
        saved = getattr(it, field)
        setattr(it, field, value)
        encoded.clear()
        with mode(name):
            ic.splice_items(req.mm.items[:2], it.extra.aux, wire._ItemSrc, encode_item)
        assert encoded == [it], field
        setattr(it, field, saved)


def test_splice_follows_item_order() -> None:
    _, req = _decoded()
    req.mm.items.reverse()
    del req.mm.items[1]
    assert _frames(wire.encode_request(req), req) == _general_bytes(req)
    back = _reencode(req)
    assert [_array(it.offsets) for it in back.mm.items] == [
        _array(it.offsets) for it in req.mm.items
    ]


@pytest.mark.parametrize("change", ["feature", "side_add", "side_data", "modality", "shape"])
def test_changed_item_is_encoded_not_spliced(change: str) -> None:
    _, req = _decoded()
    it = req.mm.items[0]
    new_feature = Tensor.from_numpy(np.arange(1000, dtype=np.float32).reshape(500, 2))
    if change == "feature":
        it.feature = new_feature
    elif change == "side_add":
        it.side["extra_tensor"] = Tensor.from_numpy(np.array([1, 2], np.int64))
    elif change == "side_data":  # a tensor cannot change: a new one takes the key
        key, grid = next(iter(it.side.items()))
        with pytest.raises(AttributeError):
            grid.data = memoryview(np.array([[1, 2, 8]], np.int64).tobytes())
        it.side[key] = Tensor(grid.dtype, grid.shape, np.array([[1, 2, 8]], np.int64).data)
    elif change == "modality":
        it.modality = 2 if it.modality == 1 else 1
    else:  # the same bytes in another shape
        t = it.feature
        assert t is not None
        it.feature = Tensor(t.dtype, (t.shape[0] // 2, t.shape[1] * 2), t.data)
    encoded: list[Any] = []

    def encode_item(item: Any) -> bytes:
        encoded.append(item)
        return b"\xc0"

    # the rule itself: the changed item goes to the encoder, an unchanged one is spliced
    ic.splice_items(req.mm.items[:2], it.extra.aux, wire._ItemSrc, encode_item)
    assert encoded == [it]
    assert _frames(wire.encode_request(req), req) == _general_bytes(req)
    back = _reencode(req).mm.items[0]
    assert snapshot_item(back) == snapshot_item(it)


def snapshot_item(it: Any) -> Any:
    def t(x: Any) -> Any:
        return (x.dtype.name, x.shape, bytes(x.data)) if isinstance(x, Tensor) else x

    return (
        it.modality,
        it.hash,
        it.pad_value,
        t(it.feature),
        {k: t(v) for k, v in it.side.items()},
    )


def test_items_moved_to_another_request_keep_their_tensors() -> None:
    """Aux indices are the received message's: an item moved elsewhere is re-encoded."""
    _, donor = _decoded("qwen3_omni_moe", 8192)
    _, host = _decoded("qwen3_5", 8192)
    host.mm.items = donor.mm.items[:5] + host.mm.items[:2]
    frames = wire.encode_request(host)
    back = wire.decode_request(frames[0], frames[1:])
    assert [snapshot_item(it) for it in back.mm.items] == [
        snapshot_item(it) for it in host.mm.items
    ]
    assert _frames(frames, host) == _general_bytes(host)


def test_aborted_request_drops_features_of_spliceable_items() -> None:
    frames, req = _decoded()
    out = wire.encode_aborted(req, Abort(AbortCode.INVALID_REQUEST, "no"))
    back = wire.decode_request(out[1], out[2:])
    assert all(it.feature is None for it in back.mm.items)
    assert all(len(f) == 0 for f in out[2:])  # every aux frame held a feature
    assert len(out) == len(frames)


def test_short_items_and_mm_get_their_own_defaults() -> None:
    vs, ve, img = 248053, 248054, 248056
    ids = [11, 12, vs, *([img] * 6), ve, 13]
    short_item = [1, 5, None, [[3, 8]]]
    payload = _ids_payload(msgpack.packb(ids), mm=[[short_item], img])
    req = wire.decode_request(payload, [])
    elems = msgspec.msgpack.decode(wire.encode_request(req)[0])
    mm = elems[22]
    assert mm[1:] == [img, None, None, None, None, None]  # repeated_cache: nil
    assert mm[0] == [[1, 5, None, [[3, 8]], None, None, {}, None, None, None]]


# --------------------------------------------------------------------------- malformed


def _small_mm_payload(trailing: tuple[Any, ...] = ()) -> tuple[bytes, list[bytes]]:
    vs, ve, img = 248053, 248054, 248056
    ids = [11, 12, vs, *([img] * 16), ve, 13]
    grid = ["int64", [1, 3], Ext(3, np.array([1, 8, 8], np.int64).tobytes())]
    feature = ["float32", [64, 2], 1]
    item = [1, None, None, [[3, 18]], feature, None, {"image_grid_thw": grid}, None, None, None]
    item2 = [1, 9, None, [], ["bfloat16", [2], Ext(3, b"abcd")], None, {}, None, None, {"h": 1}]
    mm = [[item, item2, *trailing], img, 248057, None, None, None, None]
    return _ids_payload(msgpack.packb(ids), mm=mm), [bytes(512)]


def _semantic(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot without raw bytes and aux placement (verbatim and re-encoded agree here)."""
    out = {k: v for k, v in snap.items() if k not in ("raw", "aux", "feature_aux", "mm")}
    mm = snap["mm"]
    if mm is not None:
        out["mm"] = {k: v for k, v in mm.items() if k != "items"}
        for key in ("positions", "delta"):
            out["mm"][key] = None if mm[key] is None else mm[key][:3]
        out["mm"]["items"] = [
            (
                *it[:5],
                None if it[5] is None else it[5][:3],
                it[6],
                {k: v[:3] for k, v in it[7].items()},
            )
            for it in mm["items"]
        ]
    return out


def _outcome(frames: list[Any]) -> Any:
    try:
        req = wire.decode_message(frames).request
    except wire.WireError as exc:
        return ("error", exc.rid)
    assert req is not None
    return ("ok", snapshot(req), _semantic(snapshot(_reencode(req))))


@pytest.mark.parametrize("name", MODES)
def test_truncated_at_every_offset(name: str) -> None:
    payload, aux = _small_mm_payload()
    with mode(name):
        assert _outcome([b"\x00", payload, *aux])[0] == "ok"
        for cut in range(len(payload)):
            with pytest.raises(wire.WireError) as info:
                wire.decode_message([b"\x00", payload[:cut], *aux])
            assert info.value.rid == ""  # nothing readable in a truncated array


def test_corrupted_bytes_same_outcome_in_every_mode() -> None:
    """Every byte replaced by a few telling values: the modes agree on each."""
    payload, aux = _small_mm_payload()
    start = payload.index(b"\x92\x9a")  # the mm_items array: fuzz the items, not the ids
    for pos in range(start, len(payload)):
        for value in (0x00, 0x7F, 0x91, 0xC0, 0xC1, 0xC3, 0xCF, 0xD4, 0xDC, 0xFF):
            if payload[pos] == value:
                continue
            bad = payload[:pos] + bytes([value]) + payload[pos + 1 :]
            outcomes = []
            for name in MODES:
                with mode(name):
                    outcomes.append(_outcome([b"\x00", bad, *aux]))
            assert outcomes[1:] == outcomes[:1] * (len(MODES) - 1), (pos, hex(value))


PK = Ext(1, b"\x80\x04K\x01.")
CPK = Ext(2, b"\x80\x04K\x01.")
UNKNOWN = Ext(9, b"?")


@pytest.mark.parametrize("ext", [PK, CPK, UNKNOWN], ids=["pickle", "cloudpickle", "unknown"])
@pytest.mark.parametrize(
    "where",
    [
        "offsets",
        "hash",
        "feature_dtype",
        "feature_shape",
        "feature_data",
        "feature_shm",
        "msd_value",
        "msd_tensor_nested",
        "encoded",
        "handshake_nested",
        "item_trailing_nested",
        "mm_trailing_nested",
        "mm_im_token",
        "top_map",
    ],
)
@pytest.mark.parametrize("name", MODES)
def test_refused_ext_codes_anywhere(name: str, where: str, ext: Ext) -> None:
    payload, aux = _small_mm_payload()
    items = msgspec.msgpack.decode(payload, ext_hook=lambda c, d: Ext(c, bytes(d)))
    top = items
    mm = top[22]
    it = mm[0][0]
    if where == "offsets":
        it[3] = [[3, ext]]
    elif where == "hash":
        it[1] = ext
    elif where == "feature_dtype":
        it[4][0] = ext
    elif where == "feature_shape":
        it[4][1] = [64, ext]
    elif where == "feature_data":
        it[4][2] = ext
    elif where == "feature_shm":
        it[5] = {"shm_name": "x", "shape": [ext], "dtype": "float32"}
    elif where == "msd_value":
        it[6]["other"] = {"k": [1, ext]}
    elif where == "msd_tensor_nested":
        it[6]["image_grid_thw"] = ["int64", [1, 3], [ext]]
    elif where == "encoded":
        it[7] = ext
    elif where == "handshake_nested":
        it[9] = {"a": [{"b": ext}]}
    elif where == "item_trailing_nested":
        it += [None, {"x": [ext]}]
    elif where == "mm_trailing_nested":
        mm += [{"new": {"deeper": ext}}]
    elif where == "mm_im_token":
        mm[1] = ext
    else:
        top[20] = [{"a": {"b": ext}}]
    bad = ENC.encode(top)
    with mode(name), pytest.raises(wire.WireError) as info:
        wire.decode_message([b"\x00", bad, *aux])
    assert info.value.rid == "rid-v"
    assert info.value.code is AbortCode.INVALID_REQUEST


@pytest.mark.parametrize(
    "where", ["top_trailing", "item_handshake", "item_trailing", "mm_trailing", "abort"]
)
@pytest.mark.parametrize("name", MODES)
def test_deep_nesting_is_an_error_not_a_crash(name: str, where: str) -> None:
    deep = msgspec.Raw(b"\x91" * 100_000 + b"\xc0")
    payload, aux = _small_mm_payload()
    top = msgspec.msgpack.decode(payload, ext_hook=lambda c, d: Ext(c, bytes(d)))
    if where == "top_trailing":
        top.append(deep)
    elif where == "item_handshake":
        top[22][0][0][9] = deep
    elif where == "item_trailing":
        top[22][0][0].append(deep)
    elif where == "mm_trailing":
        top[22].append(deep)
    if where == "abort":
        frames = [b"\x01", ENC.encode([deep])]
    else:
        frames = [b"\x00", ENC.encode(top), *aux]
    with mode(name), pytest.raises(wire.WireError) as info:
        wire.decode_message(frames)
    if where != "abort":
        assert info.value.rid == "rid-v"


@pytest.mark.parametrize("name", MODES)
def test_bad_token_arrays_same_messages(name: str) -> None:
    cases = {
        "not ids": "input_ids must be an array of integers (msgpack int array: expected "
        "an array header, got str (type byte 0xa7))",
        "nil": "input_ids must be an array of integers (msgpack int array: expected an "
        "array header, got nil (type byte 0xc0))",
        "mixed": "input_ids must be an array of integers (msgpack int array: element 1: "
        "expected an int, got str (type byte 0xa1))",
        "big": "input_ids must be an array of integers (msgpack int array: element 0: "
        "uint64 value 18446744073709551615 exceeds the int64 range)",
    }
    values = {"not ids": "not ids", "nil": None, "mixed": [1, "x"], "big": [2**64 - 1]}
    for key, message in cases.items():
        with mode(name), pytest.raises(wire.WireError) as info:
            wire.decode_message([b"\x00", _ids_payload(msgpack.packb(values[key]))])
        assert info.value.message == message and info.value.rid == "rid-v"
        if key == "nil":  # a nil input_ids_unpadded is simply absent
            continue
        with mode(name), pytest.raises(wire.WireError) as info:
            wire.decode_message([b"\x00", _ids_payload(b"\x91\x01", msgpack.packb(values[key]))])
        assert info.value.message == message.replace("input_ids", "input_ids_unpadded")


def test_shared_aux_frames_all_modes_agree() -> None:
    """Aux roles (feature only, or shared) decide what an abort blanks: the same in every mode."""
    vs, ve, img = 248053, 248054, 248056
    ids = [11, vs, *([img] * 16), ve, vs, *([img] * 16), ve, vs, *([img] * 16), ve, 12]
    grid = ["int64", [1, 3], Ext(3, np.array([1, 8, 8], np.int64).tobytes())]
    shared = ["int32", [4, 16], 1]  # frame 1: item 0's feature and item 1's side tensor
    items = [
        [1, None, None, [[2, 17]], shared, None, {"image_grid_thw": grid}, None, None, None],
        [1, 4, None, [[20, 35]], ["float32", [64], 2], None,
         {"image_grid_thw": grid, "extra": shared}, None, None, None],
        [1, 6, None, [[38, 53]], ["float32", [64], 2], None, {"image_grid_thw": grid}, None,
         None, None],
    ]  # fmt: skip
    payload = _ids_payload(msgpack.packb(ids), mm=[items, img, 248057, None, None, None, None])
    frames = [b"\x00", payload, bytes(range(256)), bytes(256)]
    out = check_modes_agree(frames, "qwen3_5")
    req = wire.decode_message(frames).request
    assert req is not None and req.extra.feature_aux == {2}  # frame 1 is shared
    assert out["aborted"][1][0] == bytes(range(256)) and out["aborted"][2][0] == b""


# (where in item 1, the value put there, how the refusal starts, its code)
ITEM_ERRORS = [
    ("hash", "x", "item 1: hash: Expected `int | null`, got `str`", "INVALID_REQUEST"),
    ("modality", None, "item 1: modality: Expected `int`, got `None`", "INVALID_REQUEST"),
    ("item", 5, "item 1: Expected `array`, got `int`", "INVALID_REQUEST"),
    ("feature", ["bfloat16", [2]], "item 1 feature must be a tensor [dtype, shape, data]",
     "INVALID_REQUEST"),
    ("feature", ["bfloat16", [-2], Ext(3, b"abcd")],
     "item 1 feature: shape must be a list of non-negative ints, got [-2]", "INVALID_REQUEST"),
    ("feature", ["bfloat16", [3], Ext(3, b"abcd")],
     "item 1 feature: 4 data bytes but shape [3] of bfloat16 needs 6", "INVALID_REQUEST"),
    ("feature", ["bfloat16", [2], 7],
     "item 1 feature: data refers to aux frame 7, but the message has 1 aux frame(s)",
     "INVALID_REQUEST"),
    ("feature", ["bfloat16", [2], Ext(1, b"x")],
     "item 1 feature: msgpack ext type 1 (pickle) is never accepted", "INVALID_REQUEST"),
    ("feature", ["complex", [2], Ext(3, b"abcd")],
     "item 1 feature: unsupported tensor dtype 'complex'", "INVALID_REQUEST"),
    ("feature", ["bfloat16", [2**20, 2**20], 1],
     "item 1 feature: shape [1048576, 1048576] of bfloat16 is 2199023255552 bytes, over the "
     "limit of 536870912 (--max-tensor-bytes)", "TOO_LARGE"),
    ("side", ["int64", ["a"], 1], "item 1 g: shape must be a list of non-negative ints",
     "INVALID_REQUEST"),
    ("side", ["int64", [1], Ext(3, b"abc")], "item 1 g: 3 data bytes but shape [1] of int64",
     "INVALID_REQUEST"),
    ("side", ["int64", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1], "item 1 g: rank 9 exceeds the limit of 8",
     "TOO_LARGE"),
    ("offsets", [[1, 2, 3]], "item 1: offsets must be nil or an array of [start, end] pairs",
     "INVALID_REQUEST"),
    ("offsets", [[1, 2**64 - 1]], "item 1: offsets must be nil or an array of [start, end] pairs",
     "INVALID_REQUEST"),
    ("handshake", {"x": Ext(1, b"x")}, "item 1: msgpack ext type 1 (pickle) is never accepted",
     "INVALID_REQUEST"),
]  # fmt: skip


@pytest.mark.parametrize(("where", "value", "message", "code"), ITEM_ERRORS)
def test_item_refusals_name_the_item_and_what_in_it(
    where: str, value: Any, message: str, code: str
) -> None:
    """The one item decoder refuses; the wording names the item and its field or tensor,
    with the code the problem has (a limit: TOO_LARGE), never INTERNAL."""
    payload, aux = _small_mm_payload()
    top = msgspec.msgpack.decode(payload, ext_hook=lambda c, d: Ext(c, bytes(d)))
    items = top[22][0]
    slot = {"modality": 0, "hash": 1, "offsets": 3, "feature": 4, "handshake": 9}
    if where == "item":
        items[1] = value
    elif where == "side":
        items[1][6] = {"g": value}
    else:
        items[1][slot[where]] = value
    with pytest.raises(wire.WireError) as info:
        wire.decode_message([b"\x00", ENC.encode(top), *aux])
    assert info.value.message.startswith(message), info.value.message
    assert info.value.code is AbortCode[code] and info.value.rid == "rid-v"


def test_a_repeated_side_key_is_refused() -> None:
    """A model_specific_data key written twice (no encoder writes one) is refused, in
    every mode, rather than one of its values picked."""
    payload, aux = _small_mm_payload()
    top = msgspec.msgpack.decode(payload, ext_hook=lambda c, d: Ext(c, bytes(d)))
    key = msgpack.packb("g")
    top[22][0][1][6] = msgspec.Raw(b"\x82" + key + ENC.encode(GRID) + key + ENC.encode(GRID))
    for name in MODES:
        with mode(name), pytest.raises(wire.WireError) as info:
            wire.decode_message([b"\x00", ENC.encode(top), *aux])
        assert info.value.message == "item 1: model_specific_data: the key 'g' is repeated"
        assert info.value.code is AbortCode.INVALID_REQUEST


# ------------------------------------------------ the items' walk (build_items)


def _fast_form_payload() -> tuple[bytes, list[bytes]]:
    """Items all of the common form the walk reads straight: tensors in aux frames and
    inline, ints in every width, a uint64 hash, nil and empty side maps, offsets of
    every shape."""
    vs, ve, img = 248053, 248054, 248056
    ids = [11, 12, vs, *([img] * 16), ve, 13, vs, *([img] * 4), ve]
    grid = ["int64", [1, 3], Ext(3, np.array([1, 8, 8], np.int64).tobytes())]
    small = ["int64", [1, 3], Ext(3, np.array([1, 2, 2], np.int64).tobytes())]
    items = [
        [1, None, None, [[3, 18]], ["float32", [64, 2], 1], None, {"image_grid_thw": grid}]
        + [None] * 3,
        [1, 2**64 - 1, -5, [[23, 26]], ["bfloat16", [2], Ext(3, b"abcd")], None, {}] + [None] * 3,
        [
            2,
            70000,
            2**40,
            None,
            None,
            None,
            {"video_grid_thw": small, "x": ["int8", [0], Ext(3, b"")]},
        ]
        + [None] * 3,
        [3, 1, 2, [], ["uint8", [512], 1], None, None, None, None, None],
    ]
    mm = [items, img, 248057, None, None, None, None]
    return _ids_payload(msgpack.packb(ids), mm=mm), [bytes(512)]


def _items_view(payload: bytes) -> memoryview:
    buf = memoryview(payload)
    elems = wire._split(buf, "payload")
    return memoryview(wire._split(elems[wire.F_MM], "multimodal_inputs")[0])


def _walk_items(walk: Any, view: memoryview, reader: Any) -> Any:
    """``walk.build_items`` on ``view`` as wire.py calls it."""
    return walk.build_items(
        view, view, reader.aux, reader.limits, Tensor, Item, wire._ItemSrc, wire._NO_SIDE,
        wire._value, reader.tensor, wire._decode_shm,
    )  # fmt: skip


def _built(walk: Any, view: memoryview, aux: list[Any]) -> Any:
    """What one build of the walk makes of the items (comparable), or its refusal's code."""
    reader = wire._TensorReader(aux)
    try:
        items, features, others, offsets_at = _walk_items(walk, view, reader)
    except (InvalidRequest, TooLarge) as exc:
        return ("refused", exc.code)
    assert offsets_at == [it.extra.off3 if it.extra.count > 3 else -1 for it in items]
    features = sorted(set(features) | reader.features)
    return _items_form(items), features, sorted(set(others) | reader.others)


def _reference(view: memoryview, aux: list[Any]) -> Any:
    """What the reference (tests/wire_oracle.py) makes of them, or its refusal's code."""
    reader = wire._TensorReader(aux)
    try:
        items = reference_items(view, reader)
    except (InvalidRequest, TooLarge) as exc:
        return ("refused", exc.code)
    return _items_form(items), sorted(reader.features), sorted(reader.others)


def _items_form(items: list[Any]) -> list[Any]:
    def t(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return ("value", x)
        return (x.dtype.name, x.shape, bytes(x.data), x.name, x.limits)

    out = []
    for it in items:
        s = it.extra
        out.append(
            (
                type(it.modality), it.modality, it.hash, it.pad_value, it.offsets, t(it.feature),
                repr(it.feature_shm), {k: t(v) for k, v in it.side.items()}, it.encode_handshake,
                (s.buf, s.aux, s.start, s.end, s.count, s.off1, s.off3, s.modality),
                t(s.feature), {k: t(v) for k, v in s.side.items()}, s.side is wire._NO_SIDE,
            )
        )  # fmt: skip
    return out


def _walks() -> list[Any]:
    walks = [msgpack_walk]
    if ic._BUILT is not None:
        walks.append(ic._BUILT)
    return walks


def test_build_items_builds_the_common_form_as_the_reference() -> None:
    payload, aux = _fast_form_payload()
    view = _items_view(payload)
    expected = _reference(view, aux)
    assert expected is not None
    for walk in _walks():
        assert _built(walk, view, aux) == expected, walk.__name__
    with mode("codec"):
        assert wire.decode_message([b"\x00", payload, *aux]).request is not None


@needs_vectors
@pytest.mark.parametrize("name", NAMES or ["-"])
def test_build_items_on_vectors(name: str) -> None:
    frames = load_vector(name).frames
    elems = wire._split(memoryview(bytes(frames[1])), "payload")
    if len(elems) <= wire.F_MM or wire._is_nil(elems[wire.F_MM]):
        return  # a text request: no items
    view = memoryview(wire._split(elems[wire.F_MM], "multimodal_inputs")[0])
    aux = [memoryview(bytes(f)) for f in frames[2:]]
    expected = _reference(view, aux)
    assert expected[0] != "refused"
    for walk in _walks():
        assert _built(walk, view, aux) == expected, walk.__name__


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_omni_moe"])
def test_build_items_on_generated_requests(family: str) -> None:
    for n, with_hash in ((8192, True), (32768, False)):
        req = workloads.build_request(workloads.profile_for(family), n, with_hash=with_hash)
        frames = workloads.frames_of(req)
        view = _items_view(bytes(frames[1]))
        aux = [memoryview(bytes(f)) for f in frames[2:]]
        expected = _reference(view, aux)
        assert expected[0] != "refused"
        for walk in _walks():
            assert _built(walk, view, aux) == expected, (walk.__name__, n)


def test_build_items_on_mutated_bytes_never_differs_from_the_reference() -> None:
    """Every byte of the items replaced by telling values, then random multi-byte
    mutations: both builds agree, and build what the reference builds or refuse
    what it refuses (the code may differ where two faults are worded in another
    order: the walk words the first it reads)."""
    payload, aux = _fast_form_payload()
    view = _items_view(payload)
    base = bytes(view)
    cases = []
    for pos in range(len(base)):
        for value in (0x00, 0x01, 0x03, 0x7F, 0x80, 0x91, 0x93, 0xA0, 0xC0, 0xC1, 0xC3,
                      0xCC, 0xCF, 0xD0, 0xD4, 0xD7, 0xD9, 0xDC, 0xDE, 0xFF):  # fmt: skip
            if base[pos] != value:
                cases.append(base[:pos] + bytes([value]) + base[pos + 1 :])
    rng = np.random.default_rng(18)
    for _ in range(1500):
        bad = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            bad[int(rng.integers(0, len(bad)))] = int(rng.integers(0, 256))
        cases.append(bytes(bad))
    walks = _walks()
    taken = 0
    for bad in cases:
        v = memoryview(bad)
        results = [_built(walk, v, aux) for walk in walks]
        assert results[1:] == results[:1] * (len(walks) - 1), bad.hex()
        expected = _reference(v, aux)
        if results[0][0] == "refused":
            assert expected[0] == "refused", bad.hex()
        else:
            taken += 1
            assert results[0] == expected, bad.hex()
    assert taken > 50  # the mutations also hit values the walk still takes (ints, sizes)


def test_build_items_names_past_the_kept_ones_as_the_reference() -> None:
    """Tensor names are kept per item index (256) and side key (16, first come):
    300 items, each with its own side key, are named as the reference names
    them, and a kept name is the same object in every request built."""
    grid = ["int64", [1, 3], Ext(3, np.array([1, 2, 2], np.int64).tobytes())]
    items = [
        [1, i, None, [[3 + i, 3 + i]], ["uint8", [512], 1], None, {f"k{i}-{id(grid)}": grid}]
        + [None] * 3
        for i in range(300)
    ]
    view = memoryview(ENC.encode(items))
    aux = [bytes(512)]
    expected = _reference(view, aux)
    assert expected[0] != "refused"
    for walk in _walks():
        assert _built(walk, view, aux) == expected, walk.__name__
        first = _walk_items(walk, view, wire._TensorReader(aux))
        again = _walk_items(walk, view, wire._TensorReader(aux))
        assert first[0][7].feature.name is again[0][7].feature.name  # kept
        assert first[0][299].feature.name == (299, "feature")  # past 256: made
        assert first[0][299].feature.name is not again[0][299].feature.name


def _form_item(**change: Any) -> list[Any]:
    fields = list(wire_oracle._ITEM_FIELD_NAMES)
    item: list[Any] = [1, 5, None, [[3, 18]], ["float32", [64, 2], 1], None, {}, None, None, None]
    for key, value in change.items():
        item[fields.index(key)] = value
    return item


GRID = ["int64", [1, 3], Ext(3, np.array([1, 8, 8], np.int64).tobytes())]
OUTSIDE_THE_FORM = {
    "nine_elements": _form_item()[:9],
    "eleven_elements": [*_form_item(), None],
    "feature_shm": _form_item(feature=None, feature_shm={"shm_name": "x"}),
    "flag_side_value": _form_item(model_specific_data={"use_audio_in_video": True}),
    "pickle_feature": _form_item(feature=["float32", [64, 2], PK]),
    "pickle_side": _form_item(model_specific_data={"g": ["int64", [1, 3], CPK]}),
    "aux_index_0": _form_item(feature=["float32", [64, 2], 0]),
    "aux_index_past_end": _form_item(feature=["float32", [64, 2], 2]),
    "negative_dim": _form_item(feature=["float32", [-64, 2], 1]),
    "bytes_mismatch": _form_item(feature=["float32", [64, 3], 1]),
    "unknown_dtype": _form_item(feature=["float33", [64, 2], 1]),
    # names the walk looks up by their bytes, against the first item's "float32"
    "dtype_name_longer": _form_item(feature=["float32x", [64, 2], 1]),
    "dtype_name_shorter": _form_item(feature=["float3", [64, 2], 1]),
    "dtype_name_not_utf8": _form_item(feature=[msgspec.Raw(b"\xa7float3\xff"), [64, 2], 1]),
    "four_part_tensor": _form_item(feature=["float32", [64, 2], 1, None]),
    "float_dim": _form_item(feature=["float32", [64.0, 2], 1]),
    "str_modality": _form_item(modality="image"),
    "bool_hash": _form_item(hash=True),
    "encoded": _form_item(encoded=1),
    "handshake": _form_item(encode_handshake={"h": 1}),
    "int_key": _form_item(model_specific_data={1: GRID}),
    # side keys are looked up by their bytes too
    "side_key_not_utf8": _form_item(
        model_specific_data=msgspec.Raw(b"\x81\xa2g\xff" + ENC.encode(GRID))
    ),
    # the same key twice (the first in an aux frame): the reference keeps the last only
    "repeated_key": _form_item(
        model_specific_data=msgspec.Raw(
            b"\x82"
            + msgpack.packb("g")
            + msgpack.packb(["uint8", [512], 1])
            + msgpack.packb("g")
            + ENC.encode(GRID)
        )
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(OUTSIDE_THE_FORM))
def test_items_outside_the_common_form_as_the_reference(case: str) -> None:
    """Every other item (its elements decoded one by one where they are not of the
    common form) is built or refused as the reference builds or refuses it, and the
    codec's outcome is the same in every mode."""
    vs, ve, img = 248053, 248054, 248056
    ids = [11, 12, vs, *([img] * 16), ve, 13]
    mm = [[_form_item(), OUTSIDE_THE_FORM[case]], img, 248057, None, None, None, None]
    payload, aux = _ids_payload(msgpack.packb(ids), mm=mm), [bytes(512)]
    view = _items_view(payload)
    expected = _reference(view, aux)
    for walk in _walks():
        assert _built(walk, view, aux) == expected, walk.__name__
    outcomes = []
    for name in MODES:
        with mode(name):
            try:
                req = wire.decode_message([b"\x00", payload, *aux]).request
            except wire.WireError as exc:
                outcomes.append(("error", exc.message))
            else:
                assert req is not None
                outcomes.append(("ok", snapshot(req)))
    assert outcomes[1:] == outcomes[:1] * (len(MODES) - 1)


def test_native_off_decodes_items_with_the_interpreted_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With native code off the items are built by the same walk, interpreted, to the
    same request."""
    from mmadmit import native

    payload, aux = _fast_form_payload()
    calls: list[int] = []
    walk = msgpack_walk.build_items

    def counted(*args: Any) -> Any:
        calls.append(1)
        return walk(*args)

    monkeypatch.setattr(msgpack_walk, "build_items", counted)
    try:
        native.set_enabled(False)
        off = snapshot(wire.decode_message([b"\x00", payload, *aux]).request)
        assert calls == [1]
        native.set_enabled(True)
        on = snapshot(wire.decode_message([b"\x00", payload, *aux]).request)
    finally:
        native.set_enabled(SESSION_NATIVE)
    assert on == off
    assert calls == [1]


@pytest.mark.parametrize("name", ["codec", "fallback"])
@pytest.mark.parametrize(
    "change", [{"end": 10**6}, {"off1": 0}, {"off3": 1}, {"start": -1}], ids=str
)
def test_splice_refuses_a_source_outside_its_bytes(name: str, change: dict[str, int]) -> None:
    """Offsets that do not lie in order inside the received bytes (never made by the
    decoders: a bug) end in an error, never in a read outside the buffer."""
    _, req = _decoded()
    it = req.mm.items[1]
    it.extra = msgspec.structs.replace(it.extra, **change)
    with mode(name), pytest.raises(ValueError, match="splice_items: item 1's source"):
        wire.encode_request(req)


# --------------------------------------------------------------------------
# decode_add: the whole ADD in one walk, compiled and interpreted (what --native
# off runs)

_TIGHT = Limits(
    max_tokens=64, max_items=2, max_msgpack_len=40, max_msgpack_depth=4, max_tensor_bytes=4096
)


def _added(walk: Any, payload: bytes, aux: list[Any], limits: Limits) -> Any:
    """What one way of decode_add makes of ``payload`` (comparable), or its refusal:
    type, code, message and the rid it carries (None: the caller recovers it)."""
    buf = memoryview(payload)
    reader = wire._TensorReader([memoryview(a) for a in aux], limits)
    env = (reader.aux, Tensor, Item, wire._ItemSrc, wire._NO_SIDE, wire._value, reader.tensor,
           wire._decode_shm)  # fmt: skip
    try:
        offsets, ints, rid, mm = walk.decode_add(
            buf, buf, limits, [None, None], env, wire.WireError
        )
    except (InvalidRequest, TooLarge) as exc:
        return ("refused", type(exc).__name__, exc.code, exc.message, getattr(exc, "rid", None))
    form = [x.tolist() if isinstance(x, np.ndarray) else x for x in ints]
    if mm is not None:
        for it in mm[1]:  # the rows, comparable
            it.offsets = None if it.offsets is None else it.offsets.tolist()
        mm = (mm[0], _items_form(mm[1]), sorted(mm[2]), sorted(mm[3]))
    return offsets, form, rid, mm


def _decode_add_ways() -> list[Any]:
    return [msgpack_walk] + ([ic._BUILT] if ic._BUILT is not None else [])


def _add_cases() -> list[tuple[bytes, list[bytes]]]:
    """Payloads: the common form, every vector, then each with bytes replaced."""
    base = [_fast_form_payload()]
    base += [
        (bytes(v.frames[1]), [bytes(f) for f in v.frames[2:]])
        for v in (load_vector(name) for name in NAMES)
        if len(v.frames[1]) < 20000
    ]
    rng = np.random.default_rng(35)
    cases = list(base)
    for payload, aux in base:
        for _ in range(50):
            bad = bytearray(payload)
            for _ in range(int(rng.integers(1, 4))):
                bad[int(rng.integers(0, len(bad)))] = int(rng.integers(0, 256))
            cases.append((bytes(bad), aux))
        for cut in (0, 1, len(payload) // 2, len(payload) - 1):
            cases.append((payload[:cut], aux))
    return cases


def test_decode_add_is_one_walk_in_every_build() -> None:
    """decode_add compiled and interpreted (what --native off runs) take the same
    payloads into the same offsets,
    token arrays, rid and items, and refuse the others with the same type, code,
    message and rid, under the default limits and tight ones."""
    ways = _decode_add_ways()
    refused = taken = 0
    for payload, aux in _add_cases():
        for limits in (DEFAULT_LIMITS, _TIGHT):
            results = [_added(walk, payload, aux, limits) for walk in ways]
            assert results[1:] == results[:1] * (len(ways) - 1), (payload.hex(), results)
            if results[0][0] == "refused":
                refused += 1
            else:
                taken += 1
    assert refused > 100 and taken > 50, (refused, taken)


def test_decode_add_refusals_carry_the_rid_once_it_is_read() -> None:
    """A refusal after the rid is read carries it (wire.WireError); one before it
    (structure, a limit, the tag, the rid itself) carries none and wire recovers it."""
    payload, aux = _fast_form_payload()
    after = _added(msgpack_walk, payload, aux, Limits(max_items=0))
    assert after[:3] == ("refused", "WireError", AbortCode.TOO_LARGE) and after[4] == "rid-v"
    before = _added(msgpack_walk, payload, aux, Limits(max_msgpack_len=3))
    assert before[:3] == ("refused", "TooLarge", AbortCode.TOO_LARGE) and before[4] is None
    with pytest.raises(wire.WireError) as info:
        wire.decode_message([b"\x00", payload, *aux], Limits(max_msgpack_len=3))
    assert info.value.rid == "rid-v" and info.value.code == AbortCode.TOO_LARGE


def test_decode_add_names_the_item_whose_offsets_it_refuses() -> None:
    """Offsets are read for the items that have element 3 only; a refusal names the
    item by its index among all items, not among those with offsets."""
    ids = msgpack.packb([11, 12, 13, 14])
    items = [[1, None, None], [1, None, None, None], [2, None, None, [[0, 1], [2, "x"]]]]
    payload = _ids_payload(ids, mm=[items, 248056, 248057, None, None, None, None])
    with pytest.raises(wire.WireError) as info:
        wire.decode_message([b"\x00", payload])
    assert info.value.message.startswith("item 2: offsets must be nil or an array of"), info.value
    assert info.value.rid == "rid-v"
