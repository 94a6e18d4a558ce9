"""The module graph keeps its layers: checked in a fresh interpreter per case.

* the configuration and the materializer know no wire: importing
  ``mmadmit.config`` or ``mmadmit.materializer`` loads no codec
  (``mmadmit.intcodec``, ``mmadmit.wire``, ``mmadmit.pbwire``, the C codecs);
* ``mmadmit.security`` reads files for any object with its settings and imports
  nothing of the configuration (the ``config`` <-> ``security`` cycle is gone);
* no module of the service imports, at any depth, one that imports it back;
* the server and the client are two distributions that ship no file twice, and
  the service uses only the client's public modules (no ``mmadmit_client._*``).

Run with: python -m pytest tests/test_layering.py -q -p no:cacheprovider
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

CODECS = {
    "mmadmit.intcodec",
    "mmadmit.wire",
    "mmadmit.pbwire",
    "mmadmit.msgpack_walk",
    "mmadmit._walk_c",
    "mmadmit.pbwalk",
    "mmadmit._pbwalk_c",
}


def loaded_after(module: str) -> set[str]:
    code = (
        "import json, sys, importlib; importlib.import_module(sys.argv[1]); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('mmadmit'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, module], capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", ["mmadmit.config", "mmadmit.materializer"])
def test_config_and_materializer_load_no_codec(module: str) -> None:
    assert not loaded_after(module) & CODECS, sorted(loaded_after(module) & CODECS)


def test_security_does_not_import_the_configuration() -> None:
    assert "mmadmit.config" not in loaded_after("mmadmit.security")


def _runtime_nodes(node: ast.AST) -> list[ast.AST]:
    """Every node under ``node`` but those of ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
            out += [n for stmt in child.orelse for n in [stmt, *_runtime_nodes(stmt)]]
            continue
        out += [child, *_runtime_nodes(child)]
    return out


def _imports(path: Path) -> set[str]:
    """The ``mmadmit`` modules ``path`` imports when it runs, at any depth of the file
    (a function-level import is a dependency too; a type checker's is not)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmadmit."):
            found.add(node.module.split(".")[1])  # type: ignore[union-attr]
    return found


def test_the_service_modules_import_no_cycle() -> None:
    package = Path(__file__).resolve().parent.parent / "service" / "mmadmit"
    graph = {p.stem: _imports(p) for p in package.glob("*.py")}
    graph = {m: deps & graph.keys() - {m} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


REPO = Path(__file__).resolve().parent.parent


def _client_modules_used(path: Path) -> set[str]:
    """The ``mmadmit_client`` modules ``path`` imports, at any depth of the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmadmit_client"):
            found.add(node.module)  # type: ignore[arg-type]
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mmadmit_client"))
    return found


def test_the_service_imports_only_the_clients_public_modules() -> None:
    used = {
        (path.name, module)
        for path in sorted((REPO / "service" / "mmadmit").glob("*.py"))
        for module in _client_modules_used(path)
    }
    assert used, "the service no longer uses the client at all: update this test"
    private = sorted((f, m) for f, m in used if any(p.startswith("_") for p in m.split(".")))
    assert not private, f"service modules import the client's private modules: {private}"


def test_the_two_distributions_ship_no_package_twice(tmp_path: Path) -> None:
    server = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    client = tomllib.loads((REPO / "clients" / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "mmadmit" or p.startswith("mmadmit.") for p in server["packages"])
    assert not set(server["packages"]) & set(client["packages"])
    assert set(server["package-dir"].values()) == {"service"}
    # The server's metadata as setuptools writes it (no extension is built): one
    # top-level package, and the client required from its folder beside it.
    run = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "MMADMIT_CLIENT_REQUIREMENT"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (info,) = tmp_path.glob("*.egg-info")
    assert (info / "top_level.txt").read_text().split() == ["mmadmit"]
    requires = (info / "requires.txt").read_text().splitlines()
    client_uri = (REPO / "clients").as_uri()
    assert f"mmadmit-client @ {client_uri}" in requires, requires
