"""One switch for every optional extension: native accelerators on or off.

mmadmit parses untrusted network bytes in four optional native extensions
(``_walk_c``, ``_rules_c``, ``_tensorcheck_c`` and ``_pbwalk_c``, Cython's
builds of ``msgpack_walk.py``, ``rules.py``, ``tensorcheck.py`` and
``pbwalk.py``; on x86-64 ``_rules_avx2`` is ``rules.py`` built once more with
AVX2, run in place of ``_rules_c`` on a CPU that has it). Without one, its
own source runs interpreted (and without ``_pbwalk_c`` protobuf parses whole
messages, nothing stripped or taken first): same results, same aborts (tests
and the fuzz targets under ``fuzz/`` compare them). An operator who
will not run native code on untrusted input turns them off with
``--native off`` (``MMADMIT_NATIVE=0``); ``serve`` and ``materialize`` call
:func:`set_enabled` once at start-up, before any request is read.

Each module that wraps an extension registers a setter here when it is
imported (:func:`register`); :func:`set_enabled` calls every setter, and a
module imported later gets the current state at registration. The setters
swap the module's active entry points (and its ``HAVE_NATIVE``, which says
which implementation runs); a module whose extension was never built stays
on its fallback whatever the switch says. Not meant to be flipped while
requests are in flight (tests flip it between cases).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["built", "enabled", "register", "set_enabled"]

_enabled = True
_setters: dict[str, Callable[[bool], bool]] = {}


def register(name: str, setter: Callable[[bool], bool]) -> None:
    """Register module ``name``'s setter: ``setter(on)`` returns whether native now runs."""
    _setters[name] = setter
    setter(_enabled)


def set_enabled(on: bool) -> None:
    """Use the compiled extensions (``True``, the default) or their sources interpreted only."""
    global _enabled
    _enabled = bool(on)
    for setter in _setters.values():
        setter(_enabled)


def enabled() -> bool:
    """Whether native code is allowed (it runs where it was also built)."""
    return _enabled


def built() -> dict[str, bool]:
    """For each registered module, whether its extension is built (whatever the switch)."""
    out = {name: setter(True) for name, setter in _setters.items()}
    for setter in _setters.values():
        setter(_enabled)
    return out
