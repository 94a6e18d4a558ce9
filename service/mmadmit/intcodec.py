"""msgpack arrays of ints <-> int64 numpy arrays, fast.

The msgpack wire carries token ids as a plain msgpack array of ints (128K
elements for a long prompt). Generic msgpack decoding builds one Python int
per element (about 9 ms for 128K ids); this module decodes straight into a
numpy ``int64`` array and encodes from one.

Two implementations with the same results and the same errors, messages
included:

* native: the optional C extension ``mmadmit._intcodec`` (built by
  ``setup.py``; no numpy headers, buffers go through the buffer protocol).
* fallback: pure Python/numpy, used when the extension is not built. Decoding
  goes through ``msgspec`` (one Python int per element, then ``np.array``);
  errors are re-diagnosed by a byte-level scan so the messages match the
  native ones. Encoding is ``msgspec`` on ``values.tolist()``.

``HAVE_NATIVE`` says which one :func:`decode_int_array` and
:func:`encode_int_array` use.

Format: exactly one msgpack array (fixarray, array16 or array32) whose
elements are ints in any msgpack int encoding; values must fit int64 (a uint64
above ``2**63 - 1`` is refused). Encoding writes the smallest array header
and the smallest form of each int, byte for byte what ``msgpack.packb`` writes
for the same list. Non-goals: nested arrays, nil elements, arrays of more than
``2**32 - 1`` elements.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

try:
    from mmadmit import _intcodec  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install time): use the fallback
    _intcodec = None

__all__ = ["HAVE_NATIVE", "decode_int_array", "encode_int_array"]

HAVE_NATIVE: bool = _intcodec is not None

_INT64_MAX = 2**63 - 1
_MAX_ARRAY_COUNT = 2**32 - 1
_PREFIX = "msgpack int array: "

# Element type bytes 0xcc..0xd3 -> (payload width, signed).
_INT_FORMS = {
    0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
    0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True),
}  # fmt: skip


# --------------------------------------------------------------------------
# Public API


def decode_int_array(raw: Any) -> npt.NDArray[np.int64]:
    """Decode one msgpack array of ints into a new 1-D ``int64`` array.

    ``raw``: ``bytes``, ``bytearray``, ``memoryview``, ``msgspec.Raw`` or any
    buffer holding exactly one msgpack array and nothing after it. Raises
    ``ValueError`` (naming the element index and type byte where there is one)
    for a non-array, a non-int element, truncated input, a uint64 above
    ``2**63 - 1`` and trailing bytes.
    """
    return _decode_impl(_as_bytes(raw))


def encode_int_array(values: Any) -> bytes:
    """Encode a 1-D int array (any int dtype) as one msgpack array of ints.

    Byte-identical to ``msgpack.packb(values.tolist())``. Raises ``TypeError``
    for a non-integer dtype and ``ValueError`` for a non-1-D array, a uint64
    value above ``2**63 - 1`` or more than ``2**32 - 1`` elements.
    """
    return _encode_impl(_as_int64(values))


# --------------------------------------------------------------------------
# Shared input normalization


def _as_bytes(raw: Any) -> memoryview:
    view = memoryview(raw)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
    elif not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view


def _as_int64(values: Any) -> npt.NDArray[np.int64]:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{_PREFIX}expected a 1-D int array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size:
            raise TypeError(f"{_PREFIX}expected an integer dtype, got {arr.dtype}")
        arr = arr.astype(np.int64)  # np.asarray([]) is float64
    if arr.size > _MAX_ARRAY_COUNT:
        raise ValueError(f"{_PREFIX}{arr.size} elements exceed the array32 limit")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        index = int(np.argmax(arr > _INT64_MAX))
        raise ValueError(
            f"{_PREFIX}element {index}: uint64 value {int(arr[index])} exceeds the int64 range"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


# --------------------------------------------------------------------------
# Native


def _decode_native(buf: memoryview) -> npt.NDArray[np.int64]:
    assert _intcodec is not None
    # array_len refuses a count larger than the bytes that follow, so a forged
    # header cannot make this allocate more than 8 bytes per input byte.
    out = np.empty(_intcodec.array_len(buf), dtype=np.int64)
    _intcodec.decode_into(buf, out)
    return out


def _encode_native(values: npt.NDArray[np.int64]) -> bytes:
    assert _intcodec is not None
    result: bytes = _intcodec.encode(values)
    return result


# --------------------------------------------------------------------------
# Fallback: decode


_LIST_OF_INT_DECODER = msgspec.msgpack.Decoder(list[int])


def _decode_py(buf: memoryview) -> npt.NDArray[np.int64]:
    count, _ = _parse_header(buf)  # refuse a forged count before msgspec allocates
    try:
        values = _LIST_OF_INT_DECODER.decode(buf)
        out = np.array(values, dtype=np.int64)  # OverflowError above INT64_MAX
    except (msgspec.DecodeError, OverflowError, ValueError) as exc:
        _scan(buf)  # raises the precise error (same text as the native decoder)
        raise ValueError(f"{_PREFIX}{exc}") from exc  # pragma: no cover - scan raises
    if out.shape != (count,):  # pragma: no cover - msgspec checked the count
        raise ValueError(f"{_PREFIX}expected {count} elements, decoded {out.shape}")
    return out


def _type_name(b: int) -> str:
    if b <= 0x7F or b >= 0xE0 or 0xCC <= b <= 0xD3:
        return "int"
    if b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    if b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    if b <= 0xBF or 0xD9 <= b <= 0xDB:
        return "str"
    return {
        0xC0: "nil",
        0xC1: "never-used byte",
        0xC2: "bool",
        0xC3: "bool",
        0xC4: "bin",
        0xC5: "bin",
        0xC6: "bin",
        0xCA: "float32",
        0xCB: "float64",
    }.get(b, "ext")  # 0xc7..0xc9, 0xd4..0xd8


def _parse_header(buf: memoryview) -> tuple[int, int]:
    """(count, header length); the same checks as the native array_len."""
    n = len(buf)
    if n < 1:
        raise ValueError(f"{_PREFIX}truncated input: empty buffer")
    b = buf[0]
    if 0x90 <= b <= 0x9F:
        count, hlen = b & 0x0F, 1
    elif b in (0xDC, 0xDD):
        hlen = 3 if b == 0xDC else 5
        if n < hlen:
            raise ValueError(
                f"{_PREFIX}truncated input: array header (type byte 0x{b:02x}) "
                f"needs {hlen} bytes, only {n} given"
            )
        count = int.from_bytes(buf[1:hlen], "big")
    else:
        raise ValueError(
            f"{_PREFIX}expected an array header, got {_type_name(b)} (type byte 0x{b:02x})"
        )
    if count > n - hlen:
        raise ValueError(
            f"{_PREFIX}truncated input: array header declares {count} elements "
            f"but only {n - hlen} bytes follow"
        )
    return count, hlen


def _scan(buf: memoryview) -> None:
    """Walk the array byte by byte and raise the first error, as the C code does."""
    count, pos = _parse_header(buf)
    n = len(buf)
    for i in range(count):
        if pos >= n:
            raise ValueError(f"{_PREFIX}truncated input: element {i} missing at offset {pos}")
        b = buf[pos]
        if b <= 0x7F or b >= 0xE0:
            pos += 1
            continue
        form = _INT_FORMS.get(b)
        if form is None:
            raise ValueError(
                f"{_PREFIX}element {i}: expected an int, got {_type_name(b)} (type byte 0x{b:02x})"
            )
        width, signed = form
        if n - pos < 1 + width:
            raise ValueError(
                f"{_PREFIX}truncated input: element {i} (type byte 0x{b:02x}) needs "
                f"{1 + width} bytes at offset {pos}, only {n - pos} left"
            )
        value = int.from_bytes(buf[pos + 1 : pos + 1 + width], "big", signed=signed)
        if value > _INT64_MAX:
            raise ValueError(f"{_PREFIX}element {i}: uint64 value {value} exceeds the int64 range")
        pos += 1 + width
    if pos != n:
        raise ValueError(f"{_PREFIX}{n - pos} trailing bytes after the array (at offset {pos})")


# --------------------------------------------------------------------------
# Fallback: encode

# msgspec writes ints in the same smallest forms as msgpack-python (the tests
# check it). Going through .tolist() was measured faster than a vectorized
# numpy writer (one pass per int form plus a scatter) at 128K ids.
_ENCODER = msgspec.msgpack.Encoder()


def _encode_py(values: npt.NDArray[np.int64]) -> bytes:
    return _ENCODER.encode(values.tolist())


# --------------------------------------------------------------------------

if HAVE_NATIVE:
    _decode_impl = _decode_native
    _encode_impl = _encode_native
else:
    _decode_impl = _decode_py
    _encode_impl = _encode_py
