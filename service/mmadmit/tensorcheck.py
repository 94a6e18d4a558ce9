"""The checks of a :class:`mmadmit.model.Tensor` being built: the one source.

``Tensor.__post_init__`` calls :func:`check` on every tensor a codec decodes
(two per multimodal item: its feature and its grid) and on every array the
materializer wraps. What it checks, and every message, is documented on
:class:`~mmadmit.model.Tensor`.

One file, two builds (Cython's pure-Python mode, like :mod:`mmadmit.rules` and
:mod:`mmadmit.msgpack_walk`): this file runs as plain Python, and ``setup.py``
also compiles it into ``mmadmit._tensorcheck_c`` when Cython and a compiler are
present at install time. :mod:`mmadmit.model` calls the compiled build unless
native code is switched off (``--native off``). Interpreted, the checks cost a
tensor more than its construction: about 3,500 of the 6,700 instructions a
tensor took, which is most of what decoding a request's items costs.
``tests/test_tensor.py`` and the ``intcodec`` fuzz target hold both builds to
the same outcome, message included.

The tensor is built before the checks run (``msgspec`` calls ``__post_init__``
on the new instance): a value the checks normalize (a wire dtype name, a shape
list, a non-byte buffer) is written back with ``msgspec.structs.force_setattr``.
A refused tensor is never seen by anyone: the constructor raises.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cython
import msgspec
from msgspec.structs import astuple

from .dtypes import DType, parse_dtype
from .errors import InvalidRequest
from .limits import check_shape, tensor_bytes_over

if cython.compiled:
    from cython.cimports.cpython.buffer import Py_buffer
    from cython.cimports.cpython.memoryview import PyMemoryView_GET_BUFFER

_force = msgspec.structs.force_setattr  # only while a tensor is being built
# wire dtype name -> DType (only valid names are stored, a bounded number of them)
DTYPES = cython.declare(dict, {})
_DTYPES_MAX = 1024
_MEMORYVIEW = memoryview
# the last limits seen and their three tensor bounds, one tuple (swapped whole: a
# thread never reads one object's bounds against another's); a frozen dataclass.
# The bounds come twice: as set, and each at most _FAST_MAX for _fits's C arithmetic.
_bounds: tuple = (None, 0, 0, 0, 0, 0, 0)
# _fits multiplies dimensions up to this in 64-bit C ints: a product of two stays
# below 2**62 (a larger dimension or product takes the check's exact path)
_FAST_MAX = cython.declare(cython.longlong, 1 << 31)
assert _FAST_MAX == 0x80000000  # _fits's literal


@cython.cfunc
def _limits_bounds(limits: Any) -> tuple:
    """``(limits, max_tensor_bytes, max_tensor_rank, max_tensor_dim, and the three
    again, each at most _FAST_MAX)``, cached."""
    global _bounds
    cached = _bounds
    if cached[0] is not limits:
        found = (limits.max_tensor_bytes, limits.max_tensor_rank, limits.max_tensor_dim)
        # a bound that is not an int (-1) leaves every tensor to the exact path
        cached = (limits, *found, *[min(x, _FAST_MAX) if type(x) is int else -1 for x in found])
        _bounds = cached
    return cached


# Tensor's fields, in order (mmadmit.model checks its class against it): the check
# reads them with one astuple call (a getattr each costs compiled code ~150
# instructions).
FIELDS = ("dtype", "shape", "data", "name", "limits")
# None: post_init runs this build's check; else the check every tensor goes to
# (mmadmit.model routes tensors to the interpreted build when native code is off)
_route: Any = None


def route(check_fn: Any) -> None:
    """Send every tensor :func:`post_init` sees to ``check_fn`` (None: this build's
    :func:`check`)."""
    global _route
    _route = check_fn


def post_init(t: Any) -> None:
    """``Tensor.__post_init__``: :func:`check`, or the check :func:`route` set. The
    class holds this function itself (``msgspec`` calls it on every new tensor),
    so a compiled build runs no Python frame per tensor."""
    f = _route
    if f is not None:
        f(t)
    else:
        _check(t)


def check(t: Any) -> None:
    """Check the tensor ``t`` being built, normalizing its fields (see the module)."""
    _check(t)


@cython.cfunc
def _check(t: Any) -> None:
    """:func:`check`."""
    dtype, shape, data, name, limits = astuple(t)
    if type(dtype) is not DType:
        found = DTYPES.get(dtype) if type(dtype) is str else None
        dtype = found if found is not None else _dtype_named(dtype, label(name))
        _force(t, "dtype", dtype)
    if type(shape) is not tuple:
        if not isinstance(shape, (list, tuple)):
            raise _bad_shape(label(name), shape)
        shape = tuple(shape)
        _force(t, "shape", shape)
    if _fits(dtype.itemsize, shape, data, limits):
        return
    nbytes = dtype.itemsize
    for d in shape:  # the element count, each dimension checked on the way
        if type(d) is not int or d < 0:
            raise _bad_shape(label(name), shape)
        nbytes *= d
    if limits is not None:
        _, max_bytes, max_rank, max_dim = _limits_bounds(limits)[:4]
    if limits is not None and (
        nbytes > max_bytes
        or len(shape) > max_rank
        # a dimension is at most the element count, unless another one is 0
        or (not 0 < nbytes <= max_dim and shape and max(shape) > max_dim)
    ):
        name = label(name)
        check_shape(name, shape, limits)  # rank and dimensions first
        raise tensor_bytes_over(name, shape, dtype.name, nbytes, limits.max_tensor_bytes)
    size: cython.Py_ssize_t = _byte_len(data)  # -1: not a flat byte view
    if size < 0:
        data = _byte_view(data, name)
        _force(t, "data", data)
        size = data.nbytes
    if size != nbytes:
        raise InvalidRequest(
            f"{label(name)}: {data.nbytes} data bytes but shape {list(shape)} of "
            f"{dtype.name} needs {nbytes}"
        )


@cython.cfunc
def _fits(itemsize: Any, shape: tuple, data: Any, limits: Any) -> cython.bint:
    """Whether the checks below pass for sure, with nothing to normalize: every
    dimension an int in ``[0, _FAST_MAX]``, their product with ``itemsize`` too,
    within ``limits`` (None: none), and ``data`` a flat byte view of that many
    bytes. Compiled, in C ints (no Python int made or compared); False sends the
    tensor down the exact path, which decides and words the refusal."""
    # the literal is _FAST_MAX (compared as a constant, no Python int made for it)
    if type(itemsize) is not int or not 0 < itemsize <= 0x80000000:
        return False
    nbytes: cython.longlong = itemsize
    top: cython.longlong = 0
    x: cython.longlong
    for d in shape:
        if type(d) is not int or not 0 <= d <= 0x80000000:
            return False
        x = d
        nbytes *= x
        top = x if x > top else top
        if nbytes > _FAST_MAX:
            return False
    if limits is not None:
        cached: tuple = _limits_bounds(limits)
        max_bytes: cython.longlong = cached[4]
        max_rank: cython.longlong = cached[5]
        max_dim: cython.longlong = cached[6]
        if nbytes > max_bytes or len(shape) > max_rank or top > max_dim:
            return False
    return _byte_len(data) == nbytes


@cython.cfunc
@cython.exceptval(check=False)
def _byte_len(data: Any) -> cython.Py_ssize_t:
    """The byte length of ``data`` if it is a flat, C-contiguous byte ``memoryview``
    (what a tensor keeps), else -1. Compiled, read from the view's buffer
    struct (no attribute lookups, no format string made)."""
    size: cython.Py_ssize_t = -1
    if type(data) is not _MEMORYVIEW:
        pass
    elif cython.compiled:
        view: cython.pointer[Py_buffer] = PyMemoryView_GET_BUFFER(data)
        fmt: cython.p_const_char = view.format
        if (
            view.ndim == 1
            and (fmt == cython.NULL or (fmt[0] == 66 and fmt[1] == 0))  # "B"
            and view.suboffsets == cython.NULL  # c_contiguous as memoryview decides it
            and (view.shape[0] == 1 or view.strides[0] == view.itemsize)
        ):
            size = view.len
    elif data.ndim == 1 and data.c_contiguous and data.format == "B":
        size = data.nbytes
    return size


def _dtype_named(name: Any, what: Any) -> DType:
    """A wire dtype name resolved (cached); INVALID_REQUEST naming the tensor otherwise."""
    found = DTYPES.get(name) if type(name) is str else None
    if found is None:
        try:
            found = parse_dtype(name)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{what}: {exc.message}") from None
        if len(DTYPES) < _DTYPES_MAX:  # valid spellings only, and a bounded number of them
            DTYPES[name] = found
    return found


def _byte_view(data: Any, what: Any) -> memoryview:
    """``data`` as a flat byte view (no copy); it must be C-contiguous."""
    view = data if type(data) is _MEMORYVIEW else memoryview(data)
    if not view.c_contiguous:
        raise InvalidRequest(f"{label(what)}: tensor data must be C-contiguous bytes")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class TensorName(NamedTuple):
    """A tensor's name in an error message (``item 3 feature``, ``mrope_positions``),
    formatted only when a message is: the checks run on every request."""

    item: int | None
    key: str

    def __str__(self) -> str:
        return self.key if self.item is None else f"item {self.item} {self.key}"


def label(name: Any) -> Any:
    """A tensor's name for a message: an ``(item, key)`` pair as a ``TensorName``
    (the gRPC translation words its own refusals with it too)."""
    if type(name) is tuple:
        return TensorName(*name)
    return name


def _bad_shape(what: Any, shape: Any) -> InvalidRequest:
    got = list(shape) if isinstance(shape, (list, tuple)) else shape
    return InvalidRequest(f"{what}: shape must be a list of non-negative ints, got {got!r}")
