"""The README says what the code does: its configuration table, and every example in
it and in ``docs/*.md``, are checked against the real thing.

* the configuration table is the one ``scripts/config_table.py`` makes from
  ``ServeConfig``, and lists exactly the flags ``mmadmit serve --help`` shows;
* every ``mmadmit-client`` command in a ``sh`` block runs as written against a
  live ``mmadmit serve`` of the **default profile** (what ``make run`` serves),
  but for the addresses (the documented loopback ones become the test server's
  ephemeral ones) and a shorter ``bench --duration``; a command whose comment
  names ``--model X`` runs against a server of that profile instead. Each must
  exit 0 and materialize (``bench``: every request materialized). A command that
  targets another host (a deployment, TLS or CURVE material) cannot run here: its
  arguments must parse and its request file must be one that the default profile
  materializes (``examples/request_qwen2_5_vl.json``);
* every Python block that names the default addresses runs, unchanged but for the
  addresses, against a default-profile server and gets materialized outcomes on
  both transports; any other Python block (a fragment with ``...``) compiles and
  its imports resolve;
* every JSON request example (a ``json`` block with ``"input_ids"``) is admitted by
  ``mmadmit-client`` over both transports on a default-profile server.

Run with: ``.venv/bin/python -m pytest -q tests/test_docs.py``
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_server_lifecycle import EPHEMERAL, ServeProcess, serve

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import config_table  # noqa: E402  (scripts/ is not a package)

README = (REPO_ROOT / "README.md").read_text()
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
GRPC_DEFAULT, ZMQ_DEFAULT = "127.0.0.1:50051", "tcp://127.0.0.1:5557"
CLIENT = "mmadmit-client"
BENCH_SECONDS = "1"  # the examples' `bench --duration N`, shortened
pytestmark = pytest.mark.timeout(300)


def _default_model() -> str:
    """The default ``--model`` (what ``make run`` serves), read from the generated table."""
    m = re.search(
        r"^\| `--model VALUE` \| `MMADMIT_MODEL` \| `([^`]+)`", config_table.table(), re.M
    )
    assert m, "the configuration table has no --model row"
    return m.group(1)


DEFAULT_MODEL = _default_model()


def fenced(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def doc_blocks(language: str) -> Iterator[tuple[str, str]]:
    """(document name, block) for every ``language`` block of README.md and docs/*.md."""
    for doc in DOCS:
        for block in fenced(language, doc.read_text()):
            yield doc.relative_to(REPO_ROOT).as_posix(), block


@dataclass(frozen=True)
class ClientExample:
    doc: str
    command: str  # as written, continuation lines joined, comment included
    argv: list[str]  # the words before the comment, `mmadmit-client` first
    model: str  # the profile its server must serve

    @property
    def local(self) -> bool:
        """Targets the documented loopback addresses, that is, a `make run` server."""
        return any(w.startswith(("grpc://" + GRPC_DEFAULT, ZMQ_DEFAULT)) for w in self.argv)


def client_examples() -> list[ClientExample]:
    found = []
    for doc, block in doc_blocks("sh"):
        for command in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(command, comments=True)
            if not argv or Path(argv[0]).name != CLIENT:
                continue
            m = re.search(r"#.*--model\s+(\S+)", command)
            found.append(ClientExample(doc, command, argv, m.group(1) if m else DEFAULT_MODEL))
    return found


EXAMPLES = client_examples()


def test_the_default_profile_is_what_make_run_serves() -> None:
    assert DEFAULT_MODEL == "qwen2_5_vl"
    assert "make run" in README and f"default profile ({DEFAULT_MODEL})" in README
    assert [e for e in EXAMPLES if e.local], "no mmadmit-client example found"


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


# --------------------------------------------------------------------------- live servers


def _serve(model: str) -> AbstractContextManager[ServeProcess]:
    # serve() puts the lifecycle tests' --model first; this later one wins.
    return serve("--model", model, *EPHEMERAL, "--workers", "1")


def _localize(text: str, addr: dict[str, str]) -> str:
    return (
        text.replace("grpc://" + GRPC_DEFAULT, "grpc://" + addr["grpc"])
        .replace(GRPC_DEFAULT, addr["grpc"])
        .replace(ZMQ_DEFAULT, addr["zmq"])
    )


def _workdir(tmp_path: Path) -> Path:
    """A directory that looks like the repository root to a relative path (examples/,
    tests/), where the examples' own output files (reply.frames, bench.png) land."""
    work = tmp_path / "cwd"
    work.mkdir()
    for name in ("examples", "tests"):
        (work / name).symlink_to(REPO_ROOT / name)
    return work


async def _run_client_example(ex: ClientExample, addr: dict[str, str], cwd: Path) -> None:
    argv = [_localize(w, addr) for w in ex.argv]
    if "--duration" in argv:
        argv[argv.index("--duration") + 1] = BENCH_SECONDS
    if argv[1] == "bench":
        argv.append("--no-progress")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # the shell expands globs as it would for a reader pasting the line
    line = " ".join(shlex.quote(w) if "*" not in w else w for w in argv)
    run = await asyncio.to_thread(
        subprocess.run, ["bash", "-c", line], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    where = f"{ex.doc}: {ex.command.strip()}\n{run.stdout}\n{run.stderr}"
    assert run.returncode == 0, where
    if argv[1] == "admit":
        assert "MATERIALIZED" in run.stdout or '"status": "materialized"' in run.stdout, where
    if argv[1] == "bench":
        assert "all materialized" in run.stdout, where
    if argv[1] == "health":
        assert "SERVING" in run.stdout, where
    if "--out" in argv:
        assert (cwd / argv[argv.index("--out") + 1]).stat().st_size > 0, where
    if "--plot" in argv:
        assert (cwd / argv[argv.index("--plot") + 1]).stat().st_size > 0, where


@pytest.mark.parametrize("model", sorted({e.model for e in EXAMPLES if e.local}))
async def test_every_client_example_runs_against_its_profile(model: str, tmp_path: Path) -> None:
    examples = [e for e in EXAMPLES if e.local and e.model == model]
    cwd = _workdir(tmp_path)
    with _serve(model) as srv:
        addr = await srv.wait_ready()
        for ex in examples:
            await _run_client_example(ex, addr, cwd)
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr


def test_client_examples_for_other_hosts_parse_and_use_a_default_profile_request() -> None:
    from mmadmit_client.cli import build_parser

    remote = [e for e in EXAMPLES if not e.local]
    for ex in remote:
        args = build_parser().parse_args(ex.argv[1:])
        request = getattr(args, "file", None) or (getattr(args, "files", None) or [None])[0]
        if request is not None:
            assert (REPO_ROOT / request).is_file(), (ex.doc, ex.command)
            if ex.model == DEFAULT_MODEL:  # the request of the default profile
                assert Path(request).name == f"request_{DEFAULT_MODEL}.json", (ex.doc, ex.command)


def _python_examples() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    live: list[tuple[str, str]] = []
    fragments: list[tuple[str, str]] = []
    for doc, block in doc_blocks("python"):
        (live if GRPC_DEFAULT in block else fragments).append((doc, block))
    return live, fragments


async def test_python_examples_run_against_a_default_profile_server(tmp_path: Path) -> None:
    live, _ = _python_examples()
    assert any(doc == "README.md" for doc, _ in live), "the README has no Python example"
    with _serve(DEFAULT_MODEL) as srv:
        addr = await srv.wait_ready()
        for n, (doc, example) in enumerate(live):
            code = _localize(example, addr)
            assert code != example, "the example names the default addresses"
            script = tmp_path / f"example{n}.py"
            script.write_text(code)
            run = await asyncio.to_thread(
                subprocess.run, [sys.executable, str(script)], cwd=REPO_ROOT,
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert run.returncode == 0, (doc, run.stderr)
            if doc == "README.md":
                grpc_line, zmq_line = run.stdout.strip().splitlines()
                pad, delta, pad_value = grpc_line.split()
                assert int(pad) == int(pad_value) and int(delta) != 0  # substituted
                assert zmq_line == "Materialized MATERIALIZED"
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr


def test_python_fragments_compile_and_import() -> None:
    _, fragments = _python_examples()
    for doc, block in fragments:
        tree = compile(block, doc, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for node in tree.body:  # type: ignore[attr-defined]
            if isinstance(node, ast.ImportFrom | ast.Import):
                exec(compile(ast.Module([node], []), doc, "exec"), {})


async def test_json_requests_are_admitted_on_both_transports(tmp_path: Path) -> None:
    docs = [(doc, block) for doc, block in doc_blocks("json") if '"input_ids"' in block]
    assert any(doc == "README.md" for doc, _ in docs), "the README has no JSON request"
    client = [sys.executable, "-m", "mmadmit_client.cli"]
    with _serve(DEFAULT_MODEL) as srv:
        addr = await srv.wait_ready()
        for n, (doc, block) in enumerate(docs):
            request = tmp_path / f"request{n}.json"
            request.write_text(block)
            expected_rid = json.loads(block)["request_id"]
            for target in (f"grpc://{addr['grpc']}", addr["zmq"]):
                run = await asyncio.to_thread(
                    subprocess.run, [*client, "admit", target, str(request), "--json"],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                assert run.returncode == 0, (doc, target, run.stdout, run.stderr)
                out = json.loads(run.stdout)
                assert out["status"] == "materialized" and out["request_id"] == expected_rid
                assert out["items"][0]["hash"] is not None  # the service hashed the feature
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr
