"""Examples taken from a Markdown page's own text, so that a doc edit that breaks one turns the
suite red: fenced code blocks by language, and the shell commands of a block."""

from __future__ import annotations

import re

BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(path: str, lang: str) -> list[str]:
    """The bodies of the page's fenced blocks of language ``lang``, in order."""
    with open(path) as f:
        return [body for kind, body in BLOCK.findall(f.read()) if kind == lang]


def commands(body: str) -> list[str]:
    """Shell commands of a block: a line ending inside a quote or with a backslash continues
    the command."""
    out, cur = [], ""
    for line in body.splitlines():
        cur = f"{cur}\n{line}" if cur else line
        if cur.count("'") % 2 == 0 and not cur.endswith("\\"):
            if cur.strip():
                out.append(cur)
            cur = ""
    return out
