"""Request limits (issue 12 item 3): each breach is its own outcome, decided before
anything sized by the sender is built.

Pinned here, with native code on and off (``conftest.native_mode``):

* the structure walk (:func:`mmadmit.msgpack_walk.check_structure`) and the bounded
  split: native and Python give the same answer on random nested values, on
  mutated bytes and at every limit boundary;
* every codec limit over the wire codec: the payload's length, tokens
  (``input_ids`` and ``input_ids_unpadded``, small and large payloads), one
  container's length, nesting depth, items (with and without a side value that is
  not a tensor),
  tensor rank, one dimension, bytes from the shape, ABORT ids; each at its limit
  accepted, one over refused with the code and the flag named, the rid kept;
* memory: a hostile message decoded under ``tracemalloc`` peaks far below what
  decoding it would take, and a control with the limit lifted shows that the
  same message does take it (so the bound is the limit's doing);
* configuration: every limit is a setting with its default, parsed and checked.

Transport limits (frames, in flight per peer, gRPC calls and requests per
stream) are tested on real sockets in ``test_zmq_ingest.py`` and
``test_grpc_api.py``.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from conftest import CONFIGS
from mmadmit import intcodec, msgpack_walk, wire
from mmadmit.config import ServeConfig, build_config
from mmadmit.errors import Abort, AbortCode, ConfigError
from mmadmit.limits import DEFAULT_LIMITS, Limits
from mmadmit.materializer import Materializer
from mmadmit.model import Item, Modality, MultimodalInputs, Request, Tensor
from mmadmit.profile import load_profile

pytestmark = pytest.mark.usefixtures("native_mode")

ENC = msgspec.msgpack.Encoder()
IMAGE = 248056  # Qwen3.5 <|image_pad|>


# --------------------------------------------------------------------------- helpers


def text_payload(rid: str = "r", n: int = 8, **elements: Any) -> bytes:
    """A text ADD payload with ``n`` tokens, element overrides by index (``e13=...``)."""
    raw = msgspec.msgpack.decode(
        wire.encode_request(Request(rid, np.arange(n, dtype=np.int64)))[0],
        type=list[msgspec.Raw],
    )
    for key, value in elements.items():
        i = int(key.removeprefix("e"))
        raw += [msgspec.Raw(b"\xc0")] * (i + 1 - len(raw))
        raw[i] = value if isinstance(value, msgspec.Raw) else msgspec.Raw(ENC.encode(value))
    return ENC.encode(raw)


def image_request(rid: str = "img", *, items: int = 1, shape: tuple[int, ...] = (16, 256),
                  side_extra: Any = None) -> Request:  # fmt: skip
    """A Qwen3.5 request with ``items`` 8x8 images (16 placeholders each)."""
    ids = np.full(8 + 20 * items, 100, np.int64)
    its = []
    for k in range(items):
        start = 4 + 20 * k
        ids[start : start + 16] = IMAGE
        side: dict[str, Any] = {"image_grid_thw": Tensor.from_numpy(np.array([[1, 8, 8]]))}
        if side_extra is not None:
            side["note"] = side_extra  # not a tensor: kept as the value it is
        its.append(
            Item(
                modality=int(Modality.IMAGE),
                offsets=np.array([[start, start + 15]], np.int64),
                feature=Tensor.from_numpy(np.zeros(shape, np.float32)),
                side=side,
            )
        )
    return Request(rid=rid, input_ids=ids, mm=MultimodalInputs(items=its))


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> wire.WireMessage:
    return wire.decode_message(frames, limits)


def refused(frames: list[Any], limits: Limits) -> wire.WireError:
    with pytest.raises(wire.WireError) as info:
        decode(frames, limits)
    return info.value


def add(payload: bytes, *aux: Any) -> list[Any]:
    return [b"\x00", payload, *aux]


def nested(depth: int) -> Any:
    """A value of ``depth`` nested arrays (``depth`` 0: an int)."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# --------------------------------------------------------------------------- the walk


