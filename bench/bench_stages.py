"""Where a request's time goes inside ``mmadmit serve``: a diagnostic for issue #18. Not a test.

    python bench/bench_stages.py [--pairs 300] [--cells qwen3_omni_moe:32768,...]

Per cell (``bench/workloads.py``'s request, every hash supplied), one mmadmit
ZMQ server as ``bench_zmq.py`` runs it, with timers around its stages
(``time.perf_counter`` in wrappers set at start-up, about 0.2 us each), and one
reply echo; the client runs ``--pairs`` pairs (one mmadmit round trip, then
one echo round trip, as ``bench_zmq.py --only excess`` does). The server's
stages, median ms per request:

* ``decode``: ``wire.decode_message`` (payload split, token ids, items);
* ``materialize``: ``Materializer.run``, inline on the event loop here;
* ``encode``: ``wire.encode_materialized`` (the reply frames);
* ``send``: ``Reply.emit_now`` (the frames handed to libzmq; on 2 cores it
  also holds whatever time the woken I/O thread takes from this one, so it
  moves by 0.1-0.4 ms from run to run, in a reply echo too);
* ``handler``: the whole receive callback (``ZmqIngest._on_message``: all of
  the above plus admission, the pool's ticket and telemetry).

Beside each, the same stage in this process twice: warm (the same request's
frames decoded, materialized and encoded back to back, no sockets, nothing
else running), and paused (the same, with the server's median idle gap between
two requests slept before each iteration). A ratio well above 1 against warm
is the price of the machine's state after an idle gap: between two requests
the client and the echo run, the core sleeps in epoll, and the server's caches,
TLB and branch history are no longer its own. The ratio against paused is what
is left for the server itself to answer for (its sockets, its bookkeeping, and
output buffers that are not warm); about 1 means nothing.

Two more lines per cell: ``gap``, the server's median idle time between the end
of one request's handler and the start of the next; ``page faults``, the
minor page faults the event-loop thread takes inside one handler (median,
``getrusage(RUSAGE_THREAD)``): about 0 when every buffer a request writes
(padded ids, positions, the reply) reuses memory the allocator already holds
(``runtime.tune_allocator``). A stage shown ``-`` in the server did not run
on the event loop: the request's estimated cost was over ``--inline-max-us``
on this machine, so it was materialized on a worker and its reply left
through the awaited path.

A last line times the core itself after an idle gap: a loop of Python integer
arithmetic that touches no memory beyond a few objects (so nothing a cache
could lose), back to back, after sleeping the cells' median gap, and after
spinning for it instead. Slower after the sleep but not after the spin: the
price is the core's state after it slept (its clock and power state, the
virtual CPU's wake-up), paid by every instruction, not by the server's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STAGES = ("decode", "materialize", "encode", "send", "handler")
DEFAULT_CELLS = "qwen3_5:8192,qwen3_omni_moe:8192,qwen3_omni_moe:32768,qwen3_omni_moe:131072"


def _timed(owner: Any, name: str, samples: list[float]) -> None:
    """Replace ``owner.name`` by a wrapper that appends each call's seconds."""
    fn = getattr(owner, name)
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            samples.append(clock() - t0)

    setattr(owner, name, wrapper)


def _idle_and_faults(owner: Any, name: str, samples: dict[str, list[float]]) -> None:
    """Wrap ``owner.name`` (the handler) to record the idle gap before each call
    (s, since the previous call returned) and the minor page faults this thread
    takes during it."""
    fn = getattr(owner, name)
    clock = time.perf_counter
    usage = resource.getrusage
    thread = resource.RUSAGE_THREAD
    gaps = samples.setdefault("gap", [])
    faults = samples.setdefault("page faults", [])
    last = [0.0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        f0 = usage(thread).ru_minflt
        if last[0]:
            gaps.append(t0 - last[0])
        try:
            return fn(*args, **kwargs)
        finally:
            faults.append(usage(thread).ru_minflt - f0)
            last[0] = clock()

    setattr(owner, name, wrapper)


def serve_staged(model: str, out_path: str) -> None:
    """``bench_zmq``'s mmadmit server with stage timers; SIGUSR1 writes them to
    ``out_path`` (JSON, seconds per call) and exits."""
    import bench_zmq
    from mmadmit import materializer, wire, zmq_ingest, zmq_output

    samples: dict[str, list[float]] = {stage: [] for stage in STAGES}
    _timed(wire, "decode_message", samples["decode"])
    _timed(materializer.Materializer, "run", samples["materialize"])
    _timed(wire, "encode_materialized", samples["encode"])
    _timed(zmq_output.Reply, "emit_now", samples["send"])
    _timed(zmq_ingest.ZmqIngest, "_on_message", samples["handler"])
    _idle_and_faults(zmq_ingest.ZmqIngest, "_on_message", samples)

    def dump(*_: Any) -> None:
        Path(out_path).write_text(json.dumps(samples))
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    bench_zmq.serve("mmadmit", 2, model)


def in_process(family: str, tokens: int, pause_s: float = 0.0, n: int = 200) -> dict[str, float]:
    """Median seconds of decode, materialize and encode of the cell's request: warm
    (back to back), or after ``pause_s`` of sleep before each iteration."""
    import workloads
    import zmq
    from mmadmit import wire
    from mmadmit.runtime import tune_process

    tune_process()
    limits, mat, sent = workloads.staged(family, tokens)  # the excess cells' request
    frames = [zmq.Frame(f) for f in sent]  # as the service receives them
    times: dict[str, list[float]] = {"decode": [], "materialize": [], "encode": []}
    clock = time.perf_counter
    for i in range(n + 20):
        if pause_s:
            time.sleep(pause_s)
        t0 = clock()
        msg = wire.decode_message(frames, limits)
        t1 = clock()
        assert msg.request is not None
        outcome = mat.run(msg.request)
        t2 = clock()
        wire.encode_materialized(outcome)  # type: ignore[arg-type]
        t3 = clock()
        if i >= 20:
            times["decode"].append(t1 - t0)
            times["materialize"].append(t2 - t1)
            times["encode"].append(t3 - t2)
    return {k: statistics.median(v) for k, v in times.items()}


def _spin_loop() -> int:
    """Integer arithmetic only: the probe of :func:`core_after_idle`."""
    x = 0
    for i in range(3000):
        x ^= i * 7
    return x


def core_after_idle(gap_s: float, n: int = 200) -> tuple[float, float, float]:
    """Median seconds of :func:`_spin_loop`: right after another run (back to back),
    after sleeping ``gap_s``, and after spinning ``gap_s`` (busy, no sleep) instead;
    the three interleaved, so that a drift of the machine hits them alike."""
    clock = time.perf_counter
    times: tuple[list[float], list[float], list[float]] = ([], [], [])
    for k in range(n + 10):
        for mode in range(3):
            if mode == 0:
                _spin_loop()  # the run before: no gap
            elif mode == 1:
                time.sleep(gap_s)
            else:
                t = clock()
                while clock() - t < gap_s:
                    pass
            t0 = clock()
            _spin_loop()
            if k >= 10:
                times[mode].append(clock() - t0)
    warm, slept, spun = (statistics.median(t) for t in times)
    return warm, slept, spun


def measure(family: str, tokens: int, pairs: int) -> tuple[dict[str, float | None], float]:
    """The staged server's median seconds per stage for ``pairs`` recorded pairs,
    and the median excess (s) of those pairs."""
    import bench_zmq

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "stages.json")
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-staged", family, out_path],
            stdout=subprocess.PIPE,
            text=True,
        )
        echo = None
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            if not line or line[0] != "READY":
                raise SystemExit(f"{family}: the staged server did not start")
            echo = bench_zmq.ServerProcess("reply-echo", 2, family)
            template = bench_zmq.excess_request(family, tokens, True)
            cell = bench_zmq.ExcessCell(family, tokens, True, template, [], [])
            client = bench_zmq.ExcessClient({family: (line[1], echo.endpoint)})
            try:
                client.warm_up(cell)
                client.pairs(cell, 20, record=False)
                client.pairs(cell, pairs)
            finally:
                client.close()
            proc.send_signal(signal.SIGUSR1)
            proc.wait(30)
            samples = json.loads(Path(out_path).read_text())
        finally:
            if echo is not None:
                echo.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    medians = {
        stage: statistics.median(samples[stage][-pairs:]) if samples[stage] else None
        for stage in (*STAGES, "gap", "page faults")
    }
    return medians, cell.excess_ms / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=300, help="recorded pairs per cell")
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="family:tokens,...")
    parser.add_argument("--serve-staged", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_staged:
        serve_staged(*args.serve_staged)
        return
    t0 = time.monotonic()
    print(
        "stages of `mmadmit serve` (ZMQ, hashes supplied), median ms per request; in process: "
        "the same stage back to back (warm), and after sleeping the server's median idle gap "
        f"(paused); {args.pairs} pairs per cell\n"
    )
    cols = ("family", "tokens", "stage", "in server", "warm", "server / warm", "paused")
    print("| " + " | ".join(cols) + " | server / paused |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.3f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a / b:.2f}"

    gaps: list[float] = []
    for cell in args.cells.split(","):
        family, tokens_s = cell.split(":")
        tokens = int(tokens_s)
        served, excess = measure(family, tokens, args.pairs)
        gap = served["gap"] or 0.0
        warm = in_process(family, tokens)
        paused = in_process(family, tokens, gap)
        for stage in STAGES:
            s, w, p = served[stage], warm.get(stage), paused.get(stage)
            print(
                f"| {family} | {tokens} | {stage} | {ms(s)} | {ms(w)} | {ratio(s, w)} "
                f"| {ms(p)} | {ratio(s, p)} |"
            )
        print(f"| {family} | {tokens} | excess (pairs) | {ms(excess)} | | | | |")
        print(f"| {family} | {tokens} | gap (idle before a request) | {ms(gap)} | | | | |")
        faults = served["page faults"]
        shown = "-" if faults is None else f"{faults:.0f}"
        print(f"| {family} | {tokens} | page faults a request | {shown} | | | | |")
        gaps.append(gap)
    gap = statistics.median(gaps)
    warm_s, slept_s, spun_s = core_after_idle(gap)
    print(
        f"\nthe core after an idle gap of {gap * 1e3:.1f} ms (the cells' median; a "
        f"3,000-step Python integer loop, no memory): back to back {warm_s * 1e6:.0f} us, "
        f"after sleeping the gap {slept_s * 1e6:.0f} us ({slept_s / warm_s:.2f}x), after "
        f"spinning it {spun_s * 1e6:.0f} us ({spun_s / warm_s:.2f}x)"
    )
    print(f"\ncommand: python bench/bench_stages.py; total {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
