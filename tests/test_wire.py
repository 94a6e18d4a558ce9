"""The msgpack wire codec (docs/spec/WIRE.md): decode, re-encode, errors, zero-copy."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np
import pytest
from conftest import VECTORS, load_vector, vector_names
from mmadmit import wire
from mmadmit.errors import Abort, AbortCode
from mmadmit.materializer import Materializer
from mmadmit.model import Materialized, Modality
from mmadmit.profile import load_profile

TAG = "TokenizedGenerateReqInput"
Ext = msgspec.msgpack.Ext
ENC = msgspec.msgpack.Encoder()
SPLIT = msgspec.msgpack.Decoder(list[msgspec.Raw])

NAMES = vector_names()
# every case with native code on and off (conftest.native_mode)
pytestmark = pytest.mark.usefixtures("native_mode")
needs_vectors = pytest.mark.skipif(not NAMES, reason=f"no vectors at {VECTORS}")

# Qwen3.5 ids (public checkpoint)
VS, VE, IMG, VID = 248053, 248054, 248056, 248057

SAMPLING = [
    16,
    None,
    [248044],
    1.0,
    1.0,
    1073741824,
    0.0,
    0.0,
    0.0,
    1.0,
    0,
    None,
    None,
    None,
    None,
    False,
    True,
    True,
    False,
    None,
    None,
    None,
    None,
    None,
    None,
    1,
    None,
    0,
    False,
]


# --------------------------------------------------------------------------- builders


def tensor(dtype: str, shape: list[int], data: bytes | int) -> list[Any]:
    """A wire tensor: inline bytes (ext 3) or an aux frame index."""
    return [dtype, shape, data if isinstance(data, int) else Ext(3, data)]


def grid(rows: list[list[int]]) -> list[Any]:
    return tensor("int64", [len(rows), 3], np.asarray(rows, np.int64).tobytes())


def item(
    modality: int = 1,
    hash: int | None = None,
    pad: int | None = None,
    offsets: list[list[int]] | None = None,
    feature: Any = None,
    shm: Any = None,
    msd: dict[str, Any] | None = None,
    handshake: Any = None,
    trailing: tuple[Any, ...] = (),
) -> list[Any]:
    return [modality, hash, pad, offsets, feature, shm, msd or {}, None, None, handshake, *trailing]


def mm(
    items: list[Any],
    im: int | None = IMG,
    vid: int | None = VID,
    positions: Any = None,
    delta: Any = None,
    scalar: int | None = None,
    trailing: tuple[Any, ...] = (),
) -> list[Any]:
    return [items, im, vid, positions, delta, scalar, None, *trailing]


def payload(
    ids: list[int],
    *,
    rid: str = "rid-1",
    sampling: Any = None,
    extra_infos: Any = None,
    unpadded: list[int] | None = None,
    mm_inputs: Any = None,
    verr: str | None = None,
    n: int = 24,
    trailing: tuple[Any, ...] = (),
    tag: str = TAG,
) -> bytes:
    full = [
        tag,
        rid,
        None,
        None,
        ids,
        SAMPLING if sampling is None else sampling,
        False,
        -1,
        0,
        None,
        False,
        None,
        None,
        None,
        False,
        1712345678.25,
        None,
        None,
        None,
        None,
        extra_infos,
        unpadded,
        mm_inputs,
        verr,
    ]
    return ENC.encode([*full[:n], *trailing])


def image_prompt(h: int = 4, w: int = 6) -> tuple[list[int], list[list[int]]]:
    """text, <vs>, h*w/4 image pads, <ve>, text."""
    n = h * w // 4
    ids = [11, 12, VS, *([IMG] * n), VE, 13]
    return ids, [[3, 3 + n - 1]]


def split(raw: Any) -> list[bytes]:
    return [bytes(r) for r in SPLIT.decode(raw)]


def materialize(req: Any, model: str = "qwen3_5") -> Materialized:
    out = Materializer(load_profile(model)).run(req)
    assert isinstance(out, Materialized), out
    return out


# --------------------------------------------------------------------------- vectors


@needs_vectors
@pytest.mark.parametrize("name", NAMES or ["-"])
def test_vector_round_trip(name: str) -> None:
    vec = load_vector(name)
    frames = list(vec.frames)
    msg = wire.decode_message(frames)
    assert msg.kind == wire.MSG_ADD
    req = msg.request
    out = wire.encode_request(req)
    # Nothing changed: payload byte-identical, aux frames are the received buffers.
    assert bytes(out[0]) == bytes(frames[1])
    assert len(out) == len(frames) - 1
    for a, b in zip(out[1:], frames[2:], strict=True):
        assert bytes(a) == bytes(b)
    again = wire.decode_request(out[0], out[1:])
    assert again.rid == req.rid
    np.testing.assert_array_equal(again.input_ids, req.input_ids)
    assert (again.input_ids_unpadded is None) == (req.input_ids_unpadded is None)
    assert again.validation_error == req.validation_error
    assert (again.mm is None) == (req.mm is None)
    if req.mm is not None:
        assert len(again.mm.items) == len(req.mm.items)
        for a, b in zip(again.mm.items, req.mm.items, strict=True):
            assert (a.modality, a.hash, a.pad_value) == (b.modality, b.hash, b.pad_value)
            np.testing.assert_array_equal(a.offsets, b.offsets)
            assert (a.feature is None) == (b.feature is None)
            if a.feature is not None:
                assert a.feature.dtype == b.feature.dtype and a.feature.shape == b.feature.shape
                assert bytes(a.feature.data) == bytes(b.feature.data)
            assert a.side.keys() == b.side.keys()
            for k in a.side:
                assert bytes(a.side[k].data) == bytes(b.side[k].data)


@needs_vectors
@pytest.mark.parametrize("name", NAMES or ["-"])
def test_vector_frame_counts(name: str) -> None:
    """Reply = received aux frames (same indices) + the added positions, when large."""
    vec = load_vector(name)
    req = wire.decode_request(vec.frames[1], list(vec.frames[2:]))
    model = {"qwen3_5": "qwen3_5", "qwen3_omni": "qwen3_omni_moe", "llama": "llama"}[
        vec.meta["family"]
    ]
    outcome = Materializer(load_profile(model)).run(req)
    if vec.error:
        reply = wire.encode_aborted(req, outcome)
        assert len(reply) == len(vec.frames)
        return
    reply = wire.encode_materialized(outcome)
    added = 0
    if "mrope_positions" in vec.arrays:
        added = 1 if vec.arrays["mrope_positions"].astype(np.int64).nbytes >= 256 else 0
    assert len(reply) == len(vec.frames) + added
    for k, frame in enumerate(vec.frames[2:]):
        assert reply[2 + k] is frame  # kept: the very object it came in, same index
        assert bytes(reply[2 + k]) == bytes(frame)


# --------------------------------------------------------------------------- shorter / longer


def test_short_text_payload_11_elements_decodes_with_defaults() -> None:
    raw = payload([1, 2, 3], n=11)
    assert len(split(raw)) == 11
    req = wire.decode_request(raw, [])
    assert req.rid == "rid-1"
    np.testing.assert_array_equal(req.input_ids, [1, 2, 3])
    assert req.input_ids_unpadded is None and req.mm is None and req.validation_error is None
    out = materialize(req)
    frames = wire.encode_materialized(out)
    elems = msgspec.msgpack.decode(frames[1])
    assert len(elems) == 24
    assert elems[0] == TAG and elems[4] == [1, 2, 3]
    assert elems[5] == SAMPLING
    assert elems[14] is False and isinstance(elems[15], float)  # typed fields: defaults, not nil
    assert all(elems[i] is None for i in (11, 12, 13, 16, 17, 18, 19, 20, 21, 22, 23))
    again = wire.decode_request(frames[1], frames[2:])
    np.testing.assert_array_equal(again.input_ids, [1, 2, 3])


def test_short_multimodal_payload_23_elements_decodes_with_defaults() -> None:
    ids, offs = image_prompt()
    m = mm([item(1, hash=5, offsets=offs, msd={"image_grid_thw": grid([[1, 4, 6]])})])
    raw = payload(ids, mm_inputs=m, n=23)
    assert len(split(raw)) == 23
    req = wire.decode_request(raw, [])
    assert req.validation_error is None and req.mm is not None and len(req.mm.items) == 1
    out = materialize(req)
    frames = wire.encode_materialized(out)
    elems = msgspec.msgpack.decode(frames[1], ext_hook=lambda c, d: (c, bytes(d)))
    assert len(elems) == 24 and elems[23] is None
    again = wire.decode_request(frames[1], frames[2:])
    assert again.mm.items[0].pad_value == 1_000_000 + 5
    assert again.mm.mrope_positions.shape == (3, len(ids))


def test_short_mm_and_item_arrays_decode_with_defaults() -> None:
    ids, offs = image_prompt()
    short_item = [1, 5, None, offs]  # only 4 item fields
    short_mm = [[short_item], IMG]  # only 2 MultimodalInputs fields
    req = wire.decode_request(payload(ids, mm_inputs=short_mm), [])
    it = req.mm.items[0]
    assert it.hash == 5 and it.feature is None and it.side == {}
    assert req.mm.video_token_id is None and req.mm.mrope_positions is None
    # re-encoded at full length
    frames = wire.encode_request(req)
    mm_elems = split(split(frames[0])[22])
    assert len(mm_elems) >= 7
    assert len(split(split(mm_elems[0])[0])) >= 10


def test_unknown_trailing_elements_preserved_byte_exact() -> None:
    ids, offs = image_prompt()
    top_extra = ({"new_top": [1, 2.5, "x"]}, "z" * 40)
    mm_extra = ({"new_mm": True},)
    item_extra = ([7, None, {"k": b"\x00\x01"}], 3.25)
    m = mm(
        [
            item(
                1,
                hash=9,
                offsets=offs,
                msd={"image_grid_thw": grid([[1, 4, 6]])},
                trailing=item_extra,
            )
        ],
        trailing=mm_extra,
    )
    raw = payload(ids, mm_inputs=m, trailing=top_extra)
    req = wire.decode_request(raw, [])
    want_top = [ENC.encode(v) for v in top_extra]
    want_mm = [ENC.encode(v) for v in mm_extra]
    want_item = [ENC.encode(v) for v in item_extra]

    def check(frames: list[Any]) -> None:
        top = split(frames[0])
        assert top[24:] == want_top
        mm_el = split(top[22])
        assert mm_el[7:] == want_mm
        it = split(split(mm_el[0])[0])
        assert it[10:] == want_item

    check(wire.encode_request(req))  # unchanged re-encode
    check(wire.encode_materialized(materialize(req))[1:])  # after materialization
    check(wire.encode_aborted(req, Abort(AbortCode.INVALID_REQUEST, "x"))[1:])  # abort too


def test_aux_indices_kept_and_added_tensors_appended() -> None:
    """An unknown field may point at an aux frame: indices of received frames never move."""
    ids, offs = image_prompt(8, 8)  # 16 tokens
    feat = np.arange(128, dtype=np.float32).tobytes()  # 512 bytes -> aux
    opaque = b"opaque-aux-frame" * 32
    m = mm(
        [
            item(
                1,
                offsets=offs,
                feature=tensor("float32", [64, 2], 2),
                msd={"image_grid_thw": grid([[1, 8, 8]])},
            )
        ]
    )
    raw = payload(ids, mm_inputs=m, trailing=({"blob_frame": 1},))
    aux = [opaque, feat]
    req = wire.decode_request(raw, aux)
    assert bytes(req.mm.items[0].feature.data) == feat
    out = materialize(req)
    frames = wire.encode_materialized(out)
    assert len(frames) == 2 + 3  # status, payload, the 2 received frames, positions
    assert bytes(frames[2]) == opaque and bytes(frames[3]) == feat
    elems = msgspec.msgpack.decode(frames[1], ext_hook=lambda c, d: (c, bytes(d)))
    assert elems[24] == {"blob_frame": 1}
    it = elems[22][0][0]
    assert it[4][2] == 2  # the feature still points at aux frame 2
    positions = elems[22][3]
    assert positions[0] == "int64" and positions[1] == [3, len(ids)]
    assert positions[2] == 3  # appended after the received frames
    assert bytes(frames[4]) == out.request.mm.mrope_positions.to_numpy().tobytes()
    delta = elems[22][4]
    assert delta[1] == [1, 1] and delta[2][0] == 3  # 8 bytes: inline ext 3
    again = wire.decode_request(frames[1], frames[2:])
    np.testing.assert_array_equal(
        again.mm.mrope_positions.to_numpy(), out.request.mm.mrope_positions.to_numpy()
    )


# --------------------------------------------------------------------------- tensors


def test_inline_and_aux_tensors() -> None:
    ids, offs = image_prompt()
    small = np.arange(10, dtype=np.float32).tobytes()  # 40 bytes inline
    big = np.arange(300, dtype=np.float32).tobytes()  # 1200 bytes in aux
    ids2 = ids + [VS, *([IMG] * 6), VE]
    offs2 = [[len(ids) + 1, len(ids) + 6]]
    m = mm(
        [
            item(
                1,
                offsets=offs,
                feature=tensor("float32", [5, 2], small),
                msd={"image_grid_thw": grid([[1, 4, 6]])},
            ),
            item(
                1,
                offsets=offs2,
                feature=tensor("<f4", [150, 2], 1),
                msd={"image_grid_thw": grid([[1, 4, 6]])},
            ),
        ]
    )
    req = wire.decode_request(payload(ids2, mm_inputs=m), [big])
    a, b = req.mm.items
    assert a.feature.dtype.name == "float32" and a.feature.shape == (5, 2)
    assert bytes(a.feature.data) == small
    assert b.feature.dtype.name == "float32" and b.feature.shape == (150, 2)  # "<f4" legal
    assert bytes(b.feature.data) == big
    np.testing.assert_array_equal(
        b.feature.to_numpy().reshape(-1), np.arange(300, dtype=np.float32)
    )
    frames = wire.encode_request(req)
    elems = msgspec.msgpack.decode(frames[0], ext_hook=lambda c, d: (c, bytes(d)))
    fa, fb = elems[22][0][0][4], elems[22][0][1][4]
    assert fa[2] == (3, small)
    assert fb[2] == 1 and bytes(frames[1]) == big


def test_bfloat16_tensor() -> None:
    ids, offs = image_prompt()
    data = bytes(range(16))
    m = mm(
        [
            item(
                1,
                offsets=offs,
                feature=tensor("bfloat16", [4, 2], data),
                msd={"image_grid_thw": grid([[1, 4, 6]])},
            )
        ]
    )
    req = wire.decode_request(payload(ids, mm_inputs=m), [])
    f = req.mm.items[0].feature
    assert f.dtype.name == "bfloat16" and f.dtype.itemsize == 2 and f.shape == (4, 2)
    assert bytes(f.data) == data
    out = materialize(req)
    it = out.request.mm.items[0]
    want_hash = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    assert it.hash == want_hash
    elems = msgspec.msgpack.decode(
        wire.encode_materialized(out)[1], ext_hook=lambda c, d: (c, bytes(d))
    )
    assert elems[22][0][0][4] == ["bfloat16", [4, 2], (3, data)]


def test_bfloat16_length_mismatch_names_item() -> None:
    ids, offs = image_prompt()
    m = mm(
        [
            item(
                1,
                hash=1,
                offsets=offs,
                feature=tensor("bfloat16", [4, 2], bytes(15)),
                msd={"image_grid_thw": grid([[1, 4, 6]])},
            )
        ]
    )
    with pytest.raises(wire.WireError, match=r"item 0"):
        wire.decode_request(payload(ids, mm_inputs=m), [])


def test_empty_tensor() -> None:
    ids, offs = image_prompt()
    m = mm(
        [
            item(
                1,
                hash=3,
                offsets=offs,
                feature=tensor("float32", [0], b""),
                msd={"image_grid_thw": grid([[1, 4, 6]])},
            )
        ]
    )
    req = wire.decode_request(payload(ids, mm_inputs=m), [])
    f = req.mm.items[0].feature
    assert f.shape == (0,) and f.nbytes == 0
    frames = wire.encode_request(req)
    again = wire.decode_request(frames[0], frames[1:])
    assert again.mm.items[0].feature.shape == (0,) and again.mm.items[0].feature.nbytes == 0


# --------------------------------------------------------------------------- rejections


def _pickle_placements() -> dict[str, bytes]:
    ids, offs = image_prompt()
    g = {"image_grid_thw": grid([[1, 4, 6]])}
    pk = Ext(1, b"\x80\x04K\x01.")
    cpk = Ext(2, b"\x80\x04K\x01.")
    sampling = list(SAMPLING)
    sampling[20] = {"custom": pk}
    return {
        "sampling_params": payload(
            ids, sampling=sampling, mm_inputs=mm([item(1, 1, None, offs, msd=g)])
        ),
        "item_handshake": payload(
            ids, mm_inputs=mm([item(1, 1, None, offs, msd=g, handshake={"x": cpk})])
        ),
        "item_model_specific_data": payload(
            ids, mm_inputs=mm([item(1, 1, None, offs, msd={**g, "p": pk})])
        ),
        "item_trailing": payload(
            ids, mm_inputs=mm([item(1, 1, None, offs, msd=g, trailing=(pk,))])
        ),
        "mm_trailing": payload(ids, mm_inputs=mm([item(1, 1, None, offs, msd=g)], trailing=(cpk,))),
        "top_trailing": payload(
            ids, mm_inputs=mm([item(1, 1, None, offs, msd=g)]), trailing=([pk],)
        ),
        "input_extra_infos": payload([1], sampling=[], extra_infos=[{"a": cpk}]),
        "feature_data": payload(
            ids, mm_inputs=mm([item(1, None, None, offs, feature=["float32", [1], pk], msd=g)])
        ),
    }


@pytest.mark.parametrize("where", sorted(_pickle_placements()))
def test_pickle_ext_rejected_anywhere(where: str) -> None:
    raw = _pickle_placements()[where]
    with pytest.raises(wire.WireError, match="pickle") as info:
        wire.decode_message([b"\x00", raw])
    assert info.value.rid == "rid-1"
    assert info.value.code is AbortCode.INVALID_REQUEST


def test_unknown_ext_code_rejected() -> None:
    ids, offs = image_prompt()
    raw = payload(
        ids,
        mm_inputs=mm(
            [item(1, 1, None, offs, msd={"image_grid_thw": grid([[1, 4, 6]]), "q": Ext(7, b"abc")})]
        ),
    )
    with pytest.raises(wire.WireError, match="ext"):
        wire.decode_request(raw, [])
    raw = payload([1, 2], trailing=(Ext(42, b""),))
    with pytest.raises(wire.WireError, match="ext"):
        wire.decode_request(raw, [])


def test_tensor_length_mismatch_names_item() -> None:
    ids, offs = image_prompt()
    g = {"image_grid_thw": grid([[1, 4, 6]])}
    good = item(1, 1, None, offs, msd=g)
    bad = item(
        1, None, None, [[len(ids) - 1, len(ids) - 1]], feature=tensor("float32", [100, 2], 1), msd=g
    )
    with pytest.raises(wire.WireError, match=r"item 1 feature.*799|item 1 feature.*800") as info:
        wire.decode_request(payload(ids, mm_inputs=mm([good, bad])), [bytes(799)])
    assert info.value.rid == "rid-1"


def test_side_tensor_length_mismatch_names_item_and_key() -> None:
    ids, offs = image_prompt()
    bad_grid = tensor("int64", [1, 3], bytes(16))
    with pytest.raises(wire.WireError, match=r"item 0.*image_grid_thw"):
        wire.decode_request(
            payload(ids, mm_inputs=mm([item(1, 1, None, offs, msd={"image_grid_thw": bad_grid})])),
            [],
        )


@pytest.mark.parametrize("index", [0, 2, 5, -1])
def test_aux_index_out_of_range(index: int) -> None:
    ids, offs = image_prompt()
    m = mm(
        [
            item(
                1,
                None,
                None,
                offs,
                feature=tensor("float32", [64, 2], index),
                msd={"image_grid_thw": grid([[1, 4, 6]])},
            )
        ]
    )
    with pytest.raises(wire.WireError, match=r"item 0") as info:
        wire.decode_request(payload(ids, mm_inputs=m), [bytes(512)])
    assert info.value.rid == "rid-1"


def test_bad_type_byte_recovers_rid() -> None:
    raw = payload([1, 2, 3], rid="abc")
    with pytest.raises(wire.WireError, match="type") as info:
        wire.decode_message([b"\x05", raw])
    assert info.value.rid == "abc"
    with pytest.raises(wire.WireError) as info:
        wire.decode_message([b"", raw])
    assert info.value.rid == "abc"
    with pytest.raises(wire.WireError) as info:
        wire.decode_message([b"\x00\x00", raw])
    assert info.value.rid == "abc"


@pytest.mark.parametrize("frames", [[], [b"\x00"]])
def test_fewer_than_two_frames(frames: list[bytes]) -> None:
    with pytest.raises(wire.WireError) as info:
        wire.decode_message(frames)
    assert info.value.rid == ""


def test_wrong_tag_recovers_rid() -> None:
    with pytest.raises(wire.WireError, match="tag") as info:
        wire.decode_message([b"\x00", payload([1], rid="r-tag", tag="BatchTokenIDOutSlim")])
    assert info.value.rid == "r-tag"


@pytest.mark.parametrize(
    "raw, rid",
    [
        (b"\xc1", ""),  # never-used msgpack byte
        (b"\x92\xa3abc", ""),  # truncated array
        (b"\xa5hello", ""),  # not an array
        (ENC.encode([TAG, "r-ids", None, None, "not ids"]), "r-ids"),
        (ENC.encode([TAG, "r-ids2", None, None, [1, "x"]]), "r-ids2"),
        (payload([1], rid="r-mm", sampling=[], mm_inputs="not mm", n=23), "r-mm"),
        (ENC.encode([TAG, 17]), ""),  # rid not a string
        (ENC.encode([TAG, "r-short"]), "r-short"),  # no input_ids
    ],
)
def test_undecodable_payload(raw: bytes, rid: str) -> None:
    with pytest.raises(wire.WireError) as info:
        wire.decode_message([b"\x00", raw])
    assert info.value.rid == rid
    assert info.value.code is AbortCode.INVALID_REQUEST


def test_bad_abort_message() -> None:
    with pytest.raises(wire.WireError):
        wire.decode_message([b"\x01", b"\xc1"])
    with pytest.raises(wire.WireError):
        wire.decode_message([b"\x01", ENC.encode([1, 2])])
    msg = wire.decode_message([b"\x01", ENC.encode(["a", "b"])])
    assert msg.kind == wire.MSG_ABORT and msg.abort_rids == ["a", "b"]


# --------------------------------------------------------------------------- aborted replies


def test_minimal_abort_payload() -> None:
    abort = Abort(AbortCode.INVALID_REQUEST, "bad frames")
    frames = wire.encode_aborted(None, abort, "rid-x")
    assert len(frames) == 2 and bytes(frames[0]) == b"\x01"
    elems = msgspec.msgpack.decode(frames[1])
    assert elems[0] == TAG and elems[1] == "rid-x"
    assert elems[4] == [] and elems[5] == []
    assert len(elems) >= 24
    assert elems[23] == "INVALID_REQUEST: bad frames"
    for i in (2, 3, 9, 11, 12, 13, 16, 17, 18, 19, 20, 21, 22):
        assert elems[i] is None
    assert elems[6] is False and elems[10] is False and elems[14] is False
    assert isinstance(elems[7], int) and isinstance(elems[8], int)
    assert isinstance(elems[15], float)
    req = wire.decode_request(frames[1], frames[2:])
    assert req.rid == "rid-x" and len(req.input_ids) == 0
    assert req.validation_error == "INVALID_REQUEST: bad frames"
    # no rid recovered: ""
    assert msgspec.msgpack.decode(wire.encode_aborted(None, abort)[1])[1] == ""


@needs_vectors
def test_aborted_reply_of_decoded_request_drops_features() -> None:
    vec = load_vector("qwen3_5_mixed")
    req = wire.decode_request(vec.frames[1], list(vec.frames[2:]))
    frames = wire.encode_aborted(req, Abort(AbortCode.TOO_LARGE, "item 3 is too big"))
    assert bytes(frames[0]) == b"\x01"
    assert len(frames) == len(vec.frames)  # indices of the remaining frames stay valid
    assert all(len(f) == 0 for f in frames[2:])  # every aux frame here held a feature
    back = wire.decode_request(frames[1], frames[2:])
    assert back.validation_error == "TOO_LARGE: item 3 is too big"
    assert back.rid == req.rid
    np.testing.assert_array_equal(back.input_ids, req.input_ids)
    assert len(back.mm.items) == len(req.mm.items)
    for a, b in zip(back.mm.items, req.mm.items, strict=True):
        assert a.feature is None
        assert a.hash == b.hash and a.pad_value == b.pad_value
        np.testing.assert_array_equal(a.offsets, b.offsets)
        np.testing.assert_array_equal(
            a.side["image_grid_thw" if a.modality == 1 else "video_grid_thw"].to_numpy(),
            b.side["image_grid_thw" if b.modality == 1 else "video_grid_thw"].to_numpy(),
        )
    # every other element as received
    src, rep = split(vec.frames[1]), split(frames[1])
    for i in range(len(src)):
        if i not in (22, 23):
            assert rep[i] == src[i], i


def test_aborted_reply_keeps_non_feature_aux_frames() -> None:
    ids, offs = image_prompt(8, 8)
    opaque = b"q" * 300
    feat = bytes(512)
    m = mm(
        [
            item(
                1,
                None,
                None,
                offs,
                feature=tensor("float32", [64, 2], 2),
                msd={"image_grid_thw": grid([[1, 8, 8]])},
            )
        ]
    )
    req = wire.decode_request(payload(ids, mm_inputs=m, trailing=({"f": 1},)), [opaque, feat])
    frames = wire.encode_aborted(req, Abort(AbortCode.INVALID_REQUEST, "m"))
    assert len(frames) == 4
    assert bytes(frames[2]) == opaque and len(frames[3]) == 0
    elems = msgspec.msgpack.decode(frames[1])
    assert elems[22][0][0][4] is None
    assert elems[23] == "INVALID_REQUEST: m" and elems[24] == {"f": 1}


# --------------------------------------------------------------------------- zero-copy


def _address(buf: Any) -> int:
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "zmq_frame"])
def test_zero_copy_feature(kind: str) -> None:
    rows = (1 << 20) // 8  # 1 MiB of float32 [rows, 2]
    ids, offs = image_prompt(8, 8)
    raw_feature = np.random.default_rng(0).standard_normal(rows * 2).astype(np.float32).tobytes()
    assert len(raw_feature) >= 1 << 20
    if kind == "bytes":
        frame: Any = raw_feature
        frame_addr = _address(frame)
    elif kind == "bytearray":
        frame = bytearray(raw_feature)
        frame_addr = _address(frame)
    else:
        zmq = pytest.importorskip("zmq")
        frame = zmq.Frame(raw_feature)
        frame_addr = _address(frame.buffer)
    m = mm(
        [
            item(
                1,
                None,
                None,
                offs,
                feature=tensor("float32", [rows, 2], 1),
                msd={"image_grid_thw": grid([[1, 8, 8]])},
            )
        ]
    )
    req = wire.decode_request(payload(ids, mm_inputs=m), [frame])
    data = req.mm.items[0].feature.data
    assert np.frombuffer(data).__array_interface__["data"][0] == frame_addr  # a view, no copy
    assert data.nbytes == len(raw_feature)

    out = materialize(req)
    assert out.request.mm.items[0].feature.data is data
    want = int.from_bytes(hashlib.blake2b(raw_feature, digest_size=8).digest(), "big")
    assert out.request.mm.items[0].hash == want
    assert out.request.mm.items[0].pad_value == 1_000_000 + want % 715_494_549

    reply = wire.encode_materialized(out)
    same = [f for f in reply[2:] if f is frame]
    assert same, "the reply must carry the very object the feature arrived in"
    assert _address(reply[2] if kind != "zmq_frame" else reply[2].buffer) == frame_addr
    # the payload points the feature at that frame
    elems = msgspec.msgpack.decode(reply[1], ext_hook=lambda c, d: (c, bytes(d)))
    assert elems[22][0][0][4][2] == 1


def test_zero_copy_survives_plain_reencode() -> None:
    rows = (1 << 20) // 8
    ids, offs = image_prompt(8, 8)
    frame = bytearray(rows * 8)
    m = mm(
        [
            item(
                Modality.IMAGE,
                1,
                None,
                offs,
                feature=tensor("float32", [rows, 2], 1),
                msd={"image_grid_thw": grid([[1, 8, 8]])},
            )
        ]
    )
    req = wire.decode_request(payload(ids, mm_inputs=m), [frame])
    frames = wire.encode_request(req)
    assert frames[1] is frame  # the object it arrived in
    assert _address(frames[1]) == _address(frame)


def test_carried_positions_in_aux_keep_their_index() -> None:
    """Positions received in an aux frame are kept there: nothing appended, same buffer."""
    ids, offs = image_prompt()  # 11 tokens: simple image prompt
    pos = np.array(
        [
            [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
            [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
            [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
        ],
        np.int64,
    )
    m = mm(
        [item(1, 5, None, offs, msd={"image_grid_thw": grid([[1, 4, 6]])})],
        positions=tensor("int64", [3, 11], 1),
        delta=tensor("int64", [1, 1], 2),
    )
    frames_in = [bytearray(pos.tobytes()), np.array([[-3]], np.int64).tobytes()]
    req = wire.decode_request(payload(ids, mm_inputs=m), frames_in)
    out = materialize(req)
    assert out.request.mm.mrope_position_delta_scalar == -3
    reply = wire.encode_materialized(out)
    assert len(reply) == 4
    assert reply[2] is frames_in[0]  # the object it arrived in
    elems = msgspec.msgpack.decode(reply[1], ext_hook=lambda c, d: (c, bytes(d)))
    assert elems[22][3] == ["int64", [3, 11], 1]
    assert elems[22][5] == -3


@pytest.mark.parametrize(
    "offsets", [[[2**64 - 1, 2**64 - 1]], [[1, 2, 3]], [[True, 2]], [[1.0, 2]], "x"]
)
def test_bad_offsets_rejected_naming_item(offsets: Any) -> None:
    ids, offs = image_prompt()
    g = {"image_grid_thw": grid([[1, 4, 6]])}
    m = mm([item(1, 5, None, offs, msd=g), item(1, 6, None, offsets, msd=g)])
    with pytest.raises(wire.WireError, match=r"item 1") as info:
        wire.decode_request(payload(ids, mm_inputs=m), [])
    assert info.value.rid == "rid-1"


@pytest.mark.parametrize("field, value", [(1, -1), (1, "h"), (2, 1.5), (0, "image"), (0, True)])
def test_bad_item_scalars(field: int, value: Any) -> None:
    """Modality, hash and pad_value must be integers (range checks are the materializer's)."""
    ids, offs = image_prompt()
    it = item(1, 5, None, offs, msd={"image_grid_thw": grid([[1, 4, 6]])})
    it[field] = value
    raw = payload(ids, mm_inputs=mm([it]))
    if field == 1 and value == -1:  # an int: decodes, then the materializer refuses it
        req = wire.decode_request(raw, [])
        out = Materializer(load_profile("qwen3_5")).run(req)
        assert isinstance(out, Abort) and out.code is AbortCode.INVALID_REQUEST
        assert "item 0" in out.message and "hash" in out.message
        return
    with pytest.raises(wire.WireError, match=r"item 0"):
        wire.decode_request(raw, [])


@pytest.mark.parametrize(
    "name, ok",
    [
        ("psm_1a2b", True),
        ("../etc/passwd", False),
        ("/dev/shm/x", False),
        ("a/b", False),
        ("a\\b", False),
        ("x\x00y", False),
        ("", False),
        ("n" * 256, False),
    ],
)
def test_feature_shm_name_must_be_a_plain_name(name: str, ok: bool) -> None:
    """A request field is never a path: the ZMQ wire checks shm names as gRPC does."""
    ids, offs = image_prompt()
    shm = {"shm_name": name, "shape": [4, 6], "dtype": "float32"}
    raw = payload(ids, mm_inputs=mm([item(1, 5, None, offs, shm=shm, msd={})]))
    if ok:
        (decoded,) = wire.decode_request(raw, []).mm.items  # type: ignore[union-attr]
        assert decoded.feature_shm is not None and decoded.feature_shm.name == name
        return
    with pytest.raises(wire.WireError, match=r"item 0.*shared-memory name") as info:
        wire.decode_request(raw, [])
    assert info.value.rid == "rid-1" and info.value.code is AbortCode.INVALID_REQUEST
