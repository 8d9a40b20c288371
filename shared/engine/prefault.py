"""Faulting the KV cache's pages in ahead of use, while the engine is idle.

On CPU the KV cache is a lazily zeroed mapping (`shared.model.api.KVCache.allocate`): a page
becomes resident when a step first writes a block into it, and the kernel zeroes it there, inside
the step (about 0.65 s per GiB on a 2-core EPYC; 11% of a 2048-token prefill's profile while the
cache fills, and the OpenMP team's other thread waits at the barrier meanwhile). The block
manager hands out never-used blocks in ascending order (`BlockManager.high_water`), so the pages
the next steps will touch are known: `KVPrefaulter` makes a window of them resident ahead of the
high-water mark, one chunk per idle turn of the engine thread (`EnginePort`), with
``madvise(MADV_POPULATE_WRITE)``: it faults the pages in without writing them, so a block in use
is never changed. Memory stays proportional to use (the high-water mark plus the window), and
the zeroing moves from the request path to time the engine had nothing to do.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

MADV_POPULATE_WRITE = 23  # Linux 5.14+
PAGE = mmap.PAGESIZE
CHUNK_BYTES = 16 << 20
"""Bytes one idle turn faults in (about 10 ms on a 2-core EPYC): a request that arrives meanwhile
waits at most that long."""


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


class KVPrefaulter:
    """Keeps blocks ``[0, high_water + window)`` of every layer of ``k`` and ``v``
    (``[layers, blocks, ...]``, contiguous, on the CPU) resident, a chunk per `step`.
    ``why`` says why it does nothing ("" while it works): "off" (a window of 0), "device" (not
    CPU memory), "layout", "unsupported" (no ``MADV_POPULATE_WRITE``: a kernel before 5.14,
    or not Linux)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, window_bytes: int):
        self.tensors = (k, v)
        self.num_layers, self.num_blocks = k.shape[0], k.shape[1]
        self.block_bytes = k[0, 0].numel() * k.element_size()  # one layer's block, one of k / v
        per_block = 2 * self.num_layers * self.block_bytes  # a block of every layer, k and v
        self.window = min(self.num_blocks, -(-window_bytes // per_block)) if window_bytes else 0
        self.chunk = max(1, CHUNK_BYTES // per_block)
        self.done = 0  # blocks [0, done) are resident in every layer of k and v
        self.bytes = 0  # bytes faulted in so far
        self._madvise = _madvise()
        self.why = self._why(k, v)

    def _why(self, k: torch.Tensor, v: torch.Tensor) -> str:
        if not self.window:
            return "off"
        if k.device.type != "cpu" or v.device.type != "cpu":
            return "device"
        if not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape:
            return "layout"
        if self._madvise is None or not hasattr(os, "sysconf"):
            return "unsupported"
        return ""

    def target(self, high_water: int) -> int:
        return min(self.num_blocks, high_water + self.window)

    def pending(self, high_water: int) -> bool:
        return not self.why and max(self.done, high_water) < self.target(high_water)

    def step(self, high_water: int) -> int:
        """Fault in the next chunk of blocks past ``max(done, high_water)`` (blocks below the
        high-water mark were written by steps: resident already); returns the bytes."""
        if not self.pending(high_water):
            return 0
        start = max(self.done, high_water)
        end = min(self.target(high_water), start + self.chunk)
        n = 0
        for t in self.tensors:
            base = t.data_ptr()
            for layer in range(self.num_layers):
                lo = base + (layer * self.num_blocks + start) * self.block_bytes
                hi = base + (layer * self.num_blocks + end) * self.block_bytes
                lo -= lo % PAGE  # a page shared with the block before: populating it is harmless
                hi += -hi % PAGE
                if self._madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                    self.why = "unsupported"  # EINVAL: a kernel without it
                    return n
                n += hi - lo
        self.done, self.bytes = end, self.bytes + n
        return n
