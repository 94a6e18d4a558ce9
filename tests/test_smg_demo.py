"""``make smg-demo`` (scripts/smg_demo.py) runs end to end: the real SMG in front of
``mmadmit serve --smg-grpc-listen`` and the test scheduler, a text completion and a
Qwen2.5-VL image chat, both JSON responses printed, everything stopped, exit 0.
Its failure line names the step, and ``--make-model-dir`` writes the folder the
by-hand guide (docs/smg-grpc.md) uses.

Skips only where the ``smg`` binary cannot be found (``pip install smg==1.13.0``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import smg_gateway as g

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "smg_demo.py"
needs_smg = pytest.mark.skipif(
    not g.have_smg(), reason="the smg binary is not installed (pip install smg==1.13.0)"
)


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=None if env is None else {**os.environ, **env},
    )


def printed_json(stdout: str, title: str) -> Any:
    """The JSON document printed after the ``--- TITLE...`` line."""
    head = next(i for i, line in enumerate(stdout.splitlines(True)) if line.startswith(title))
    rest = "".join(stdout.splitlines(True)[head + 1 :])
    doc, _ = json.JSONDecoder().raw_decode(rest)
    return doc


@needs_smg
def test_demo_runs_end_to_end_and_prints_both_responses() -> None:
    done = run_demo()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    text = printed_json(done.stdout, "--- text completion: POST /v1/completions: HTTP 200")
    assert text["object"] == "text_completion"
    assert text["choices"][0]["finish_reason"] == "stop"
    chat = printed_json(done.stdout, "--- image chat: POST /v1/chat/completions: HTTP 200")
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert (
        'mmadmit_requests_total{code="OK",outcome="materialized",transport="smg_grpc"} 2.0'
        in done.stdout
    )
    assert "smg-demo: done" in done.stdout
    assert "--prometheus-host 127.0.0.1" in done.stdout


def test_demo_failure_names_the_step_and_stops_its_processes() -> None:
    # an "smg" that exits at once: step 3 fails, mmadmit and the scheduler are stopped
    done = run_demo(env={g.SMG_BINARY_ENV: "/bin/false"})
    assert done.returncode == 1, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("smg-demo: step 3 (start SMG) failed: SMG exited"), done.stderr
    assert "smg-demo: stopped" not in done.stdout
    for name in ("mmadmit", "scheduler"):
        assert f"--- {name} log (tail) ---" in done.stderr
    # mmadmit was stopped by the demo (SIGTERM: its drain ran to the end)
    assert "[shutdown] done" in done.stderr


def test_make_model_dir_writes_the_tiny_folder(tmp_path: Path) -> None:
    done = run_demo("--make-model-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    assert folder == (tmp_path / "Qwen2.5-VL-tiny").resolve()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    assert (folder / "preprocessor_config.json").is_file()
