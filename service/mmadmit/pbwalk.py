"""The protobuf wire walks of the gRPC transport: one source, interpreted or compiled.

:mod:`mmadmit.pbwire` says what each walk is for and when it runs; this module
holds the walks themselves, over a request's wire bytes (an ``AdmitRequest``
or SMG's ``GenerateRequest``, which share the field numbers walked):

* :func:`limits_breach`: counts tokens, items, placeholders, map entries and
  other fields against the limits before protobuf builds anything, and words
  the first breach (``mmadmit.limits``) as it goes;
* :func:`strip_inline`: the message with every ``TensorData.inline`` of
  ``min_bytes`` or more replaced by a marker, and those payloads;
* :func:`take_ids`: the message without its token ids, and their values;
* :func:`packed_uint32_field`: an int64 array as one packed ``repeated
  uint32`` field (the response side), and :func:`varint`, the one varint
  encoder.

Like :mod:`mmadmit.rules`, this file runs as plain Python, and ``setup.py``
also compiles it into ``mmadmit._pbwalk_c`` (Cython's pure-Python mode);
:mod:`mmadmit.pbwire` picks the build. ``tests/test_pbwire.py`` and the
``pbwire`` fuzz target run both builds on valid and mutated bytes and demand
the same result, message included, and hold the strip to the reference walk
in ``tests/pbwire_oracle.py`` and every walk to protobuf itself.
``cython.compiled`` is tested only where the compiled code must differ:
:class:`_Reader` and :class:`_Out` (compiled, pointers into the request's
``bytes`` and into the new ``bytes`` or ``bytearray``, since each typed
memoryview costs about half a microsecond to make; interpreted, views),
:func:`_set_int`, :func:`_copy` (``memcpy`` compiled, slicing interpreted),
:func:`_ends` (a byte loop compiled, numpy interpreted) and
:func:`packed_uint32_field` (its values through the buffer protocol and a
loop writing the new ``bytes`` compiled, whole-array numpy passes
interpreted).

What the walks accept is what upb (protobuf's runtime) accepts, or less: a
key or a length over 5 bytes (upb takes non-minimal ones of up to 5 and calls
a 6th byte "Wire format was corrupt"), a field number of 0 or above
2**29 - 1, groups, the reserved wire types, a varint over 64 bits or a cut
message end a walk without a result, and the caller lets upb parse the bytes
as they are. Every read is bounded by the end of the (sub-)message it is in,
and a sub-message's end is checked against its parent's before it is entered.
Walks that rewrite a message write the new lengths as minimal varints; they
count the new size first and then write exactly that many bytes, every write
checked against it (:func:`_room`; a failure there is a ``SystemError``, a bug
of ours, never a request's fault).
"""

from __future__ import annotations

import cython
import numpy as np

from .errors import TooLarge
from .limits import items_over, msgpack_len_over, placeholders_over, tokens_over

if cython.compiled:
    from cython.cimports.cpython.buffer import (
        Py_buffer,
        PyBUF_C_CONTIGUOUS,
        PyBuffer_Release,
        PyObject_GetBuffer,
    )
    from cython.cimports.cpython.bytearray import (
        PyByteArray_AS_STRING,
        PyByteArray_FromStringAndSize,
    )
    from cython.cimports.cpython.bytes import PyBytes_AS_STRING, PyBytes_FromStringAndSize
    from cython.cimports.libc.string import memcpy

u8 = cython.typedef(cython.uchar)
i64 = cython.typedef(cython.longlong)
u64 = cython.typedef(cython.ulonglong)
ssize = cython.typedef(cython.Py_ssize_t)

_SHORT_MAX = cython.declare(cython.int, 5)  # bytes of a key or a length, as upb reads them
_VALUE_MAX = cython.declare(cython.int, 10)  # bytes of a value varint (64 bits)
_FIELD_MAX = cython.declare(u64, 0x1FFFFFFF)
_U32_MAX = cython.declare(u64, 0xFFFFFFFF)

# ------------------------------------------------------------------------------ helpers


@cython.cfunc
@cython.inline
@cython.exceptval(check=False)
def _varint_size(v: u64) -> ssize:
    n: ssize = 1
    while v > 0x7F:
        v >>= 7
        n += 1
    return n


@cython.final
@cython.cclass
class _Out:
    """A new buffer a walk writes: ``size`` bytes (compiled, a ``bytes`` object
    written through a pointer before anything else sees it; interpreted, a
    ``bytearray``), or with ``ints`` that many int64 values (in a ``bytearray``).
    Compiled, no typed memoryview is made: each costs about half a microsecond."""

    obj: object
    p: cython.pointer(u8)  # compiled: its first byte; interpreted: a writable view
    cap: ssize  # its length, in items
    ints: cython.bint

    def __init__(self, size: ssize, ints: cython.bint) -> None:
        self.cap, self.ints = size, ints
        if not cython.compiled:
            self.obj = bytearray(size * 8 if ints else size)
            self.p = memoryview(self.obj).cast("q") if ints else self.obj  # type: ignore
        elif ints:
            self.obj = PyByteArray_FromStringAndSize(cython.NULL, size * 8)
            self.p = cython.cast(cython.pointer(u8), PyByteArray_AS_STRING(self.obj))
        else:
            self.obj = PyBytes_FromStringAndSize(cython.NULL, size)
            self.p = cython.cast(cython.pointer(u8), PyBytes_AS_STRING(self.obj))

    def result(self) -> object:
        """The bytes written, or the int64 values as a (writable) numpy array."""
        if self.ints:
            return np.frombuffer(self.obj, np.int64)
        return self.obj if cython.compiled else bytes(self.obj)


_NO_INTS = _Out(0, True)


@cython.cfunc
@cython.exceptval(-1)
def _room(o: _Out, at: ssize, m: ssize) -> ssize:
    """``at``, after checking that ``m`` items fit at ``o[at]`` (the walks size ``o``
    from their count pass: a failure here is a bug, never a request's fault)."""
    if at < 0 or m < 0 or at + m > o.cap:
        raise SystemError("pbwalk: a write out of its buffer")
    return at


@cython.cfunc
@cython.inline
@cython.exceptval(check=False)
def _set_int(o: _Out, n: ssize, v: i64) -> cython.void:
    """``o[n] = v`` for an ``ints`` buffer (the caller has checked ``n``)."""
    if cython.compiled:
        cython.cast(cython.pointer(i64), o.p)[n] = v
    else:
        o.p[n] = v


@cython.cfunc
@cython.exceptval(-1)
def _put_varint(o: _Out, at: ssize, v: u64) -> ssize:
    """``v``'s minimal varint written at ``o[at]``; where it ends."""
    _room(o, at, _varint_size(v))
    while v > 0x7F:
        o.p[at] = (v & 0x7F) | 0x80
        v >>= 7
        at += 1
    o.p[at] = v
    return at + 1


def varint(v: u64) -> bytes:
    """The minimal protobuf varint of ``v`` (``pbwire.encode_varint``)."""
    out = _Out(_varint_size(v), False)
    _put_varint(out, 0, v)
    result: bytes = out.result()
    return result


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _ends(p: cython.pointer(cython.const[u8]), a: ssize, b: ssize) -> ssize:
    """How many varints end in ``p[a:b]`` (one at each byte below 0x80)."""
    n: ssize = 0
    k: ssize
    if cython.compiled:
        for k in range(a, b):
            n += p[k] < 0x80
    else:
        n = int(np.count_nonzero(np.frombuffer(p[a:b], np.uint8) < 0x80))
    return n


