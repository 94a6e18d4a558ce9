"""Does each fast path still earn its keep? End to end in process, with and without it.

A fast path stays only where it makes a named workload at least 10% faster end
to end (issue 35); this bench measures each one kept, against what would run
without it, in the same process and in interleaved rounds (medians; the
ratio is "without / with", so 1.10 or more keeps it):

* the compiled per-token loops of ``mmadmit.rules`` (M-RoPE positions, the
  placeholder-span check, the pad fill), each against its numpy reference
  (``tests/kernels_oracle.py``), and
* splicing the reply's items from their received bytes (``splice_items``)
  against encoding every item, and
* writing the padded ids from the received ids' bytes and the pad spans
  (``encode_filled``) against encoding the padded array,

on a ZMQ ADD's decode + materialize + encode (``workloads.staged``: Qwen3.5 and
Qwen3-Omni at 8K, 32K and 128K tokens, hashes supplied); and

* the protobuf walks compiled (``mmadmit.pbwalk``: strip the large inline
  tensors, take the ids, count the limits, write the packed ids) against what
  runs with ``--native off`` (upb alone, the count and the packed ids
  interpreted),

on gRPC ``Admit`` (``bench_grpc``'s 1K tokens + one 2.4 MB image) and SMG's
``Generate`` (``bench_smg_grpc``'s workloads), parse + translate + materialize
+ encode.

Run: python bench/bench_fast_paths.py [--rounds 5] [--only NAME-PART]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bench_grpc  # noqa: E402
import bench_smg_grpc  # noqa: E402
import kernels_oracle  # noqa: E402  (the tests' numpy references)
import workloads  # noqa: E402
from bench_materialize import median_ms  # noqa: E402
from mmadmit import pbwire, planner, wire  # noqa: E402
from mmadmit.config import build_config  # noqa: E402
from mmadmit.materializer import CPU_OPS, Materializer  # noqa: E402
from mmadmit.servicer import encode_response, request_from_proto  # noqa: E402
from mmadmit.smg_request import parse_generate, request_from_generate  # noqa: E402

KEEP = 1.10  # "without / with" at or above this on some workload: the fast path stays
FAMILIES = ("qwen3_5", "qwen3_omni_moe")
TOKENS = (8192, 32768, 131072)


@contextmanager
def _numpy_loop(owner: Any, name: str) -> Iterator[None]:
    """``owner.<name>`` replaced by its numpy reference (``tests/kernels_oracle.py``)."""
    real = getattr(owner, name)
    setattr(owner, name, getattr(kernels_oracle, name))
    try:
        yield
    finally:
        setattr(owner, name, real)


@contextmanager
def _no_splice() -> Iterator[None]:
    real = wire.splice_items

    def encode_every_item(items: Any, aux: Any, src: Any, enc: Any, splice: bool = True) -> Any:
        return real(items, aux, src, enc, False)

    wire.splice_items = encode_every_item
    try:
        yield
    finally:
        wire.splice_items = real


@contextmanager
def _no_fill_from_bytes() -> Iterator[None]:
    real = wire._int_array

    def encode_padded(extra: Any, values: Any, padding: Any = None) -> Any:
        return real(extra, values, None)

    wire._int_array = encode_padded
    try:
        yield
    finally:
        wire._int_array = real


@contextmanager
def _no_pbwire() -> Iterator[None]:
    was = pbwire.HAVE_NATIVE
    pbwire._use_native(False)
    try:
        yield
    finally:
        pbwire._use_native(was)


@contextmanager
def _as_is() -> Iterator[None]:
    yield


def zmq_cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for family in FAMILIES:
        for tokens in TOKENS:
            limits, materializer, frames = workloads.staged(family, tokens)

            def run(limits: Any = limits, m: Materializer = materializer, f: Any = frames) -> None:
                msg = wire.decode_message(f, limits)
                assert msg.request is not None
                wire.encode_materialized(m.run(msg.request, CPU_OPS))  # type: ignore[arg-type]

            cases[f"ZMQ {family} {tokens // 1024}K"] = run
    return cases


def grpc_cases() -> dict[str, Callable[[], None]]:
    config = build_config({"model": "qwen2_5_vl", "device": "cpu"})
    profile, limits = config.load_profile(), config.limits
    materializer = Materializer(profile, limits)
    body, _ = bench_grpc.workload("qwen2_5_vl")
    admit = body + bench_grpc._rid_field("r1")

    def admit_run() -> None:
        req = pbwire.parse_admit_request(admit, limits=limits)
        out = materializer.run(request_from_proto(req, profile, limits), CPU_OPS)
        encode_response("r1", out, echo_features=False)

    cases: dict[str, Callable[[], None]] = {"gRPC Admit 1K + image (2.4 MB)": admit_run}
    smg_config = bench_smg_grpc.serve_config()
    smg_profile = smg_config.load_profile()
    smg_materializer = Materializer(smg_profile, smg_config.limits)
    for name, base in bench_smg_grpc.build_workloads(smg_profile).items():
        data = bench_smg_grpc.serialized(base, "r1")

        def generate_run(data: bytes = data) -> None:
            parsed = parse_generate(data, smg_config.limits)
            req = request_from_generate(parsed, smg_profile, smg_config.limits)
            out = smg_materializer.run(req, CPU_OPS)
            assert out.request is not None  # type: ignore[union-attr]
            wire.encode_request(out.request)  # type: ignore[union-attr]

        cases[f"SMG Generate {name}"] = generate_run
    return cases


def measure(
    paths: dict[str, Callable[[], Any]],
    cases: dict[str, Callable[[], None]],
    rounds: int,
    per: int,
) -> dict[tuple[str, str, str], list[float]]:
    """For each fast path and case: medians with it ("with") and without it, rounds
    alternating which side runs first."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for r in range(rounds):
        for path, without in paths.items():
            sides = [("with", _as_is), ("without", without)]
            for side, ctx in sides if r % 2 == 0 else sides[::-1]:
                with ctx():
                    for case, run in cases.items():
                        n = max(3, per // 3) if "128K" in case else per
                        out.setdefault((path, case, side), []).append(median_ms(run, n) * 1e3)
    return out


def report(results: dict[tuple[str, str, str], list[float]]) -> None:
    print("| fast path | workload | with us | without us | without / with | kept |")
    print("|---|---|---:|---:|---:|---|")
    best: dict[str, float] = {}
    for path, case, side in results:
        if side != "with":
            continue
        a = statistics.median(results[(path, case, "with")])
        b = statistics.median(results[(path, case, "without")])
        best[path] = max(best.get(path, 0.0), b / a)
        print(f"| {path} | {case} | {a:.0f} | {b:.0f} | {b / a:.2f} | |")
    for path, ratio in best.items():
        verdict = "yes" if ratio >= KEEP else "NO: remove it"
        print(f"| {path} | best of its workloads | | | {ratio:.2f} | {verdict} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per", type=int, default=20, help="runs per median (a third at 128K)")
    ap.add_argument("--only", help="measure only the fast paths whose name contains this")
    args = ap.parse_args()
    print(f"command: python bench/bench_fast_paths.py --rounds {args.rounds} --per {args.per}")
    if planner._BUILT is None or pbwire._BUILT is None:
        print("the C extensions are not built: nothing to compare")
        return 1
    gc.disable()  # the collector's pauses are noise here, not the paths' cost
    zmq_paths: dict[str, Callable[[], Any]] = {
        "rules.positions (M-RoPE positions)": lambda: _numpy_loop(planner, "positions"),
        # called inside the compiled rules: replaced in that module
        "rules.first_mismatch (the span check)": lambda: _numpy_loop(
            planner._BUILT, "first_mismatch"
        ),
        "rules.fill_spans (the pad fill)": lambda: _numpy_loop(planner, "fill_spans"),
        "splice_items (items from their bytes)": _no_splice,
        "encode_filled (padded ids from their bytes)": _no_fill_from_bytes,
    }
    grpc_paths: dict[str, Callable[[], Any]] = {"pbwalk compiled (every walk)": _no_pbwire}
    if args.only:
        zmq_paths = {k: v for k, v in zmq_paths.items() if args.only in k}
        grpc_paths = {k: v for k, v in grpc_paths.items() if args.only in k}
    results = measure(zmq_paths, zmq_cases(), args.rounds, args.per) if zmq_paths else {}
    if grpc_paths:
        results |= measure(grpc_paths, grpc_cases(), args.rounds, args.per)
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
