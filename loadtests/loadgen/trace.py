"""Pure replay of the Mooncake conversation trace, scaled down to one machine.

Each trace row has ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one per
512-token prefix block). A hash id maps to a fixed pseudo-random run of words (same id -> same
text, in every process and run), the blocks are concatenated and the last one is truncated to the
input length. Lengths and time are scaled by factors and capped, so shared prefixes stay shared
(a scaled block is ``round(512 * length_scale)`` words).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadtests.loadgen.workload import WORDS, Job

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_trace.jsonl"
)
"""The vendored trace (Apache-2.0, see loadtests/data/mooncake/README.md)."""


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScale:
    """How the trace is shrunk: multiply lengths and times, then cap."""

    length_scale: float = 1 / 32  # input tokens and block size
    output_scale: float = 1 / 16  # output tokens
    time_scale: float = 1.0  # arrival offsets (0.5 = twice as fast)
    max_input: int = 512  # cap on scaled input words
    max_output: int = 64  # cap on scaled output tokens
    max_requests: int = 64  # rows used (from the start of the trace)
    seed: int = 0  # changes every block's text

    def __post_init__(self) -> None:
        for name in ("length_scale", "output_scale", "time_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_input < 1 or self.max_output < 1 or self.max_requests < 1:
            raise ValueError("max_input, max_output and max_requests must be >= 1")

    @property
    def block_words(self) -> int:
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))


def load_trace(path: str | Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRow]:
    """The first ``limit`` rows of a Mooncake-format JSONL trace."""
    rows = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            d = json.loads(line)
            rows.append(
                TraceRow(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(d["hash_ids"]),
                )
            )
    return rows


def block_text(hash_id: int, n_words: int, seed: int = 0) -> list[str]:
    """The fixed words of one trace block: a pure function of (hash_id, n_words, seed)."""
    rng = random.Random(f"mooncake:{seed}:{hash_id}")
    return [rng.choice(WORDS) for _ in range(n_words)]


def scaled_lengths(row: TraceRow, scale: TraceScale) -> tuple[int, int]:
    """(input words, output tokens) of ``row`` after scaling and capping (each >= 1)."""
    n_in = min(scale.max_input, max(1, round(row.input_length * scale.length_scale)))
    n_out = min(scale.max_output, max(1, round(row.output_length * scale.output_scale)))
    return n_in, n_out


def row_prompt(row: TraceRow, scale: TraceScale) -> str:
    """The prompt of one row: its blocks' words in order, truncated to the scaled input."""
    n_in, _ = scaled_lengths(row, scale)
    out: list[str] = []
    for h in row.hash_ids:
        if len(out) >= n_in:
            break
        out.extend(block_text(h, scale.block_words, scale.seed))
    if len(out) < n_in:  # a row longer than its blocks: pad with a row-specific tail
        out.extend(block_text(-1 - len(out), n_in - len(out), scale.seed))
    return " ".join(out[:n_in])


def trace_jobs(rows: list[TraceRow], scale: TraceScale) -> list[Job]:
    """Completion jobs for the first ``scale.max_requests`` rows, arrivals from the trace."""
    rows = rows[: scale.max_requests]
    t0 = rows[0].timestamp_ms if rows else 0.0
    jobs = []
    for i, row in enumerate(rows):
        _, n_out = scaled_lengths(row, scale)
        arrival = (row.timestamp_ms - t0) / 1000.0 * scale.time_scale
        jobs.append(Job(i, n_out, prompt=row_prompt(row, scale), arrival=arrival))
    return jobs
