"""The kvstore stores and serves KV frames as bytes: its process must not import torch (a few
seconds of CPU at every start and a few hundred MiB per instance, for nothing)."""

from __future__ import annotations

import subprocess
import sys


def test_the_kvstore_service_imports_no_torch():
    code = (
        "import sys, services.kvstore.app; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
