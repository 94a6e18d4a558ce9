"""The README says what the code does: its configuration table, its Python example
and its JSON request are checked against the real thing.

* the configuration table is the one ``scripts/config_table.py`` makes from
  ``ServeConfig``, and lists exactly the flags ``mmadmit serve --help`` shows;
* the Python example runs, unchanged but for the addresses, against a live
  ``mmadmit serve`` and gets materialized outcomes on both transports;
* the JSON request example is admitted by ``mmadmit-client`` over both transports.

Run with: ``.venv/bin/python -m pytest -q tests/test_docs.py``
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_server_lifecycle import EPHEMERAL, serve

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import config_table  # noqa: E402  (scripts/ is not a package)

README = (REPO_ROOT / "README.md").read_text()
pytestmark = pytest.mark.timeout(120)


def fenced(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_config_table_is_current_and_matches_serve_help() -> None:
    assert config_table.readme_table(README) == config_table.table(), (
        "README.md's configuration table is stale: python scripts/config_table.py --write"
    )
    help_text = subprocess.run(
        [sys.executable, "-m", "mmadmit", "serve", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    in_help = set(re.findall(r"(--[a-z][a-z0-9-]+)", help_text)) - {"--help"}
    in_table = set(re.findall(r"^\| `(--[a-z0-9-]+)", config_table.table(), flags=re.M))
    assert in_table == in_help
    for flag in in_table:  # each row names the variable the flag reads
        env = "MMADMIT_" + flag[2:].upper().replace("-", "_")
        assert f"`{flag}" in README and f"`{env}`" in README, flag


async def test_readme_python_example_runs_against_a_live_server(tmp_path: Path) -> None:
    (example,) = [block for block in fenced("python") if "GrpcTransport(" in block]
    with serve(*EPHEMERAL, "--workers", "1") as srv:
        addr = await srv.wait_ready()
        code = example.replace("127.0.0.1:50051", addr["grpc"]).replace(
            "tcp://127.0.0.1:5557", addr["zmq"]
        )
        assert code != example, "the example names the default addresses"
        script = tmp_path / "example.py"
        script.write_text(code)
        run = await asyncio.to_thread(
            subprocess.run, [sys.executable, str(script)], cwd=REPO_ROOT,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        grpc_line, zmq_line = run.stdout.strip().splitlines()
        pad, delta, pad_value = grpc_line.split()
        assert int(pad) == int(pad_value) and int(delta) != 0  # substituted by the pad value
        assert zmq_line == "Materialized MATERIALIZED"
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr


async def test_readme_json_request_is_admitted_on_both_transports(tmp_path: Path) -> None:
    (doc,) = [block for block in fenced("json") if '"input_ids"' in block]
    request = tmp_path / "request.json"
    request.write_text(doc)
    json.loads(doc)
    client = [sys.executable, "-m", "mmadmit_client.cli"]
    with serve(*EPHEMERAL, "--workers", "1") as srv:
        addr = await srv.wait_ready()
        for target in (f"grpc://{addr['grpc']}", addr["zmq"]):
            run = await asyncio.to_thread(
                subprocess.run, [*client, "admit", target, str(request), "--json"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert run.returncode == 0, (target, run.stdout, run.stderr)
            out = json.loads(run.stdout)
            assert out["status"] == "materialized" and out["request_id"] == "readme-example"
            assert out["items"][0]["hash"] is not None  # the service hashed the feature
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr
