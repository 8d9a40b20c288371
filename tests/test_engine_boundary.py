"""The engine's boundary: code outside ``shared/engine`` reaches the engine only through its port.

Services and the worker library may import from ``shared.engine`` only the port, its types,
the engine configuration and the structured-output compiler (sampling parameters and the
block-hash definition are protocol: ``shared.protocol.sampling``, ``shared.protocol.hashing``);
they never run lambdas on the engine thread nor touch the model runner, block tables,
reservations or the scheduler's lists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "shared.engine.port",  # EnginePort
    "shared.engine.port_types",  # what crosses it
    "shared.engine.params",  # EngineConfig builds the engine
    "shared.engine.structured",  # structured-output request specs (validated at the gateway)
}
INTERNALS = re.compile(
    r"\.call\(lambda|\.runner\b|\.block_table\b|\b(e|engine)\.(current|scheduler|seqs|bm|reserved)\b"
)


def outside_files() -> list[Path]:
    files = [*(ROOT / "services").rglob("*.py"), *(ROOT / "shared").rglob("*.py")]
    return [p for p in files if not p.is_relative_to(ROOT / "shared" / "engine")]


def engine_imports(src: str) -> list[str]:
    """Every ``shared.engine...`` module an import statement names (``from shared.engine import
    x`` names ``shared.engine.x``)."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("shared.engine")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shared.engine"):
            if node.module == "shared.engine":
                out += [f"shared.engine.{a.name}" for a in node.names]
            else:
                out.append(node.module)
    return out


def violations(path: str, src: str) -> list[str]:
    bad = [f"{path}: imports {m}" for m in engine_imports(src) if m not in ALLOWED]
    for n, line in enumerate(src.splitlines(), 1):
        if INTERNALS.search(line):
            bad.append(f"{path}:{n}: engine internals: {line.strip()}")
    return bad


def test_outside_the_engine_only_the_port_is_used():
    files = outside_files()
    assert any(p.match("services/decode/service.py") for p in files)
    assert any(p.match("shared/worker/kv_wire.py") for p in files)
    assert not any(p.is_relative_to(ROOT / "shared" / "engine") for p in files)
    bad = []
    for p in files:
        bad += violations(str(p.relative_to(ROOT)), p.read_text())
    assert not bad, "code outside shared/engine reaches into the engine:\n" + "\n".join(bad)


def test_the_check_catches_each_kind_of_reach():
    assert violations("x.py", "from shared.engine.engine import LLMEngine\n")
    assert violations("x.py", "from shared.engine import scheduler\n")
    assert violations("x.py", "import shared.engine.kv_io\n")
    assert violations("x.py", "async def f(ae):\n    await ae.call(lambda e: e.release('r'))\n")
    assert violations("x.py", "dt = rt.engine.runner.kv.k.dtype\n")
    assert violations("x.py", "t = seq.block_table\n")
    assert violations("x.py", "r = e.reserved['x']\n")
    assert violations("x.py", "s = engine.current\n")
    ok = (
        "from shared.engine.port import EnginePort\nfrom shared.engine.params import EngineConfig\n"
    )
    assert violations("x.py", ok) == []


def test_the_protocol_imports_nothing_from_the_engine():
    """What rides the bus (sampling parameters, block hashes, dtype names) is defined in
    ``shared/protocol``; the engine imports it, never the other way round."""
    files = sorted((ROOT / "shared" / "protocol").rglob("*.py"))
    assert any(p.name == "sampling.py" for p in files)
    bad = [
        f"{p.relative_to(ROOT)}: imports {m}" for p in files for m in engine_imports(p.read_text())
    ]
    assert not bad, "\n".join(bad)
