"""Helpers shared by the targets: native on/off, outcomes in comparable form."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from mmadmit import native


def on_walk(walk: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a public :mod:`mmadmit.intcodec` function) run on one build of the
    walker: ``intcodec._BUILT`` (compiled) or ``mmadmit.msgpack_walk`` (interpreted,
    with intcodec's msgspec shortcuts)."""
    from mmadmit import intcodec

    def run(*args: Any) -> Any:
        was = intcodec.HAVE_NATIVE
        intcodec._use_native(walk is intcodec._BUILT)
        try:
            return fn(*args)
        finally:
            intcodec._use_native(was)

    return run


@contextlib.contextmanager
def native_mode(on: bool) -> Iterator[None]:
    """Every wrapped extension on (when built) or off, restored afterwards."""
    prev = native.enabled()
    native.set_enabled(on)
    try:
        yield
    finally:
        native.set_enabled(prev)


def outcome(
    fn: Callable[..., Any], *args: Any, errors: tuple[type[BaseException], ...] = (ValueError,)
) -> tuple[Any, ...]:
    """``("ok", result)`` or ``("err", type name, message)`` for an expected error type.

    Any other exception propagates: that is a finding (a crash of the contract).
    """
    try:
        return ("ok", fn(*args))
    except errors as exc:
        return ("err", type(exc).__name__, str(exc))


def comparable(x: Any) -> Any:
    """Arrays, memoryviews and nested containers as plain comparable values."""
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, (bytes, memoryview, bytearray)):  # any buffer: compared by content
        return ("bytes", bytes(x))
    if isinstance(x, (list, tuple)):
        return type(x).__name__, [comparable(v) for v in x]
    return x


def same(a: Any, b: Any, what: str, *, messages: bool = True) -> None:
    """Assert two outcomes agree (error messages too unless ``messages`` is False)."""
    if not messages and a[0] == "err" and b[0] == "err":
        assert a[1] == b[1], f"{what}: native raised {a[1]}, fallback {b[1]} ({a[2]!r} / {b[2]!r})"
        return
    ca, cb = comparable(a), comparable(b)
    assert ca == cb, f"{what}: native and fallback disagree:\n  native   {a!r}\n  fallback {b!r}"
