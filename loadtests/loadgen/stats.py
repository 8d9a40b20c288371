"""Pure statistics over finished requests: percentiles, CDFs and one run's summary.

`RequestResult` is what the client records per request; `summarize` turns a list of them plus
the run's wall time into a `Summary` (plain dict-able dataclass, the JSON report's core).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds from the run's start)."""

    index: int
    start: float
    status: int = 0  # HTTP status; 0 = transport error before any status
    ttft: float | None = None  # seconds from send to the first content chunk
    e2e: float | None = None  # seconds from send to the end of the response
    itl: list[float] = field(default_factory=list)  # gaps between content chunks (TBT)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    tenant: int = -1
    image: bool = False
    concurrency: int = 0  # sweep level this request ran at (0 = not a sweep)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); ``q`` in [0, 100].

    NaN for an empty list, so a missing measurement never reads as zero."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical CDF (i/n for the i-th smallest, 1-based)."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


@dataclass
class Dist:
    """Percentiles of one latency (seconds)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Dist:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            len(values),
            sum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
            max(values),
        )


@dataclass
class Summary:
    """Aggregate of one run (or of one concurrency level of a sweep)."""

    requests: int
    ok: int
    errors_by_status: dict[str, int]
    duration_s: float
    request_throughput: float  # finished OK requests per second
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt + completion tokens of OK requests per second
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: Dist
    tbt: Dist
    e2e: Dist
    concurrency: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def error_key(r: RequestResult) -> str:
    """Bucket of a failed request: its HTTP status, or ``transport`` / ``stream`` errors."""
    if r.status == 0:
        return "transport"
    if r.status == 200:
        return "stream"  # an error object mid-stream, or a cut stream
    return str(r.status)


def summarize(results: list[RequestResult], duration_s: float, concurrency: int = 0) -> Summary:
    """Summary of ``results`` over a run of ``duration_s`` wall seconds."""
    ok = [r for r in results if r.ok]
    errors = Counter(error_key(r) for r in results if not r.ok)
    dur = max(duration_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    return Summary(
        requests=len(results),
        ok=len(ok),
        errors_by_status=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=len(ok) / dur,
        output_tokens_per_s=completion / dur,
        total_tokens_per_s=(prompt + completion) / dur,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=sum(r.cached_tokens for r in ok),
        ttft=Dist.of([r.ttft for r in ok if r.ttft is not None]),
        tbt=Dist.of([g for r in ok for g in r.itl]),
        e2e=Dist.of([r.e2e for r in ok if r.e2e is not None]),
        concurrency=concurrency,
    )
