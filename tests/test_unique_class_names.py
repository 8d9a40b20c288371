"""No two classes under `services/` or `shared/` share a name (a grep for a class finds one)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def class_names(roots: list[str]) -> dict[str, list[str]]:
    """Class name -> the files (relative to the repo) that define it, nested classes included."""
    seen: dict[str, list[str]] = defaultdict(list)
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    seen[node.name].append(str(path.relative_to(ROOT)))
    return seen


def test_class_names_are_unique_across_services_and_shared():
    seen = class_names(["services", "shared"])
    assert len(seen) > 50  # the walk found the code
    dupes = {name: files for name, files in seen.items() if len(files) > 1}
    assert dupes == {}
