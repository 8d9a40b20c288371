"""The model fingerprint, torch-free: the tokenizer salts block hashes with it exactly as the
engines do, without loading (or importing) anything that runs the model.

Fingerprint: ``sha256(architecture, weights digest, dtype)``. The weights digest hashes, per
safetensors file in name order, the file name and size plus either the whole file (files up to
``FULL_HASH_LIMIT`` bytes) or the safetensors header and ``SAMPLE_CHUNKS`` evenly spaced 1 MiB
chunks (larger files). It depends only on file bytes, so it is stable across processes and
machines, and it costs at most ~``SAMPLE_CHUNKS`` MiB of reads per big shard. The dtype is
spelled as torch prints it (``torch.bfloat16``), whether given as a torch dtype or a wire name,
so fingerprints stay what earlier releases wrote to the pool.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from shared.model.validate import checkpoint_files
from shared.protocol.dtypes import canonical_name

if TYPE_CHECKING:
    import torch

FULL_HASH_LIMIT = 256 << 20
SAMPLE_CHUNKS = 32
_CHUNK = 1 << 20


def _file_digest(file: Path, h) -> None:
    size = file.stat().st_size
    h.update(f"{file.name}\0{size}\0".encode())
    with open(file, "rb") as f:
        if size <= FULL_HASH_LIMIT:
            while chunk := f.read(16 * _CHUNK):
                h.update(chunk)
            return
        (header_len,) = struct.unpack("<Q", f.read(8))
        h.update(f.read(header_len))
        for i in range(SAMPLE_CHUNKS):
            f.seek(max(size - _CHUNK, 0) * i // (SAMPLE_CHUNKS - 1))
            h.update(f.read(_CHUNK))


def weights_digest(files: list[Path]) -> str:
    """Hex digest of the weight files (see module docstring for the sampling rule)."""
    h = hashlib.sha256()
    for file in sorted(files, key=lambda p: p.name):
        _file_digest(file, h)
    return h.hexdigest()


def fingerprint_of(architecture: str, files: list[Path], dtype: torch.dtype | str) -> str:
    """The model fingerprint: sha256 of architecture, weights digest and dtype (a torch dtype
    or its wire name: the same fingerprint)."""
    spelled = f"torch.{canonical_name(dtype)}" if isinstance(dtype, str) else str(dtype)
    return hashlib.sha256(
        f"{architecture}\0{weights_digest(files)}\0{spelled}".encode()
    ).hexdigest()


def model_fingerprint(path: str | Path, architecture: str, dtype: torch.dtype | str) -> str:
    """`LoadedModel.fingerprint` of a checkpoint without loading its weights (the tokenizer
    service uses it to salt block hashes exactly as the engines do)."""
    files, _ = checkpoint_files(Path(path))
    return fingerprint_of(architecture, files, dtype)
