"""Requests and outcomes of ``mmadmit-client``, independent of the transport.

A request file is read once into a :class:`LoadedRequest` that holds the
client's model (:class:`~mmadmit_client.Request`) both transports start from:

* a ``.frames`` container (a captured ZMQ ADD message,
  :mod:`mmadmit_client.frames`) is decoded with the client's codec
  (:func:`mmadmit_client.wire.decode_add`); over ZMQ the captured frames are
  sent as they are (re-encoded only to give them another request id, every
  field of the wire kept); over gRPC the request is translated into an
  ``AdmitRequest`` (``_grpc_codec.request_to_proto``);
* a JSON document (schema in ``clients/README.md``, :func:`request_from_json`)
  is built into the same model, and encoded by whichever transport sends it.

What the gRPC API cannot carry is refused with :class:`UsageError` instead of
being dropped in a way that would change the outcome (a ``validation_error``
mark, an unknown modality number, token ids outside ``uint32``). Fields that
are not the admission service's business (sampling parameters and the other
passthrough elements of the msgpack wire) exist only on the ZMQ wire and are
not sent over gRPC.

Outcomes of both transports become one :class:`AdmitResult` (the ``--json``
object and the readable view), and over gRPC the reply frames
``[status, payload, *aux]`` are rebuilt with the codec
(:func:`mmadmit_client.wire.encode_reply`): the request as sent with the
response's derived fields applied, i.e. what the ZMQ reply mode would have
sent for it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from . import wire
from ._cli_usage import UsageError
from ._models import MODALITIES, Item, Materialized, Outcome, Request, ShmFeature, Tensor
from .dtypes import DTYPES, canonical_dtype, numpy_dtype
from .frames import MAGIC, parse_frames

_UINT64_MAX = 2**64 - 1


# --------------------------------------------------------------------------- loading


@dataclass(eq=False)
class LoadedRequest:
    """One request file, read and decoded once.

    ``request`` is the client's model (None when a frames file does not decode:
    ``decode_error`` says why; such a file can still be sent verbatim over
    ZMQ, where the service answers it with an abort). ``frames`` is the
    captured message of a frames file.
    """

    path: Path
    kind: Literal["frames", "json"]
    request: Request | None
    frames: list[memoryview] | None = None
    decode_error: str | None = None
    _proto: Any = field(default=None, repr=False)

    @property
    def rid(self) -> str:
        if self.request is not None:
            return self.request.request_id
        return wire.recover_rid(self.frames[1]) if self.frames and len(self.frames) > 1 else ""

    def decoded(self, rid: str | None = None) -> Request:
        """The request (under ``rid`` if given); :class:`UsageError` when the frames
        do not decode."""
        if self.request is None:
            raise UsageError(
                f"{self.path}: the captured message does not decode ({self.decode_error}); "
                "it can only be sent as it is, over ZMQ, without a new request id"
            )
        if rid is not None and rid != self.request.request_id:
            return self.request.with_request_id(rid)
        return self.request

    def proto(self, rid: str | None = None) -> Any:
        """The ``AdmitRequest`` (built once, copied for another ``rid``; read-only)."""
        if self._proto is None:
            from ._grpc_codec import request_to_proto

            try:
                self._proto = request_to_proto(self.decoded())
            except ValueError as exc:
                raise UsageError(
                    f"{self.path}: the request cannot be expressed over gRPC: {exc}"
                ) from exc
        if rid is None or rid == self._proto.request_id:
            return self._proto
        msg = type(self._proto)()
        msg.CopyFrom(self._proto)
        msg.request_id = rid
        return msg

    def zmq_frames(self, rid: str | None = None) -> list[Any]:
        """The ADD message: the captured frames as they are, or encoded by the codec
        (a JSON request, or any request given another ``rid``)."""
        if self.frames is not None and (rid is None or rid == self.rid):
            return list(self.frames)
        return wire.encode_add(self.decoded(rid))


def load_request_file(path: str | Path) -> LoadedRequest:
    """Read a ``.frames`` container or a JSON request document (told apart by content)."""
    p = Path(path)
    try:
        blob = p.read_bytes()
    except OSError as exc:
        raise UsageError(f"{p}: cannot read ({exc.strerror or exc})") from exc
    if blob.startswith(MAGIC) or p.suffix == ".frames":
        return _load_frames(p, blob)
    try:
        doc = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{p}: neither a frames container nor JSON ({exc})") from exc
    return LoadedRequest(p, "json", request_from_json(doc, base_dir=p.parent, where=str(p)))


def _load_frames(p: Path, blob: bytes) -> LoadedRequest:
    try:
        frames = parse_frames(blob)
    except ValueError as exc:
        raise UsageError(f"{p}: {exc}") from exc
    if len(frames) < 2 or bytes(frames[0]) != bytes([wire.MSG_ADD]):
        kind = bytes(frames[0]).hex() if frames else "none"
        raise UsageError(
            f"{p}: not a captured ADD message (type byte {kind or '(empty)'}, "
            f"{len(frames)} frame(s)); expected [00, payload, *aux]"
        )
    try:
        request = wire.decode_add(frames)
    except wire.WireFormatError as exc:
        return LoadedRequest(p, "frames", None, frames, decode_error=str(exc))
    return LoadedRequest(p, "frames", request, frames)


# --------------------------------------------------------------------------- JSON schema


class _Where:
    """Error paths such as ``items[1].feature.shape``."""

    def __init__(self, root: str) -> None:
        self.root = root

    def fail(self, path: str, message: str) -> UsageError:
        return UsageError(f"{self.root}: {path}: {message}")


def _check_keys(
    obj: Any, path: str, w: _Where, allowed: set[str], required: Sequence[str] = ()
) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise w.fail(path, f"must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed - {"comment"})
    if unknown:
        raise w.fail(
            path, f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    for key in required:
        if key not in obj:
            raise w.fail(path, f"'{key}' is required")
    return obj


def _int(value: Any, path: str, w: _Where, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise w.fail(path, f"must be an integer, got {json.dumps(value)}")
    if lo is not None and value < lo:
        raise w.fail(path, f"{value} is below {lo}")
    if hi is not None and value > hi:
        raise w.fail(path, f"{value} is above {hi}")
    return value


def _token_ids(value: Any, path: str, w: _Where) -> np.ndarray:
    """Ints, or ``{"token": T, "count": N}`` runs, flattened to int64."""
    if not isinstance(value, list):
        raise w.fail(path, "must be an array of token ids")
    parts: list[np.ndarray] = []
    plain: list[int] = []
    for i, elem in enumerate(value):
        if isinstance(elem, dict):
            run = _check_keys(elem, f"{path}[{i}]", w, {"token", "count"}, ("token", "count"))
            token = _int(run["token"], f"{path}[{i}].token", w, -(2**63), 2**63 - 1)
            count = _int(run["count"], f"{path}[{i}].count", w, 0)
            if plain:
                parts.append(np.array(plain, np.int64))
                plain = []
            parts.append(np.full(count, token, np.int64))
        else:
            plain.append(_int(elem, f"{path}[{i}]", w, -(2**63), 2**63 - 1))
    if plain:
        parts.append(np.array(plain, np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _hash(value: Any, path: str, w: _Where) -> int:
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            value = int(text, 16) if text.startswith("0x") else int(text, 10)
        except ValueError:
            raise w.fail(path, f"{value!r} is neither a decimal nor a 0x-hex integer") from None
    return _int(value, path, w, 0, _UINT64_MAX)


def _spans(value: Any, path: str, w: _Where, *, lengths: bool) -> np.ndarray:
    if not isinstance(value, list):
        raise w.fail(path, "must be an array of [a, b] pairs")
    rows = []
    for k, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise w.fail(f"{path}[{k}]", "must be a pair [a, b]")
        a = _int(pair[0], f"{path}[{k}][0]", w, 0)
        b = _int(pair[1], f"{path}[{k}][1]", w, 0)
        if lengths:
            if b == 0:
                raise w.fail(f"{path}[{k}]", "a placeholder range covers at least one token")
            b = a + b - 1
        rows.append((a, b))
    return np.array(rows, np.int64).reshape(-1, 2)


def _shape(value: Any, path: str, w: _Where) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise w.fail(path, "must be an array of dimension sizes")
    return tuple(_int(d, f"{path}[{i}]", w, 0) for i, d in enumerate(value))


def _dtype(value: Any, path: str, w: _Where) -> str:
    name = canonical_dtype(value)
    if name is None:
        raise w.fail(path, f"unsupported tensor dtype {value!r}")
    return name


def _bfloat16_bits(arr: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN)."""
    f = np.ascontiguousarray(arr, dtype="<f4")
    bits = f.view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded).astype("<u2")


def _convert(arr: np.ndarray, dtype: str, path: str, w: _Where) -> bytes:
    """Values (from JSON or a .npy file) as raw little-endian bytes of ``dtype``."""
    spec, npd = DTYPES[dtype], numpy_dtype(dtype)
    if npd is not None:
        if spec.kind in "iub":
            if arr.size and arr.dtype.kind not in "iub":
                raise w.fail(path, f"{dtype} values must be integers")
            if arr.size and spec.kind in "iu":
                info = np.iinfo(npd)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise w.fail(path, f"values [{lo}, {hi}] do not fit {dtype}")
        elif arr.size and arr.dtype.kind not in "iubf":
            raise w.fail(path, f"{dtype} values must be numbers")
        return np.ascontiguousarray(arr.astype(npd)).tobytes()
    if arr.dtype.kind == "u" and arr.dtype.itemsize == spec.itemsize:
        return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"))).tobytes()  # raw bits
    if dtype == "bfloat16" and arr.dtype.kind in "iuf":
        return _bfloat16_bits(arr).tobytes()
    raise w.fail(
        path,
        f"{dtype} has no numpy type: give its raw bits as base64, or as a .npy of "
        f"uint{spec.itemsize * 8}",
    )


_TENSOR_KEYS = {"dtype", "shape", "values", "fill", "base64", "npy"}
_SOURCES = ("values", "fill", "base64", "npy")


