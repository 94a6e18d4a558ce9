"""What a new user meets first (issue 34): ``mmadmit-client``'s output and the
server's shutdown line.

Contract pinned here:

* a ``bench`` run is headed by its status, outcomes by code, in the table and
  the plot: a run whose every request was aborted (requests of another
  profile than the server's, 100% ``INVALID_REQUEST``) says ``ALL ABORTED``
  in red, never just "N outcomes, R/s"; a run with some aborts says which
  share, in orange; and the plot has a panel of outcomes by code;
* readable output on a pipe with no terminal (and no ``COLUMNS``) is not
  wrapped at rich's fallback of 80 columns, and with a width too narrow for a
  table the table is drawn wider than the width rather than a number split
  over two lines or cut short with an ellipsis;
* the README's and ``clients/README.md``'s lists of the client's dependencies
  are ``clients/pyproject.toml``'s;
* the server's ``[shutdown] done`` line counts the requests the transports
  answered: 0 after a start and stop with no traffic (the start-up's warm-up
  request is no traffic), and each request a client sent otherwise.

The server of the client tests is the real wiring (``mmadmit.server.start_server``)
in this process, on the built-in default profile (Qwen2.5-VL, what ``make run``
serves); the commands run as subprocesses awaited with asyncio, with stdout and
stderr pipes and no terminal. The shutdown line is read from a real
``mmadmit serve`` process (``test_server_lifecycle.serve``).

Run with: ``.venv/bin/python -m pytest -q tests/test_client_polish.py``
"""

from __future__ import annotations

import collections
import io
import json
import re
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from client_helpers import run_cli
from conftest import REPO_ROOT, serving
from mmadmit.server import ServerHandle
from mmadmit_client._bench import BenchReport, BenchSettings, plot_figure, render_report
from rich.console import Console
from test_server_lifecycle import EPHEMERAL, serve

EXAMPLES = REPO_ROOT / "examples"
ON_DEFAULT = EXAMPLES / "request_qwen2_5_vl.json"  # materializes on the default profile
OTHER_PROFILE = EXAMPLES / "request_qwen3_5.json"  # Qwen3.5 ids: aborted there
MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(120)


