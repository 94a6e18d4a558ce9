"""The module graph keeps its layers: checked in a fresh interpreter per case.

* the configuration and the materializer know no wire: importing
  ``mmadmit.config`` or ``mmadmit.materializer`` loads no codec
  (``mmadmit.intcodec``, ``mmadmit.wire``, ``mmadmit.pbwire``, the C codecs);
* ``mmadmit.security`` reads files for any object with its settings and imports
  nothing of the configuration (the ``config`` <-> ``security`` cycle is gone).

Run with: python -m pytest tests/test_layering.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import subprocess
import sys

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