def _random_value(rng: random.Random, depth: int) -> Any:
    roll = rng.random()
    if depth <= 0 or roll < 0.35:
        return rng.choice([0, -3, 200, 70_000, 2**40, -(2**40), 1.5, "s", "x" * 40, b"b", None,
                           True, msgspec.msgpack.Ext(3, b"ab")])  # fmt: skip
    # mostly short containers; the longer ones (past the fix forms) near the leaves
    n = rng.choice([0, 1, 2, 3, 15, 16, 17, 40] if depth <= 1 else [0, 1, 2, 3])
    if roll < 0.7:
        return [_random_value(rng, depth - 1) for _ in range(n)]
    return {f"k{i}": _random_value(rng, depth - 1) for i in range(n)}


# check_structure of each build: compiled (None when not built) and interpreted
_check_native = getattr(intcodec._BUILT, "check_structure", None)
_check_py = msgpack_walk.check_structure


def _check(buf: bytes, *args: Any) -> Any:
    """check_structure on ``buf``, by the build native code selects."""
    return intcodec._WALK.check_structure(memoryview(buf), *args)


def _both(buf: bytes, offsets: list[int], skip: tuple[int, ...], depth: int, length: int) -> Any:
    """(native result, Python result), each with the odd elements it named; a
    ValueError is the result ``"ValueError"``."""
    out = []
    for impl in (_check_native, _check_py):
        odd: list[int] = []
        try:
            out.append((impl(memoryview(buf), list(offsets), skip, depth, length, odd), odd))
        except ValueError:
            out.append(("ValueError", odd))
    return tuple(out)


@pytest.mark.skipif(not intcodec._BUILT, reason="the C extension is not built")
def test_structure_walk_native_and_python_agree_on_random_and_mutated_input() -> None:
    rng = random.Random(12)
    breaches = {1: 0, 2: 0, 3: 0, None: 0}
    for _ in range(400):
        value = [_random_value(rng, 6) for _ in range(rng.randint(1, 6))]
        buf = ENC.encode(value)
        offsets, _ = intcodec.split_array(buf)
        skip = tuple(i for i in range(len(value)) if rng.random() < 0.2)
        for depth, length in ((1, 0), (2, 3), (3, 16), (4, 15), (32, 65_536), (1024, 2**40)):
            native, python = _both(buf, offsets, skip, depth, length)
            assert native == python, (value, skip, depth, length)
            breaches[None if native[0] is None else native[0][0]] += 1
        # mutated bytes inside the elements, offsets kept: the same verdict or both refuse
        for _ in range(4):
            bad = bytearray(buf)
            bad[rng.randrange(offsets[0], len(bad))] = rng.randrange(256)
            native, python = _both(bytes(bad), offsets, skip, 4, 15)
            assert native == python, (bytes(bad).hex(), skip)
    assert all(count > 50 for count in breaches.values()), breaches  # every verdict seen


def test_structure_walk_boundaries() -> None:
    buf = ENC.encode(["tag", nested(3), {"a": [1, 2, 3]}, list(range(5))])
    offsets, _ = intcodec.split_array(buf)
    check = _check
    assert check(buf, offsets, (), 4, 5) is None  # element 1: depth 4 (3 arrays in the payload)
    assert check(buf, offsets, (), 3, 5) == (3, 1, 4)
    assert check(buf, offsets, (1,), 3, 5) is None  # skipped
    assert check(buf, offsets, (1,), 3, 4) == (1, 3, 5)  # array of 5 over 4
    assert check(buf, offsets, (1, 3), 3, 2) == (1, 2, 3)  # element 2's [1, 2, 3]
    assert check(buf, offsets, (1, 3), 3, 0) == (2, 2, 1)  # the map of 1 entry
    with pytest.raises(ValueError, match="spans"):
        check(buf, [offsets[0], len(buf) + 1], (), 4, 5)
    with pytest.raises(ValueError, match="one value"):
        check(buf, [offsets[0], offsets[2]], (), 4, 5)
    with pytest.raises(ValueError, match="max_depth"):
        check(buf, offsets, (), 0, 5)


