"""Prometheus metrics of the kvstore (hits/misses per tier, bytes, latency, spill/restore, errors)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from shared.metrics import latency_histogram

HITS = Counter("strata_kvstore_hits_total", "Block reads served, by tier", ["tier"])
MISSES = Counter("strata_kvstore_misses_total", "Block reads found in no tier")
PUTS = Counter("strata_kvstore_puts_total", "Blocks received, by outcome", ["outcome"])
TIER_BLOCKS = Gauge("strata_kvstore_blocks", "Blocks held, by tier", ["tier"])
TIER_BYTES = Gauge("strata_kvstore_bytes", "Bytes held, by tier", ["tier"])
SPILLS = Counter("strata_kvstore_spills_total", "Blocks evicted from DRAM, then written to SSD")
PERSISTS = Counter(
    "strata_kvstore_persists_total", "Blocks written behind to the SSD tier (still in DRAM)"
)
SPILL_BYTES = Counter("strata_kvstore_spill_bytes_total", "Block bytes written to the SSD tier")
SSD_OBJECTS = Counter(
    "strata_kvstore_ssd_objects_written_total",
    "Objects written to the SSD tier, by kind (block: one block; chunk: several small ones)",
    ["kind"],
)
REFRESHES = Counter(
    "strata_kvstore_ssd_refreshes_total", "Listings of the SSD tier after a miss (freshness)"
)
REFRESH_FOUND = Counter(
    "strata_kvstore_ssd_refresh_found_blocks_total",
    "Blocks found by a refresh (written by another instance or before a restart)",
)
SSD_ONLINE = Gauge("strata_kvstore_ssd_online", "1 while the SSD tier answers, else 0")
RESTORES = Counter("strata_kvstore_restores_total", "Blocks read back from the SSD tier")
RESTORE_BYTES = Counter("strata_kvstore_restore_bytes_total", "Bytes read from the SSD tier")
SSD_GETS = Counter(
    "strata_kvstore_ssd_gets_total",
    "GET requests for block reads from the SSD tier (one GET may carry many adjacent blocks)",
)
SSD_GET_BYTES = Counter("strata_kvstore_ssd_get_bytes_total", "Bytes those GETs returned")
SSD_EVICTED_OBJECTS = Counter(
    "strata_kvstore_ssd_evicted_objects_total",
    "Objects deleted from the SSD tier to keep it under ssd_bytes (least recently used first)",
)
SSD_EVICTED_BLOCKS = Counter(
    "strata_kvstore_ssd_evicted_blocks_total", "Blocks in the objects evicted from the SSD tier"
)
SSD_EVICTED_BYTES = Counter(
    "strata_kvstore_ssd_evicted_bytes_total", "Bytes of the objects evicted from the SSD tier"
)
SSD_BUDGET = Gauge("strata_kvstore_ssd_budget_bytes", "SSD tier budget (ssd_bytes; 0 = unbounded)")
ERRORS = Counter("strata_kvstore_errors_total", "Failed operations, by op", ["op"])
LATENCY = latency_histogram("strata_kvstore_op_latency_seconds", "kvstore op latency", ("op",))


def update_gauges(counts: dict[str, int]) -> None:
    TIER_BLOCKS.labels("dram").set(counts["dram_blocks"] + counts["pending_spill_blocks"])
    TIER_BYTES.labels("dram").set(counts["dram_bytes"] + counts["pending_spill_bytes"])
    TIER_BLOCKS.labels("ssd").set(counts["ssd_blocks"])
    TIER_BYTES.labels("ssd").set(counts["ssd_bytes"])
    SSD_BUDGET.set(counts["ssd_budget_bytes"])
    TIER_BLOCKS.labels("write_behind").set(counts["write_behind_blocks"])
