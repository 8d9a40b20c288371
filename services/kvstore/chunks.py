"""Where a block lives in the SSD tier (`SsdLoc`) and the chunk object format. Pure Python.

Small blocks (the default model's are ~32-64 KiB) are written together as one *chunk object*:
per-object cost dominates below ~1 MiB (docs/benchmarks/kvpool.md). A chunk carries its own
manifest in a header, so one PUT commits blocks and index together (no object without its
index, no index without its object), blocks are read back with ranged GETs (`plan_reads`:
adjacent blocks of one request in one GET), and a restart rebuilds ``hash -> (object, offset,
length)`` by reading each chunk's header::

    b"SKVC" | u32 little-endian index length | msgpack [[hash, length], ...] | block bytes...

Offsets are implied by the order of the index (blocks are stored back to back after it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

MAGIC = b"SKVC"
PREFIX_BYTES = 8  # magic + u32 index length
HEADER_READ_BYTES = 64 << 10  # first ranged read of a header (a second read if it is longer)


class ChunkFormatError(ValueError):
    """The bytes are not a chunk object (wrong magic, truncated or unparsable index)."""


@dataclass(frozen=True)
class SsdLoc:
    """Where a block's bytes are in the object store."""

    obj: str
    """Object name."""
    offset: int = 0
    """Byte offset in the object (0 for a per-block object)."""
    length: int = 0
    """Byte length of the block's serialized frame."""
    ranged: bool = False
    """True when the block is a byte range of a chunk object (read with offset/length)."""


def pack_chunk(obj: str, blocks: list[tuple[str, bytes]]) -> tuple[bytes, dict[str, SsdLoc]]:
    """Chunk object bytes for ``blocks`` (hash, serialized block) and each block's location."""
    if not blocks:
        raise ValueError("a chunk needs at least one block")
    index = msgpack.packb([[h, len(data)] for h, data in blocks])
    offset = PREFIX_BYTES + len(index)
    locs: dict[str, SsdLoc] = {}
    for h, data in blocks:
        locs[h] = SsdLoc(obj, offset, len(data), ranged=True)
        offset += len(data)
    body = b"".join(data for _, data in blocks)
    return MAGIC + struct.pack("<I", len(index)) + index + body, locs


def header_length(prefix: bytes) -> int:
    """Total header bytes (prefix + index) announced by the first ``PREFIX_BYTES`` of a chunk."""
    if len(prefix) < PREFIX_BYTES or prefix[:4] != MAGIC:
        raise ChunkFormatError("not a chunk object (bad magic)")
    (n,) = struct.unpack("<I", prefix[4:PREFIX_BYTES])
    return PREFIX_BYTES + n


def parse_index(obj: str, header: bytes) -> dict[str, SsdLoc]:
    """Locations of the blocks of chunk ``obj`` from its header (at least `header_length`)."""
    end = header_length(header)
    if len(header) < end:
        raise ChunkFormatError(f"chunk {obj}: header truncated ({len(header)} < {end} bytes)")
    try:
        entries = msgpack.unpackb(header[PREFIX_BYTES:end])
        offset = end
        locs: dict[str, SsdLoc] = {}
        for h, length in entries:
            locs[str(h)] = SsdLoc(obj, offset, int(length), ranged=True)
            offset += int(length)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ChunkFormatError(f"chunk {obj}: bad index: {exc}") from exc
    return locs


@dataclass(frozen=True)
class RangeRead:
    """One GET of the SSD tier: ``length`` bytes of ``obj`` from ``offset`` (the whole object
    when not ``ranged``), carrying one or more requested blocks."""

    obj: str
    offset: int
    length: int
    ranged: bool
    members: tuple[tuple[int, int, int], ...]
    """Per block carried: (index in the request, offset in the read's bytes, length)."""

    @property
    def loc(self) -> SsdLoc:
        return SsdLoc(self.obj, self.offset, self.length, self.ranged)


def plan_reads(locs: list[SsdLoc], *, max_bytes: int, max_gap: int) -> list[RangeRead]:
    """The fewest GETs that read every block of ``locs``: blocks of one chunk object whose byte
    ranges are at most ``max_gap`` bytes apart are read with one ranged GET of at most
    ``max_bytes`` (a block larger than that still gets its own; ``max_bytes`` 0 = one GET per
    block); a per-block object is one GET, shared by repeats. Reads come in the order of their
    first requested block, so a streamed reply can start before the last read ends."""
    by_obj: dict[str, list[int]] = {}
    for i, loc in enumerate(locs):
        by_obj.setdefault(loc.obj, []).append(i)
    reads: list[RangeRead] = []
    for obj, idxs in by_obj.items():
        if not locs[idxs[0]].ranged:
            members = tuple((i, 0, locs[i].length) for i in idxs)
            reads.append(RangeRead(obj, 0, locs[idxs[0]].length, False, members))
            continue
        run: list[int] = []
        start = end = 0
        for i in sorted(idxs, key=lambda j: (locs[j].offset, j)):
            lo, hi = locs[i].offset, locs[i].offset + locs[i].length
            if run and lo <= end + max_gap and max(end, hi) - start <= max_bytes:
                run.append(i)
                end = max(end, hi)
                continue
            if run:
                reads.append(_ranged(obj, start, end, run, locs))
            run, start, end = [i], lo, hi
        reads.append(_ranged(obj, start, end, run, locs))
    reads.sort(key=lambda r: min(m[0] for m in r.members))
    return reads


def _ranged(obj: str, start: int, end: int, run: list[int], locs: list[SsdLoc]) -> RangeRead:
    members = tuple((i, locs[i].offset - start, locs[i].length) for i in sorted(run))
    return RangeRead(obj, start, end - start, True, members)