def test_structure_walk_names_the_elements_a_decode_must_check() -> None:
    """check_structure's ``odd``: the walked elements holding a str, a map or an ext
    anywhere, or arrays nested deeper than PLAIN_DEPTH; the rest only ever decode."""
    from mmadmit.msgpack_walk import PLAIN_DEPTH

    ext = msgspec.msgpack.Ext(3, b"ab")
    value = [
        None, True, -5, 2**64 - 1, 1.5, b"x", [1, [2.0, None, b""]],  # 0-6 plain
        "s", {"a": 1}, [[{"k": 1}]], ext, [1, [ext]], ["x" * 40],  # 7-12 odd
        nested(PLAIN_DEPTH), nested(PLAIN_DEPTH + 1), [],  # 13 plain, 14 odd, 15 plain
    ]  # fmt: skip
    buf = ENC.encode(value)
    offsets, _ = intcodec.split_array(buf)
    for skip, want in (((), [7, 8, 9, 10, 11, 12, 14]), ((8, 14), [7, 9, 10, 11, 12])):
        for impl in (_check_native, _check_py):
            if impl is None:
                continue
            odd: list[int] = []
            assert impl(memoryview(buf), offsets, skip, 1024, 100, odd) is None
            assert odd == want
    for i in range(len(value)):  # what is not odd decodes, whatever it holds
        if i not in (7, 8, 9, 10, 11, 12, 14):
            msgspec.msgpack.decode(buf[offsets[i] : offsets[i + 1]])
    odd = []  # up to a breach: element 9 nests too deep for 3
    assert _check(buf, offsets, (), 3, 100, odd) == (3, 9, 4)
    assert odd == [7, 8, 9]


def test_bounded_split_refuses_from_the_header() -> None:
    buf = ENC.encode(["t", list(range(50)), 3, list(range(20))])
    offsets, ints = intcodec.split_array(buf, (1, 3), 50)
    assert [a.tolist() for a in ints] == [list(range(50)), list(range(20))]
    with pytest.raises(intcodec.IntArrayTooLong) as info:
        intcodec.split_array(buf, (1, 3), 49)
    assert (info.value.element, info.value.count, info.value.limit) == (1, 50, 49)
    with pytest.raises(intcodec.IntArrayTooLong) as info:
        intcodec.split_array(ENC.encode(["t", [1], 3, ["a"] * 30]), (1, 3), 20)
    assert info.value.element == 3  # an array of non-ints is refused from its header too


# --------------------------------------------------------------------------- the codec


def test_payload_length() -> None:
    n = DEFAULT_LIMITS.max_msgpack_len
    err = refused(add(text_payload()), Limits(max_msgpack_len=23))  # 24 elements
    assert err.code is AbortCode.TOO_LARGE and "--max-msgpack-len" in err.message
    assert err.rid == "r"
    assert decode(add(text_payload()), Limits(max_msgpack_len=24)).request is not None
    huge = ENC.encode(["TokenizedGenerateReqInput", "big", *([None] * n)])
    err = refused(add(huge), DEFAULT_LIMITS)
    assert err.code is AbortCode.TOO_LARGE and f"{n + 2} elements" in err.message
    assert err.rid == "big"


@pytest.mark.parametrize("n", [100, 5000])  # a payload under and over 4 KiB
@pytest.mark.parametrize("field", ["input_ids", "input_ids_unpadded"])
def test_tokens(n: int, field: str) -> None:
    ids = list(range(n))
    payload = text_payload(n=8, e4=ids) if field == "input_ids" else text_payload(n=8, e21=ids)
    assert decode(add(payload), Limits(max_tokens=n)).request is not None
    err = refused(add(payload), Limits(max_tokens=n - 1))
    assert err.code is AbortCode.TOO_LARGE
    assert err.message == f"{field}: {n} tokens exceed the limit of {n - 1} (--max-tokens)"
    assert err.rid == "r"


