"""`shared.omp`: a thread under `serial_torch_here` never leads an OpenMP team, and a team led
inside `in_fresh_thread` ends with it. Each case runs in a fresh interpreter with 2 torch
threads (this process's own teams would blur the thread counts), and each has its control: the
same op without the guard starts the team's worker thread, which a plain thread keeps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, sys, threading, time
import torch
from shared.omp import in_fresh_thread, serial_torch_here

torch.set_num_threads(2)
case = sys.argv[1]

def tasks():
    return set(os.listdir("/proc/self/task"))

def big_op():
    x = torch.ones(1 << 22)
    for _ in range(3):
        x.mul_(1.0001)  # a parallel_for over 4M floats: a team when allowed
    return float(x[0])

def settled(want, timeout=5.0):
    deadline = time.monotonic() + timeout
    while len(tasks()) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(tasks())

base = len(tasks())
seen = {}
if case in ("serial", "plain"):
    def run():
        if case == "serial":
            seen["guarded"] = serial_torch_here()
        before = len(tasks())
        big_op()
        seen["new_threads"] = len(tasks()) - before
    t = threading.Thread(target=run); t.start(); t.join()
elif case in ("fresh", "kept"):
    if case == "fresh":
        in_fresh_thread(big_op)
        seen["left_behind"] = settled(base) - base
    else:
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1)
        pool.submit(big_op).result()
        seen["left_behind"] = settled(base + 1, 1.0) - base - 1  # minus the pool's own thread
print(json.dumps(seen))
"""


def run_case(case: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, case],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_serial_thread_leads_no_team():
    assert run_case("plain")["new_threads"] == 1  # the control: the op starts a team's worker
    seen = run_case("serial")
    assert seen == {"guarded": True, "new_threads": 0}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_team_led_in_a_fresh_thread_ends_with_it():
    assert run_case("kept")["left_behind"] == 1  # the control: a live thread keeps its team
    assert run_case("fresh")["left_behind"] == 0


def test_fresh_thread_returns_and_raises():
    from shared.omp import in_fresh_thread

    assert in_fresh_thread(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        in_fresh_thread(lambda: 1 / 0)