def _tensor(spec: Any, path: str, w: _Where, base_dir: Path) -> Tensor:
    """``{dtype, shape, values | fill | base64 | npy}`` -> an internal :class:`Tensor`."""
    spec = _check_keys(spec, path, w, _TENSOR_KEYS)
    given = [k for k in _SOURCES if k in spec]
    if len(given) != 1:
        raise w.fail(path, f"give exactly one of {', '.join(_SOURCES)} (got {len(given)})")
    source = given[0]
    shape = _shape(spec["shape"], f"{path}.shape", w) if "shape" in spec else None
    dtype = _dtype(spec["dtype"], f"{path}.dtype", w) if "dtype" in spec else None
    if source == "npy":
        file = spec["npy"]
        if not isinstance(file, str):
            raise w.fail(f"{path}.npy", "must be a path (relative to the JSON file)")
        try:
            arr = np.load(base_dir / file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise w.fail(f"{path}.npy", f"cannot load {file}: {exc}") from None
        if dtype is None:
            dtype = _dtype(arr.dtype.str if arr.dtype.kind != "b" else "bool", f"{path}.npy", w)
        if shape is not None and tuple(arr.shape) != shape:
            raise w.fail(f"{path}.shape", f"{list(shape)} but the file holds {list(arr.shape)}")
        return _make_tensor(dtype, tuple(arr.shape), _convert(arr, dtype, path, w))
    if dtype is None:
        raise w.fail(path, f"'dtype' is required with {source}")
    if source == "base64":
        if shape is None:
            raise w.fail(path, "'shape' is required with base64")
        try:
            data = base64.b64decode(spec["base64"], validate=True)
        except (TypeError, binascii.Error) as exc:
            raise w.fail(f"{path}.base64", f"not base64 ({exc})") from None
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if len(data) != want:
            raise w.fail(
                f"{path}.base64",
                f"{len(data)} bytes but shape {list(shape)} of {dtype} needs {want}",
            )
        return _make_tensor(dtype, shape, data)
    if source == "fill":
        if shape is None:
            raise w.fail(path, "'shape' is required with fill")
        value = spec["fill"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise w.fail(f"{path}.fill", "must be a number")
        arr = np.full(shape, value)
    else:
        try:
            arr = np.asarray(spec["values"])
        except (ValueError, OverflowError) as exc:
            raise w.fail(f"{path}.values", f"not a regular array of numbers ({exc})") from None
        if arr.dtype == object or arr.dtype.kind not in "iubf":
            raise w.fail(f"{path}.values", "must be a (nested) array of numbers")
        if shape is not None:
            if math.prod(shape) != arr.size:
                raise w.fail(f"{path}.shape", f"{list(shape)} does not hold {arr.size} values")
            arr = arr.reshape(shape)
    return _make_tensor(dtype, tuple(int(d) for d in arr.shape), _convert(arr, dtype, path, w))


def _make_tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> Tensor:
    return Tensor(dtype, shape, data)


def _grid(value: Any, path: str, w: _Where) -> Tensor:
    arr = np.asarray(value) if isinstance(value, list) else None
    if arr is None or arr.dtype.kind not in "iu" or arr.size == 0 or arr.size % 3:
        raise w.fail(path, "must be [t, h, w] or an array of such rows (integers)")
    return Tensor.from_numpy(arr.astype(np.int64).reshape(-1, 3))


def _seconds(value: Any, path: str, w: _Where) -> Tensor:
    arr = np.asarray(value) if isinstance(value, list | int | float) else None
    if arr is None or isinstance(value, bool) or arr.dtype.kind not in "iuf" or arr.ndim > 1:
        raise w.fail(path, "must be a number or an array of numbers")
    return Tensor.from_numpy(np.atleast_1d(arr.astype(np.float32)))


_GRIDS = ("image_grid_thw", "video_grid_thw")
_TIMES = ("second_per_grid_ts", "video_second_per_grid")
_ITEM_KEYS = {
    "modality", "offsets", "placeholders", "hash", "pad_value", "feature", "feature_shm",
    "side", "encode_handshake", *_GRIDS, *_TIMES,
}  # fmt: skip
_SHM_KEYS = {"name", "shape", "dtype", "offset", "nbytes"}
_HANDSHAKE_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_TOP_KEYS = {
    "request_id",
    "input_ids",
    "input_ids_unpadded",
    "placeholder_token_ids",
    "mrope",
    "items",
}


def _item(obj: Any, path: str, w: _Where, base_dir: Path, tokens: dict[str, int]) -> Item:
    obj = _check_keys(obj, path, w, _ITEM_KEYS, ("modality",))
    name = obj["modality"]
    modality = name.lower() if isinstance(name, str) else None
    if modality not in MODALITIES:
        raise w.fail(f"{path}.modality", f"must be one of {', '.join(MODALITIES)}")
    if ("offsets" in obj) == ("placeholders" in obj):
        raise w.fail(
            path, "give exactly one of offsets ([start, end]) or placeholders ([offset, length])"
        )
    if "offsets" in obj:
        offsets = _spans(obj["offsets"], f"{path}.offsets", w, lengths=False)
    else:
        offsets = _spans(obj["placeholders"], f"{path}.placeholders", w, lengths=True)
    feature = _tensor(obj["feature"], f"{path}.feature", w, base_dir) if "feature" in obj else None
    shm = None
    if "feature_shm" in obj:
        if feature is not None:
            raise w.fail(path, "give feature or feature_shm, not both")
        s = _check_keys(
            obj["feature_shm"], f"{path}.feature_shm", w, _SHM_KEYS, ("name", "shape", "dtype")
        )
        if not isinstance(s["name"], str) or not s["name"]:
            raise w.fail(f"{path}.feature_shm.name", "must be a non-empty string")
        shm = ShmFeature(
            name=s["name"],
            shape=_shape(s["shape"], f"{path}.feature_shm.shape", w),
            dtype=_dtype(s["dtype"], f"{path}.feature_shm.dtype", w),
            offset=_int(s.get("offset", 0), f"{path}.feature_shm.offset", w, 0),
            nbytes=_int(s["nbytes"], f"{path}.feature_shm.nbytes", w, 0) if "nbytes" in s else 0,
        )
    side: dict[str, Tensor] = {}
    for key in _GRIDS:
        if key in obj:
            side[key] = _grid(obj[key], f"{path}.{key}", w)
    for key in _TIMES:
        if key in obj:
            side[key] = _seconds(obj[key], f"{path}.{key}", w)
    extra_side = obj.get("side", {})
    if not isinstance(extra_side, dict):
        raise w.fail(f"{path}.side", "must be an object of name -> tensor")
    for key, spec in extra_side.items():
        if key in side:
            raise w.fail(f"{path}.side.{key}", f"{key} is also given as a key of the item")
        side[key] = _tensor(spec, f"{path}.side.{key}", w, base_dir)
    handshake = None
    if "encode_handshake" in obj:
        where = f"{path}.encode_handshake"
        h = _check_keys(obj["encode_handshake"], where, w, set(_HANDSHAKE_KEYS), _HANDSHAKE_KEYS)
        if not isinstance(h["bootstrap_host"], str):
            raise w.fail(f"{where}.bootstrap_host", "must be a string")
        handshake = {
            "bootstrap_host": h["bootstrap_host"],
            "bootstrap_port": _int(h["bootstrap_port"], f"{where}.bootstrap_port", w, 0, 2**31 - 1),
            "bootstrap_room": _int(h["bootstrap_room"], f"{where}.bootstrap_room", w, 0, 2**63 - 1),
        }
    return Item(
        modality=modality,  # type: ignore[arg-type]
        hash=_hash(obj["hash"], f"{path}.hash", w) if "hash" in obj else None,
        pad_value=_int(obj["pad_value"], f"{path}.pad_value", w, 0, 2**63 - 1)
        if "pad_value" in obj
        else None,
        offsets=offsets,
        feature=feature if feature is not None else shm,
        side=side,
        placeholder_token_id=tokens.get(modality),
        encode_handshake=handshake,
    )


def request_from_json(doc: Any, *, base_dir: Path = Path("."), where: str = "request") -> Request:
    """Build the internal request from a JSON document (``clients/README.md``)."""
    w = _Where(where)
    doc = _check_keys(doc, "top level", w, _TOP_KEYS, ("input_ids",))
    rid = doc.get("request_id", f"mmadmit-client-{uuid.uuid4().hex[:12]}")
    if not isinstance(rid, str) or not rid:
        raise w.fail("request_id", "must be a non-empty string")
    input_ids = _token_ids(doc["input_ids"], "input_ids", w)
    unpadded = (
        _token_ids(doc["input_ids_unpadded"], "input_ids_unpadded", w)
        if "input_ids_unpadded" in doc
        else None
    )
    if not any(k in doc for k in ("items", "mrope", "placeholder_token_ids")):
        return Request(rid, input_ids, input_ids_unpadded=unpadded)
    items_doc = doc.get("items", [])
    if not isinstance(items_doc, list):
        raise w.fail("items", "must be an array of items")
    overrides = _check_keys(
        doc.get("placeholder_token_ids", {}), "placeholder_token_ids", w, {"image", "video"}
    )
    # the request-wide override becomes each item's of that modality (gRPC's form)
    tokens: dict[str, int] = {
        name: _int(overrides[name], f"placeholder_token_ids.{name}", w, 0)
        for name in ("image", "video")
        if name in overrides
    }
    items = [_item(it, f"items[{i}]", w, base_dir, tokens) for i, it in enumerate(items_doc)]
    mrope = _check_keys(doc.get("mrope", {}), "mrope", w, {"positions", "delta"})
    positions = None
    if "positions" in mrope:
        pos = np.asarray(mrope["positions"]) if isinstance(mrope["positions"], list) else None
        if pos is None or pos.ndim != 2 or pos.dtype.kind not in "iu":
            raise w.fail("mrope.positions", "must be a [3, N] array of integers")
        positions = pos.astype(np.int64)
    delta = _int(mrope["delta"], "mrope.delta", w) if "delta" in mrope else None
    return Request(
        rid,
        input_ids,
        tuple(items),
        input_ids_unpadded=unpadded,
        mrope_positions=positions,
        mrope_position_delta=delta,
        multimodal=True,
    )


# --------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class ResultItem:
    modality: str
    hash: int | None
    pad_value: int | None
    offsets: list[tuple[int, int]]


@dataclass(eq=False)
class AdmitResult:
    """One outcome of either transport, normalized (arrays only when materialized)."""

    transport: Literal["grpc", "zmq"]
    request_id: str
    status: Literal["materialized", "aborted"]
    abort_code: str | None = None
    abort_message: str | None = None
    input_ids: np.ndarray | None = None
    input_ids_unpadded: np.ndarray | None = None
    items: list[ResultItem] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None
    mrope_position_delta: int | None = None
    passthrough: bool | None = None  # gRPC only
    reply_frames: list[Any] = field(default_factory=list)
    latency_ms: float = 0.0

    @property
    def materialized(self) -> bool:
        return self.status == "materialized"

    @property
    def code(self) -> str:
        return "MATERIALIZED" if self.materialized else str(self.abort_code)

    def to_json(self) -> dict[str, Any]:
        def ids(a: np.ndarray | None) -> list[int] | None:
            return None if a is None else a.tolist()

        return {
            "transport": self.transport,
            "request_id": self.request_id,
            "status": self.status,
            "abort": None
            if self.materialized
            else {"code": self.abort_code, "message": self.abort_message},
            "latency_ms": round(self.latency_ms, 3),
            "num_tokens": None if self.input_ids is None else int(self.input_ids.size),
            "input_ids": ids(self.input_ids),
            "input_ids_unpadded": ids(self.input_ids_unpadded),
            "items": [
                {
                    "modality": it.modality,
                    "hash": it.hash,
                    "pad_value": it.pad_value,
                    "offsets": [list(p) for p in it.offsets],
                }
                for it in self.items
            ],
            "mrope_positions": None
            if self.mrope_positions is None
            else self.mrope_positions.tolist(),
            "mrope_position_delta": self.mrope_position_delta,
            "passthrough": self.passthrough,
        }


def result_from_outcome(
    transport: Literal["grpc", "zmq"], outcome: Outcome, reply_frames: list[Any], latency_ms: float
) -> AdmitResult:
    """An outcome of either transport as an :class:`AdmitResult`."""
    if not isinstance(outcome, Materialized):
        return AdmitResult(
            transport, outcome.request_id, "aborted", outcome.code, outcome.message,
            reply_frames=reply_frames, latency_ms=latency_ms,
        )  # fmt: skip
    items = [
        ResultItem(it.modality, it.hash, it.pad_value, [(s, e) for s, e in it.offsets.tolist()])
        for it in outcome.items
    ]
    return AdmitResult(
        transport, outcome.request_id, "materialized",
        input_ids=outcome.input_ids, input_ids_unpadded=outcome.input_ids_unpadded, items=items,
        mrope_positions=outcome.mrope_positions, mrope_position_delta=outcome.mrope_position_delta,
        passthrough=outcome.passthrough, reply_frames=reply_frames, latency_ms=latency_ms,
    )  # fmt: skip
