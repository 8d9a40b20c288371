"""How long a cluster takes to start, with the model processes forked from the zygote
(`services/infra/zygote.py`) and without (``fork_model_processes=False``).

    .venv/bin/python -m loadtests.bench_start --repeats 3 [--prefill 1 --decode 2] \\
        [--json start.json]

Each trial is a fresh launcher process (as `strata up` is) on the built-in default model, the
two modes alternated (forked, fresh, fresh, forked, ...): it starts a cluster of the shape this
machine gets (or the ``--prefill``/``--decode`` counts given) and measures

- ``first``: `Cluster.start()` until every service is ready and the gateway healthy (with the
  zygote, its own start included: what `strata up` waits for);
- ``restart``: `Cluster.restart("decode-0")` until it is ready again (what a crashed decode
  instance costs before it serves again);
- ``second``: a second cluster started by the same launcher process (the zygote already warm:
  the test suite's case, which starts dozens).

It prints the median and spread per mode, the load average, and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TRIAL = r"""
import json, os, sys, time
from services.cluster_config import ensure_model
from loadtests.simulator.realcluster import start_cluster
fork, counts = sys.argv[1] == "1", json.loads(sys.argv[2])
md = ensure_model("")
out = {}
t = time.monotonic()
c = start_cluster(md, fork_model_processes=fork, **counts)
out["first"] = time.monotonic() - t
out["forked"] = sorted(n for n, p in c.sup.procs.items() if p.forked)
t = time.monotonic()
c.restart("decode-0")
out["restart"] = time.monotonic() - t
c.stop()
t = time.monotonic()
c = start_cluster(md, fork_model_processes=fork, **counts)
out["second"] = time.monotonic() - t
c.stop()
print(json.dumps(out), flush=True)
"""


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="trials per mode")
    p.add_argument("--prefill", type=int, default=None, help="default: the machine's shape")
    p.add_argument("--decode", type=int, default=None)
    p.add_argument("--json", default="", help="write every trial here")
    a = p.parse_args(argv)
    counts = {k: v for k, v in (("prefill", a.prefill), ("decode", a.decode)) if v is not None}
    order = []
    for i in range(a.repeats):
        order += [True, False] if i % 2 == 0 else [False, True]
    trials: list[dict] = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for fork in order:
        r = subprocess.run(
            [sys.executable, "-c", TRIAL, "1" if fork else "0", json.dumps(counts)],
            cwd=root,
            env=dict(os.environ, PYTHONPATH=root),
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode != 0:
            print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
            return 1
        t = json.loads(r.stdout.strip().splitlines()[-1])
        t.update(fork=fork, load=os.getloadavg()[0])
        trials.append(t)
        print(json.dumps(t), flush=True)
    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} cores; shape {counts or 'of this machine'}")
    print("| model processes | first start (s) | decode-0 restart (s) | second start (s) |")
    print("| --- | --- | --- | --- |")
    for fork in (True, False):
        rows = [t for t in trials if t["fork"] is fork]
        cells = []
        for k in ("first", "restart", "second"):
            v = [t[k] for t in rows]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        name = "forked from the zygote" if fork else "fresh interpreters"
        print(f"| {name} | " + " | ".join(cells) + " |")
    loads = [t["load"] for t in trials]
    print(f"\nload average after each trial: {min(loads):.2f}-{max(loads):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model(), "counts": counts, "trials": trials}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
