"""``--native off`` (``MMADMIT_NATIVE=0``): no C extension runs, the fallbacks do all.

Run with: python -m pytest tests/test_native_switch.py -q
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import SESSION_NATIVE, load_vector, vector_names
from mmadmit import (
    intcodec,
    model,
    msgpack_walk,
    native,
    pbwalk,
    pbwire,
    planner,
    rules,
    tensorcheck,
    wire,
)
from mmadmit.config import ServeConfig, build_config
from mmadmit.errors import ConfigError
from mmadmit.materializer import Materializer
from mmadmit.model import Materialized
from mmadmit.profile import load_profile

MODULES = {
    "mmadmit.intcodec": intcodec,
    "mmadmit.pbwire": pbwire,
    "mmadmit.planner": planner,
    "mmadmit.model": model,
}


class _Tripwire:
    """Stands in for an extension module: any attribute use fails the test."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        raise AssertionError(f"native code ran with --native off: {self.name}.{attr}")


@contextlib.contextmanager
def tripwired(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every extension replaced by a tripwire, then native code switched off."""
    for name, module in MODULES.items():
        monkeypatch.setattr(module, "_BUILT", _Tripwire(name))
    native.set_enabled(False)
    try:
        yield
    finally:
        monkeypatch.undo()
        native.set_enabled(SESSION_NATIVE)


def test_config_field_flag_and_env() -> None:
    assert ServeConfig().native is True
    assert build_config({}, environ={"MMADMIT_NATIVE": "0"}).native is False
    assert build_config({"native": "off"}, environ={"MMADMIT_NATIVE": "1"}).native is False
    assert build_config({"native": "on"}, environ={}).native is True
    with pytest.raises(ConfigError, match="--native"):
        build_config({"native": "maybe"}, environ={})


def test_every_wrapping_module_registers_and_switches() -> None:
    assert set(native.built()) >= set(MODULES)
    native.set_enabled(False)
    try:
        assert not native.enabled()
        assert not any(m.HAVE_NATIVE for m in MODULES.values())
        assert intcodec._WALK is msgpack_walk
        assert planner._active is rules and pbwire._compiled is None and pbwire._walks is pbwalk
        assert model._check is tensorcheck.check
        native.set_enabled(True)
        for name, module in MODULES.items():
            assert module.HAVE_NATIVE == native.built()[name]
    finally:
        native.set_enabled(SESSION_NATIVE)


@pytest.mark.parametrize("name", vector_names())
def test_vectors_materialize_with_no_native_call(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode, materialize and encode every vector with each extension a tripwire."""
    vec = load_vector(name)
    m = Materializer(load_profile(str(vec.config)))
    want = m.run(wire.decode_message(list(vec.frames)).request)  # type: ignore[arg-type]
    with tripwired(monkeypatch):
        req = wire.decode_message(list(vec.frames)).request
        assert req is not None
        got = m.run(req)
        assert type(got) is type(want)
        if isinstance(got, Materialized):
            frames = wire.encode_materialized(got)
            assert isinstance(want, Materialized)
            assert [bytes(memoryview(f).cast("B")) for f in frames] == [
                bytes(memoryview(f).cast("B")) for f in wire.encode_materialized(want)
            ]
        else:
            assert got == want


def test_grpc_shortcuts_with_no_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = np.arange(300, dtype=np.int64)
    want = pbwire.packed_uint32_field(1, ids)
    with tripwired(monkeypatch):
        assert pbwire.packed_uint32_field(1, ids) == want
        assert pbwire.strip_inline_payloads(b"\x0a\x00", 1) is None
