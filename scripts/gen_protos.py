#!/usr/bin/env python3
"""Generate mmadmit's protobuf and gRPC Python code from ``protos/``.

The generated modules are build outputs, never committed, and live in one
place: the gitignored package directory ``clients/mmadmit_client/proto/`` of
the client distribution, a public module of it that the service (which
requires the client) imports too (``from mmadmit_client.proto import
admission_pb2``). ``clients/setup.py`` takes its build commands from
:func:`setuptools_cmdclass`, which calls :func:`generate` (for ``pip install``
and PEP 660 ``pip install -e`` alike). Run this script by hand to regenerate after
editing a ``.proto`` in a checkout that is already installed in editable mode::

    python scripts/gen_protos.py            # -> clients/mmadmit_client/proto/
    python scripts/gen_protos.py OUT_DIR    # anywhere else (tests use this)

For each ``protos/<pkg path>/<name>.proto`` this writes ``<name>_pb2.py``,
``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` flat into the output directory,
plus an ``__init__.py``, so the import path is
``from mmadmit_client.proto import admission_pb2, admission_pb2_grpc``. The protoc
imports between generated modules (``from mmadmit.v1 import admission_pb2``)
are rewritten to relative ones (``from . import admission_pb2``), the
message classes' ``__module__`` is set to the real module name, and every
file gets a ``# mypy: ignore-errors`` / do-not-edit header. The descriptor's
file name stays ``mmadmit/v1/admission.proto`` (what reflection reports).

Needs ``grpcio-tools`` (a build requirement in ``pyproject.toml``); nothing
outside the standard library is imported at module level, so ``setup.py`` can
import this file before the build requirements are known to be present.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT_DIR = ROOT / "clients" / "mmadmit_client" / "proto"

# Suffixes protoc writes per .proto with --python_out, --pyi_out, --grpc_python_out.
_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_INIT_TEXT = '''"""Protobuf and gRPC code generated from protos/ (see scripts/gen_protos.py).

