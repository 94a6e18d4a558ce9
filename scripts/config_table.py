#!/usr/bin/env python3
"""Print the README's configuration table of ``mmadmit serve``, or check it.

The table is made from the one configuration object (``ServeConfig``): one row
per field with its flag, its environment variable, its default and its help
text with its valid range (``config.field_help``), exactly what ``mmadmit serve
--help`` shows. The README holds it between
``<!-- config-table:begin -->`` and ``<!-- config-table:end -->``::

    python scripts/config_table.py            # print the table
    python scripts/config_table.py --write    # replace the README's table
    python scripts/config_table.py --check    # exit 1 when the README's table is stale

``tests/test_docs.py`` runs the check, and also compares the rows with the
flags ``mmadmit serve --help`` really lists.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BEGIN = "<!-- config-table:begin -->"
END = "<!-- config-table:end -->"


def _default(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    from mmadmit.config import OFF

    value = f.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if value != OFF else "off"


def table() -> str:
    from mmadmit.config import ServeConfig, env_name, field_help, flag_name

    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(ServeConfig):
        meaning = field_help(f).replace("|", "\\|")
        flag = flag_name(f.name) + ("" if f.metadata.get("flag") else " VALUE")
        rows.append(f"| `{flag}` | `{env_name(f.name)}` | `{_default(f)}` | {meaning} |")
    return "\n".join(rows) + "\n"


def readme_table(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{README}: no {BEGIN} ... {END} block")
    return text[start + len(BEGIN) : end].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the README's table")
    mode.add_argument("--check", action="store_true", help="exit 1 if the README's is stale")
    args = parser.parse_args(argv)
    current = table()
    if not (args.write or args.check):
        sys.stdout.write(current)
        return 0
    text = README.read_text()
    if args.check:
        if readme_table(text) != current:
            print("README.md: the configuration table is stale; run "
                  "python scripts/config_table.py --write", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + current + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