@cython.cclass
class _Reader:
    """Reads keys, lengths and varints from ``buf``, the ``n`` bytes of ``data`` (a
    pointer to them compiled, a view interpreted): each read takes a position and
    the end of the message it is in, and returns where the read ends (-1: the bytes
    are not read as upb reads them); the value read is left in ``value`` (a key's
    in ``number`` and ``wire_type``, a length's also in ``size``). Integers
    convert implicitly: ``cython.cast`` costs a call each interpreted."""

    data: bytes
    buf: cython.pointer(cython.const[u8])
    n: ssize
    value: u64
    number: u64
    wire_type: cython.int
    size: ssize

    def __init__(self, data: object) -> None:
        self.data = data if type(data) is bytes else bytes(data)  # type: ignore[arg-type]
        self.n = len(self.data)
        if cython.compiled:  # (a pointer into a bytes object, which is immutable)
            self.buf = cython.cast(cython.pointer(cython.const[u8]), PyBytes_AS_STRING(self.data))
        else:
            self.buf = memoryview(self.data)  # type: ignore[assignment]
        self.value = 0
        self.number = 0
        self.wire_type = 0
        self.size = 0

    @cython.cfunc
    @cython.final
    @cython.exceptval(check=False)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def varint(self, pos: ssize, end: ssize, most: cython.int) -> ssize:
        """A varint of at most ``most`` bytes and 64 bits (``end`` <= ``len(buf)``)."""
        result: u64 = 0
        b: u64
        k: cython.int
        for k in range(most):
            if pos >= end:
                return -1
            b = self.buf[pos]
            pos += 1
            result |= (b & 0x7F) << (7 * k)
            if b < 0x80:
                if k == 9 and b > 1:
                    return -1  # more than 64 bits
                self.value = result
                return pos
        return -1

    @cython.cfunc
    @cython.final
    @cython.exceptval(check=False)
    def key(self, pos: ssize, end: ssize) -> ssize:
        """A field's key: 5 bytes at most and a field number in [1, 2**29 - 1]."""
        pos = self.varint(pos, end, _SHORT_MAX)
        if pos < 0:
            return -1
        self.number = self.value >> 3
        self.wire_type = self.value & 7
        if self.number == 0 or self.number > _FIELD_MAX:
            return -1
        return pos

    @cython.cfunc
    @cython.final
    @cython.exceptval(check=False)
    def length(self, pos: ssize, end: ssize) -> ssize:
        """A length of 5 bytes at most, whose contents end by ``end``: where they start."""
        room: u64
        pos = self.varint(pos, end, _SHORT_MAX)
        if pos < 0:
            return -1
        room = end - pos
        if self.value > room:
            return -1
        self.size = self.value
        return pos

    @cython.cfunc
    @cython.final
    @cython.exceptval(check=False)
    def skip(self, pos: ssize, end: ssize, wire_type: cython.int) -> ssize:
        """Past the value of a field of ``wire_type`` (its key read at ``pos``)."""
        if wire_type == 0:
            return self.varint(pos, end, _VALUE_MAX)
        if wire_type == 1 or wire_type == 5:
            pos += 8 if wire_type == 1 else 4
            return pos if pos <= end else -1
        if wire_type == 2:
            pos = self.length(pos, end)
            return -1 if pos < 0 else pos + self.size
        return -1  # groups and the reserved wire types


@cython.cfunc
@cython.exceptval(-1)
def _copy(o: _Out, at: ssize, r: _Reader, a: ssize, m: ssize) -> ssize:
    """``o[at : at + m] = r.buf[a : a + m]``; where the copy ends in ``o``."""
    if m > 0:
        _room(o, at, m)
        if a < 0 or a + m > r.n:
            raise SystemError("pbwalk: a copy out of its buffers")
        if cython.compiled:
            memcpy(o.p + at, r.buf + a, m)
        else:
            o.p[at : at + m] = r.buf[a : a + m]
    return at + m


# ---------------------------------------------------------------------- limits_breach

# Message kinds the count walks, and what a field of each holds (_count_kind).
# Tensors are not entered: a shape's packed dimensions cost upb 4 bytes per wire
# byte at most, and the materializer checks rank and dimensions after the parse.
_C_ADMIT = cython.declare(cython.int, 0)
_C_TOKENIZED = cython.declare(cython.int, 1)
_C_MM = cython.declare(cython.int, 2)
_C_ITEM = cython.declare(cython.int, 3)
_C_RID = cython.declare(cython.int, 4)
_C_IDS = cython.declare(cython.int, 5)
_C_UNPADDED = cython.declare(cython.int, 6)
_C_ENTRY = cython.declare(cython.int, 7)
_C_PLACEHOLDER = cython.declare(cython.int, 8)
_C_OTHER = cython.declare(cython.int, 9)
_C_NAMES = ("AdmitRequest", "tokenized", "mm_inputs", "item")


@cython.cfunc
@cython.exceptval(check=False)
def _count_kind(kind: cython.int, number: u64) -> cython.int:
    if kind == _C_ADMIT:
        if number == 1:
            return _C_RID
        if number == 2:
            return _C_TOKENIZED
        if number == 9:
            return _C_MM
        if number == 100:
            return _C_UNPADDED
    elif kind == _C_TOKENIZED:
        if number == 1:
            return _C_IDS
    elif kind == _C_MM:
        if number == 1:
            return _C_ITEM
    elif kind == _C_ITEM:
        if number == 4:
            return _C_ENTRY
        if number == 5:
            return _C_PLACEHOLDER
    return _C_OTHER