def test_container_length() -> None:
    sampling = {f"k{i}": i for i in range(300)}
    payload = text_payload(e5=sampling)
    assert decode(add(payload), Limits(max_msgpack_len=300)).request is not None
    err = refused(add(payload), Limits(max_msgpack_len=299))
    assert err.code is AbortCode.TOO_LARGE
    assert err.message == (
        "element 5: a map of 300 entries, over the limit of 299 (--max-msgpack-len)"
    )
    err = refused(add(text_payload(e13=[[0] * 300])), Limits(max_msgpack_len=299))
    assert "element 13: an array of 300 elements" in err.message


# values of pass-through elements: the decode refuses some (an unknown or pickle ext,
# a str of bad UTF-8, a map keyed by an array), the walk alone none
_PASS_VALUES: list[Any] = [
    None, False, 7, -(2**63), 2**64 - 1, 0.25, b"bin", [1, [None, 2.5]], nested(20), "ok",
    {"temperature": 0.5, "stop": ["a"]}, msgspec.msgpack.Ext(2, b"x"),
    msgspec.msgpack.Ext(wire.EXT_TENSOR_DATA, b"\x00" * 4), [msgspec.msgpack.Ext(1, b"p")],
    msgspec.Raw(b"\xa2\xff\xfe"), msgspec.Raw(b"\x91\xa1\xc3"),
    msgspec.Raw(b"\x81\x91\x01\x02"), msgspec.Raw(b"\x81\xa1k\xd4\x05\x00"),
]  # fmt: skip


def test_pass_through_elements_refused_as_decoding_each_one_would() -> None:
    """Only the elements the walk names odd are decoded (the rest cannot be refused):
    the outcome is the one decoding every pass-through element in order gives."""
    rng = random.Random(7)
    positions = [2, 3, *range(5, 21)]
    refusals = 0
    for _ in range(300):
        chosen = {i: rng.choice(_PASS_VALUES) for i in rng.sample(positions, rng.randint(1, 5))}
        payload = text_payload(**{f"e{i}": v for i, v in chosen.items()})
        expected = None
        for i in sorted(chosen):
            raw = msgspec.Raw(ENC.encode(chosen[i]))
            try:
                wire._value(raw, f"element {i}")
            except wire.InvalidRequest as exc:
                expected = exc.message
                break
        if expected is None:
            assert decode(add(payload)).request is not None, chosen
        else:
            refusals += 1
            err = refused(add(payload), DEFAULT_LIMITS)
            assert (err.code, err.message, err.rid) == (AbortCode.INVALID_REQUEST, expected, "r")
    assert 50 < refusals < 250, refusals


def test_depth() -> None:
    payload = text_payload(e13=nested(31))  # the payload (1) + 31 arrays = depth 32
    assert decode(add(payload)).request is not None
    err = refused(add(text_payload(e13=nested(32))), DEFAULT_LIMITS)
    assert err.code is AbortCode.INVALID_REQUEST
    assert err.message == (
        "element 13: msgpack nested 33 levels deep, over the limit of 32 (--max-msgpack-depth)"
    )
    # deeper than msgspec or any recursion would go: refused by the walk all the same
    err = refused(add(text_payload(e13=msgspec.Raw(b"\x91" * 200_000 + b"\x01"))), DEFAULT_LIMITS)
    assert err.code is AbortCode.INVALID_REQUEST and "--max-msgpack-depth" in err.message


@pytest.mark.parametrize("side", ["tensors", "a value"])
def test_items(side: str) -> None:
    req = image_request(items=3, side_extra="x" if side == "a value" else None)
    frames = add(*wire.encode_request(req))
    assert len(decode(frames, Limits(max_items=3)).request.mm.items) == 3
    err = refused(frames, Limits(max_items=2))
    assert err.code is AbortCode.TOO_LARGE
    assert err.message == "3 items exceed the limit of 2 (--max-items)"
    assert err.rid == "img"


