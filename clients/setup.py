"""Build hook of the ``mmadmit-client`` distribution; metadata lives in pyproject.toml.

The protobuf/gRPC modules (``mmadmit_client/proto/``, gitignored; a public
module the service imports too) are generated at build time from the
repository's ``../protos/`` by ``../scripts/gen_protos.py``, which also
supplies the build commands. ``pip install ./clients`` builds
in place, so both are found; a copy without them (an sdist) must already carry
the generated ``proto`` package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
GEN_PROTOS = HERE.parent / "scripts" / "gen_protos.py"
OUT_DIR = HERE / "mmadmit_client" / "proto"

cmdclass = {}
if GEN_PROTOS.is_file():
    spec = importlib.util.spec_from_file_location("_mmadmit_gen_protos", GEN_PROTOS)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    cmdclass = gen.setuptools_cmdclass(OUT_DIR, HERE.parent / "protos")
elif not (OUT_DIR / "__init__.py").is_file():
    raise RuntimeError(f"mmadmit-client: neither {GEN_PROTOS} nor generated code in {OUT_DIR}")

setup(cmdclass=cmdclass)
