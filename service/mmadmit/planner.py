"""Which build of :mod:`mmadmit.rules` runs: compiled when it is built, else interpreted.

:mod:`mmadmit.rules` is one source of rules 5 and 6 in Cython's pure-Python
mode; ``setup.py`` also compiles it into ``mmadmit._rules_c``. This module
hands the materializer the compiled entry points unless native code is off
(:mod:`mmadmit.native`, ``--native off``) or the extension was not built, and
the interpreted ones otherwise. Both give the same outcome, message included
(``tests/test_planner.py``, the ``planner`` fuzz target).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from . import native, rules

try:
    from . import _rules_c as _BUILT  # type: ignore[attr-defined]
except ImportError:  # no compiler (or no Cython) at install time: rules.py interpreted
    _BUILT = None

_active: ModuleType = _BUILT or rules
HAVE_NATIVE = _BUILT is not None


def _use_native(on: bool) -> bool:
    global _active, HAVE_NATIVE
    _active = _BUILT if on and _BUILT is not None else rules
    HAVE_NATIVE = _active is not rules
    return HAVE_NATIVE


native.register(__name__, _use_native)


def plan_items(*args: Any, **kwargs: Any) -> rules.ItemPlan:
    """:func:`mmadmit.rules.plan_items`, in the active build."""
    return _active.plan_items(*args, **kwargs)  # type: ignore[no-any-return]


def spans_of(items: list[Any], n: int) -> rules.Spans:
    """:func:`mmadmit.rules.spans_of`, in the active build."""
    return _active.spans_of(items, n)  # type: ignore[no-any-return]


def tensors_within(mm: Any, limits: Any) -> None:
    """:func:`mmadmit.rules.tensors_within`, in the active build."""
    _active.tensors_within(mm, limits)


def first_outside(ids: Any, vocab: int) -> int:
    """:func:`mmadmit.rules.first_outside`, in the active build."""
    return _active.first_outside(ids, vocab)  # type: ignore[no-any-return]


def pad_value(modality: int, content_hash: int) -> int:
    """:func:`mmadmit.rules.pad_value`, in the active build."""
    return _active.pad_value(modality, content_hash)  # type: ignore[no-any-return]


def fill_spans(ids: Any, starts: Any, stops: Any, values: Any) -> Any:
    """:func:`mmadmit.rules.fill_spans`, in the active build."""
    return _active.fill_spans(ids, starts, stops, values)


def positions(n: int, plan: Any) -> tuple[Any, int]:
    """:func:`mmadmit.rules.positions`, in the active build."""
    return _active.positions(n, plan)  # type: ignore[no-any-return]


def with_pad(item: Any, content_hash: int, pad: int) -> Any:
    """:func:`mmadmit.rules.with_pad`, in the active build."""
    return _active.with_pad(item, content_hash, pad)
