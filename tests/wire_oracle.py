"""The reference item decoder: the oracle tests and the fuzz targets hold
:func:`mmadmit.msgpack_walk.build_items` to (compiled and interpreted), and the
reference item encoder they hold ``mmadmit.msgpack_walk.splice_items`` to.

It is the item decoder wire.py ran before the walker took every item: one typed
``msgspec`` call over ``mm_items`` (:class:`_WireItem`), then the tensors built by
wire.py's :class:`~mmadmit.wire._TensorReader`; when the typed call refuses,
:func:`_item_error` words why with a second, looser decode (:class:`_LooseItem`).
Not in production: what it builds and refuses is what the walker must build and
refuse.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
from mmadmit.errors import AdmissionError, InvalidRequest
from mmadmit.model import Item
from mmadmit.tensorcheck import TensorName
from mmadmit.wire import (
    _ITEM_FIELDS,
    _NO_SIDE,
    EXT_TENSOR_DATA,
    _array_header,
    _decode_shm,
    _encode_item,
    _ext_hook,
    _InlineData,
    _ItemSrc,
    _split,
    _TensorReader,
    _value,
)
from mmadmit_client.wire import ext_refusal

_Ext = msgspec.msgpack.Ext
_NIL = msgspec.Raw(msgspec.msgpack.encode(None))


def _build(reader: _TensorReader, dtype: Any, shape: Any, data: Any, name: Any, role: str) -> Any:
    """``reader.build``, the typed decoder's ext data (an ``Ext``) first refused
    (pickle, an unknown code) or taken as inline bytes (code 3)."""
    if type(data) is _Ext:
        if data.code != EXT_TENSOR_DATA:
            raise InvalidRequest(f"{TensorName(*name)}: {ext_refusal(data.code)}")
        data = _InlineData(bytes(data.data))
    return reader.build(dtype, shape, data, name, role)


def _map_len(raw: Any) -> int:
    """The entry count of the msgpack map header at the start of ``raw``."""
    head = bytes(memoryview(raw)[:5])
    if head[0] == 0xDE:
        return int.from_bytes(head[1:3], "big")
    if head[0] == 0xDF:
        return int.from_bytes(head[1:5], "big")
    return head[0] & 0x0F


def _is_tensor_value(value: Any) -> bool:
    return (
        type(value) is list and len(value) == 3 and type(value[0]) is str and type(value[1]) is list
    )


class _WireTensor(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    """A tensor ``[dtype, shape, data]`` as the item decoder takes it (``feature``).

    Exactly three elements (an array-like struct otherwise skips trailing
    ones); what the types leave open (the dtype's name, the aux index, the
    ext code, the byte length, the limits) is decided where the
    :class:`~mmadmit.model.Tensor` is built.
    """

    dtype: str
    shape: tuple[int, ...]
    data: int | msgspec.msgpack.Ext  # an aux frame index or inline bytes (ext 3)


class _WireItem(msgspec.Struct, array_like=True, gc=False):
    """A MultimodalDataItem as the one item decoder takes it: every item of a request
    in one typed ``msgspec`` call.

    It takes every legal item: ``model_specific_data`` values are any value
    (a tensor is recognised by its form, ``[str, list, data]``; others, such
    as a ``use_audio_in_video`` flag, are kept as they are). ``offsets`` are
    decoded for every item at once by :func:`mmadmit.msgpack_walk.int_rows`.
    Trailing fields of a newer peer are skipped here unseen: they are checked
    (no pickle) from the item's raw elements. What the types refuse is worded
    by :func:`_item_error`, which decodes nothing that is kept.
    """

    modality: int
    hash: int | None = None
    pad_value: int | None = None
    offsets: msgspec.Raw = _NIL
    feature: _WireTensor | None = None
    feature_shm: Any = None
    model_specific_data: dict[str, msgspec.Raw] | None = None  # see _side_value
    # Passed through untouched, but decoded so the ext hook sees every element.
    encoded: Any = None
    encoded_deepstack: Any = None
    # EPD: nil or a map, as TokenSpeed's decoder types it (passed through untouched)
    encode_handshake: dict[str, Any] | None = None


_ITEMS = msgspec.msgpack.Decoder(list[_WireItem], ext_hook=_ext_hook)
_TENSOR = msgspec.msgpack.Decoder(_WireTensor)


def _side_value(raw: msgspec.Raw, idx: int, key: str, reader: _TensorReader) -> Any:
    """A ``model_specific_data`` value the tensor struct does not take (every other is
    a tensor): any value, kept as decoded (a ``use_audio_in_video`` flag). One of a
    tensor's form (``[str, list, data]``) is built all the same, for
    :class:`~mmadmit.model.Tensor` to word what is wrong with it."""
    value = _value(raw, f"item {idx} {key}")
    if _is_tensor_value(value):
        return _build(reader, value[0], value[1], value[2], (idx, key), "side")
    return value


def item_spans(view: memoryview) -> list[int]:
    """5 ints per element of the msgpack array in ``view``: its start and end, its
    element count (-1: not an array), where its elements 1 and 3 start (-1 both
    for fewer than 3 elements). msgpack-python's ``Unpacker`` reads the bytes
    (``tell()`` after each header and skip), independent of the walker it checks.
    ``ValueError`` for anything but one well-formed array."""
    data = bytes(view)
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    spans: list[int] = []
    try:
        for _ in range(unpacker.read_array_header()):
            start, at1, at3 = unpacker.tell(), -1, -1
            if start >= len(data):
                raise ValueError(f"msgpack: truncated input: element missing at offset {start}")
            b = data[start]
            if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
                count = unpacker.read_array_header()
                for k in range(count):
                    if k == 1 and count >= 3:
                        at1 = unpacker.tell()
                    if k == 3:
                        at3 = unpacker.tell()
                    unpacker.skip()
                if count == 3:  # element 3 would start where the item ends
                    at3 = unpacker.tell()
            else:
                count = -1
                unpacker.skip()
            spans += [start, unpacker.tell(), count, at1, at3]
    except msgpack.UnpackException as exc:
        raise ValueError(f"msgpack: {type(exc).__name__}: {exc}") from exc
    if unpacker.tell() != len(data):
        raise ValueError(f"msgpack: trailing bytes after the array (at offset {unpacker.tell()})")
    return spans


def decode_items(view: memoryview, reader: _TensorReader) -> list[Item]:
    """The reference item decode (one typed ``msgspec`` call, see :class:`_WireItem`)."""
    try:
        spans = item_spans(view)
    except ValueError as exc:
        raise InvalidRequest(f"mm_items must be a msgpack array ({exc})") from exc
    try:
        wire_items = _ITEMS.decode(view)
    except (msgspec.DecodeError, RecursionError, InvalidRequest) as exc:
        # a type the decoder refuses (ValidationError is a DecodeError), pickle in any field
        raise _item_error(view, spans, reader, exc) from exc
    decode_tensor = _TENSOR.decode
    items: list[Item] = []
    for i, w, start, end, count, off1, off3 in zip(
        range(len(wire_items)),
        wire_items,
        spans[0::5],
        spans[1::5],
        spans[2::5],
        spans[3::5],
        spans[4::5],
        strict=True,
    ):
        if count > _ITEM_FIELDS:  # newer peer's fields: validated (no pickle), kept raw
            for extra_raw in _split(view[start:end], f"item {i}")[_ITEM_FIELDS:]:
                _value(extra_raw, f"item {i}")
        feature = None
        wt = w.feature
        if wt is not None:
            feature = _build(reader, wt.dtype, wt.shape, wt.data, (i, "feature"), "feature")
        side: dict[str, Any] = {}  # the item's own (it may be changed): never _NO_SIDE
        if w.model_specific_data and _map_len(_split(view[start:end], "item")[6]) != len(
            w.model_specific_data
        ):  # a repeated key (the decode kept its last value): the walk refuses it
            raise InvalidRequest(f"item {i}: model_specific_data: a key is repeated")
        if w.model_specific_data:
            for key, raw in w.model_specific_data.items():
                try:
                    t = decode_tensor(raw)
                except msgspec.DecodeError:  # not a tensor, or a malformed one
                    side[key] = _side_value(raw, i, key, reader)
                else:
                    side[key] = _build(reader, t.dtype, t.shape, t.data, (i, key), "side")
        shm = None if w.feature_shm is None else _decode_shm(w.feature_shm, f"item {i}")
        src = _ItemSrc(
            view,
            reader.aux,
            start,
            end,
            count,
            off1,
            off3,
            w.modality,
            feature,
            side.copy() if side else _NO_SIDE,
        )
        items.append(
            Item(w.modality, w.hash, w.pad_value, None, feature, shm, side, src, w.encode_handshake)
        )
    return items


class _LooseItem(msgspec.Struct, array_like=True):
    """The item's fields with only their basic types, for :func:`_item_error`'s wording."""

    modality: int
    hash: int | None = None
    pad_value: int | None = None
    offsets: list[tuple[int, int]] | None = None
    feature: Any = None
    feature_shm: Any = None
    model_specific_data: dict[str, Any] | None = None
    encoded: Any = None
    encoded_deepstack: Any = None
    encode_handshake: dict[str, Any] | None = None


_LOOSE_ITEM = msgspec.msgpack.Decoder(_LooseItem, ext_hook=_ext_hook)
_ITEM_FIELD_NAMES = [f.name for f in msgspec.structs.fields(_LooseItem)]


def _item_error(
    view: memoryview, spans: list[int], reader: _TensorReader, exc: Exception
) -> AdmissionError:
    """Word why the item decoder refused ``mm_items``: the first item that is wrong,
    and what in it (its field, or its tensor by key). Only error wording: what it
    decodes is dropped, and it runs only once the request has failed."""
    order = range(len(spans) // 5)
    index = _error_index(exc)
    if index is not None and index < len(order):
        order = range(index, len(order))  # the decoder stopped there; the ones before passed
    for i in order:
        start, end = spans[5 * i], spans[5 * i + 1]
        found = _item_problem(view[start:end], i, reader)
        if found is not None:
            return found
    return InvalidRequest(f"mm_items: {exc}")  # pragma: no cover - every refusal is worded above


def _error_index(exc: Exception) -> int | None:
    """The item index of msgspec's "... - at `$[3]...`" (None without a path)."""
    _, sep, path = str(exc).partition(" - at `$[")
    if not sep:
        return None
    index = path.split("]", 1)[0]
    return int(index) if index.isdigit() else None


