"""Native CPU kernel for decode attention over the paged KV cache.

Decode attention in torch needs, per sequence and layer, two ``index_select`` copies of its
context blocks and one small SDPA call: ~300 tiny ops per step for 16 sequences x 8 layers, which
measured ~13 ms of a 33 ms step on the benchmark model (docs/benchmarks/model.md). The kernel
in ``decode_attention.c`` (beside this file, shipped as package data) reads K/V straight from
the blocks (no copy) for every sequence and head in one call.

It is plain C built on first use with the system C compiler (``cc -O3 -march=native``, well
under a second) into ``$STRATA_CACHE/kernels`` and called through ctypes, which releases the GIL.
No torch headers are needed. Where there is no compiler, or ``STRATA_CPU_KERNELS=0``, or the
dtype is not float32, ``decode_attention`` returns ``None`` and the caller uses the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from shared.config import RuntimeSettings

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_attention.c")  # package data (pyproject.toml)

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None  # False: tried and unavailable


def _cache_dir() -> Path:
    return Path(RuntimeSettings.from_env().cache_dir) / "kernels"


def _build() -> ctypes.CDLL | bool:
    if not RuntimeSettings.from_env().cpu_kernels:
        return False
    cc = os.environ.get("CC", "cc")
    try:
        source = _SOURCE.read_text()
    except OSError as e:
        log.warning("CPU attention kernel source missing (%s); using the torch path", e)
        return False
    key = hashlib.sha256(
        "\0".join([source, cc, *_FLAGS, platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"strata_attn_{key}.so"
    try:
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                src, so = Path(tmp) / "k.c", Path(tmp) / "k.so"
                src.write_text(source)
                subprocess.run(
                    [cc, *_FLAGS, str(src), "-o", str(so), "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(so, out)  # atomic: concurrent builders race harmlessly
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU attention kernel unavailable (%s); using the torch path", e)
        return False
    f = lib.strata_decode_attn_f32
    f.restype = None
    f.argtypes = (
        [ctypes.c_void_p] * 5
        + [ctypes.c_int64] * 6
        + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
    )
    return lib


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


# CPU flags of a native matrix unit for each half type; without one torch emulates it (measured
# 3-4x slower than float32 on an AVX2-only EPYC, docs/benchmarks/peer.md).
_NATIVE_HALF = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def native_half(dtype: str, flags: str | None = None) -> bool:
    """Whether this CPU (or ``flags``, a /proc/cpuinfo flags line) has native matrix products
    for ``dtype`` ("bfloat16" / "float16"); True for any other dtype."""
    if dtype not in _NATIVE_HALF:
        return True
    have = set((_cpu_flags() if flags is None else flags).split())
    return any(f in have for f in _NATIVE_HALF[dtype])


def available() -> bool:
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _build()
    return _lib is not False


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """``[B, H, D]`` attention of one query token per sequence over its cached context, or
    ``None`` when the native kernel does not apply (not CPU float32, or no compiler)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if not available():
        return None
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    ctx = context_lens.to(torch.int64).contiguous()
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    out = torch.empty_like(q)
    _lib.strata_decode_attn_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        ctx.data_ptr(),
        tables.shape[1],
        b,
        h,
        kvh,
        d,
        bs,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
