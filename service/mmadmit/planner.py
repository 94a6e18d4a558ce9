"""Which build of :mod:`mmadmit.rules` runs: compiled when it is built, else interpreted.

:mod:`mmadmit.rules` is one source of rules 5 to 8 in Cython's pure-Python
mode; ``setup.py`` also compiles it into ``mmadmit._rules_c``, and on x86-64
once more with AVX2 into ``mmadmit._rules_avx2``. This module hands the
materializer the compiled entry points unless native code is off
(:mod:`mmadmit.native`, ``--native off``) or no extension was built, and the
interpreted ones otherwise: ``_rules_avx2`` on a CPU whose flags
(``/proc/cpuinfo``) list ``avx2``, else ``_rules_c``. Every build gives the
same outcome, message included (``tests/test_planner.py``,
``tests/test_kernels.py``, the ``planner`` and ``kernels`` fuzz targets).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from . import native, rules


def _cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where it does not)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _runnable(flags: frozenset[str]) -> dict[str, ModuleType]:
    """The compiled builds that are built and can run on a CPU with ``flags``,
    the preferred first."""
    builds = {}
    for name, needs in (("_rules_avx2", "avx2"), ("_rules_c", None)):
        if needs is not None and needs not in flags:
            continue
        try:
            builds[name] = importlib.import_module(f"{__package__}.{name}")
        except ImportError:  # not built here (no compiler, or not x86-64)
            continue
    return builds


# every compiled build this process can run (the tests hold each to the source)
COMPILED = _runnable(_cpu_flags())
_BUILT: ModuleType | None = next(iter(COMPILED.values()), None)

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
