"""A request's own work with warm and with cold caches (issue #18). Not a test.

    python bench/bench_cold.py [--requests 300] [--sweep-mib 16]

Diagnostic for the excess ``bench_zmq.py`` measures: in process, the stages
the service runs for one request (``wire.decode_message`` of the received
frames, ``Materializer.run``, ``wire.encode_materialized``) on frames freshly
received over a TCP ``PAIR`` each time (libzmq's thread wrote them, as in the
service), on ``bench/workloads.py``'s requests with every hash supplied. Two
conditions, interleaved request by request: **warm**, the stages right after
the previous request's; **cold**, after ``--sweep-mib`` of other memory was
read (what the processes running between two of the service's requests do
to the caches). The ratio cold / warm is what the caches add to the same
instructions: a request that touches less code and memory loses less.
Medians over the requests, the first 50 of each condition left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CELLS = [
    ("qwen3_5", 8192),
    ("qwen3_omni_moe", 8192),
    ("qwen3_omni_moe", 32768),
    ("qwen3_omni_moe", 131072),
]
SKIP = 50


def _cell(family: str, tokens: int, requests: int, sweep: Any) -> dict[str, list[float]]:
    import workloads
    import zmq
    from mmadmit import wire

    limits, materializer, frames = workloads.staged(family, tokens)
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    try:
        for i in range(2 * requests):
            kind = "cold" if i % 2 else "warm"
            a.send_multipart(frames, copy=False)
            got = b.recv_multipart(copy=False)
            if kind == "cold":
                sweep.sum()  # other memory through the caches
            t0 = time.perf_counter()
            msg = wire.decode_message(got, limits)
            assert msg.request is not None
            outcome = materializer.run(msg.request)
            wire.encode_materialized(outcome)  # type: ignore[arg-type]
            times[kind].append(time.perf_counter() - t0)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per condition and cell")
    parser.add_argument("--sweep-mib", type=int, default=16, help="memory read before a cold one")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import numpy as np
    from mmadmit.runtime import tune_process

    tune_process()  # as `mmadmit serve` runs (arenas, GC)
    sweep = np.ones(args.sweep_mib << 20, dtype=np.uint8)
    print(f"command: python bench/bench_cold.py --requests {args.requests} "
          f"--sweep-mib {args.sweep_mib}")  # fmt: skip
    print(
        "decode + materialize + encode in process, frames fresh off a TCP PAIR, every hash "
        f"supplied; cold: after {args.sweep_mib} MiB read; medians of {args.requests - SKIP}"
    )
    print()
    print("| family | tokens | warm ms | cold ms | cold / warm |")
    print("|---|---:|---:|---:|---:|")
    for family, tokens in CELLS:
        times = _cell(family, tokens, args.requests, sweep)
        warm = statistics.median(times["warm"][SKIP:]) * 1e3
        cold = statistics.median(times["cold"][SKIP:]) * 1e3
        print(f"| {family} | {tokens} | {warm:.3f} | {cold:.3f} | {cold / warm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
