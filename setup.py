"""Build hooks for mmadmit; all metadata lives in pyproject.toml.

This distribution installs the service (``mmadmit``) and, from ``clients/``,
the client library and its CLI (``mmadmit_client``, also its own distribution:
``pip install ./clients``). Two build outputs are never committed and are
produced here, for both ``pip install .`` and PEP 660 ``pip install -e .``:

* The protobuf/gRPC modules, in one place shared by client and service:
  ``clients/mmadmit_client/_proto/`` (gitignored), generated from ``protos/``
  by ``scripts/gen_protos.py``, whose :func:`setuptools_cmdclass` supplies the
  build commands (``clients/setup.py`` uses the same ones).
* The optional C extensions ``mmadmit._intcodec`` and friends.
  ``optional=True``: without a working compiler the install still succeeds
  and the service uses its pure-Python fallbacks. Editable installs build
  them in place (``service/mmadmit/_*.so``, gitignored).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
GEN_PROTOS = ROOT / "scripts" / "gen_protos.py"


def _load_gen_protos() -> ModuleType:
    # scripts/ is not a package; load the file by path (also works when the
    # build backend runs from another working directory).
    spec = importlib.util.spec_from_file_location("_mmadmit_gen_protos", GEN_PROTOS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_GEN = _load_gen_protos()
_COMPILE_ARGS = ["/O2"] if sys.platform == "win32" else ["-O3"]

# Pure-Python-mode sources that Cython compiles into a separately named module:
# the .py file stays importable as plain Python (the reference, and what
# `--native off` runs) and the compiled build sits beside it.
_CYTHON_MODULES: list[tuple[str, str]] = []


def _cython_extensions() -> list[Extension]:
    """The compiled builds of _CYTHON_MODULES; none without Cython (optional)."""
    try:
        from Cython.Build import cythonize
    except ImportError:
        _LOGGER.warning("mmadmit: Cython is not installed; the rules run as plain Python")
        return []
    exts = [
        Extension(name, sources=[src], extra_compile_args=_COMPILE_ARGS, optional=True)
        for name, src in _CYTHON_MODULES
    ]
    return list(cythonize(exts, build_dir="build/cython", language_level=3, quiet=True))


setup(
    cmdclass=_GEN.setuptools_cmdclass(_GEN.DEFAULT_OUT_DIR, _GEN.PROTO_ROOT),
    # include-package-data (pyproject) would also ship the extension's source.
    exclude_package_data={"mmadmit": ["*.c"]},
    ext_modules=[
        Extension(
            "mmadmit._intcodec",
            sources=["service/mmadmit/_intcodec.c"],
            depends=["service/mmadmit/_native.h"],
            extra_compile_args=_COMPILE_ARGS,
            optional=True,
        ),
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
