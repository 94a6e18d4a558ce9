"""Shared test helpers: where the wire vectors live and how to load them.

``VECTORS`` is ``$MMADMIT_VECTORS`` or ``tests/data/vectors``, the copy of the
reference vectors the repository carries (see its ``README.md`` for provenance), so
a clone with nothing beside it runs the whole suite. Helpers here are plain functions
(importable as ``from conftest import ...`` because pytest puts ``tests/`` on
``sys.path``) plus thin fixtures around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SERVICE_DIR = REPO_ROOT / "service"

# The package is normally installed (`pip install -e .`); fall back to the source
# tree so a fresh checkout still runs its tests.
try:  # pragma: no cover - depends on the environment
    import mmadmit  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(SERVICE_DIR))

# hf_oracle / prompt_gen are imported as top-level modules by the tests.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

VECTORS = Path(os.environ.get("MMADMIT_VECTORS") or (TESTS_DIR / "data" / "vectors"))
CONFIGS = VECTORS / "configs"

FAMILY_CONFIG = {
    "qwen3_5": "qwen3_5.json",
    "qwen3_omni": "qwen3_omni_moe.json",
    "llama": "llama.json",
}


def vector_names() -> list[str]:
    """Names of every vector case (``<name>.frames``), sorted; empty if absent."""
    if not VECTORS.is_dir():
        return []
    return sorted(p.stem for p in VECTORS.glob("*.frames"))


def config_for_family(family: str) -> Path:
    """The ``configs/`` file serving a vector's ``meta['family']``."""
    try:
        return CONFIGS / FAMILY_CONFIG[family]
    except KeyError:
        raise KeyError(f"no vector config known for family {family!r}") from None


@dataclass
class Vector:
    name: str
    frames: list[memoryview]  # [type, payload, *aux] as zero-copy views of the container
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]
    blob: bytes  # the raw .frames container

    @property
    def config(self) -> Path:
        return config_for_family(self.meta["family"])

    @property
    def error(self) -> dict[str, Any] | None:
        return self.meta.get("error")

    @property
    def frames_path(self) -> Path:
        return VECTORS / f"{self.name}.frames"


def load_vector(name: str) -> Vector:
    """Frames (via ``mmadmit.frames.parse_frames``), expected arrays and metadata."""
    from mmadmit.frames import parse_frames

    blob = (VECTORS / f"{name}.frames").read_bytes()
    frames = parse_frames(blob)
    with np.load(VECTORS / f"{name}.npz") as npz:
        arrays = {key: npz[key] for key in npz.files}
    meta = json.loads((VECTORS / f"{name}.json").read_text())
    return Vector(name=name, frames=frames, arrays=arrays, meta=meta, blob=blob)


def require_vectors() -> None:
    if not vector_names():
        pytest.skip(f"no wire vectors at {VECTORS} (set MMADMIT_VECTORS)")


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    require_vectors()
    return VECTORS


@pytest.fixture(scope="session")
def vector_loader():
    """``vector_loader(name)`` -> :class:`Vector` (skips when the vectors are absent)."""
    require_vectors()
    return load_vector


@pytest.fixture(params=["native", "fallback"])
def native_mode(request: pytest.FixtureRequest) -> Any:
    """Run a test twice: C extensions on, then Python fallbacks only (``--native off``).

    The vector and transport tests use it (``pytestmark``), so the suite proves
    both ways serve every vector and transport case. In-process servers started
    in the test get the same setting (their config's ``native``; see
    ``test_admission_both_transports.running``).
    """
    from mmadmit import intcodec, kernels, native, pbwire, planner  # noqa: F401 (register)

    on = request.param == "native"
    if on and not any(native.built().values()):
        pytest.skip("no C extension is built: the fallback run covers it")
    native.set_enabled(on)
    try:
        yield on
    finally:
        native.set_enabled(True)


async def http_get(address: str, path: str = "/metrics", method: str = "GET") -> tuple[int, str]:
    """One plain HTTP/1.1 request to the metrics endpoint: (status, body)."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split(" ", 2)[1]), body


class Sockets:
    """Raw test sockets on the test's own context. It keeps a reference to
    every socket until teardown closes them (a socket dropped unclosed when the
    test coroutine ends would raise a ResourceWarning)."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._made: list[zmq.asyncio.Socket] = []

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._made.append(sock)
        return sock

    def close(self) -> None:
        for sock in self._made:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def zctx() -> AsyncIterator[Sockets]:
    net = Sockets()
    yield net
    net.close()
