"""Build hooks for mmadmit; all metadata lives in pyproject.toml.

This distribution installs the service (``mmadmit``) and, from ``clients/``,
the client library and its CLI (``mmadmit_client``, also its own distribution:
``pip install ./clients``). Two build outputs are never committed and are
produced here, for both ``pip install .`` and PEP 660 ``pip install -e .``:

* The protobuf/gRPC modules, in one place shared by client and service:
  ``clients/mmadmit_client/_proto/`` (gitignored), generated from ``protos/``
  by ``scripts/gen_protos.py``, whose :func:`setuptools_cmdclass` supplies the
  build commands (``clients/setup.py`` uses the same ones).
* The optional C extensions (``_kernels``, ``_pbwire``, from C sources) and
  the modules written in Cython's pure-Python mode, listed in
  ``CYTHON_MODULES``: each ``.py`` is a module of the package as it is (the
  reference, run interpreted) and is also compiled by Cython into a
  separately named extension (``mmadmit.msgpack_walk`` -> ``mmadmit._walk_c``,
  ``mmadmit.rules`` -> ``mmadmit._rules_c``, ``mmadmit.tensorcheck`` ->
  ``mmadmit._tensorcheck_c``; the generated C in ``build/cython/``);
  ``mmadmit.native`` picks one at run time. ``optional=True`` for all: without
  a working compiler (or without Cython) the install still succeeds and the
  pure-Python paths run. Editable
  installs build them in place (``service/mmadmit/*.so``, gitignored).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
_LOGGER = logging.getLogger("mmadmit.setup")
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

# Modules in Cython's pure-Python mode: (extension name, source). The source
# stays an importable module under its own name; the extension is the same
# code compiled. One line per module.
CYTHON_MODULES = [
    ("mmadmit._walk_c", "service/mmadmit/msgpack_walk.py"),
    ("mmadmit._rules_c", "service/mmadmit/rules.py"),
    ("mmadmit._tensorcheck_c", "service/mmadmit/tensorcheck.py"),
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
    cmdclass=_GEN.setuptools_cmdclass(_GEN.DEFAULT_OUT_DIR, _GEN.PROTO_ROOT),
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
            "mmadmit._pbwire",
            sources=["service/mmadmit/_pbwire.c"],
            extra_compile_args=_COMPILE_ARGS,
            optional=True,
        ),
        *_cython_extensions(),
    ],
)
