"""The cyclic garbage collector in a long-running service: start-up objects frozen out of its
view, and its pauses measured.

A service's heap after start-up is mostly objects that live as long as the process: modules,
FastAPI and pydantic schemas, the tokenizer, the model's modules and parameters. CPython's full
(generation-2) collection walks all of them while holding the GIL, and it runs whenever enough
new objects have survived two younger collections: under load, every few seconds. Measured on
the default cluster (2-core box): 130-180 ms per full collection in the gateway and in the decode
process, 255 ms in the tokenizer, each a stall of every request in that process (in decode, of
the engine thread too). `freeze_startup_heap` collects once and moves everything alive into
the permanent generation (`gc.freeze`), so later collections only walk what was allocated since.
Every service calls it when it announces it is ready (`shared.service.announce_ready`).

``strata_gc_pause_seconds{generation}`` (a histogram, every service) shows the collector's
pauses; ``strata_gc_frozen_objects`` how many objects start-up froze.
"""

from __future__ import annotations

import gc
import time

from prometheus_client import Gauge, Histogram

GC_PAUSE = Histogram(
    "strata_gc_pause_seconds",
    "Pauses of Python's cyclic garbage collector (the GIL is held throughout)",
    ["generation"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
GC_FROZEN = Gauge(
    "strata_gc_frozen_objects",
    "Objects moved out of the collector's view at start-up (gc.freeze)",
)

_started: list[float] = []


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        GC_PAUSE.labels(str(info["generation"])).observe(time.perf_counter() - _started.pop())


def watch_gc_pauses() -> None:
    """Time every collection into ``strata_gc_pause_seconds`` (idempotent)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now; the number frozen."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    GC_FROZEN.set(n)
    return n