@pytest.mark.parametrize("side", ["tensors", "a value"])
@pytest.mark.parametrize(
    ("shape", "at_limit", "over", "flag"),
    [
        ((1,) * 8 + (16,), Limits(max_tensor_rank=9), Limits(max_tensor_rank=8),
         "--max-tensor-rank"),
        ((16, 256), Limits(max_tensor_dim=256), Limits(max_tensor_dim=255), "--max-tensor-dim"),
        ((16, 256), Limits(max_tensor_bytes=16 * 256 * 4),
         Limits(max_tensor_bytes=16 * 256 * 4 - 1), "--max-tensor-bytes"),
    ],
)  # fmt: skip
def test_tensor_limits(
    side: str, shape: tuple[int, ...], at_limit: Limits, over: Limits, flag: str
) -> None:
    req = image_request(shape=shape, side_extra="x" if side == "a value" else None)
    frames = add(*wire.encode_request(req))
    assert decode(frames, at_limit).request is not None
    err = refused(frames, over)
    assert err.code is AbortCode.TOO_LARGE and flag in err.message, err.message
    assert err.message.startswith("item 0 feature:")


def test_tensor_bytes_are_judged_from_the_shape() -> None:
    """A shape promising 4 TiB (each dimension in range) over a small frame: TOO_LARGE,
    not a byte mismatch."""
    req = image_request()
    payload, *aux = wire.encode_request(req)
    feature = msgspec.Raw(ENC.encode(["float32", [2**20, 2**20], 1]))
    elems = msgspec.msgpack.decode(payload, type=list[msgspec.Raw])
    mm = msgspec.msgpack.decode(elems[22], type=list[msgspec.Raw])
    items = msgspec.msgpack.decode(mm[0], type=list[list[msgspec.Raw]])
    items[0][4] = feature
    mm[0] = msgspec.Raw(ENC.encode(items))
    elems[22] = msgspec.Raw(ENC.encode(mm))
    err = refused(add(ENC.encode(elems), *aux), DEFAULT_LIMITS)
    assert err.code is AbortCode.TOO_LARGE and "--max-tensor-bytes" in err.message


def test_abort_ids() -> None:
    ids = [f"r{i}" for i in range(50)]
    assert decode([b"\x01", ENC.encode(ids)], Limits(max_abort_ids=50)).abort_rids == ids
    err = refused([b"\x01", ENC.encode(ids)], Limits(max_abort_ids=49))
    assert err.code is AbortCode.TOO_LARGE
    assert err.message == "ABORT payload: 50 request ids exceed the limit of 49 (--max-abort-ids)"
    err = refused([b"\x01", ENC.encode(["a", ["b"]])], DEFAULT_LIMITS)
    assert err.code is AbortCode.INVALID_REQUEST and "request id strings" in err.message


def test_materializer_checks_dimensions_for_every_transport() -> None:
    """gRPC requests reach the materializer without the codec: it checks the same limits."""
    m = Materializer(load_profile(str(CONFIGS / "qwen3_5.json")), Limits(max_tensor_dim=255))
    out = m.run(image_request())
    assert isinstance(out, Abort) and out.code is AbortCode.TOO_LARGE
    assert "dimension 256 exceeds the limit of 255 (--max-tensor-dim)" in out.message
    ok = Materializer(load_profile(str(CONFIGS / "qwen3_5.json")), Limits(max_tensor_dim=256))
    assert not isinstance(ok.run(image_request()), Abort)


# --------------------------------------------------------------------------- memory


