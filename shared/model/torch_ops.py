"""The native CPU kernels as torch custom ops (``torch.library``): ``torch.ops.strata.*``.

``torch_ops.cpp`` registers each kernel's schema and CPU kernel with torch's dispatcher:
``rms_norm``, ``add_rms_norm``, ``qk_norm_rope_``, ``decode_attention``, ``prefill_attention_``,
``pack_linear`` / ``linear`` (float32 GEMM), ``pack_int8`` / ``linear_int8`` (W8A8 GEMM),
``pack_bf16`` / ``linear_bf16`` (bf16 weights, float32 activations) and ``decoder_layer_`` (the
one-call layer), beside the kernels' own size queries (``gemm_panel_width``,
``int8_packed_bytes``, ``bf16_packed_numel``, ``layer_scratch``) and ``bind``. The C kernels stay
in the library of the ISA variant `cpu_kernels` loads: `bind` hands its path to the op library,
which looks every entry point of ``kernels.h`` up by name, so the ops follow
``STRATA_CPU_ISA`` and this library is built once per torch version, not per variant. The fake
(meta) kernels registered here give each op's outputs without running it, which
``torch.compile`` and ``torch.library.opcheck`` need.

`cpu_kernels` calls the ops (its wrappers keep the fallbacks and the call counts); nothing calls
a kernel through ctypes. Built with the system C++ compiler against torch's headers (about 5 s
on 2 cores, at set-up: ``python -m shared.model.torch_ops``, else on first use) into
``$STRATA_CACHE/kernels``, keyed by the sources, the torch version and the flags.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp

from shared.config import RuntimeSettings

SOURCE = Path(__file__).with_name("torch_ops.cpp")
HEADER = Path(__file__).with_name("kernels.h")  # the kernels' declarations and layer structs
_lock = threading.Lock()
_registered = False  # the op library is loaded into this process (once: torch cannot unload it)
bound = ""  # the ISA variant whose kernels the ops call


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    inc = [f"-I{p}" for p in (SOURCE.parent, *cpp.include_paths())]
    libs = [f"-L{p}" for p in cpp.library_paths()]
    return [
        "-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *inc, *libs,
        "-lc10", "-ltorch_cpu", "-ldl",
    ]  # fmt: skip


def compiler() -> str:
    """The C++ compiler: ``CXX`` when set, else the first of ``c++`` and ``g++`` on the PATH (a
    Debian box may have ``g++`` without the ``c++`` alternative), else ``c++`` (the build then
    fails with a clear line)."""
    given = os.environ.get("CXX")
    if given:
        return given
    return next((c for c in ("c++", "g++") if shutil.which(c)), "c++")


def library_path() -> Path:
    """Where the op library is (or will be) in the cache: named by a hash of the sources, the
    torch version, the compiler and the flags."""
    cxx = compiler()
    key = "\0".join([SOURCE.read_text(), HEADER.read_text(), torch.__version__, cxx, *_flags()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = Path(RuntimeSettings.from_env().cache_dir) / "kernels"
    return cache / f"strata_torch_ops_{digest}.so"


def build() -> Path:
    """The op library, compiled first when the cache lacks it (`subprocess.SubprocessError`
    with the compiler's last line when that fails)."""
    cxx = compiler()
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / "ops.so"
        cmd = [cxx, str(SOURCE), "-o", str(so), *_flags()]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise subprocess.SubprocessError(f"{cxx} failed for {SOURCE.name}: {tail}")
        os.replace(so, out)  # atomic: concurrent builders race harmlessly
    return out


def _register() -> None:
    """Load the op library (building it first when needed) and register the fake kernels, once
    per process. Raises `OSError` or `subprocess.SubprocessError` when that fails."""
    global _registered
    if _registered:
        return
    torch.ops.load_library(str(build()))  # runs TORCH_LIBRARY: the schemas and CPU kernels
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"strata::{name}")(fake)
    _registered = True


def bind(path: Path) -> str:
    """Point every op at the kernels of the variant library ``path`` (registering the ops first,
    once) and return the variant that library reports. Raises `OSError` or
    `subprocess.SubprocessError` when the op library cannot be built or loaded."""
    global bound
    with _lock:
        _register()
        try:
            bound = torch.ops.strata.bind(str(path))
        except RuntimeError as e:  # dlopen / a missing entry point: the library is unusable
            raise OSError(str(e).splitlines()[0]) from e
    return bound


def _rms_norm_fake(x, weight, eps):
    torch._check(weight.numel() == x.shape[-1])
    return torch.empty_like(x)


def _add_rms_norm_fake(x, residual, weight, eps):
    torch._check(weight.numel() == x.shape[-1])
    return torch.empty_like(x), torch.empty_like(x)


def _in_place_fake(*args, **kwargs):
    return None


def _decode_attention_fake(q, k_cache, v_cache, block_tables, context_lens, scale, sinks=None):
    return torch.empty_like(q)


def _pack_linear_fake(w):
    width = torch.ops.strata.gemm_panel_width()
    n, k = w.shape
    return w.new_empty(((n + width - 1) // width * width * k,))


def _linear_fake(x, packed, n, bias):
    return x.new_empty((x.shape[0], n))


def _pack_int8_fake(w, scale):
    n, k = w.shape
    return w.new_empty((torch.ops.strata.int8_packed_bytes(n, k),), dtype=torch.uint8)


def _pack_bf16_fake(w):
    n, k = w.shape
    return w.new_empty((torch.ops.strata.bf16_packed_numel(n, k),))


def _linear_bf16_fake(x, packed, n, bias, dot_rows):
    return x.new_empty((x.shape[0], n))


_FAKES = {
    "rms_norm": _rms_norm_fake,
    "add_rms_norm": _add_rms_norm_fake,
    "qk_norm_rope_": _in_place_fake,
    "decode_attention": _decode_attention_fake,
    "prefill_attention_": _in_place_fake,
    "pack_linear": _pack_linear_fake,
    "linear": _linear_fake,
    "pack_int8": _pack_int8_fake,
    "linear_int8": _linear_fake,
    "pack_bf16": _pack_bf16_fake,
    "linear_bf16": _linear_bf16_fake,
    "decoder_layer_": _in_place_fake,
}


def main() -> int:
    """Build the op library (``scripts/setup.sh``); one line. Exit 1 when that fails."""
    try:
        path = build()
    except (OSError, subprocess.SubprocessError) as e:
        print(f"[kernels] torch ops: not built ({e})", file=sys.stderr)
        return 1
    print(f"[kernels] torch ops: {path.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
