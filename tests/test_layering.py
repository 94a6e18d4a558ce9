"""The module graph keeps its layers: checked in a fresh interpreter per case.

* the configuration and the materializer know no wire: importing
  ``mmadmit.config`` or ``mmadmit.materializer`` loads no codec
  (``mmadmit.intcodec``, ``mmadmit.wire``, ``mmadmit.pbwire``, the C codecs);
* ``mmadmit.security`` reads files for any object with its settings and imports
  nothing of the configuration (the ``config`` <-> ``security`` cycle is gone);
* no module of the service imports, at any depth, one that imports it back.

Run with: python -m pytest tests/test_layering.py -q -p no:cacheprovider
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

CODECS = {
    "mmadmit.intcodec",
    "mmadmit.wire",
    "mmadmit.pbwire",
    "mmadmit.msgpack_walk",
    "mmadmit._walk_c",
    "mmadmit._pbwire",
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
