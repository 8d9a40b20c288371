"""What a worker pays before it serves: building the model skips its random initialisation
(the checkpoint overwrites every tensor), and xgrammar (with transformers behind it) is imported
by the first structured request, not at start. Asserted on the modules a fresh interpreter has
loaded, not on seconds: on the meta device ``nn.Embedding``'s ``normal_`` runs through a Python
decomposition whose first call imports torch._dynamo and torch._inductor (about 1.6 s of CPU
per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch import nn

from shared.model.loader import skip_init


def loaded_modules(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; which of the watched modules it imported."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps({m: m in sys.modules for m in "
        "('torch._dynamo', 'torch._inductor', 'xgrammar', 'transformers')}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_a_model_compiles_nothing(default_model_dir):
    got = loaded_modules(
        "from shared.model.loader import load_model\n"
        f"m = load_model({str(default_model_dir)!r})\n"
        "assert sum(p.double().abs().sum() for p in m.model.parameters()) > 0"
    )
    assert not got["torch._dynamo"] and not got["torch._inductor"], got


def test_a_worker_imports_no_grammar_library_until_a_structured_request():
    got = loaded_modules("import services.decode.app, services.prefill.app")
    assert not got["xgrammar"] and not got["transformers"], got
    got = loaded_modules(
        "from shared.engine.structured import allocate_bitmask; allocate_bitmask(1, 64)"
    )
    assert got["xgrammar"], got  # imported on first use


def test_skip_init_leaves_weights_alone_and_restores_the_initialisers():
    with skip_init():
        layer = nn.Linear(4, 4)  # on CPU: the weight is whatever the allocator held
        emb = nn.Embedding(8, 4)
    assert nn.init.normal_(torch.zeros(1000)).std() > 0.5  # the real one again
    assert layer.weight.shape == (4, 4) and emb.weight.shape == (8, 4)
