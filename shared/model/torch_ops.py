"""The native kernels as torch custom ops (``torch.library``), one so far: ``strata::rms_norm``.

``torch_ops.cpp`` registers the op's schema and CPU kernel with torch's dispatcher; the kernel
calls the RMSNorm of ``fused.c`` in whichever ISA variant `cpu_kernels` loaded (its address is
handed over at `load`), so the op follows ``STRATA_CPU_ISA`` like the ctypes path and this
library is built once per torch version, not per variant. A fake (meta) kernel registered here
gives the output's shape without running, which ``torch.compile`` and ``torch.library.opcheck``
need. The engine's default path still calls the kernel through ctypes (`cpu_kernels.rms_norm`):
the op is the first step of moving them over, checked end to end in
``tests/model/test_torch_ops.py``.

Built with the system C++ compiler against torch's headers (about 15 s on 2 cores) into
``$STRATA_CACHE/kernels``, keyed by the source, the torch version and the flags.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp

from shared.config import RuntimeSettings
from shared.model import cpu_kernels

SOURCE = Path(__file__).with_name("torch_ops.cpp")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
bound = ""  # the ISA variant whose kernel the op calls


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    inc = [f"-I{p}" for p in cpp.include_paths()]
    libs = [f"-L{p}" for p in cpp.library_paths()]
    return [
        "-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *inc, *libs,
        "-lc10", "-ltorch_cpu",
    ]  # fmt: skip


def build() -> Path:
    """The op library, compiled first when the cache lacks it (`subprocess.SubprocessError`
    with the compiler's last line when that fails)."""
    cxx = os.environ.get("CXX", "c++")
    flags = _flags()
    key = "\0".join([SOURCE.read_text(), torch.__version__, cxx, *flags])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = Path(RuntimeSettings.from_env().cache_dir) / "kernels" / f"strata_torch_ops_{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / "ops.so"
        done = subprocess.run(
            [cxx, str(SOURCE), "-o", str(so), *flags], capture_output=True, text=True, timeout=600
        )
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise subprocess.SubprocessError(f"{cxx} failed for {SOURCE.name}: {tail}")
        os.replace(so, out)
    return out


def load() -> str:
    """Register ``torch.ops.strata.rms_norm`` (once) and bind it to the RMSNorm of the variant
    `cpu_kernels` has loaded now; returns that variant. Call again after `cpu_kernels.use`.
    Raises RuntimeError when the native kernels are unavailable."""
    global _lib, bound
    if not cpu_kernels.available():
        raise RuntimeError(f"native CPU kernels {cpu_kernels.off_reason()}")
    with _lock:
        if _lib is None:
            path = build()
            torch.ops.load_library(str(path))  # runs TORCH_LIBRARY: the schema and CPU kernel
            _lib = ctypes.CDLL(str(path))
            _lib.strata_ops_bind.argtypes = (ctypes.c_void_p,)
            _lib.strata_ops_bind.restype = None
            torch.library.register_fake("strata::rms_norm")(_rms_norm_fake)
        fn = ctypes.cast(cpu_kernels._lib.strata_rms_norm_f32, ctypes.c_void_p).value
        _lib.strata_ops_bind(fn)
        bound = cpu_kernels.loaded_isa()
    return bound


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float, nthreads: int = 1):
    torch._check(weight.numel() == x.shape[-1])
    return torch.empty_like(x)
