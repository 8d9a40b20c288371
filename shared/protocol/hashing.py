"""The one block-identity function of the project.

A KV block is ``block_size`` tokens across all layers. Its identity is a chained hash
``h_i = xxh3_128(h_{i-1} || tokens_i as little-endian int32 || extra_i)`` whose root parent is a
salt derived from the model fingerprint, the KV dtype and the block size. Only FULL blocks get a
hash. ``extra_i`` carries the content hashes of image spans overlapping block ``i``, so the same
placeholder tokens with different images never collide. A request with a ``cache_salt``
(`request_salt`) roots its chain on a salt derived from both, so its blocks match only those of
requests with the same salt. The engine, the kvstore and the global
scheduler all import this module; hashes travel as hex strings on the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xxhash

_VERSION = b"strata-kv-v1"


def model_salt(fingerprint: str, dtype: str, block_size: int) -> bytes:
    """Root parent of every hash chain for one (model weights, KV dtype, block size)."""
    key = b"|".join([_VERSION, fingerprint.encode(), str(dtype).encode(), str(block_size).encode()])
    return xxhash.xxh3_128_digest(key)


def request_salt(salt: bytes, cache_salt: str = "") -> bytes:
    """The root of one request's hash chain: ``salt`` (`model_salt`), or with a ``cache_salt``
    (vLLM's per-request prefix-cache isolation) a root derived from both, so no block of it
    hashes like a block of a request without that salt."""
    if not cache_salt:
        return salt
    return xxhash.xxh3_128_digest(salt + b"|cache_salt|" + cache_salt.encode())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes,
    extra_keys: Callable[[int], bytes] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained 16-byte hashes of the full blocks of ``token_ids``.

    ``parent`` continues an existing chain (``token_ids`` then start at a block boundary and
    ``extra_keys(i)`` is indexed relative to them); without it the chain starts at ``salt``.
    A trailing partial block gets no hash.
    """
    prev = salt if parent is None else parent
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    arr = np.asarray(token_ids[: n_full * block_size], dtype="<i4")
    out: list[bytes] = []
    for i in range(n_full):
        data = prev + arr[i * block_size : (i + 1) * block_size].tobytes()
        if extra_keys is not None:
            data += extra_keys(i)
        prev = xxhash.xxh3_128_digest(data)
        out.append(prev)
    return out


def mm_extra_keys(
    spans: Sequence[tuple[int, int, str]], block_size: int, first_block: int = 0
) -> Callable[[int], bytes] | None:
    """``extra_keys`` for image spans ``(offset, length, content_hash)`` in token positions.

    Block ``i`` (relative to ``first_block``) gets the content hashes of every span that overlaps
    it, in offset order. Returns None when there are no spans (text-only prompts hash the same as
    with ``extra_keys=None``).
    """
    if not spans:
        return None
    ordered = sorted(spans)

    def extra(i: int) -> bytes:
        lo = (first_block + i) * block_size
        hi = lo + block_size
        return b"".join(h.encode() for off, n, h in ordered if off < hi and off + n > lo)

    return extra


def to_hex(hashes: Sequence[bytes]) -> list[str]:
    """Wire form of block hashes."""
    return [h.hex() for h in hashes]


def from_hex(hashes: Sequence[str]) -> list[bytes]:
    """Inverse of :func:`to_hex`."""
    return [bytes.fromhex(h) for h in hashes]