def _peak(fn: Callable[[], Any]) -> int:
    """Peak bytes traced while ``fn`` runs (numpy's buffers included)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            fn()
        except wire.WireError:
            pass
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _array32(body: bytes, n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + body * n


# Each sized by n: the peak of a refusal must not grow with n (headers only,
# nothing per element), while decoding with the limit lifted costs more than
# the payload (the control). n is kept small: with native off the walker runs
# interpreted, under tracemalloc.
HOSTILE: dict[str, tuple[Callable[[int], list[Any]], Limits, Limits]] = {
    # n one-byte tokens: 8n bytes as int64
    "tokens": (
        lambda n: add(text_payload(e4=msgspec.Raw(_array32(b"\x01", n)))),
        Limits(max_tokens=1000),
        Limits(max_tokens=1 << 30),
    ),
    # an array of n empty maps: n dicts, about 64n bytes
    "container": (
        lambda n: add(text_payload(e13=msgspec.Raw(_array32(b"\x80", n)))),
        Limits(max_msgpack_len=1000),
        Limits(max_msgpack_len=1 << 30),
    ),
    # n empty request ids: a list of n str, 8n bytes at least
    "abort_ids": (
        lambda n: [b"\x01", _array32(b"\xa0", n)],
        Limits(max_abort_ids=1000),
        Limits(max_abort_ids=1 << 30),
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_breach_allocates_nothing_sized_by_the_sender(case: str) -> None:
    build, limits, lifted = HOSTILE[case]
    small, large = build(1 << 14), build(1 << 16)
    grown = len(large[1]) - len(small[1])
    refused = [_peak(lambda f=f: decode(f, limits)) for f in (small, large, small, large)]
    # a one-off allocation (a cache filled, a dict resized) can land in any one run:
    # per-element growth would show in both large runs
    growth = min(refused[1], refused[3]) - max(refused[0], refused[2])
    assert growth < grown // 8, (refused, grown)  # headers only, nothing per element
    lifted_peak = _peak(lambda: decode(large, lifted))
    assert lifted_peak > 4 * len(large[1]), (lifted_peak, len(large[1]))  # the control


# --------------------------------------------------------------------------- configuration


LIMIT_DEFAULTS = {
    "max_tokens": 262_144,
    "max_items": 256,
    "max_tensor_bytes": 536_870_912,
    "max_tensor_rank": 8,
    "max_tensor_dim": 2**31 - 1,
    "max_msgpack_depth": 32,
    "max_msgpack_len": 65_536,
    "max_abort_ids": 4096,
    "max_message_bytes": 1_073_741_824,
    "max_frames": 1024,
    "max_peer_inflight": None,
    "max_grpc_streams": 1024,
    "max_stream_inflight": 64,
}


def test_every_limit_is_a_setting_with_its_default() -> None:
    config = build_config({}, environ={})
    assert {k: getattr(config, k) for k in LIMIT_DEFAULTS} == LIMIT_DEFAULTS
    assert config.limits == DEFAULT_LIMITS  # the codec's and materializer's defaults agree
    env = {f"MMADMIT_{k.upper()}": "7" for k in LIMIT_DEFAULTS}
    config = build_config({}, environ=env)
    assert all(getattr(config, k) == 7 for k in LIMIT_DEFAULTS)
    lim = config.limits
    assert (lim.max_msgpack_depth, lim.max_msgpack_len, lim.max_abort_ids) == (7, 7, 7)
    assert (lim.max_tensor_rank, lim.max_tensor_dim) == (7, 7)


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("max_msgpack_depth", "1", "--max-msgpack-depth must be at least 2: "),
        ("max_msgpack_depth", "1025", "--max-msgpack-depth must be at most 1024: "),
        ("max_frames", "1", "--max-frames must be at least 2: a message has a type and a pay"),
        ("max_peer_inflight", "0", r"--max-peer-inflight must be at least 1 \(got 0\)"),
        ("max_grpc_streams", "-1", r"--max-grpc-streams must be at least 1 \(got -1\)"),
        ("max_tensor_dim", "x", r"must be an integer in 1\.\.9223372036854775807 \(got x\)"),
    ],
)  # every --max-* flag at its bounds: tests/test_limit_flags.py
def test_limit_settings_are_checked(flag: str, value: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        build_config({flag: value}, environ={})


def test_limits_reach_the_fields_of_serve_config() -> None:
    assert set(LIMIT_DEFAULTS) <= {f for f in ServeConfig.__dataclass_fields__}


# --------------------------------------------------------------------------- gRPC, pre-parse

import sys  # noqa: E402
from collections import Counter  # noqa: E402

from conftest import REPO_ROOT  # noqa: E402

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from mmadmit import pbwalk, pbwire  # noqa: E402
from mmadmit_client.proto import admission_pb2 as pb  # noqa: E402

from fuzz.targets.pbwire_target import count  # noqa: E402  (the target's outcome of a count)

PAD = "x" * pbwire.PRECHECK_MIN_BYTES  # original_text: makes a message big enough to count


def admit_bytes(*, tokens: int = 8, items: int = 0, shape: int = 2, pad: str = PAD,
                unpadded: int = 0, placeholders: int = 1, extra: bytes = b"") -> bytes:  # fmt: skip
    req = pb.AdmitRequest(request_id="g1")
    req.tokenized.input_ids.extend(range(tokens))
    req.tokenized.original_text = pad
    req.input_ids_unpadded.extend(range(unpadded))
    for _ in range(items):
        item = req.mm_inputs.items.add()
        item.encoder_input.shape.extend([1] * shape)
        for _ in range(placeholders):
            item.placeholders.add(offset=0, length=1)
    return req.SerializeToString() + extra


def varint(v: int) -> bytes:
    return pbwire.encode_varint(v)


@pytest.mark.parametrize(
    ("build", "limits", "expected"),
    [
        (lambda: admit_bytes(tokens=1001), Limits(max_tokens=1000),
         "input_ids: at least 1001 tokens exceed the limit of 1000 (--max-tokens)"),
        (lambda: admit_bytes(unpadded=1001), Limits(max_tokens=1000),
         "input_ids_unpadded: at least 1001 tokens"),
        (lambda: admit_bytes(items=257), DEFAULT_LIMITS,
         "at least 257 items exceed the limit of 256 (--max-items)"),
        (lambda: admit_bytes(items=1, placeholders=1001), Limits(max_tokens=1000),
         "item 0: at least 1001 placeholders exceed the limit of 1000 (--max-tokens)"),
        # 65,537 unknown varint fields (number 50) at the top level
        (lambda: admit_bytes(extra=(varint(50 << 3) + b"\x00") * 65_537), DEFAULT_LIMITS,
         "AdmitRequest: at least 65537 fields, over the limit of 65536 (--max-msgpack-len)"),
        # input_ids not packed: each id its own field 1 of TokenizedInput, counted the same
        (lambda: admit_bytes(tokens=0, extra=b"\x12" + varint(1001 * 2) + b"\x08\x05" * 1001),
         Limits(max_tokens=1000), "input_ids: at least 1001 tokens"),
    ],
)  # fmt: skip
def test_grpc_request_counted_before_protobuf_parses_it(
    build: Callable[[], bytes], limits: Limits, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = build()
    assert len(data) >= pbwire.PRECHECK_MIN_BYTES
    parsed: list[int] = []
    real = pb.AdmitRequest.FromString
    monkeypatch.setattr(pb.AdmitRequest, "FromString", lambda b: parsed.append(1) or real(b))
    out = pbwire.parse_admit_request(data, limits=limits)
    assert isinstance(out, pbwire.RefusedRequest), out
    assert (out.request_id, out.code) == ("g1", AbortCode.TOO_LARGE)
    assert out.message.startswith(expected), out.message
    assert not parsed  # protobuf never saw it
    # within the limits (or the check off) the same bytes parse as before
    lifted = Limits(max_tokens=1 << 20, max_items=1 << 20, max_msgpack_len=1 << 20)
    again = pbwire.parse_admit_request(data, limits=lifted)
    assert isinstance(again, pb.AdmitRequest | pbwire.StrippedRequest)  # ids taken, or not
    assert parsed


def test_grpc_precheck_at_the_limits_and_small_messages() -> None:
    at = admit_bytes(tokens=1000, items=256, unpadded=1000, placeholders=4)
    assert pbwire.check_admit_limits(at, Limits(max_tokens=1000)) is None
    # tensors are not entered: rank is the materializer's, after the parse
    assert pbwire.check_admit_limits(admit_bytes(items=1, shape=9), DEFAULT_LIMITS) is None
    small = admit_bytes(tokens=5000, pad="")  # under PRECHECK_MIN_BYTES: parsed, then checked
    assert len(small) < pbwire.PRECHECK_MIN_BYTES
    assert isinstance(pbwire.parse_admit_request(small, limits=Limits(max_tokens=10)),
                      pb.AdmitRequest | pbwire.StrippedRequest)  # fmt: skip
    # bytes the walk does not understand are left to protobuf (and its own error)
    assert pbwire.check_admit_limits(PAD.encode() + b"\x0b", DEFAULT_LIMITS) is None


def _precheck_inputs() -> list[bytes]:
    """Messages at, over and under every counted limit, every wire vector's request,
    and each of them cut and bit-flipped."""
    from conftest import load_vector, vector_names
    from test_grpc_api import request_from_vector

    base = [
        admit_bytes(tokens=1000, items=256, unpadded=1000, placeholders=4),
        admit_bytes(tokens=1001),
        admit_bytes(unpadded=1001),
        admit_bytes(items=257),
        admit_bytes(items=1, placeholders=1001),
        admit_bytes(items=2, shape=9, extra=(varint(50 << 3) + b"\x00") * 40),
        admit_bytes(tokens=0, extra=b"\x12" + varint(1001 * 2) + b"\x08\x05" * 1001),
        admit_bytes(extra=b"\x11" + b"\x00" * 8 + b"\x15" + b"\x00" * 4),  # fixed64, fixed32
        b"\x4a" + varint(2 << 20) + b"\x0a\x00" * (1 << 20),
    ]
    base += [request_from_vector(load_vector(n)).SerializeToString() for n in vector_names()]
    rng = np.random.default_rng(11)
    out = list(base)
    for data in base:
        cuts = rng.integers(0, len(data), 24) if len(data) < 4096 else rng.integers(0, 4096, 24)
        out += [data[:c] for c in cuts]
        for _ in range(24):
            flipped = bytearray(data[: 1 << 16])
            k = int(rng.integers(0, len(flipped)))
            flipped[k] ^= 1 << int(rng.integers(0, 8))
            out.append(bytes(flipped))
    return out


@pytest.mark.skipif(pbwire._BUILT is None, reason="mmadmit._pbwalk_c is not built")
def test_grpc_precheck_compiled_agrees_with_interpreted() -> None:
    """The count (``pbwalk._Count``) compiled and interpreted: the same outcome
    (passed, not understood, or the same refusal and request id) under the
    defaults and under tight limits, on valid, cut and bit-flipped messages."""
    tight = Limits(max_tokens=64, max_items=4, max_msgpack_len=32)
    seen: Counter[str] = Counter()
    for data in _precheck_inputs():
        for limits in (DEFAULT_LIMITS, tight):
            got = count(pbwire._BUILT, data, limits)
            assert got == count(pbwalk, data, limits), (limits, data[:64])
            seen[str(got[1]) if got[0] == "ok" else "refused"] += 1
    assert min(seen.values()) > 100, seen
    refused = pbwire.check_admit_limits(admit_bytes(items=257), DEFAULT_LIMITS)
    assert refused is not None and refused.message.startswith("at least 257 items exceed")


def test_grpc_precheck_allocates_nothing_per_element() -> None:
    """1 M empty items (2 MB): refused after 257 of them, nothing built for the rest."""
    data = b"\x4a" + varint(2 << 20) + b"\x0a\x00" * (1 << 20)
    peak = _peak(lambda: pbwire.check_admit_limits(data, DEFAULT_LIMITS))
    assert peak < 64 << 10, peak
    out = pbwire.check_admit_limits(data, DEFAULT_LIMITS)
    assert out is not None and "--max-items" in out.message
