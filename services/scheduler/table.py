"""Numpy columns over one role's live instances, so a policy scores 1000 instances in a few
vector operations instead of a Python loop (decision latency p99 < 1 ms at 1000 instances).

`Membership` keeps one `RoleTable` per role in step with the `InstanceView`s: rebuilt when the
live set changes, one row rewritten per load report and per routing decision (`refresh`).
A policy given a `ClusterState` without tables (the simulator, failover exclusions) builds one
from the lists (`RoleTable(views)`, O(n) Python, fine at simulator scale).
"""

from __future__ import annotations

import numpy as np

from services.scheduler.types import InstanceView


class RoleTable:
    """Row ``i`` = ``views[i]`` (id order). Columns (float64 unless noted):

    queued: prompt tokens queued (reported waiting + routed since the report);
    rate: measured prefill tokens/s (0 = unknown);
    batch: running + waiting + routed requests;
    kv_total / kv_free_tokens / kv_used: KV capacity (blocks), free tokens, used fraction;
    cached_blocks: blocks the prefix index says the instance holds (its cache footprint);
    reserved: bool, reserved for very long prompts.
    """

    __slots__ = (
        "views",
        "pos",
        "queued",
        "rate",
        "batch",
        "kv_total",
        "kv_free_tokens",
        "kv_used",
        "cached_blocks",
        "reserved",
    )

    def __init__(self, views: list[InstanceView]) -> None:
        self.views = views
        self.pos = {v.instance_id: i for i, v in enumerate(views)}
        n = len(views)
        for col in self.__slots__[2:]:
            setattr(self, col, np.zeros(n, dtype=bool if col == "reserved" else np.float64))
        for i, v in enumerate(views):
            self._set(i, v)

    def __len__(self) -> int:
        return len(self.views)

    def _set(self, i: int, v: InstanceView) -> None:
        self.queued[i] = v.waiting_tokens + v.pending_tokens
        self.rate[i] = v.prefill_tokens_per_s
        self.batch[i] = v.num_running + v.num_waiting + v.pending_requests
        self.kv_total[i] = v.kv_blocks_total
        self.kv_free_tokens[i] = v.kv_blocks_free * v.block_size
        self.kv_used[i] = v.kv_used_frac
        self.cached_blocks[i] = v.cached_blocks
        self.reserved[i] = v.reserved_long

    def refresh(self, v: InstanceView) -> None:
        """Rewrite the row of ``v`` after its view changed (no-op if it is not in the table)."""
        i = self.pos.get(v.instance_id)
        if i is not None and self.views[i] is v:
            self._set(i, v)

    def prefill_rates(self, default_rate: float) -> np.ndarray:
        return np.where(self.rate > 0, self.rate, default_rate)

    def decode_loads(self, batch_norm: float) -> np.ndarray:
        """`basic.decode_load` of every row."""
        return self.kv_used + self.batch / batch_norm


def first_min(primary: np.ndarray, secondary: np.ndarray) -> int:
    """The row with the smallest ``primary``, ties to the smallest ``secondary``, then to the
    lowest row: ``np.lexsort((secondary, primary))[0]`` in O(n) instead of a sort of every row
    (at 5,000 rows 0.01 against 0.58 ms, most of a least_loaded decision)."""
    m = primary.min()
    if m != m:  # NaN: the sort puts it last; keep its answer
        return int(np.lexsort((secondary, primary))[0])
    ties = np.flatnonzero(primary == m)
    return int(ties[0]) if len(ties) == 1 else int(ties[np.argmin(secondary[ties])])


def table_of(views: list[InstanceView], table: RoleTable | None) -> RoleTable:
    """``table`` if given (kept by `Membership`), else one built from ``views``."""
    return table if table is not None else RoleTable(views)
