"""Which build of :mod:`mmadmit.rules` the materializer runs.

``rules.py`` is the one source of rules 5 and 6 over a request's items. When
Cython and a compiler were present at install time, ``setup.py`` compiled that
same file into ``mmadmit._rules_c``; it is used unless native code is switched
off (:mod:`mmadmit.native`, ``--native off``), when the file runs as plain
Python. Both give the same outcome on every input, message included
(``tests/test_planner.py``, the ``planner`` fuzz target).
"""

from __future__ import annotations

from types import ModuleType

from . import native, rules

try:
    from . import _rules_c as _BUILT  # type: ignore[attr-defined]
except ImportError:  # no Cython or compiler at install time: the interpreted build
    _BUILT = None

active: ModuleType = _BUILT or rules  # the build in use (native.set_enabled switches it)
HAVE_NATIVE = _BUILT is not None


def _use_native(on: bool) -> bool:
    global active, HAVE_NATIVE
    active = _BUILT if on and _BUILT is not None else rules
    HAVE_NATIVE = active is not rules
    return HAVE_NATIVE


native.register(__name__, _use_native)