Public modules of the client, which the service imports too: import them directly,
``from mmadmit_client.proto import admission_pb2, admission_pb2_grpc``.
"""
'''


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """All ``.proto`` files under ``proto_root``, relative to it, sorted."""
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def _tools_version() -> str:
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - vendored copy
        return "unknown"


def _header(proto: Path) -> str:
    return (
        "# mypy: ignore-errors\n"
        f"# Generated from protos/{proto.as_posix()} by scripts/gen_protos.py"
        f" (grpcio-tools {_tools_version()}); do not edit.\n"
        "# Regenerated at build time by setup.py; by hand: python scripts/gen_protos.py\n"
    )


def _relative_imports(text: str, packages: set[str], modules: set[str]) -> str:
    """Rewrite ``from <proto package> import <generated module>`` to ``from . import``.

    Only imports of modules generated in this run are touched; well-known types
    (``google.protobuf``) and grpc stay absolute.
    """
    pattern = re.compile(
        r"^(?P<indent>[ \t]*)from (?P<pkg>[\w.]+) import (?P<mod>\w+)\b", re.MULTILINE
    )

    def repl(m: re.Match[str]) -> str:
        if m.group("pkg") in packages and m.group("mod") in modules:
            return f"{m.group('indent')}from . import {m.group('mod')}"
        return m.group(0)

    return pattern.sub(repl, text)


def _own_module_name(text: str) -> str:
    """Make the message classes' ``__module__`` the module's real import name.

    protoc bakes in the proto path (``mmadmit.v1.admission_pb2``), which does
    not exist as a module here: pickling a message (multiprocessing) and
    tracebacks would point there. ``__name__`` is right wherever it lives.
    """
    return re.sub(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'[\w.]+'", r"\1__name__", text)


def generate(
    out_dir: str | Path = DEFAULT_OUT_DIR, proto_root: str | Path = PROTO_ROOT
) -> list[Path]:
    """Generate the Python code for every ``.proto`` under ``proto_root`` into ``out_dir``.

    Returns the written paths (``__init__.py`` included). Generated files in
    ``out_dir`` that no ``.proto`` produces any more are removed. Raises
    ``RuntimeError`` when protoc fails, ``ImportError`` without grpcio-tools.
    """
    from importlib.resources import files

    from grpc_tools import protoc

    out_dir = Path(out_dir)
    proto_root = Path(proto_root).resolve()
    protos = proto_files(proto_root)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    stems = [p.stem for p in protos]
    if len(set(stems)) != len(stems):
        raise RuntimeError(f"proto file names must be unique (flat output): {stems}")

    packages = {".".join(p.parent.parts) for p in protos}
    modules = {p.stem + s.split(".")[0] for p in protos for s in _GENERATED_SUFFIXES}
    wkt_include = str(files("grpc_tools") / "proto")  # google/protobuf/*.proto

    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="mmadmit-protoc-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={proto_root}",
            f"--proto_path={wkt_include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(p.as_posix() for p in protos),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}: {args}")

        out_dir.mkdir(parents=True, exist_ok=True)
        for proto in protos:
            for suffix in _GENERATED_SUFFIXES:
                src = Path(tmp) / proto.parent / (proto.stem + suffix)
                text = src.read_text(encoding="utf-8")
                text = _own_module_name(_relative_imports(text, packages, modules))
                text = _header(proto) + text
                dst = out_dir / src.name
                _write_if_changed(dst, text)
                written.append(dst)

    init = out_dir / "__init__.py"
    _write_if_changed(init, _INIT_TEXT)
    written.append(init)

    keep = {p.name for p in written}
    for stale in out_dir.iterdir():
        if stale.name not in keep and stale.name.endswith(_GENERATED_SUFFIXES):
            stale.unlink()
    return written


def _write_if_changed(path: Path, text: str) -> None:
    # Leaves mtimes alone when nothing changed (no needless rebuilds / reloads),
    # and replaces atomically: a process importing the package meanwhile (tests
    # while an editable reinstall runs) never reads a half-written module.
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def setuptools_cmdclass(out_dir: Path, proto_root: Path = PROTO_ROOT) -> dict[str, type]:
    """The setuptools commands that generate into ``out_dir`` before anything is built.

    ``build_protos`` generates; ``egg_info`` runs it first (metadata
    preparation lists the package sources and fails on a missing package
    directory), it is the first sub-command of ``build`` (and hence of
    ``bdist_wheel`` and ``editable_wheel``), and ``build_py`` runs it too
    (``run_command`` runs a command once per build, so these are no-ops after
    the first), so ``build_py`` always copies fresh stubs. It is a command of
    its own rather than only code in ``build_py`` because setuptools' editable
    build swallows exceptions from a customized ``build_py`` (a warning, and an
    install without stubs); a failure here fails the install. Without
    ``protos/`` (a copy made without it) the code already generated in
    ``out_dir`` is used.
    """
    import logging

    from setuptools import Command
    from setuptools.command.build import build
    from setuptools.command.build_py import build_py
    from setuptools.command.egg_info import egg_info

    # Not Command.announce: its level argument changed meaning across setuptools
    # versions (distutils levels, then logging levels).
    log = logging.getLogger("mmadmit.setup")

    class build_protos(Command):
        description = "generate protobuf/gRPC Python code from protos/"
        user_options: list[tuple[str, str | None, str]] = []
        editable_mode = False  # set by editable_wheel; generation is the same

        def initialize_options(self) -> None:
            pass

        def finalize_options(self) -> None:
            pass

        def run(self) -> None:
            if not proto_root.is_dir():
                if (out_dir / "__init__.py").is_file():
                    log.info("no protos/ here: keeping the generated code in %s", out_dir)
                    return
                raise RuntimeError(f"mmadmit: neither {proto_root} nor generated code in {out_dir}")
            try:
                import grpc_tools  # noqa: F401
            except ImportError as exc:
                raise RuntimeError(
                    "mmadmit: generating the protobuf code needs grpcio-tools, a build "
                    "requirement in pyproject.toml (with --no-build-isolation, install it "
                    "first: pip install 'grpcio-tools>=1.66,<2')"
                ) from exc
            log.info("generating protobuf code: %s -> %s", proto_root, out_dir)
            for path in generate(out_dir, proto_root):
                log.info("  %s", path)

        def get_outputs(self) -> list[str]:
            # In the source tree; build_py installs them like any other module.
            return []

    class build_py_with_protos(build_py):
        def run(self) -> None:
            self.run_command("build_protos")
            super().run()

    class egg_info_with_protos(egg_info):
        def run(self) -> None:
            self.run_command("build_protos")
            super().run()

    class build_with_protos(build):
        sub_commands = [("build_protos", None), *build.sub_commands]

    return {
        "build": build_with_protos,
        "build_protos": build_protos,
        "build_py": build_py_with_protos,
        "egg_info": egg_info_with_protos,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out_dir = Path(argv[0]) if argv else DEFAULT_OUT_DIR
    for path in generate(out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