def _item_problem(raw: memoryview, idx: int, reader: _TensorReader) -> AdmissionError | None:
    """What is wrong with item ``idx`` (None: nothing the item decoder refuses)."""
    what = f"item {idx}"
    try:
        w = _LOOSE_ITEM.decode(raw)
    except msgspec.ValidationError as exc:
        return InvalidRequest(f"{what}: {_field_error(exc)}")
    except (msgspec.DecodeError, RecursionError) as exc:
        return InvalidRequest(f"{what}: undecodable msgpack ({exc})")
    except InvalidRequest as exc:  # the ext hook: pickle or an unknown ext code
        return InvalidRequest(f"{what}: {exc.message}")
    if w.feature is not None:
        try:
            reader.tensor(w.feature, idx, "feature", "feature")
        except AdmissionError as exc:  # InvalidRequest, or TooLarge before the wrong part
            return exc
    return None


def _field_error(exc: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int`, got `str` - at `$[1]`" with the field's wire name."""
    text = str(exc)
    head, sep, path = text.partition(" - at `")
    where, sep2, index_path = path.partition("$[")  # "key` in `$[9]`": a map key
    if sep and sep2:
        index = index_path.split("]", 1)[0]
        if index.isdigit() and int(index) < len(_ITEM_FIELD_NAMES):
            of = "a key: " if where.startswith("key") else ""
            return f"{_ITEM_FIELD_NAMES[int(index)]}: {of}{head}"
    return text


def encode_items(items: list[Item], writer: Any, drop_features: bool, aux: Any) -> msgspec.Raw:
    """``wire._encode_items`` with no item spliced from its received bytes: the
    mm_items array of every item encoded from the model (what the splice must
    emit, the received encodings being canonical)."""
    encoded = [_encode_item(item, writer, drop_features) for item in items]
    return msgspec.Raw(_array_header(len(items)) + b"".join(encoded))
