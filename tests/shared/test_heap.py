"""`shared.heap` and its use in `shared.service`: a process started by `run` freezes its
start-up heap when it announces ready (full collections then skip those objects), a service run
inside another process leaves that process's collector alone, and collections are timed.

The freezing cases run in a fresh interpreter each: freezing would change this test process."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from shared import heap

SCRIPT = r"""
import asyncio, gc, json, sys
from shared import service
from shared.heap import GC_FROZEN

keep = [[i] for i in range(50_000)]  # start-up objects that live as long as the process
case = sys.argv[1]
seen = {"before": gc.get_freeze_count()}

async def main(stop):
    service.announce_ready("probe", "probe-0")

if case == "run":
    service.run(main)  # the process is this service's
else:
    asyncio.run(main(None))  # a service inside someone else's process
seen["after"] = gc.get_freeze_count()
seen["gauge"] = GC_FROZEN._value.get()
# a full collection now walks only what was allocated after the freeze
seen["tracked_gen2"] = len(gc.get_objects(generation=2))
print(json.dumps(seen))
"""


def run_case(case: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_service_process_freezes_its_startup_heap_when_ready():
    seen = run_case("run")
    assert seen["before"] == 0
    # the start-up lists and everything imported (the gauge is the count at the freeze; a
    # frozen object freed since, by the loop's teardown, leaves the count)
    assert seen["gauge"] >= seen["after"] > 50_000
    assert seen["tracked_gen2"] < 50_000  # they are no longer in the oldest generation


def test_a_service_inside_another_process_does_not_freeze_it():
    seen = run_case("in-process")
    assert seen["before"] == seen["after"] == 0
    assert seen["gauge"] == 0
    assert seen["tracked_gen2"] > 50_000  # control: without the freeze they are walked


@pytest.mark.parametrize("generation", [0, 2])
def test_collections_are_timed_per_generation(generation):
    heap.watch_gc_pauses()
    heap.watch_gc_pauses()  # idempotent: one callback
    assert gc.callbacks.count(heap._on_gc) == 1
    sample = heap.GC_PAUSE.labels(str(generation))
    gc.disable()  # no automatic collection (another thread's allocations) between the reads
    try:
        before = sample._sum.get(), _count(generation)
        gc.collect(generation)
        after = sample._sum.get(), _count(generation)
    finally:
        gc.enable()
    assert after[1] == before[1] + 1
    assert after[0] > before[0]


def _count(generation: int) -> float:
    for metric in heap.GC_PAUSE.collect():
        for s in metric.samples:
            if s.name.endswith("_count") and s.labels.get("generation") == str(generation):
                return s.value
    return 0.0