@cython.final
@cython.cclass
class _Count(_Reader):
    """One count of a request's wire bytes against the limits."""

    max_tokens: i64
    max_items: i64
    max_fields: i64
    ids: i64
    unpadded: i64
    items: i64
    rid_at: ssize  # the last request id read: buf[rid_at:rid_end]
    rid_end: ssize

    def __init__(self, data: object, max_tokens: i64, max_items: i64, max_fields: i64) -> None:
        _Reader.__init__(self, data)
        self.max_tokens, self.max_items, self.max_fields = max_tokens, max_items, max_fields
        self.ids = self.unpadded = self.items = 0
        self.rid_at = self.rid_end = 0

    def walk(self) -> bool:
        """Whether the whole request is walked within the limits (False: bytes the
        walk does not understand); a breach raises its ``TooLarge``."""
        return self.message(0, self.n, _C_ADMIT, -1) == 1

    def request_id(self) -> str:
        """The last request id read ("" if none)."""
        return self.data[self.rid_at : self.rid_end].decode("utf-8", "replace")

    @cython.cfunc
    @cython.exceptval(-1)
    def message(self, start: ssize, end: ssize, kind: cython.int, item: i64) -> cython.int:
        """1: ``buf[start:end]``, a message of ``kind`` (inside item ``item``, -1 outside
        any), is within every limit; 0: bytes the walk does not understand. A breach
        raises its :class:`~mmadmit.errors.TooLarge`. Repeated fields add up over
        their occurrences, packed or not, as protobuf merges them."""
        fields: i64 = 0
        entries: i64 = 0
        placeholders: i64 = 0
        n: i64
        pos: ssize = start
        data: ssize
        sub: cython.int
        packed: cython.bint
        while pos < end:
            pos = self.key(pos, end)
            if pos < 0:
                return 0
            sub = _count_kind(kind, self.number)
            if sub == _C_OTHER or sub == _C_RID or sub == _C_TOKENIZED or sub == _C_MM:
                fields += 1  # a field no other limit bounds
                if fields > self.max_fields:
                    where = _C_NAMES[kind] if item < 0 else f"item {item}"
                    raise msgpack_len_over(where, fields, "fields", self.max_fields,
                                           at_least=True)  # fmt: skip
            data = pos
            if self.wire_type == 2:
                data = self.length(pos, end)
                if data < 0:
                    return 0
                pos = data + self.size
                packed = True
            elif self.wire_type == 0:
                pos = self.varint(pos, end, _VALUE_MAX)
                if pos < 0:
                    return 0
                packed = False
            else:
                pos = self.skip(pos, end, self.wire_type)
                if pos < 0:
                    return 0
                continue
            if sub == _C_OTHER:
                continue
            if sub == _C_IDS or sub == _C_UNPADDED:
                n = _ends(self.buf, data, pos) if packed else 1
                if sub == _C_IDS:
                    self.ids += n
                    n = self.ids
                else:
                    self.unpadded += n
                    n = self.unpadded
                if n > self.max_tokens:
                    name = "input_ids" if sub == _C_IDS else "input_ids_unpadded"
                    raise tokens_over(name, n, self.max_tokens, at_least=True)
            elif not packed:
                continue  # a varint where a sub-message belongs: upb words it
            elif sub == _C_RID:
                self.rid_at, self.rid_end = data, pos
            elif sub == _C_PLACEHOLDER:
                placeholders += 1
                if placeholders > self.max_tokens:  # each covers one token at least
                    raise placeholders_over(item, placeholders, self.max_tokens)
            elif sub == _C_ENTRY:
                entries += 1
                if entries > self.max_fields:
                    raise msgpack_len_over(f"item {item}", entries, "model_specific_tensors",
                                           self.max_fields, at_least=True)  # fmt: skip
            else:
                if sub == _C_ITEM:
                    self.items += 1
                    if self.items > self.max_items:
                        raise items_over(self.items, self.max_items, at_least=True)
                    item = self.items - 1
                if not self.message(data, pos, sub, item):
                    return 0
        return pos == end


