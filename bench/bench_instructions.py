"""Instructions a request costs, counted by valgrind (issue #18). Not a test.

    python bench/bench_instructions.py [--baseline DIR] [--repeat 40] [--jobs 2]

Wall-clock medians on a shared 2-core machine move by 10-30% from one run to
the next, more than most single changes to the request's Python work. An
instruction count does not move: each cell runs its stage ``--repeat`` times
under ``valgrind --tool=callgrind`` and once with no repetition (imports,
set-up, the request made and decoded once), and divides the difference. The
count leaves out what instructions do not show (cache misses, memory traffic,
the GIL), so it ranks changes to the work itself; ``bench_zmq.py`` stays the
measure of the service.

Stages, in process, on ``bench/workloads.py``'s requests with every hash
supplied: ``decode`` (``wire.decode_message`` of the received frames: payload
split, token ids, items), ``materialize`` (``Materializer.run`` on a decoded
request) and ``encode`` (``wire.encode_materialized`` of its outcome). With
``--baseline DIR`` (another checkout, built: ``python setup.py build_ext
--inplace`` and ``scripts/gen_protos.py`` there) the same cells run on that
code too, through ``PYTHONPATH``, and the table gives the ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CELLS = [("qwen3_5", 8192), ("qwen3_omni_moe", 32768), ("qwen3_omni_moe", 131072)]
STAGES = ("decode", "materialize", "encode")


def child(family: str, tokens: int, stage: str, repeat: int) -> None:
    """One stage ``repeat`` times (0: set-up only), as measured under valgrind."""
    sys.path.insert(0, str(HERE))
    import workloads
    from mmadmit import wire

    limits, materializer, frames = workloads.staged(family, tokens)
    # received frames are zmq.Frame objects in the service: the same here
    import zmq

    try:  # the collector as `mmadmit serve` tunes it: when it runs moved a count by 1-2%
        from mmadmit.runtime import tune_process
    except ImportError:  # a baseline older than runtime.tune_process
        pass
    else:
        tune_process()

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://frames")
    b.connect("inproc://frames")
    a.send_multipart(frames)
    received = b.recv_multipart(copy=False)
    n = 40  # requests made before the measured part, whatever ``repeat`` is
    decoded = [wire.decode_message(received, limits).request for _ in range(n)]
    outcomes = [materializer.run(r) for r in decoded] if stage == "encode" else []
    if stage == "decode":
        for _ in range(repeat):
            wire.decode_message(received, limits)
    elif stage == "materialize":
        for r in decoded[:repeat]:
            materializer.run(r)
    else:
        for o in outcomes[:repeat]:
            wire.encode_materialized(o)  # type: ignore[arg-type]


def _count(cell: tuple[str, int, str], repeat: int, pythonpath: str | None) -> int:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    family, tokens, stage = cell
    cmd = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--child", family, str(tokens), stage, str(repeat),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stderr
    found = re.search(r"I\s+refs:\s+([\d,]+)", out)
    if found is None:
        raise SystemExit(f"no instruction count from valgrind for {cell}:\n{out[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_request(cell: tuple[str, int, str], repeat: int, pythonpath: str | None) -> float:
    return (_count(cell, repeat, pythonpath) - _count(cell, 0, pythonpath)) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="another built checkout to compare with")
    parser.add_argument("--repeat", type=int, default=40, help="repetitions a cell (max 40)")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        family, tokens, stage, repeat = args.child
        child(family, int(tokens), stage, int(repeat))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions needs valgrind (apt-get install valgrind)")
    repeat = max(1, min(args.repeat, 40))
    cells = [(f, t, s) for f, t in CELLS for s in STAGES]
    sides: dict[str, str | None] = {"this": None}
    if args.baseline:
        base = Path(args.baseline).resolve()
        sides["baseline"] = f"{base / 'service'}{os.pathsep}{base / 'clients'}"
    jobs = [(side, cell) for side in sides for cell in cells]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        counts = list(pool.map(lambda job: per_request(job[1], repeat, sides[job[0]]), jobs))
    got: dict[tuple[str, Any], float] = {(s, c): n for (s, c), n in zip(jobs, counts, strict=True)}
    baseline = f" --baseline {args.baseline}" if args.baseline else ""
    print(f"command: python bench/bench_instructions.py{baseline}")
    print(
        f"instructions a request (callgrind, {repeat} repetitions less none), every hash supplied\n"
    )
    head = "| family | tokens | stage | instructions |"
    rule = "|---|---:|---|---:|"
    if args.baseline:
        head += " baseline | ratio |"
        rule += "---:|---:|"
    print(head)
    print(rule)
    totals: dict[tuple[str, str, int], float] = {}
    for family, tokens, stage in cells:
        row = f"| {family} | {tokens} | {stage} | {got[('this', (family, tokens, stage))]:,.0f} |"
        for side in sides:
            key = (side, family, tokens)
            totals[key] = totals.get(key, 0.0) + got[(side, (family, tokens, stage))]
        if args.baseline:
            base_n = got[("baseline", (family, tokens, stage))]
            row += f" {base_n:,.0f} | {got[('this', (family, tokens, stage))] / base_n:.3f} |"
        print(row)
    for family, tokens in CELLS:
        row = f"| {family} | {tokens} | **all three** | {totals[('this', family, tokens)]:,.0f} |"
        if args.baseline:
            base_n = totals[("baseline", family, tokens)]
            row += f" {base_n:,.0f} | {totals[('this', family, tokens)] / base_n:.3f} |"
        print(row)


if __name__ == "__main__":
    main()
