"""Chunk object format and the refresh/negative cache: pure, exact."""

from __future__ import annotations

import pytest

from services.kvstore.chunks import (
    PREFIX_BYTES,
    ChunkFormatError,
    SsdLoc,
    header_length,
    pack_chunk,
    parse_index,
)
from services.kvstore.miss_cache import MissCache
from services.kvstore.ssd import chunk_fingerprint, new_chunk_name, object_name, parse_name


def test_chunk_round_trip_and_byte_ranges():
    blocks = [("h1", b"a" * 5), ("h2", b""), ("h3", b"xyz")]
    data, locs = pack_chunk("fp/chunk/1", blocks)
    hdr = header_length(data[:PREFIX_BYTES])
    assert locs == {
        "h1": SsdLoc("fp/chunk/1", hdr, 5, True),
        "h2": SsdLoc("fp/chunk/1", hdr + 5, 0, True),
        "h3": SsdLoc("fp/chunk/1", hdr + 5, 3, True),
    }
    assert len(data) == hdr + 8
    for h, payload in blocks:
        loc = locs[h]
        assert data[loc.offset : loc.offset + loc.length] == payload
    assert parse_index("fp/chunk/1", data[:hdr]) == locs  # the header alone is enough
    with pytest.raises(ChunkFormatError):
        parse_index("x", data[: hdr - 1])
    with pytest.raises(ChunkFormatError):
        header_length(b"NOPE\0\0\0\0")
    with pytest.raises(ValueError):
        pack_chunk("x", [])


def test_object_names():
    assert object_name(("fp", "ab")) == "fp/ab" and parse_name("fp/ab") == ("fp", "ab")
    assert parse_name("_/ab") == ("", "ab")
    name = new_chunk_name("fp")
    assert name.startswith("fp/chunk/") and parse_name(name) is None
    assert chunk_fingerprint(name) == "fp" and chunk_fingerprint("fp/ab") is None
    assert chunk_fingerprint(new_chunk_name("")) == ""
    assert new_chunk_name("fp") != name


def test_miss_cache_rate_limits_refreshes_and_expires_negatives():
    now = [100.0]
    mc = MissCache(refresh_interval=2.0, negative_ttl=5.0, max_keys=2, clock=lambda: now[0])
    a, b, c = ("m", "a"), ("m", "b"), ("m", "c")
    assert mc.need_refresh("m", [a])  # never refreshed
    mc.refreshed("m")
    mc.missed([a])
    assert not mc.need_refresh("m", [b])  # refreshed 0 s ago
    now[0] += 2.0
    assert not mc.need_refresh("m", [a]) and mc.need_refresh("m", [a, b])
    assert mc.need_refresh("other", [("other", "a")])  # per fingerprint
    mc.missed([b, c])  # bounded: a (oldest) is dropped
    assert not mc.is_negative(a) and mc.is_negative(b) and mc.is_negative(c)
    mc.forget(b)
    assert not mc.is_negative(b)
    now[0] += 5.0
    assert not mc.is_negative(c)
