"""Operating-system knobs on the default cluster: do they buy throughput on a small box?

    .venv/bin/python -m loadtests.bench_cpu_knobs [--repeats 2] [--sides default,nice10,...]

Each side is `Cluster` as ``strata up --model CK`` starts it (benchmark model, the machine's
shape), driven with bench_peer's standard workload (`drive` warms up on other prompts first);
the sides run one after the other in alternating order per repeat, each on a fresh cluster:

- ``default``: as users get it;
- ``nice10``: every process but the model processes (gateway, tokenizer, scheduler, kvstore,
  nats-server, MinIO) reniced to 10, so the engine's OpenMP team is preempted less;
- ``omp-passive`` / ``omp-active``: ``OMP_WAIT_POLICY`` for every process (idle OpenMP threads
  sleep at once, or spin);
- ``no-pool``: the same shape without the kvstore and MinIO (``--kvstore 0 --no-minio``): what
  offering every prompt's KV blocks to the pool costs the engine;
- ``bf16`` / ``fp32``: the model processes in bfloat16 / float32 (``--dtype``; what a bf16
  checkpoint costs served in its own dtype against float32 on this CPU).

Prints one markdown table: out tok/s median and spread, TTFT p50 / p99 and TBT medians, and the
load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

SIDES = ("default", "nice10", "omp-passive", "omp-active", "no-pool", "bf16", "fp32")
MODEL_ROLES = ("decode", "prefill", "vision")


def renice_services(c) -> None:
    pids = [c.sup.procs[n].proc.pid for n in c.names() if n.rsplit("-", 1)[0] not in MODEL_ROLES]
    pids += [s.proc.pid for s in (c.nats, c.minio) if s is not None and getattr(s, "proc", None)]
    for pid in pids:  # the process group: a service's helpers (e.g. MinIO's) go with it
        subprocess.run(["renice", "-n", "10", "-g", str(os.getpgid(pid))], capture_output=True)


def run_side(side: str, model_dir: str, prompts: list[str], wl, log) -> dict:
    from loadtests.bench_peer import drive
    from services.launcher import Cluster

    os.environ.pop("OMP_WAIT_POLICY", None)
    if side.startswith("omp-"):
        os.environ["OMP_WAIT_POLICY"] = side[4:].upper()
    try:
        extra = {
            "no-pool": dict(kvstore=0, minio=False),
            "bf16": dict(dtype="bfloat16"),
            "fp32": dict(dtype="float32"),
        }.get(side, {})
        with Cluster(
            model_dir, log_stream=log, die_with_parent=True, log_level="WARNING", **extra
        ) as c:
            if side == "nice10":
                renice_services(c)
            return drive(c.gateway_url, os.path.basename(model_dir), prompts, wl)
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def main() -> None:
    from loadtests.bench_peer import WORKLOADS, model_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"of {', '.join(SIDES)}")
    a = ap.parse_args()
    sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides) or a.repeats < 1:
        sys.exit(f"bench_cpu_knobs: sides must be of {', '.join(SIDES)}; --repeats >= 1")
    model_dir = os.path.abspath(model_for("25m"))
    wl = WORKLOADS["standard"]
    prompts = wl.prompts("standard")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with open(os.path.join(tempfile.mkdtemp(prefix="bench-knobs-"), "strata.log"), "w") as log:
        for rep in range(a.repeats):
            for side in sides if rep % 2 == 0 else sides[::-1]:
                r = run_side(side, model_dir, prompts, wl, log)
                runs[side].append(r)
                print(f"[bench_cpu_knobs] {side}: {r['tok_s']:.1f} tok/s", file=sys.stderr)
    print(f"### OS knobs on the default cluster, standard workload, {a.repeats} run(s) per side\n")
    print("\n".join(runs_table("side", runs)))


def runs_table(first: str, runs: dict[str, list[dict]]) -> list[str]:
    """Markdown rows, one per key of ``runs`` (`drive` results): out tok/s median and spread,
    TTFT p50 / p99 and TBT medians, errors, load average range."""
    rows = [
        f"| {first} | out tok/s median | spread | TTFT p50 | TTFT p99 | TBT p50 | errors "
        "| load avg |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, rs in runs.items():
        tok = [r["tok_s"] for r in rs]
        med = {k: statistics.median(r[k] for r in rs) for k in ("ttft_p50", "ttft_p99", "tbt_p50")}
        loads = [r["load"] for r in rs]
        rows.append(
            f"| {name} | {statistics.median(tok):.1f} | {min(tok):.1f}-{max(tok):.1f} "
            f"| {med['ttft_p50'] * 1000:.0f} ms | {med['ttft_p99'] * 1000:.0f} ms "
            f"| {med['tbt_p50'] * 1000:.1f} ms | {sum(r['errors'] for r in rs)} "
            f"| {min(loads):.2f}-{max(loads):.2f} |"
        )
    return rows


if __name__ == "__main__":
    main()
