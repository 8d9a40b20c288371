"""The dtype `strata up` gives the model processes: the checkpoint's, or float32 where the CPU
would emulate the checkpoint's half type.

A bf16 or fp16 checkpoint on a CPU without a native unit for that type (no ``avx512_bf16`` /
``amx_bf16``, resp. ``avx512_fp16`` / ``amx_fp16``) runs in float32: torch emulates the half type
there and runs several times slower (docs/benchmarks/peer.md). Float32 doubles the weights'
memory, so the half type stays, with a line saying why, when float32 weights would take more
than half of the machine's memory. ``--dtype`` always wins. Where the CPU has a native unit the
half type stays: on an AVX512-BF16 EPYC the default cluster served a bf16 model at about the
same tokens/s as in float32, with a shorter TTFT and a longer TBT (docs/benchmarks/peer.md).

Every model process and the tokenizer get the same ``STRATA_DTYPE`` (block hashes carry the
dtype-bearing fingerprint, so all must agree).
"""

from __future__ import annotations

from pathlib import Path

from shared.model.errors import CheckpointError
from shared.model.validate import declared_dtype, read_config_json
from shared.worker.kv_budget import fmt_bytes

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype the checkpoint's config.json declares, by name ("float32" when it names none or
    cannot be read: the model processes then report what is wrong)."""
    try:
        named = declared_dtype(read_config_json(Path(model_dir) / "config.json"))
    except CheckpointError:
        return "float32"
    return str(named).removeprefix("torch.") if named else "float32"


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's weight files (0 when there are none to read)."""
    try:
        files = list(Path(model_dir).iterdir())
    except OSError:
        return 0
    return sum(f.stat().st_size for f in files if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def serving_dtype(
    checkpoint: str,
    requested: str,
    device: str,
    native: bool,
    weights: int = 0,
    memory: int = 0,
) -> tuple[str, str]:
    """The ``STRATA_DTYPE`` for the model processes ("" = the checkpoint's), and why (one line)
    when it is not what was asked. ``native``: the CPU has a unit for the checkpoint's half type
    (`shared.model.cpu_kernels.native_half`); ``weights`` the checkpoint's weight bytes and
    ``memory`` the machine's (0 = unknown)."""
    if requested or device != "cpu" or checkpoint == "float32" or native:
        return requested, ""
    if weights and memory and 2 * weights > memory // 2:
        return requested, (
            f"dtype {checkpoint} kept: float32 weights ({fmt_bytes(2 * weights)}) would take more than "
            f"half of the memory ({fmt_bytes(memory)}), but this CPU has no native {checkpoint} unit "
            f"and runs it several times slower"
        )
    return "float32", (
        f"dtype float32: the checkpoint is {checkpoint} and this CPU has no native {checkpoint} "
        f"matrix unit (AVX512 / AMX), where {checkpoint} runs several times slower; "
        f"--dtype {checkpoint} keeps it"
    )
