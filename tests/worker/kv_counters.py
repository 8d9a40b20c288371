"""The KV transfer counters of in-process services, as before/after deltas.

Decode recomputes a prompt whose KV does not arrive and produces the same tokens, so a test that
compares tokens only passes with the transfer broken. These helpers read the counters that say
which path moved the KV (`shared.worker.kv_metrics`, and the kvstore's served blocks per
tier) straight from the Prometheus registry, and compute the bytes a path must move.
"""

from __future__ import annotations

from prometheus_client import REGISTRY

from shared.worker.kv_metrics import FALLBACK_REASONS, TRANSFER_MODES


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def read_counters() -> dict[str, float]:
    """``"sent:<mode>"``, ``"received:<mode>"``, ``"fallback:<reason>"`` and
    ``"kvstore_hits:<tier>"`` -> current value."""
    out = {}
    for m in TRANSFER_MODES:
        out[f"sent:{m}"] = _value("strata_kv_transfer_sent_bytes_total", mode=m)
        out[f"received:{m}"] = _value("strata_kv_transfer_received_bytes_total", mode=m)
    for r in FALLBACK_REASONS:
        out[f"fallback:{r}"] = _value("strata_kv_transfer_fallback_total", reason=r)
    for t in ("dram", "ssd"):
        out[f"kvstore_hits:{t}"] = _value("strata_kvstore_hits_total", tier=t)
    return out


class Transfers:
    """Counters at construction; `moved` gives what changed since (non-zero deltas only)."""

    def __init__(self) -> None:
        self.before = read_counters()

    def moved(self) -> dict[str, int]:
        now = read_counters()
        return {k: int(v - self.before[k]) for k, v in now.items() if v != self.before[k]}


def kv_bytes(rt, tokens: int, *, int8: bool = False) -> int:
    """Payload bytes of ``tokens`` tokens' KV over all layers of ``rt``'s model: layers x 2 (K/V)
    x kv_heads x head_dim x dtype size; int8 is 1 byte per element plus a float32 scale per
    head_dim row."""
    m = rt.loaded.model
    row = m.head_dim + 4 if int8 else m.head_dim * rt.port.kv_spec.element_size
    return tokens * m.num_layers * 2 * m.num_kv_heads * row


def assert_moved(
    moved: dict[str, int], mode: str, nbytes: int, *, sent: int | None = None, **extra: int
) -> None:
    """Path ``mode`` delivered exactly ``nbytes`` into decode, prefill sent ``sent`` (default the
    same), no other path moved a byte, nothing fell back; ``extra`` are other expected deltas
    (e.g. ``kvstore_hits_dram=10``)."""
    sent = nbytes if sent is None else sent
    want = {f"received:{mode}": nbytes, f"sent:{mode}": sent}
    want.update({k.replace("_dram", ":dram").replace("_ssd", ":ssd"): v for k, v in extra.items()})
    want = {k: v for k, v in want.items() if v}
    assert nbytes > 0, "a transfer test must expect bytes to move"
    assert moved == want, f"KV transfer counters moved {moved}, expected {want}"
