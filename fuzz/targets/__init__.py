"""Fuzz targets: each module has ``NAME`` and ``one(data: bytes) -> None``.

``one`` raises (``AssertionError`` for a divergence between a native path and
its Python fallback, or an ``INTERNAL`` outcome; anything else for a crash of
the harness' own contract) and returns ``None`` for every input that behaves.
The same function runs under atheris (``fuzz/run.py``), under the repo's own
mutation fuzzer (no atheris) and in the test suite (``tests/test_fuzz_smoke.py``).
"""

from __future__ import annotations

TARGETS = ("intcodec", "pbwire", "planner", "kernels", "zmq", "grpc", "smg")