async def client(*args: str, columns: int | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``mmadmit-client ARGS`` (:func:`run_cli`: no
    terminal, ``COLUMNS`` set only when ``columns`` is given)."""
    run = await run_cli(*args, columns=columns)
    return run.rc, run.stdout, run.stderr


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[ServerHandle]:
    """The default profile (no ``--model``), as ``make run`` serves it."""
    async with serving() as handle:
        yield handle


def _report(codes: dict[str, int], errors: dict[str, int] | None = None) -> BenchReport:
    report = BenchReport(
        "tcp://127.0.0.1:5557", "zmq", ["a.frames"], BenchSettings(8, duration_s=10.0)
    )
    n = 0
    for code, count in codes.items():
        for _ in range(count):
            report.samples.append((n / 1000, 6.84, code))
            n += 1
    report.errors = collections.Counter(errors or {})
    report.sent = n + sum(report.errors.values())
    report.elapsed_s = 10.0
    return report


def _rendered(report: BenchReport, width: int = 120) -> str:
    buf = io.StringIO()
    render_report(report, Console(file=buf, width=width, highlight=False, color_system=None))
    return buf.getvalue()


# --------------------------------------------------------------------------- bench status


def test_an_all_aborted_run_says_so_in_its_title_and_colour() -> None:
    """The user's run: 11,431 requests, every one ``INVALID_REQUEST``; before, the
    plot's title read "11431 outcomes, 1143/s" and nothing was red."""
    report = _report({"INVALID_REQUEST": 11431})
    status, level = report.status()
    assert status == "ALL ABORTED: 11431 outcomes, 1143/s (INVALID_REQUEST 11431)"
    assert level == "failed"
    assert report.aborted == 11431 and report.to_json()["aborted"] == 11431
    lines = _rendered(report).splitlines()
    assert lines[:2] == [
        "bench tcp://127.0.0.1:5557 (zmq): 10 s at concurrency 8, 1 file(s)",
        status,
    ]
    assert any(re.fullmatch(r"│ INVALID_REQUEST +│ +11431 │ +100\.0% │", ln) for ln in lines), lines

    import matplotlib.pyplot as plt

    fig = plot_figure(report)
    try:
        title = fig._suptitle  # type: ignore[attr-defined]
        assert title.get_text().splitlines()[1] == status
        assert title.get_color() == "#cc3311"  # red
        panels = {ax.get_title(): ax for ax in fig.axes}
        assert "outcomes by code" in panels
        labels = [t.get_text() for t in panels["outcomes by code"].get_yticklabels()]
        assert labels == ["INVALID_REQUEST"]
    finally:
        plt.close(fig)


def test_status_levels_name_every_code() -> None:
    ok = _report({"MATERIALIZED": 500})
    assert ok.status() == ("all materialized: 500 outcomes, 50/s (MATERIALIZED 500)", "ok")
    some = _report({"MATERIALIZED": 450, "OVERLOADED": 40, "INVALID_REQUEST": 10})
    assert some.status() == (
        "10.0% ABORTED: 500 outcomes, 50/s (MATERIALIZED 450, OVERLOADED 40, INVALID_REQUEST 10)",
        "aborts",
    )
    lost = _report({"MATERIALIZED": 97}, {"ServerUnavailable": 3})
    text, level = lost.status()
    assert level == "failed"
    assert text.endswith("; 3 without an outcome (ServerUnavailable 3)"), text
    assert _report({}).status()[0].startswith("NO OUTCOME: 0 outcomes")


@MODULE_LOOP
@pytest.mark.parametrize("transport", ["grpc", "zmq"])
async def test_bench_of_another_profiles_requests_is_all_aborted(
    transport: str, server: ServerHandle, tmp_path: Path
) -> None:
    """Qwen3.5 requests against the default (Qwen2.5-VL) server, as the user ran it."""
    target = (
        f"grpc://{server.addresses['grpc']}" if transport == "grpc" else server.addresses["zmq"]
    )
    args = ("bench", target, str(OTHER_PROFILE), "--requests", "20", "--concurrency", "2")
    rc, out, err = await client(*args, "--no-progress")
    assert rc == 0, err  # every request got an outcome: an abort is one
    lines = out.splitlines()
    assert lines[1] == "ALL ABORTED: 20 outcomes, " + lines[1].split(", ", 1)[1], out
    assert lines[1].endswith("/s (INVALID_REQUEST 20)"), out
    rc, out, err = await client(*args, "--json", "--plot", str(tmp_path / "b.png"))
    doc = json.loads(out)
    assert doc["outcomes"] == {"INVALID_REQUEST": 20} and doc["aborted"] == 20, doc
    assert doc["status"].startswith("ALL ABORTED: 20 outcomes"), doc
    assert (tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


# --------------------------------------------------------------------------- width


@MODULE_LOOP
async def test_piped_output_is_not_wrapped_at_80_columns(server: ServerHandle) -> None:
    """No terminal, no COLUMNS: the outcome line stays one line, whatever its length
    (before: broken at column 80, e.g. between ``6.84`` and ``ms``)."""
    rid = "a-long-request-id-" + "x" * 90
    target = f"grpc://{server.addresses['grpc']}"
    rc, out, err = await client("admit", target, str(ON_DEFAULT), "--rid", rid)
    assert rc == 0, err
    first = out.splitlines()[0]
    assert re.fullmatch(rf"MATERIALIZED  rid={rid}  {re.escape(target)}  \d+\.\d\d ms", first), out


@MODULE_LOOP
@pytest.mark.parametrize("columns", [None, 30])
async def test_a_table_never_splits_a_number(columns: int | None, server: ServerHandle) -> None:
    """A bench table too wide for the width is drawn wider than it: every number whole
    (before, at 30 columns: ``3…``, or ``34`` / ``5`` over two lines)."""
    rc, out, err = await client(
        "bench", server.addresses["zmq"], str(ON_DEFAULT), "--requests", "345",
        "--concurrency", "8", "--no-progress", columns=columns,
    )  # fmt: skip
    assert rc == 0, err
    assert "…" not in out, out
    v = "[│|]"  # (rich's ASCII box on an output that cannot encode its lines)
    row = re.compile(rf"{v} +345 {v} +345 {v} +0 {v} +0 {v} +0 {v} +\d+\.\d\d {v} +\d+\.\d {v}")
    assert any(row.fullmatch(line) for line in out.splitlines()), out
    assert "sent 345, received 345: every request got exactly one outcome" in out, out


# --------------------------------------------------------------------------- README


def _names(text: str) -> set[str]:
    return {w for w in re.split(r",\s*|\s+and\s+", " ".join(text.split())) if w}


def test_readme_lists_the_clients_dependencies() -> None:
    project = tomllib.loads((REPO_ROOT / "clients" / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0] for dep in project["dependencies"]}
    readme = (REPO_ROOT / "README.md").read_text()
    m = re.search(r"\(`pip install \./clients`:\s*(.*?);", readme, flags=re.S)
    assert m, "README.md: no `pip install ./clients`: <dependencies>; in the Library section"
    assert _names(m.group(1)) == declared
    client_readme = (REPO_ROOT / "clients" / "README.md").read_text()
    m = re.search(r"It depends on (.*?) only", client_readme, flags=re.S)
    assert m, "clients/README.md: no 'It depends on ... only'"
    assert _names(m.group(1)) == declared


# --------------------------------------------------------------------------- shutdown line


def _done_line(lines: list[str]) -> str:
    (line,) = [ln for ln in lines if "[shutdown] done:" in ln]
    return line


async def test_shutdown_line_counts_no_warm_up() -> None:
    """Start, stop, no traffic: 0 answered (before: "1 admitted", the warm-up)."""
    with serve(*EPHEMERAL, "--workers", "1") as srv:
        await srv.wait_ready()
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr
    expected = (
        "[shutdown] done: 0 request(s) answered (0 materialized, 0 aborted), "
        "0 ended SHUTTING_DOWN by the drain deadline"
    )
    assert expected in _done_line(srv.lines), srv.stderr


async def test_shutdown_line_counts_each_request_answered() -> None:
    with serve(*EPHEMERAL, "--workers", "1") as srv:  # Qwen3.5
        addr = await srv.wait_ready()
        runs = [
            await client("admit", f"grpc://{addr['grpc']}", str(OTHER_PROFILE)),
            await client("admit", addr["zmq"], str(OTHER_PROFILE)),
            await client("admit", addr["zmq"], str(ON_DEFAULT)),
        ]
        assert [rc for rc, _, _ in runs[:2]] == [0, 0], runs
        assert runs[2][0] in (0, 1), runs  # materialized or aborted: an outcome either way
        srv.send()
        assert (await srv.wait_exit(20))[0] == 0, srv.stderr
    aborted = runs[2][0]
    expected = f"3 request(s) answered ({3 - aborted} materialized, {aborted} aborted)"
    assert expected in _done_line(srv.lines), srv.stderr
