"""``make smg-demo``: the real SMG in front of mmadmit's SMG gRPC face, on this machine.

    python scripts/smg_demo.py                      # the whole demo
    python scripts/smg_demo.py --make-model-dir DIR # only step 1: a tiny model folder in DIR

The steps, each also a command of docs/smg-grpc.md ("By hand"):

1. a tiny, weight-less Qwen2.5-VL model folder (config, tokenizer, chat template,
   preprocessor config; ``tests/smg_gateway.py``'s ``make_model_dir``) in a
   temporary directory;
2. ``mmadmit serve --smg-grpc-listen ... --engine-handshake-listen ...`` and the
   project's test scheduler (``tests/engine_peers.py scheduler``, which answers
   every request as TokenSpeed's scheduler does) on loopback ephemeral ports;
3. ``smg launch --backend tokenspeed --worker-urls grpc://... --prometheus-host
   127.0.0.1 ...`` (the harness's ``SmgGateway``), waiting until SMG lists the model;
4. a text completion (``POST /v1/completions``) through SMG, response printed;
5. a chat with an image (``POST /v1/chat/completions``), response printed;
6. mmadmit's ``/metrics``: the ``mmadmit_requests_total{transport="smg_grpc"}`` lines;
7. SMG, mmadmit and the scheduler stopped (SIGTERM, then SIGKILL).

It exits 0 when every step passed. Otherwise it prints the tails of the logs and
then one line, ``smg-demo: step N (WHAT) failed: WHY``, and exits 1; its
processes are stopped either way. Every address is 127.0.0.1. Needs the test
extra (``make setup``) and ``smg==1.13.0`` (``make smg-demo`` installs it when
missing).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = REPO_ROOT / "tests"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import smg_gateway as g  # noqa: E402  (tests/smg_gateway.py: one harness for tests and demo)
from conftest import free_ports  # noqa: E402

FAMILY = "qwen2_5_vl"
READY_TIMEOUT_S = 60.0
# the SMG face's own series printed in step 6 (besides mmadmit_requests_total)
FACE_SERIES = (
    "mmadmit_smg_grpc_scheduler_up",
    "mmadmit_smg_grpc_generate_calls_total",
    "mmadmit_smg_grpc_adds_sent_total",
    "mmadmit_smg_grpc_completes_total",
    "mmadmit_smg_grpc_aborts_sent_total",
)


class StepFailed(Exception):
    def __init__(self, step: int, what: str, why: str) -> None:
        super().__init__(f"smg-demo: step {step} ({what}) failed: {why}")


def say(text: str) -> None:
    print(f"smg-demo: {text}", flush=True)


class Child:
    """One child process whose stdout and stderr go to a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        say(f"starting {name}: {shlex.join(cmd)}")
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=REPO_ROOT, start_new_session=True,
            )  # fmt: skip

    def lines(self) -> list[str]:
        try:
            return self.log.read_text("utf-8", "replace").splitlines()
        except FileNotFoundError:
            return []

    def wait_line(self, prefix: str, timeout_s: float) -> str:
        """The first log line starting with *prefix*; fails if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.lines():
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} printed no {prefix!r} line in {timeout_s:.0f} s")
            time.sleep(0.05)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}")

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, SIGKILL after *timeout_s*; the exit status."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.lines()[-n:])


def http_json(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One HTTP request to 127.0.0.1:*port*; (status, the decoded JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode("utf-8", "replace")


def http_text(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode("utf-8", "replace")
    finally:
        conn.close()


def show(title: str, status: int, doc: Any) -> None:
    print(f"--- {title}: HTTP {status}", flush=True)
    print(json.dumps(doc, indent=2) if not isinstance(doc, str) else doc, flush=True)


class Demo:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.children: list[Child] = []
        self.gateway: g.SmgGateway | None = None
        self.step = 0
        self.what = ""

    @contextlib.contextmanager
    def step_of(self, n: int, what: str) -> Iterator[None]:
        self.step, self.what = n, what
        say(f"step {n}: {what}")
        try:
            yield
        except StepFailed:
            raise
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StepFailed(n, what, why) from exc

    def start(self, name: str, cmd: list[str]) -> Child:
        child = Child(name, cmd, self.work / f"{name}.log")
        self.children.append(child)
        return child

    def run(self) -> None:
        with self.step_of(1, "make the model folder"):
            model = g.make_model_dir(self.work, FAMILY)
            say(f"model folder {model}")

        with self.step_of(2, "start mmadmit and the test scheduler"):
            face, handshake, metrics = free_ports(3)
            mmadmit = self.start("mmadmit", [
                sys.executable, "-m", "mmadmit", "serve", "--model", str(model),
                "--smg-grpc-listen", f"127.0.0.1:{face}",
                "--engine-handshake-listen", f"tcp://127.0.0.1:{handshake}",
                "--metrics-listen", f"127.0.0.1:{metrics}",
                "--grpc-listen", "off", "--zmq-listen", "off",
                "--device", "cpu", "--workers", "1",
            ])  # fmt: skip
            mmadmit.wait_line("mmadmit engine-handshake ", READY_TIMEOUT_S)
            scheduler = self.start("scheduler", [
                sys.executable, str(TESTS_DIR / "engine_peers.py"), "scheduler",
                "--handshake", f"tcp://127.0.0.1:{handshake}",
            ])  # fmt: skip
            ready = mmadmit.wait_line("mmadmit ready ", READY_TIMEOUT_S)
            say(ready)
            scheduler.check_alive()

        with self.step_of(3, "start SMG"):
            self.gateway = g.SmgGateway(
                model,
                worker_urls=[f"grpc://127.0.0.1:{face}"],
                work_dir=self.work / "smg",
                ready_timeout=READY_TIMEOUT_S,
            )
            say("starting SMG (smg launch; its HTTP and metrics ports are chosen at start)")
            self.gateway.start()
            say(f"started SMG: {shlex.join(self.gateway.command())}")
            say(f"SMG ready on {self.gateway.base_url}, model id {self.gateway.model_id}")
        gw = self.gateway
        model_id = gw.model_id

        with self.step_of(4, "text completion"):
            body: dict[str, Any] = {
                "model": model_id,
                "prompt": "The capital of France is",
                "max_tokens": 16,
            }
            status, doc = http_json(gw.port, "POST", "/v1/completions", body)
            show("text completion: POST /v1/completions", status, doc)
            if status != 200 or not isinstance(doc, dict) or not doc.get("choices"):
                raise RuntimeError(f"HTTP {status}: {json.dumps(doc)[:300]}")

        with self.step_of(5, "image chat"):
            message = g.user_message(g.image_part(g.png_data_url(64, 64, 1)), "What is it?")
            body = {"model": model_id, "messages": [message], "max_tokens": 16}
            status, doc = http_json(gw.port, "POST", "/v1/chat/completions", body)
            show("image chat: POST /v1/chat/completions", status, doc)
            if status != 200 or not isinstance(doc, dict) or not doc.get("choices"):
                raise RuntimeError(f"HTTP {status}: {json.dumps(doc)[:300]}")

        with self.step_of(6, "read mmadmit's /metrics"):
            text = http_text(metrics, "/metrics")
            lines = [
                line
                for line in text.splitlines()
                if line.startswith("mmadmit_requests_total") and 'transport="smg_grpc"' in line
            ]
            counted = [ln for ln in lines if float(ln.rsplit(" ", 1)[1]) > 0]
            face_lines = [ln for ln in text.splitlines() if ln.split(" ")[0] in FACE_SERIES]
            print(
                f"--- mmadmit /metrics (127.0.0.1:{metrics}): smg_grpc requests, the face's state"
            )
            print("\n".join(counted + face_lines), flush=True)
            missing = set(FACE_SERIES) - {ln.split(" ")[0] for ln in face_lines}
            if missing:
                raise RuntimeError(f"series missing from /metrics: {sorted(missing)}")
            done = [ln for ln in counted if 'outcome="materialized"' in ln]
            if sum(float(ln.rsplit(" ", 1)[1]) for ln in done) != 2:
                raise RuntimeError(f"not 2 materialized smg_grpc requests: {counted}")

        with self.step_of(7, "stop SMG, mmadmit and the scheduler"):
            self.stop_all()
            codes = {c.name: c.proc.returncode for c in self.children}
            say(f"stopped: {codes}")
            if codes.get("mmadmit") != 0:
                raise RuntimeError(f"mmadmit exited {codes.get('mmadmit')}, not 0")

    def stop_all(self) -> None:
        """SMG first, then mmadmit (it drains), then the scheduler behind it."""
        if self.gateway is not None:
            self.gateway.stop()
        for child in self.children:
            if child.name == "mmadmit":
                child.stop()
        for child in self.children:
            child.stop()

    def tails(self) -> None:
        logs: list[tuple[str, Callable[[], str]]] = [(c.name, c.tail) for c in self.children]
        if self.gateway is not None:
            logs.append(("smg", self.gateway.log_tail))
        for name, tail in logs:
            with contextlib.suppress(Exception):
                print(f"--- {name} log (tail) ---\n{tail()}", file=sys.stderr, flush=True)


def fail(line: str) -> NoReturn:
    print(line, file=sys.stderr, flush=True)
    sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--make-model-dir",
        metavar="DIR",
        help="only write the tiny model folder (Qwen2.5-VL-tiny) under DIR, print its path",
    )
    args = parser.parse_args(argv)
    if args.make_model_dir:
        print(g.make_model_dir(Path(args.make_model_dir), FAMILY).resolve())
        return 0
    if not g.have_smg():
        fail("smg-demo: step 3 (start SMG) failed: no smg binary (pip install smg==1.13.0)")
    with tempfile.TemporaryDirectory(prefix="smg-demo-") as td:
        demo = Demo(Path(td))
        # SIGTERM (a timeout's kill) ends the demo through the same cleanup as a failure
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            demo.run()
        except StepFailed as exc:
            demo.stop_all()
            demo.tails()
            fail(str(exc))
        except BaseException:
            demo.stop_all()
            raise
    say("done: both requests answered through SMG -> mmadmit -> scheduler")
    return 0


if __name__ == "__main__":
    sys.exit(main())