@cython.ccall
def limits_breach(
    data: object, max_tokens: i64, max_items: i64, max_fields: i64
) -> tuple[str, TooLarge] | None:
    """The first breach of the limits in ``data`` (a request's wire bytes, any
    buffer), as (the last request id read before it, "" if none; the refusal,
    worded by :mod:`mmadmit.limits`). None within the limits, and for bytes the
    walk does not understand (protobuf then refuses them with its own error).

    Each field is visited once and the walk stops at the first breach, so its
    cost is bounded by the limits, not by what the sender put in the message."""
    count = _Count(data, max_tokens, max_items, max_fields)
    try:
        count.walk()
    except TooLarge as exc:
        return count.request_id(), exc
    return None


# ------------------------------------------------------------------------ strip_inline

# Message kinds the strip walks (_strip_kind: what a field of each holds).
_K_ADMIT = cython.declare(cython.int, 0)
_K_MM = cython.declare(cython.int, 1)
_K_ITEM = cython.declare(cython.int, 2)
_K_ENTRY = cython.declare(cython.int, 3)
_K_MROPE = cython.declare(cython.int, 4)
_K_TENSOR = cython.declare(cython.int, 5)
_K_INLINE = cython.declare(cython.int, 6)
_K_NONE = cython.declare(cython.int, 7)


@cython.cfunc
@cython.exceptval(check=False)
def _strip_kind(kind: cython.int, number: u64) -> cython.int:
    if kind == _K_ADMIT:
        if number == 9:
            return _K_MM
        if number == 101:
            return _K_MROPE
    elif kind == _K_MM:
        if number == 1:
            return _K_ITEM
    elif kind == _K_ITEM:
        if number == 3:
            return _K_TENSOR
        if number == 4:
            return _K_ENTRY
    elif kind == _K_ENTRY or kind == _K_MROPE:
        if number == (2 if kind == _K_ENTRY else 1):
            return _K_TENSOR
    elif kind == _K_TENSOR:
        if number == 3:
            return _K_INLINE
    return _K_NONE


@cython.final
@cython.cclass
class _Strip(_Reader):
    """Both passes of one strip: the count (``at`` < 0) and the write into ``out``."""

    min_bytes: ssize
    nonce: bytes
    view: object  # the write pass: memoryview(data), for the payload slices
    payloads: list  # the write pass: the payloads replaced, as slices of view
    out: _Out  # the write pass: the new message
    stripped: ssize  # payloads replaced in the message the last walk() call walked

    def __init__(self, data: bytes, min_bytes: ssize, nonce: bytes) -> None:
        _Reader.__init__(self, data)
        self.min_bytes, self.nonce = min_bytes, nonce
        self.stripped = 0

    @cython.cfunc
    @cython.exceptval(-2)
    def walk(self, start: ssize, end: ssize, kind: cython.int, at: ssize) -> ssize:
        """The new size of ``buf[start:end]``, a message of ``kind``, written at
        ``out[at]`` unless ``at`` < 0; -1 for bytes the walk does not understand. A
        sub-message without a payload to strip is kept byte for byte."""
        size: ssize = 0
        stripped: ssize = 0
        kept: ssize = start  # unchanged bytes not yet written
        plain: cython.bint = True  # a map entry of key (1) and value (2) only
        pos: ssize = start
        data: ssize
        new: ssize
        o: ssize
        tag_end: ssize
        index: ssize
        k: ssize
        sub: cython.int
        number: u64
        while pos < end:
            pos = self.key(pos, end)
            if pos < 0:
                return -1
            number = self.number
            if number > 2 or self.wire_type != 2:
                plain = False
            if self.wire_type != 2:
                pos = self.skip(pos, end, self.wire_type)
                if pos < 0:
                    return -1
                continue
            tag_end = pos
            data = self.length(pos, end)
            if data < 0:
                return -1
            pos = data + self.size
            sub = _strip_kind(kind, number)
            if sub == _K_NONE:
                continue
            if sub == _K_INLINE:
                if pos - data < self.min_bytes:
                    continue
                new = len(self.nonce) + 4
                stripped += 1
            else:
                new = self.walk(data, pos, sub, -1)  # counted first: its length leads
                if new < 0:
                    return -1
                if self.stripped == 0:
                    continue  # unchanged: kept byte for byte
                stripped += self.stripped
            if at >= 0:  # the bytes kept before it and its key, its new length, contents
                o = _copy(self.out, at + size, self, kept, tag_end - kept)
                o = _put_varint(self.out, o, new)
                if sub == _K_INLINE:
                    index = len(self.payloads)  # the marker: the nonce, then the index
                    _room(self.out, o, new)
                    for k in range(new - 4):
                        self.out.p[o + k] = self.nonce[k]
                    for k in range(4):
                        self.out.p[o + new - 4 + k] = (index >> (8 * k)) & 0xFF
                    self.payloads.append(self.view[data:pos])
                elif self.walk(data, pos, sub, o) != new:
                    raise SystemError("strip_inline: the write pass disagrees")
            size += tag_end - kept + _varint_size(new) + new
            kept = pos
        if kind == _K_ENTRY and not plain:
            # upb keeps a map entry with any other field whole, as an unknown field of
            # the item: its bytes stay as they are (the write pass never enters it).
            self.stripped = 0
            return end - start
        if at >= 0:
            _copy(self.out, at + size, self, kept, end - kept)
        self.stripped = stripped
        return size + end - kept


