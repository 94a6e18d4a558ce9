"""Materializer benchmark (issue: materializer core and codec). Not a test.

    python bench/bench_materialize.py [--repeat 15] [--sizes 1024,8192,32768,131072]

Prints markdown tables of medians, each next to a baseline measured in the
same run:

1. materialize alone (internal model in, internal model out) vs copying the
   request's input_ids and writing an int64 [3, N] array with numpy;
2. codec + materialize (received frames -> reply frames) vs the codec alone
   (decode and re-encode the same frames without materializing);
3. hashing features without a content hash vs hashlib.blake2b on the same
   bytes, with tracemalloc's peak during the hash (no copy of the feature).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mmadmit import intcodec, wire  # noqa: E402
from mmadmit.hashing import feature_hash  # noqa: E402
from mmadmit.materializer import Materializer  # noqa: E402
from mmadmit.model import Materialized  # noqa: E402
from mmadmit.runtime import tune_process  # noqa: E402
from workloads import build_request, frames_of, media_share, profile_for  # noqa: E402


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def paired_median_ms(
    base: Callable[[], object], measured: Callable[[], object], repeat: int
) -> tuple[float, float]:
    """Medians of a baseline and a measured region, sampled alternately.

    Alternating keeps a burst of background load (these machines are shared)
    from landing on one side of a ratio only.
    """
    base()
    measured()  # warm both
    a, b = [], []
    for _ in range(repeat):
        for fn, out in ((base, a), (measured, b)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(a) * 1e3, statistics.median(b) * 1e3


def codec_only(frames: list) -> list:
    """Decode the frames and encode the request again, without materializing.

    ``input_ids`` is replaced by a copy first: the codec re-emits a token array
    it decoded as its received bytes while the request still holds that very
    array, and a materialized reply always carries new (substituted) ids, so
    the baseline must pay for encoding them too.
    """
    msg = wire.decode_message(frames)
    assert msg.request is not None
    msg.request.input_ids = msg.request.input_ids.copy()
    return [b"\x00", *wire.encode_request(msg.request)]


def codec_and_materialize(mat: Materializer, frames: list) -> list:
    msg = wire.decode_message(frames)
    assert msg.request is not None
    out = mat.run(msg.request)
    assert isinstance(out, Materialized), out
    return wire.encode_materialized(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--sizes", default="1024,8192,32768,131072")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tune_process()  # as `mmadmit serve` does at start-up
    print(
        f"native int codec: {intcodec.HAVE_NATIVE}; median of {args.repeat} runs, "
        "baseline and measured region sampled alternately; "
        f"command: python bench/bench_materialize.py --repeat {args.repeat}\n"
    )

    rows_a, rows_b = [], []
    for family in ("qwen3_5", "qwen3_omni_moe"):
        profile = profile_for(family)
        mat = Materializer(profile)
        for n in sizes:
            req = build_request(profile, n, seed=n)
            ids = req.input_ids

            def baseline(ids: np.ndarray = ids) -> None:
                ids.copy()
                out = np.empty((3, len(ids)), np.int64)
                out[:] = ids

            t_base, t_mat = paired_median_ms(
                baseline, lambda req=req, mat=mat: mat.materialize(req), args.repeat
            )
            rows_a.append((family, n, f"{media_share(req):.0%}", len(req.mm.items), t_base, t_mat))
            frames = frames_of(req)
            t_codec, t_full = paired_median_ms(
                lambda f=frames: codec_only(f),
                lambda f=frames, mat=mat: codec_and_materialize(mat, f),
                args.repeat,
            )
            rows_b.append((family, n, t_codec, t_full))

    print("### materialize alone vs numpy copy baseline (target <= 5x at 32K and 128K)\n")
    print("| family | tokens | media | items | baseline ms | materialize ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for fam, n, share, items, tb, tm in rows_a:
        print(f"| {fam} | {n} | {share} | {items} | {tb:.3f} | {tm:.3f} | {tm / tb:.2f}x |")
    print("\n### codec + materialize vs codec alone (target <= 1.5x at 32K and 128K)\n")
    print("| family | tokens | codec ms | codec+materialize ms | ratio |")
    print("|---|---:|---:|---:|---:|")
    for fam, n, tc, tf in rows_b:
        print(f"| {fam} | {n} | {tc:.3f} | {tf:.3f} | {tf / tc:.2f}x |")

    print("\n### feature hashing (no content hash supplied) vs hashlib.blake2b\n")
    print("| feature bytes | hashlib MB/s | feature_hash MB/s | ratio | tracemalloc peak |")
    print("|---:|---:|---:|---:|---:|")
    for nbytes in (1 << 20, 16 << 20, 100 << 20):
        buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        view = memoryview(buf).cast("B")
        t_ref = median_ms(lambda view=view: hashlib.blake2b(view, digest_size=8).digest(), 5)
        t_ours = median_ms(lambda view=view: feature_hash(view), 5)
        tracemalloc.start()
        feature_hash(view)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        mb = nbytes / 1e6
        print(
            f"| {nbytes} | {mb / t_ref * 1e3:.0f} | {mb / t_ours * 1e3:.0f} | "
            f"{t_ours / t_ref:.2f}x | {peak} B |"
        )


if __name__ == "__main__":
    main()
