"""A short, deterministic run of every fuzz target (no sanitizer, no atheris).

Each target (``fuzz/targets/``) replays its whole seed corpus, including the
``regress-*`` inputs that once failed, then a fixed number of inputs from the
repository's own mutation fuzzer with a fixed seed, so the run is the same on
every machine and cannot flake. A divergence between a native path and its
Python fallback, an ``INTERNAL`` outcome or a crash fails the test and names
the seed and iteration to reproduce it with ``python fuzz/run.py TARGET
--engine mutate --seed S --runs N``. The long runs under sanitizers are
``make fuzz`` (RELIABILITY.md).

Run with: python -m pytest tests/test_fuzz_smoke.py -q
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from fuzz.mutator import fuzz  # noqa: E402
from fuzz.targets import TARGETS  # noqa: E402

CORPUS = REPO_ROOT / "fuzz" / "corpus"
# Mutated inputs per target: one to two seconds each here (the targets differ in cost).
RUNS = {
    "intcodec": 30000,
    "pbwire": 30000,
    "kernels": 12000,
    "planner": 6000,
    "zmq": 10000,
    "grpc": 15000,
    "smg": 10000,
}


def _seeds(target: str) -> list[bytes]:
    folder = CORPUS / target
    return [p.read_bytes() for p in sorted(folder.iterdir())] if folder.is_dir() else []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_smoke(target: str) -> None:
    module = importlib.import_module(f"fuzz.targets.{target}_target")
    seeds = _seeds(target)
    assert seeds, f"no seed corpus in {CORPUS / target}"
    failed: list[str] = []

    def note(data: bytes, i: int) -> None:
        failed.append(f"{target}: seed 0, iteration {i}, input {data[:64].hex()}...")

    n = fuzz(
        module.one,
        seeds,
        runs=len(seeds) + RUNS[target],
        seed=0,
        max_len=getattr(module, "MAX_LEN", 4096),
        on_failure=note,
    )
    assert n == len(seeds) + RUNS[target] and not failed


def test_corpus_stays_small() -> None:
    total = sum(p.stat().st_size for p in Path(CORPUS).rglob("*") if p.is_file())
    assert total < 2 << 20, f"fuzz/corpus is {total} bytes; keep it under 2 MiB"
