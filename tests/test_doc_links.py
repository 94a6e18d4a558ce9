"""Every document reference resolves inside the repository.

* each relative markdown link in README.md, docs/**/*.md, clients/README.md,
  deploy/README.md and RELIABILITY.md names an existing file or folder, and its
  ``#anchor``, when it has one and points at a markdown file, names a heading
  there (GitHub's heading ids);
* each ``*.md`` name mentioned in those files, in tests/*.py and in the Python
  files of service/ and clients/ is a file of the repository: a path relative to
  the mentioning file or to the repository root, or a bare name that exactly one
  markdown file of the repository carries. The normative spec lives in
  docs/spec/, so a spec file that goes missing fails here.

Plain file reads and regular expressions: well under a second.

Run with: ``.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_doc_links.py``
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Folders that are not the repository's own documents (environments, build
# outputs, caches, VCS data).
_SKIP_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
# [text](target "title") and ![alt](target); the text may hold one level of [].
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
_MD_END = re.compile(r"\.md\b")
_PATH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files(root: Path) -> list[Path]:
    """The markdown documents whose links and mentions are checked."""
    files = [root / "README.md", root / "RELIABILITY.md"]
    files += [root / "clients" / "README.md", root / "deploy" / "README.md"]
    docs = root / "docs"
    if docs.is_dir():
        files += sorted(docs.rglob("*.md"))
    return [f for f in files if f.is_file()]


def python_files(root: Path) -> list[Path]:
    """The Python files whose ``*.md`` mentions are checked: generated stubs excepted, and
    this module, whose self-test names missing files on purpose."""
    files = [f for f in sorted((root / "tests").glob("*.py")) if f.name != Path(__file__).name]
    for top in ("service", "clients"):
        files += [f for f in _walk(root / top, ".py") if "proto" not in f.parts]
    return files


def _walk(top: Path, suffix: str) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
        ]
        for name in filenames:
            if name.endswith(suffix):
                yield Path(dirpath, name)


@cache
def _basenames(root: Path) -> Counter[str]:
    return Counter(p.name for p in _walk(root, ".md"))


def prose(text: str) -> str:
    """Markdown without fenced code blocks, code spans and HTML comments (no links there)."""
    out, fenced = [], False
    for line in _HTML_COMMENT.sub("", text).splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(_CODE_SPAN.sub("code", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's id for a heading: markup and punctuation dropped, lower case, '-' for ' '."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: Counter[str] = Counter()
    ids = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            ids.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return frozenset(ids)


def broken_links(md: Path, root: Path) -> Iterator[str]:
    """Each relative link of ``md`` that does not resolve, as 'file: target (why)'."""
    for line in prose(md.read_text(encoding="utf-8")).splitlines():
        for target in _LINK.findall(line):
            if _URL.match(target) or target.startswith(("mailto:", "//")):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (md.parent / path_part).resolve() if path_part else md
            where = f"{md.relative_to(root)}: {target}"
            if not dest.exists():
                yield f"{where} (no such file)"
            elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
                yield f"{where} (no heading #{anchor} in {dest.relative_to(root)})"


def md_mentions(text: str) -> list[str]:
    """The ``*.md`` names a text mentions (a path or a bare name), URLs and globs left out.

    Each ``.md`` is read backwards over path characters: cheaper than a regular
    expression tried at every word of 2 MB of text.
    """
    names = []
    for m in _MD_END.finditer(text):
        start = m.start()
        while start and text[start - 1] in _PATH_CHARS:
            start -= 1
        name = text[start : m.end()]
        if name == ".md" or name.startswith("//") or text[start - 1 : start] == "*":
            continue  # "*.md", "dir/*.md": a glob; "//host/x.md" after "https:": a URL
        names.append(name)
    return names


def resolves(name: str, mentioned_in: Path, root: Path) -> bool:
    """A path relative to the mentioning file or to the root, or a unique basename."""
    if (mentioned_in.parent / name).is_file() or (root / name).is_file():
        return True
    return "/" not in name and _basenames(root)[name] == 1


def unresolved_mentions(files: Iterable[Path], root: Path) -> Iterator[str]:
    for f in files:
        for name in sorted(set(md_mentions(f.read_text(encoding="utf-8")))):
            if not resolves(name, f, root):
                yield f"{f.relative_to(root)}: {name}"


def test_relative_markdown_links_resolve() -> None:
    files = markdown_files(REPO_ROOT)
    assert len(files) >= 5 + 5, [str(f) for f in files]  # the docs and the five spec files
    broken = [b for md in files for b in broken_links(md, REPO_ROOT)]
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_md_mentions_resolve_to_repository_files() -> None:
    files = markdown_files(REPO_ROOT) + python_files(REPO_ROOT)
    missing = list(unresolved_mentions(files, REPO_ROOT))
    assert not missing, "*.md names that are no file of the repository:\n" + "\n".join(missing)


def test_spec_is_in_the_repository_and_nothing_points_outside() -> None:
    spec = REPO_ROOT / "docs" / "spec"
    for name in ("MATERIALIZE", "WIRE", "GRPC", "CLI", "SMG_GRPC"):
        assert (spec / f"{name}.md").is_file(), f"docs/spec/{name}.md is missing"
    outside = [
        str(f.relative_to(REPO_ROOT))
        for f in markdown_files(REPO_ROOT) + python_files(REPO_ROOT)
        if "../shared" in f.read_text(encoding="utf-8")
    ]
    assert not outside, f"mentions of ../shared (a user's clone has no such folder): {outside}"


def test_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs" / "spec").mkdir(parents=True)
    (tmp_path / "docs" / "spec" / "WIRE.md").write_text("# Wire\n\n## Engine mode: relay\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "See [WIRE.md](docs/spec/WIRE.md#engine-mode-relay), [gone](docs/spec/GRPC.md),\n"
        "[bad anchor](docs/spec/WIRE.md#nowhere), `[not a link](x.md)` and\n"
        "[web](https://example.com/a.md).\n\n```\n[in code](missing.md)\n```\n"
        "Mentions: WIRE.md, docs/spec/WIRE.md, CLI.md, https://example.com/CLI.md\n"
    )
    assert list(broken_links(readme, tmp_path)) == [
        "README.md: docs/spec/GRPC.md (no such file)",
        "README.md: docs/spec/WIRE.md#nowhere (no heading #nowhere in docs/spec/WIRE.md)",
    ]
    assert list(unresolved_mentions([readme], tmp_path)) == [
        "README.md: CLI.md",
        "README.md: docs/spec/GRPC.md",
        "README.md: missing.md",
        "README.md: x.md",
    ]
