"""docs/ARCHITECTURE.md walks a request through the code file by file: every file path and every
public name it cites in backticks must exist, so the page cannot silently drift from the code."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
TICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^(?:services|shared|protos|tests|loadtests|docs|compose|scripts)/[\w./-]*$")
CLASS = re.compile(r"^[A-Z][A-Za-z0-9]+$")
DOTTED = re.compile(r"^([A-Z][A-Za-z0-9]+)\.([a-z_][a-z0-9_]*)$")
SNAKE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")


@lru_cache(maxsize=1)
def source() -> str:
    return "\n".join(
        p.read_text()
        for base in ("services", "shared", "loadtests", "protos")
        for p in (ROOT / base).rglob("*.py")
    )


def defined(name: str) -> bool:
    """A class, function, method, attribute or config field of that name is defined, or it is a
    registered string (a policy name, a bucket name)."""
    pat = (
        rf"(?:\b(?:class|def)\s+{name}\b)|(?:^\s*(?:self\.)?{name}\s*[:=])"
        rf"|(?:[\"']{name}[\"'])"
    )
    return re.search(pat, source(), re.M) is not None


def cited() -> list[str]:
    return TICKED.findall(DOC.read_text())


def test_every_cited_file_exists():
    missing = []
    for tok in cited():
        tok = tok.split(" ")[0].rstrip(".,:;")
        if PATH.match(tok) and not (ROOT / tok.rstrip("/")).exists():
            missing.append(tok)
    assert not missing, f"ARCHITECTURE.md cites files that do not exist: {missing}"


def test_every_cited_public_name_exists():
    missing = []
    for tok in cited():
        if (m := DOTTED.match(tok)) is not None:
            if not (defined(m.group(1)) and defined(m.group(2))):
                missing.append(tok)
        elif (CLASS.match(tok) or SNAKE.match(tok)) and not defined(tok):
            missing.append(tok)
    assert not missing, f"ARCHITECTURE.md cites names that are defined nowhere: {missing}"


def test_the_checks_see_the_page():
    toks = cited()
    assert sum(bool(PATH.match(t)) for t in toks) >= 20
    assert sum(bool(CLASS.match(t) or DOTTED.match(t)) for t in toks) >= 10
