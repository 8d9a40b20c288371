"""`loadtests.loadgen.cpu`: what each process is, from its command line, and the cores each
kind used between two snapshots of the real ``/proc`` (this process spinning, a child sleeping)."""

import subprocess
import sys
import time

from loadtests.loadgen.cpu import cores_by_label, label_of, snapshot


def test_processes_are_labelled_by_what_they_run():
    py = "/x/.venv/bin/python"
    assert label_of([py, "-m", "services.cli", "serve", "decode", "--x"], 5, 0, 1) == "decode"
    assert label_of(["/c/bin/nats-server", "-c", "n.conf"], 5, 0, 1) == "nats-server"
    assert label_of(["/c/minio", "server", "/d"], 5, 0, 1) == "minio"
    assert label_of([py, "-m", "loadtests.bench_fairness"], 1, 0, 1) == "bench client (main)"
    assert label_of(["/usr/bin/sleep", "9"], 5, 0, 1) == "other"


def test_cores_are_the_difference_between_two_snapshots():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)  # its interpreter start is before the first snapshot
        before, t0, c0 = snapshot(), time.perf_counter(), time.process_time()
        while time.process_time() < c0 + 0.5:  # this process: 0.5 CPU seconds, however busy
            pass  # the box is
        after, c1 = snapshot(), time.process_time()
        wall = time.perf_counter() - t0
        cores = cores_by_label(before, after, wall)
        # what it spent between the snapshots, not its lifetime (/proc counts in clock ticks)
        assert abs(cores["bench client (main)"] * wall - (c1 - c0)) < 0.1, (cores, c1 - c0)
        assert before[sleeper.pid].label == "other"
        spent = after[sleeper.pid].seconds - before[sleeper.pid].seconds
        assert spent < 0.05  # asleep: no CPU time
    finally:
        sleeper.kill()
        sleeper.wait()
