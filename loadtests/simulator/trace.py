"""The Mooncake conversation trace (vendored: loadtests/data/mooncake/, Apache-2.0)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512  # one hash id per 512-token block
_LOADTESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(_LOADTESTS, "data", "mooncake", "conversation_trace.jsonl")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_len: int
    output_len: int
    hashes: tuple[str, ...]  # block identities as the index sees them


def load_trace(path: str = DEFAULT_TRACE, limit: int = 0) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(
                TraceRequest(
                    r["timestamp"] / 1000.0,
                    int(r["input_length"]),
                    max(1, int(r["output_length"])),
                    tuple(f"{h:x}" for h in r["hash_ids"]),
                )
            )
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out
