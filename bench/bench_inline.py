"""Inline or a worker, for a request with nothing to hash: the measured crossover. Not a test.

    python bench/bench_inline.py [--rounds 15]

For Qwen3.5 and Qwen3-Omni requests of 4K to 256K tokens with every content hash
supplied (``bench/workloads.py``), in this process, in the same run (sizes and
paths alternating every round):

* ``inline``: ``MaterializerPool.submit`` on a pool that runs everything inline:
  the materializer on the calling thread, the ticket done before ``submit``
  returns; this is also how long the event loop is held;
* ``worker``: the same request on a pool that never runs inline: submit, the
  hand-off to a worker thread and back, and awaiting the outcome on the loop.

Then what ``mmadmit serve``'s defaults decide for that request
(``--inline-max-tokens`` 16384, ``--inline-max-us`` 1000, the rate calibrated
at start-up as the server does) and the estimate behind the decision. The
crossover is where the inline time passes the budget: below it the thread hop
costs more than the work it moves off the loop; above it a worker keeps the
loop free for other requests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import workloads  # noqa: E402
from mmadmit.config import build_config  # noqa: E402
from mmadmit.materializer import Materializer  # noqa: E402
from mmadmit.model import Materialized  # noqa: E402
from mmadmit.pool import MaterializerPool, hashes_nothing  # noqa: E402
from mmadmit.profile import load_profile  # noqa: E402
from mmadmit.server import calibration_request  # noqa: E402

SIZES = (4096, 16384, 32768, 65536, 131072, 262144)
FAMILIES = ("qwen3_5", "qwen3_omni_moe")


async def main_async(args: argparse.Namespace) -> int:
    defaults = build_config({}, environ={})
    rows = []
    started = time.monotonic()
    for family in FAMILIES:
        profile = load_profile(family)
        materializer = Materializer(profile, defaults.limits)
        inline = MaterializerPool(materializer, workers=1, inline_max_tokens=1 << 30)
        worker = MaterializerPool(materializer, workers=1, inline_max_tokens=0)
        served = MaterializerPool(
            materializer,
            workers=1,
            inline_max_tokens=defaults.inline_max_tokens,
            inline_max_us=defaults.inline_max_us,
        )
        served.calibrate_inline(calibration_request(profile))
        try:
            reqs = {n: workloads.build_request(profile, n, seed=7) for n in SIZES}
            assert all(hashes_nothing(r) for r in reqs.values())
            times: dict[tuple[int, str], list[float]] = {}
            for r in range(args.rounds + 2):  # two warm-up rounds
                for n in SIZES if r % 2 == 0 else SIZES[::-1]:
                    for path, pool in (("inline", inline), ("worker", worker))[:: 1 - 2 * (r % 2)]:
                        t0 = time.perf_counter()
                        ticket = pool.submit(reqs[n])
                        outcome = ticket.result() if ticket.done else await ticket.outcome()
                        dt = time.perf_counter() - t0
                        assert isinstance(outcome, Materialized), outcome
                        if r >= 2:
                            times.setdefault((n, path), []).append(dt)
            for n in SIZES:
                req = reqs[n]
                items = len(req.mm.items) if req.mm is not None else 0
                rows.append(
                    (
                        family,
                        n,
                        items,
                        statistics.median(times[(n, "inline")]) * 1e6,
                        statistics.median(times[(n, "worker")]) * 1e6,
                        served.inline_cost.estimate_us(req),
                        "inline" if served.runs_inline(req) else "worker",
                    )
                )
            rate = served.inline_cost.rate_ns
        finally:
            for pool in (inline, worker, served):
                pool.close()
        rows.append((family, -1, 0, 0.0, 0.0, rate, ""))
    print(f"command: python bench/bench_inline.py --rounds {args.rounds}")
    print(
        f"in process, hashes supplied, medians of {args.rounds} runs per size and path, "
        f"paths and sizes alternated; total {time.monotonic() - started:.1f}s\n"
    )
    print(
        "| family | tokens | items | inline us (the loop held) | worker us (hop and back) "
        "| inline / worker | estimate us | serve's defaults |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for family, n, items, t_in, t_w, est, choice in rows:
        if n < 0:
            continue
        print(
            f"| {family} | {n} | {items} | {t_in:.0f} | {t_w:.0f} | {t_in / t_w:.2f}x "
            f"| {est:.0f} | {choice} |"
        )
    print()
    for family, n, _, _, _, rate, _ in rows:
        if n < 0:
            print(f"{family}: calibrated rate {rate:.2f} ns per unit (a token, or 1/1000 item)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
