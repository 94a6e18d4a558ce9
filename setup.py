"""Build hooks for mmadmit; all metadata lives in pyproject.toml.

Two build outputs are never committed and are produced here, for both
``pip install .`` and PEP 660 ``pip install -e .``:

* The protobuf/gRPC modules in ``service/mmadmit/_proto/`` (gitignored),
  generated from ``protos/`` by ``scripts/gen_protos.py`` in the ``build_protos``
  command. ``egg_info`` runs it first (metadata preparation lists the package
  sources and fails on a missing package directory), it is the first
  sub-command of ``build``, and ``build_py`` runs it too (``run_command`` runs
  a command once per build, so these are no-ops after the first), so
  ``build_py`` always copies fresh stubs. It is a command of its own rather
  than only code in ``build_py`` because setuptools' editable build swallows
  exceptions from a customized ``build_py`` (a warning, and an install without
  stubs); a failure here fails the install.
* The optional C extensions (``_kernels``, ``_planner``, ``_pbwire``, from C
  sources) and the modules written in Cython's pure-Python mode, listed in
  ``CYTHON_MODULES``: each ``.py`` is a module of the package as it is (the
  reference, run interpreted) and is also compiled by Cython into a
  separately named extension (``mmadmit.msgpack_walk`` -> ``mmadmit._walk_c``;
  the generated C in ``build/cython/``); ``mmadmit.native`` picks one at run
  time. ``optional=True`` for all: without a working compiler (or without
  Cython) the install still succeeds and the pure-Python paths run. Editable
  installs build them in place (``service/mmadmit/*.so``, gitignored).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Command, Extension, setup
from setuptools.command.build import build
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

# Not Command.announce: its level argument changed meaning across setuptools
# versions (distutils levels, then logging levels).
_LOGGER = logging.getLogger("mmadmit.setup")

ROOT = Path(__file__).resolve().parent
GEN_PROTOS = ROOT / "scripts" / "gen_protos.py"
PROTO_ROOT = ROOT / "protos"
PROTO_OUT_DIR = ROOT / "service" / "mmadmit" / "_proto"


def _load_gen_protos() -> ModuleType:
    # scripts/ is not a package; load the file by path (also works when the
    # build backend runs from another working directory).
    spec = importlib.util.spec_from_file_location("_mmadmit_gen_protos", GEN_PROTOS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class build_protos(Command):
    """Generate mmadmit/_proto/ from protos/ (scripts/gen_protos.py)."""

    description = "generate protobuf/gRPC Python code from protos/"
    user_options: list[tuple[str, str | None, str]] = []
    editable_mode = False  # set by editable_wheel; generation is the same

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        if not (GEN_PROTOS.is_file() and PROTO_ROOT.is_dir()):
            # An sdist made without protos/ and scripts/ (they need a
            # MANIFEST.in entry) still carries the code generated when it was
            # made (egg_info lists the package); use that.
            if (PROTO_OUT_DIR / "__init__.py").is_file():
                _LOGGER.info("no protos/ here: keeping the generated code in %s", PROTO_OUT_DIR)
                return
            raise RuntimeError(
                f"mmadmit: neither {PROTO_ROOT} nor generated code in {PROTO_OUT_DIR}"
            )
        try:
            import grpc_tools  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "mmadmit: generating the protobuf code needs grpcio-tools, a build "
                "requirement in pyproject.toml (with --no-build-isolation, install it "
                "first: pip install 'grpcio-tools>=1.66,<2')"
            ) from exc
        gen = _load_gen_protos()
        _LOGGER.info("generating protobuf code: %s -> %s", PROTO_ROOT, PROTO_OUT_DIR)
        for path in gen.generate(PROTO_OUT_DIR, PROTO_ROOT):
            _LOGGER.info("  %s", path.relative_to(ROOT))

    def get_outputs(self) -> list[str]:
        # In the source tree; build_py installs them like any other module.
        return []


class build_py_with_protos(build_py):
    """``build_py`` that makes sure the generated stubs exist first."""

    def run(self) -> None:
        self.run_command("build_protos")
        super().run()


class egg_info_with_protos(egg_info):
    """``egg_info`` (metadata, SOURCES.txt) needs the _proto package to exist."""

    def run(self) -> None:
        self.run_command("build_protos")
        super().run()


# Generation runs before anything else in `build` (and hence in bdist_wheel and
# editable_wheel, which both iterate build's sub-commands).
class build_with_protos(build):
    sub_commands = [("build_protos", None), *build.sub_commands]


_COMPILE_ARGS = ["/O2"] if sys.platform == "win32" else ["-O3"]

# Modules in Cython's pure-Python mode: (extension name, source). The source
# stays an importable module under its own name; the extension is the same
# code compiled. One line per module.
CYTHON_MODULES = [
    ("mmadmit._walk_c", "service/mmadmit/msgpack_walk.py"),
]


def _cython_extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:  # a build requirement; without it the pure modules run
        _LOGGER.warning("mmadmit: Cython is not installed: %s stay interpreted", CYTHON_MODULES)
        return []
    extensions = [
        Extension(name, [source], extra_compile_args=_COMPILE_ARGS, optional=True)
        for name, source in CYTHON_MODULES
    ]
    result: list[Extension] = cythonize(
        extensions, build_dir="build/cython", language_level=3, quiet=True
    )
    return result


setup(
    cmdclass={
        "build": build_with_protos,
        "build_protos": build_protos,
        "build_py": build_py_with_protos,
        "egg_info": egg_info_with_protos,
    },
    # include-package-data (pyproject) would also ship the extension's source.
    exclude_package_data={"mmadmit": ["*.c"]},
    ext_modules=[
        Extension(
            "mmadmit._kernels",
            sources=["service/mmadmit/_kernels.c"],
            depends=["service/mmadmit/_native.h"],
            extra_compile_args=_COMPILE_ARGS,
            optional=True,
        ),
        Extension(
            "mmadmit._planner",
            sources=["service/mmadmit/_planner.c"],
            depends=["service/mmadmit/_native.h"],
            extra_compile_args=_COMPILE_ARGS,
            optional=True,
        ),
        Extension(
            "mmadmit._pbwire",
            sources=["service/mmadmit/_pbwire.c"],
            extra_compile_args=_COMPILE_ARGS,
            optional=True,
        ),
        *_cython_extensions(),
    ],
)
