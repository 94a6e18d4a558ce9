"""Build hooks for mmadmit (the server); the rest of its metadata is in pyproject.toml.

This distribution installs the service (``mmadmit``) only. The client library,
its CLI and the generated protobuf modules are the ``mmadmit-client``
distribution in ``clients/``, which this one requires: ``pip install .``
brings it from that folder (a ``file://`` requirement computed here), so the
two wheels ship no file twice and the service uses only the client's public
modules (``mmadmit_client.proto``, ``mmadmit_client.dtypes``,
``mmadmit_client.wire``, ``mmadmit_client.frames``).

``MMADMIT_CLIENT_REQUIREMENT`` replaces that requirement: ``make setup``
installs ``./clients`` editable first and sets it to ``mmadmit-client``, which
the editable install satisfies (pip refuses an editable install and a
``file://`` requirement of one project in one resolve).

The optional extensions are the modules written in Cython's pure-Python mode,
listed in ``CYTHON_MODULES``: each ``.py`` is a module of the package as it is
(run interpreted) and is also compiled by Cython into a separately named
extension (``mmadmit.msgpack_walk`` -> ``mmadmit._walk_c``, ``mmadmit.rules``
-> ``mmadmit._rules_c``, ``mmadmit.tensorcheck`` -> ``mmadmit._tensorcheck_c``,
``mmadmit.pbwalk`` -> ``mmadmit._pbwalk_c``; the generated C in
``build/cython/``); ``mmadmit.native`` picks one at run time.
``optional=True`` for all: without a working compiler (or without Cython) the
install still succeeds and the pure-Python paths run. Editable
installs build them in place (``service/mmadmit/*.so``, gitignored).

``ISA_VARIANTS`` compiles a module once more for a wider instruction set, on
x86-64 only: ``rules.py`` -> ``mmadmit._rules_avx2`` with ``-mavx2`` (its
per-token loops store four ints at a time, and the vocabulary check reads
four; the x86-64 baseline has two). The same source again, never a second
implementation: :mod:`mmadmit.planner` runs it only on a CPU whose flags list
``avx2``, and ``_rules_c`` everywhere else (the C loops it replaced got the
same from ``target_clones``, which Cython cannot emit).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import tomllib
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
_LOGGER = logging.getLogger("mmadmit.setup")
CLIENT_DIR = ROOT / "clients"
# The client is released with the server's version number.
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _client_requirement() -> str:
    override = os.environ.get("MMADMIT_CLIENT_REQUIREMENT", "").strip()
    if override:
        return override
    if (CLIENT_DIR / "pyproject.toml").is_file():
        return f"mmadmit-client @ {CLIENT_DIR.as_uri()}"
    return f"mmadmit-client=={VERSION}"  # built away from the repository


INSTALL_REQUIRES = [
    _client_requirement(),
    # torch is loose on purpose: the CUDA machines bring their own build.
    # On a CPU machine install the CPU wheel first (see README / Makefile).
    "torch>=2.4",
    "numpy>=1.26",
    "msgpack>=1.0",
    "msgspec>=0.18",
    # mmadmit.msgpack_walk imports `cython` for its type annotations (pure-Python
    # mode); this file compiles the same source into mmadmit._walk_c with it.
    "Cython>=3.1",
    "pyzmq>=26",
    "grpcio>=1.81.1",
    "grpcio-health-checking>=1.66",
    "grpcio-reflection>=1.66",
    "protobuf>=6.33.5",
    # SMG's gRPC worker contract (TokenSpeedScheduler), used as published: the
    # generated modules come from the package, never a hand copy of its .proto.
    "smg-grpc-proto>=0.4.28,<0.5",
    "uvloop>=0.19; sys_platform != 'win32'",
    "prometheus-client>=0.20",
]
_COMPILE_ARGS = ["/O2"] if sys.platform == "win32" else ["-O3"]

# Modules in Cython's pure-Python mode: (extension name, source). The source
# stays an importable module under its own name; the extension is the same
# code compiled. One line per module.
CYTHON_MODULES = [
    ("mmadmit._walk_c", "service/mmadmit/msgpack_walk.py"),
    ("mmadmit._rules_c", "service/mmadmit/rules.py"),
    ("mmadmit._tensorcheck_c", "service/mmadmit/tensorcheck.py"),
    ("mmadmit._pbwalk_c", "service/mmadmit/pbwalk.py"),
]
# (extension name, source, compiler flag): a module of CYTHON_MODULES compiled
# again for a wider instruction set (module docstring). One line per variant.
ISA_VARIANTS = [
    ("mmadmit._rules_avx2", "service/mmadmit/rules.py", "-mavx2"),
]
_X86_64 = platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32"


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
    for name, source, flag in ISA_VARIANTS if _X86_64 else []:
        # its own build_dir: Cython names the C file after the source, not the module
        variant = Extension(
            name, [source], extra_compile_args=[*_COMPILE_ARGS, flag], optional=True
        )
        result += cythonize(
            [variant], build_dir=f"build/cython{flag}", language_level=3, quiet=True
        )
    return result


setup(
    install_requires=INSTALL_REQUIRES,
    # include-package-data (pyproject) would also ship Cython's generated C.
    exclude_package_data={"mmadmit": ["*.c"]},
    ext_modules=_cython_extensions(),
)
