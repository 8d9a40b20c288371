"""The tokenizer runs no model: its process imports no torch until a request carries an output
constraint (xgrammar, which compiles it, brings torch and transformers along: about 2.5 CPU-s
that every tokenizer start, and every cluster start, would otherwise pay)."""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = """
import json, sys
import services.tokenizer.app
from services.tokenizer.core import TokenizerCore
from shared.protocol.sampling import StructuredSpec
from shared.protocol.tok import TokenizeRequest

out = {}
core = TokenizerCore(sys.argv[1], sys.argv[2])
rep = core.encode(TokenizeRequest(request_id="r", messages=[{"role": "user", "content": "hi"}]))
out["plain"] = {"torch": "torch" in sys.modules, "grammars_built": core._grammars is not None,
                "fingerprint": rep.model_fingerprint, "kv_dtype": rep.kv_dtype}
spec = StructuredSpec(kind="regex", spec="[0-9]{3}")
core.encode(TokenizeRequest(request_id="r", prompt="n:", constraint=spec))
out["constrained"] = {"torch": "torch" in sys.modules, "grammars_built": core._grammars is not None,
                      "compiled": core.grammars.misses}
print(json.dumps(out))
"""


def _run(model_dir, dtype: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(model_dir), dtype],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_tokenizer_imports_torch_only_for_its_first_constraint(tmp_path):
    import torch

    from shared.model.default_model import build_default_model
    from shared.model.loader import load_model

    model_dir = build_default_model(tmp_path / "m")
    for dtype, torch_dtype in (("", None), ("bfloat16", torch.bfloat16)):
        out = _run(model_dir, dtype)
        plain, constrained = out["plain"], out["constrained"]
        assert plain["torch"] is False and plain["grammars_built"] is False, out
        # names, not torch dtypes: the same fingerprint and KV dtype the engine keys blocks with
        engine = load_model(model_dir, dtype=torch_dtype)
        assert plain["fingerprint"] == engine.fingerprint, (dtype, out)
        assert plain["kv_dtype"] == (dtype or "float32")
        assert constrained == {"torch": True, "grammars_built": True, "compiled": 1}, out