def strip_inline(data: bytes, min_bytes: ssize, nonce: bytes) -> tuple[bytes, list] | None:
    """``data`` (a request's wire bytes) with every ``TensorData.inline`` of
    ``min_bytes`` or more, in the fields :mod:`mmadmit.pbwire` lists, replaced by
    the marker ``nonce + index.to_bytes(4, "little")``, the enclosing lengths
    rewritten; and the replaced contents as ``memoryview`` slices of ``data``, in
    wire order. None when nothing is replaced, or when the walk does not
    understand the bytes (nothing upb refuses is ever stripped)."""
    if type(data) is not bytes:
        raise TypeError("strip_inline: data must be bytes")
    if min_bytes < 1:
        raise ValueError("strip_inline: min_bytes must be positive")
    walk = _Strip(data, min_bytes, nonce)
    n: ssize = len(data)
    size: ssize = walk.walk(0, n, _K_ADMIT, -1)
    if size < 0 or walk.stripped == 0:
        return None
    walk.out, walk.view, walk.payloads = _Out(size, False), memoryview(data), []
    if walk.walk(0, n, _K_ADMIT, 0) != size:
        raise SystemError("strip_inline: the write pass disagrees")
    return walk.out.result(), walk.payloads


# ---------------------------------------------------------------------------- take_ids

_T_REQUEST = cython.declare(cython.int, 0)
_T_TOKENIZED = cython.declare(cython.int, 1)


