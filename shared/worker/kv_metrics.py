"""KV transfer metrics of a prefill / decode instance: which path moved a prompt's KV.

Prefill counts the payload bytes it hands to a transfer (``strata_kv_transfer_sent_bytes_total
{mode}``), decode the payload bytes it wrote into its engine from a transfer and used
(``strata_kv_transfer_received_bytes_total{mode}``); either side counts a transfer that fell
back to recompute (``strata_kv_transfer_fallback_total{reason}``: prefill when its push broke,
decode when promised KV did not check out or the pool lacked blocks). Payload bytes are a
frame's data + scales, so int8 KV shows as int8-sized. A transfer that silently breaks leaves
the received bytes flat and the fallback counter moving, while the tokens stay right.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from prometheus_client import Counter

from protos.kv_transfer_pb2 import BlockFrame
from shared.kvtransfer.frames import frame_nbytes
from shared.protocol.errors import StrataError

# layerwise: pushed layer by layer during the prefill; after_prefill: pushed once the prefill
# finished; pool: through the kvstore (prefill stores the full blocks, decode loads them).
TRANSFER_MODES = ("layerwise", "after_prefill", "pool")
# no_kv: decode was promised pushed KV that never came; pool_miss: the pool lacked blocks;
# timeout: a transfer started but did not complete in time; bad_frame: the receiver rejected a
# frame (fingerprint, dtype, shape, range, coverage); unreachable: prefill could not reach the
# decode instance; broken: the stream failed otherwise.
FALLBACK_REASONS = ("no_kv", "pool_miss", "timeout", "bad_frame", "unreachable", "broken")

KV_SENT_BYTES = Counter(
    "strata_kv_transfer_sent_bytes_total",
    "KV payload bytes prefill handed to the transfer, by mode",
    ["mode"],
)
KV_RECEIVED_BYTES = Counter(
    "strata_kv_transfer_received_bytes_total",
    "KV payload bytes decode wrote into its engine from a transfer and used, by mode",
    ["mode"],
)
KV_TRANSFER_FALLBACKS = Counter(
    "strata_kv_transfer_fallback_total",
    "Decode recomputed a prompt because KV did not arrive, by reason",
    ["reason"],
)
for _m in TRANSFER_MODES:  # every series exists from the start (a scrape reads 0, not absent)
    KV_SENT_BYTES.labels(_m)
    KV_RECEIVED_BYTES.labels(_m)
for _r in FALLBACK_REASONS:
    KV_TRANSFER_FALLBACKS.labels(_r)


def fallback_reason(exc: BaseException) -> str:
    """The fallback reason a failed push on the prefill side stands for."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, StrataError):
        return {"timeout": "timeout", "bad_request": "bad_frame", "unavailable": "unreachable"}.get(
            exc.code, "broken"
        )
    return "broken"


def count_fallback(reason: str) -> None:
    """One prompt decode recomputes because its KV did not arrive, for ``reason``."""
    if reason not in FALLBACK_REASONS:
        raise ValueError(
            f"unknown KV fallback reason {reason!r}; expected one of {FALLBACK_REASONS}"
        )
    KV_TRANSFER_FALLBACKS.labels(reason).inc()


async def counted_frames(frames: AsyncIterable[BlockFrame], mode: str) -> AsyncIterator[BlockFrame]:
    """``frames`` unchanged, each one's payload bytes counted as sent in ``mode`` as it is
    handed to the transport."""
    sent = KV_SENT_BYTES.labels(mode)
    async for f in frames:
        sent.inc(frame_nbytes(f))
        yield f
