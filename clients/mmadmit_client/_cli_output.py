"""Readable output of ``mmadmit-client``: rich on stdout at the real output width.

* Width: a terminal's width (rich measures stdin, stdout or stderr, so
  ``mmadmit-client ... | less`` in a terminal gets that terminal's), or
  ``COLUMNS`` when it is set. With neither (output to a file or a pipe, no
  terminal anywhere) nothing is wrapped: there is no width to wrap to, and
  rich's fallback of 80 columns would break lines no reader asked to break.
* Never inside a number: a line of prose is printed with ``soft_wrap`` (rich
  inserts no line break; a terminal wraps it on screen), and a table is never
  drawn narrower than its longest words (:func:`print_table`): when the width
  cannot hold it the table is drawn wider than the width (a terminal wraps
  it on screen), rather than a number folded over two lines or cut short
  with an ellipsis.
"""

from __future__ import annotations

import os
from typing import Any

# the width of an output that has none (no terminal, no COLUMNS): nothing wraps
UNBOUNDED = 100_000


def output_width() -> int | None:
    """None: rich's own (``COLUMNS``, else a terminal's width); else :data:`UNBOUNDED`."""
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return None
    for fd in (0, 1, 2):
        try:
            os.get_terminal_size(fd)
        except (OSError, ValueError):
            continue
        return None
    return UNBOUNDED


def stdout_console() -> Any:
    """The console of the readable output on stdout (see the module docstring)."""
    from rich.console import Console

    return Console(highlight=False, width=output_width())


def print_line(console: Any, text: Any, **kwargs: Any) -> None:
    """One line of prose, never broken by rich (``soft_wrap``)."""
    console.print(text, soft_wrap=True, **kwargs)


def print_table(console: Any, table: Any) -> None:
    """Print ``table`` with no column narrower than its longest word (a number is
    never folded or cut short with an ellipsis: a table that cannot fit the width
    is drawn wider than it, uncropped) and no narrower than its title, up to the
    width (the title is not wrapped in a narrow table)."""
    from rich.measure import Measurement
    from rich.text import Text

    wide = console.options.update_width(UNBOUNDED)
    for column in table.columns:
        cells = [*column.cells, *([column.header] if table.show_header else [])]
        column.min_width = max(
            (Measurement.get(console, wide, c).minimum for c in cells), default=0
        )
    title = table.title
    if title is not None:
        title_len = (title if isinstance(title, Text) else Text.from_markup(str(title))).cell_len
        table.min_width = max(table.min_width or 0, min(title_len, console.width))
    console.print(table, crop=False)