@cython.final
@cython.cclass
class _Take(_Reader):
    """Both passes of one take: the count (``at`` < 0) and the write into ``out``,
    ``ids`` and ``unp``."""

    unpadded: cython.bint  # take field 100 too
    seen_unp: cython.bint
    n_ids: ssize
    n_unp: ssize
    sizes: list  # the new size of each TokenizedInput, in wire order (the count pass)
    k_sizes: ssize
    out: _Out
    ids: _Out
    unp: _Out

    def __init__(self, data: object, unpadded: cython.bint) -> None:
        _Reader.__init__(self, data)
        self.unpadded, self.seen_unp = unpadded, False
        self.n_ids = self.n_unp = self.k_sizes = 0
        self.sizes = []
        self.ids = self.unp = _NO_INTS  # (the count pass passes them on, unused)

    @cython.cfunc
    @cython.exceptval(check=False)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def values(self, pos: ssize, end: ssize, wire_type: cython.int, into: _Out,
               n: ssize, writing: cython.bint) -> ssize:  # fmt: skip
        """One occurrence of a repeated uint32 field (its key read): its values
        appended at ``into[n]`` when ``writing``, else counted. How many there
        are now; -1 for a cut or malformed value, a value above 2**32 - 1 or
        another wire type. The count pass checks that a packed run ends with a
        whole varint; the write pass checks each value. ``self.size``: where
        the occurrence ends."""
        stop: ssize
        b: u8
        if wire_type == 0:
            pos = self.varint(pos, end, _VALUE_MAX)
            if pos < 0 or self.value > _U32_MAX:
                return -1
            if writing:
                if n >= into.cap:
                    return -1  # more than counted
                _set_int(into, n, self.value)
            self.size = pos
            return n + 1
        if wire_type != 2:
            return -1
        pos = self.length(pos, end)
        if pos < 0:
            return -1
        stop = pos + self.size
        if not writing:
            if stop > pos and self.buf[stop - 1] >= 0x80:
                return -1  # the last varint is cut
            n += _ends(self.buf, pos, stop)
        buf: cython.pointer(cython.const[u8]) = self.buf
        top: u64 = _U32_MAX  # (locals: a global is read again after each store)
        cap: ssize = into.cap if writing else 0  # what the count pass counted
        v: u64
        k: cython.int
        while writing and pos < stop:  # varint() inlined: the loop runs once an id
            b = buf[pos]
            pos += 1
            v = b & 0x7F
            k = 0
            while b >= 0x80:
                k += 1
                if k == 10 or pos >= stop:
                    return -1
                b = buf[pos]
                pos += 1
                v |= cython.cast(u64, b & 0x7F) << (7 * k)
            if (k == 9 and b > 1) or v > top or n >= cap:
                return -1  # over 64 bits, above 2**32 - 1 (or more than counted)
            _set_int(into, n, v)
            n += 1
        self.size = stop
        return n

    @cython.cfunc
    @cython.exceptval(-2)
    def take(self, start: ssize, end: ssize, kind: cython.int, at: ssize) -> ssize:
        """The new size of ``buf[start:end]``, a message of ``kind`` (a request or a
        ``TokenizedInput``), without the fields taken, written at ``out[at]`` unless
        ``at`` < 0; -1 for bytes not taken."""
        pos: ssize = start
        size: ssize = 0
        field: ssize
        tag_end: ssize
        inner: ssize
        data: ssize
        o: ssize
        n: ssize
        writing: cython.bint = at >= 0
        while pos < end:
            field = pos
            pos = self.key(pos, end)
            if pos < 0:
                return -1
            if kind == _T_TOKENIZED and self.number == 1:
                n = self.values(pos, end, self.wire_type, self.ids, self.n_ids, writing)
                if n < 0:
                    return -1
                self.n_ids, pos = n, self.size
                continue
            if kind == _T_REQUEST and self.number == 100 and self.unpadded:
                self.seen_unp = True
                n = self.values(pos, end, self.wire_type, self.unp, self.n_unp, writing)
                if n < 0:
                    return -1
                self.n_unp, pos = n, self.size
                continue
            if kind == _T_REQUEST and self.number == 2:
                tag_end = pos
                data = self.length(pos, end) if self.wire_type == 2 else -1
                if data < 0:
                    return -1
                pos = data + self.size
                if writing:
                    inner = self.sizes[self.k_sizes]
                    self.k_sizes += 1
                    o = _copy(self.out, at + size, self, field, tag_end - field)
                    o = _put_varint(self.out, o, inner)
                    if self.take(data, pos, _T_TOKENIZED, o) != inner:
                        return -1  # a value the count pass did not check
                else:
                    inner = self.take(data, pos, _T_TOKENIZED, -1)
                    if inner < 0:
                        return -1
                    self.sizes.append(inner)
                size += tag_end - field + _varint_size(inner) + inner
                continue
            pos = self.skip(pos, end, self.wire_type)
            if pos < 0:
                return -1
            if writing:
                _copy(self.out, at + size, self, field, pos - field)
            size += pos - field
        return size


def take_ids(data: object, unpadded: cython.bint) -> tuple | None:
    """``data`` (a request's wire bytes, any buffer) without its
    ``tokenized.input_ids`` (field 1 of every field 2) and, with ``unpadded``,
    without ``AdmitRequest.input_ids_unpadded`` (field 100), each enclosing
    length rewritten, every other byte kept; the values taken as int64 arrays in
    wire order (packed and unpacked occurrences alike, as protobuf concatenates
    them), the unpadded ones None without ``unpadded`` or field 100. None when
    there is nothing to take, and for anything not taken exactly as upb would
    parse it: bytes the walks do not read, a field 2, 1 or 100 of an unexpected
    wire type, a value above 2**32 - 1 (upb would truncate it)."""
    take = _Take(data, unpadded)
    n: ssize = take.n
    size: ssize = take.take(0, n, _T_REQUEST, -1)
    if size < 0 or size == n:
        return None
    n_ids, n_unp = take.n_ids, take.n_unp
    take.out, take.ids, take.unp = _Out(size, False), _Out(n_ids, True), _Out(n_unp, True)
    take.n_ids = take.n_unp = 0
    if take.take(0, n, _T_REQUEST, 0) != size:
        return None  # a value the count pass did not check
    if take.n_ids != n_ids or take.n_unp != n_unp:
        raise SystemError("take_ids: the write pass disagrees")
    return take.out.result(), take.ids.result(), take.unp.result() if take.seen_unp else None


