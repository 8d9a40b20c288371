"""Where a model process's time goes inside the default cluster, per thread, under the standard
workload: how much of the wall clock each thread is on a CPU, and how much it holds the GIL.

    .venv/bin/python -m loadtests.profile_cluster [--role decode] [--seconds 12] [--model-size 25m]

Starts `Cluster` as ``strata up --model CK`` does (the shape the machine gets), then
drives bench_peer's standard workload twice while py-spy samples the role's process: once for
on-CPU samples, once for GIL-holding samples (``--gil``). py-spy is installed with pip into
``.cache/tools`` when it is not on PATH. Prints one markdown table: per thread, the share of the
sampled wall clock it was on a CPU and held the GIL, and its top frames of this repository.
With ``--processes``: one pass instead, and a table of the CPU seconds every process of the
cluster (nats-server and MinIO included) spent during it, from ``/proc/<pid>/stat``: where the
cores go besides the model process.

A thread on a CPU without the GIL is inside a kernel (torch releases the GIL in its ops); the
engine thread's GIL share is its per-step Python (op dispatch, scheduling, sampling), during
which the other cores of its OpenMP team wait.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

RATE = 200  # samples per second


def py_spy() -> str:
    found = shutil.which("py-spy")
    if found:
        return found
    tools = Path(".cache/tools")
    exe = tools / "bin" / "py-spy"
    if not exe.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(tools), "py-spy"],
            check=True,
        )
    return str(exe)


def sample(pid: int, seconds: float, gil: bool, out: str) -> subprocess.Popen:
    argv = [py_spy(), "record", "--pid", str(pid), "--threads", "--nonblocking"]
    argv += ["--gil"] if gil else []
    argv += ["-r", str(RATE), "-d", str(int(seconds)), "-f", "raw", "-o", out]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def per_thread(path: str) -> tuple[collections.Counter, dict[str, collections.Counter]]:
    """Samples per thread, and per thread the innermost frame of this repository."""
    total: collections.Counter = collections.Counter()
    frames: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        parts = stack.split(";")
        thread = parts[0].split(": ", 1)[-1]
        total[thread] += int(n)
        ours = [f for f in parts[1:] if any(p in f for p in ("services/", "shared/", "models/"))]
        frames[thread][(ours[-1] if ours else parts[-1]).split(" (")[0]] += int(n)
    return total, frames


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its threads (``/proc/<pid>/stat``), 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def by_process(c, drive_once) -> tuple[dict[str, float], dict, float]:
    """CPU seconds per cluster process during one ``drive_once()``, its stats, and the wall."""
    import time

    pids = {n: p.proc.pid for n, p in c.sup.procs.items() if p.proc is not None}
    for name, server in (("nats-server", c.nats), ("minio", c.minio)):
        if server is not None and server.proc is not None:
            pids[name] = server.proc.pid
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    t0 = time.monotonic()
    stats = drive_once()
    wall = time.monotonic() - t0
    return {n: cpu_seconds(p) - before[n] for n, p in pids.items()}, stats, wall


def main() -> None:
    from loadtests.bench_peer import WORKLOADS, drive, model_for
    from services.launcher import Cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="decode", help="the model process to sample")
    ap.add_argument("--seconds", type=float, default=12.0, help="sampling window per pass")
    ap.add_argument("--model-size", choices=["25m", "250m"], default="25m")
    ap.add_argument(
        "--processes", action="store_true", help="CPU seconds per process instead of py-spy"
    )
    a = ap.parse_args()
    model_dir = os.path.abspath(model_for(a.model_size))
    wl = WORKLOADS["standard"]
    prompts = wl.prompts("standard")
    name = os.path.basename(model_dir)
    tmp = tempfile.mkdtemp(prefix="profile-cluster-")
    with (
        open(os.path.join(tmp, "strata.log"), "w") as log,
        Cluster(model_dir, log_stream=log, die_with_parent=True, log_level="WARNING") as c,
    ):
        if a.processes:
            drive(c.gateway_url, name, wl.prompts("warm-up"), wl)  # compile, warm the caches
            # prompts of its own: the warm-up's would be served from the prefix cache
            cpu, stats, wall = by_process(c, lambda: drive(c.gateway_url, name, prompts, wl))
            print(f"### CPU by process, `strata up --model CK` ({c.shape.line})")
            print(
                f"standard workload, one pass after a warm-up on other prompts: {wall:.1f} s wall, out tok/s "
                f"{stats.get('tok_s', 0):.1f}, {os.cpu_count()} cores, "
                f"load average {os.getloadavg()[0]:.2f}\n"
            )
            print("| process | CPU s | cores busy (CPU s / wall) | share of all |")
            print("| --- | ---: | ---: | ---: |")
            total = sum(cpu.values()) or 1.0
            for n, v in sorted(cpu.items(), key=lambda kv: -kv[1]):
                print(f"| {n} | {v:.1f} | {v / wall:.2f} | {v / total:.0%} |")
            return
        names = c.names(a.role)
        if not names:
            sys.exit(f"profile_cluster: no {a.role} process in this shape ({c.shape.line})")
        pid = c.sup.procs[names[0]].proc.pid
        runs = {}
        for gil in (False, True):
            out = os.path.join(tmp, f"{'gil' if gil else 'cpu'}.txt")
            spy = sample(pid, a.seconds, gil, out)
            stats: dict = {}
            t = threading.Thread(
                target=lambda s=stats: s.update(drive(c.gateway_url, name, prompts, wl))
            )
            t.start()
            spy.wait()
            t.join()
            runs[gil] = (per_thread(out), stats)
    window = RATE * a.seconds
    (cpu, frames), cpu_stats = runs[False]
    (gil, _), _ = runs[True]
    print(f"### {a.role} process of `strata up --model CK` ({c.shape.line})")
    print(
        f"standard workload, {a.seconds:.0f} s sampled per pass at {RATE} Hz; "
        f"out tok/s during the on-CPU pass {cpu_stats.get('tok_s', 0):.1f}, "
        f"load average {os.getloadavg()[0]:.2f}\n"
    )
    print(
        "| thread | on a CPU (% of wall) | holds the GIL (% of wall) | top frames (share of its CPU) |"
    )
    print("| --- | ---: | ---: | --- |")
    for thread, n in cpu.most_common():
        top = ", ".join(f"`{f}` {m / n:.0%}" for f, m in frames[thread].most_common(3))
        print(f"| {thread} | {n / window:.1%} | {gil.get(thread, 0) / window:.1%} | {top} |")


if __name__ == "__main__":
    main()