# ------------------------------------------------------------------ packed_uint32_field


def packed_uint32_field(field_number: i64, values: object) -> bytes:
    """``values`` (1-D, C-contiguous int64) as one packed ``repeated uint32`` field:
    the key (wire type 2), the payload's length, each value's varint; b"" for no
    values. A value outside ``[0, 2**32 - 1]`` raises ``ValueError("Value out of
    range: V")`` for the first such value (protobuf's own message for ``extend``)."""
    if field_number < 1 or field_number > 0x1FFFFFFF:
        raise ValueError("field number out of range")
    key: u64 = (cython.cast(u64, field_number) << 3) | 2
    if not cython.compiled:
        return _packed_numpy(key, np.asarray(values))
    view = cython.declare(Py_buffer)  # the buffer protocol (a typed memoryview costs more)
    PyObject_GetBuffer(values, cython.address(view), PyBUF_C_CONTIGUOUS)
    try:
        if view.itemsize != 8 or view.len % 8 != 0:
            raise ValueError("packed_uint32_field: values must be an int64 buffer")
        return _packed(key, cython.cast(cython.pointer(cython.const[i64]), view.buf), view.len // 8)
    finally:
        PyBuffer_Release(cython.address(view))


@cython.cfunc
def _packed(key: u64, values: cython.pointer(cython.const[i64]), n: ssize) -> bytes:
    """:func:`packed_uint32_field` compiled: one pass to check and size, one to write."""
    i: ssize
    v: i64
    top: i64 = 0xFFFFFFFF
    payload: ssize = 0
    if n == 0:
        return b""
    for i in range(n):
        v = values[i]
        if v < 0 or v > top:
            raise ValueError(f"Value out of range: {v}")
        payload += 1 + (v >= 1 << 7) + (v >= 1 << 14) + (v >= 1 << 21) + (v >= 1 << 28)
    out = _Out(_varint_size(key) + _varint_size(payload) + payload, False)
    at: ssize = _put_varint(out, _put_varint(out, 0, key), payload)
    o: cython.pointer(u8) = out.p + at
    for i in range(n):
        v = values[i]
        while v > 0x7F:
            o[0] = cython.cast(u8, (v & 0x7F) | 0x80)
            o += 1
            v >>= 7
        o[0] = cython.cast(u8, v)
        o += 1
    return out.result()


def _packed_numpy(key: int, values: np.ndarray) -> bytes:
    """:func:`packed_uint32_field` interpreted: one whole-array pass per varint byte."""
    if values.shape[0] == 0:
        return b""
    if values.min() < 0 or values.max() > 0xFFFFFFFF:
        first = int(np.argmax((values < 0) | (values > 0xFFFFFFFF)))
        raise ValueError(f"Value out of range: {int(values[first])}")
    v = values.astype(np.uint32)
    extra = (v >= 1 << 7).view(np.uint8)  # bytes after each value's first: 0 to 4
    for bits in (14, 21, 28):
        extra = extra + (v >= 1 << bits).view(np.uint8)
    sizes = extra.astype(np.int64) + 1
    ends = np.cumsum(sizes)
    out = np.empty(int(ends[-1]), np.uint8)
    starts = ends - sizes
    for k in range(5):  # byte k of every value that has one
        if k == 0:
            at, vk, ek = starts, v, extra
        else:
            has = extra >= k
            if not has.any():
                break
            at, vk, ek = starts[has] + k, v[has], extra[has]
        out[at] = ((vk >> (7 * k)) & 0x7F).astype(np.uint8) | ((ek > k).view(np.uint8) << 7)
    return varint(key) + varint(out.shape[0]) + out.tobytes()
