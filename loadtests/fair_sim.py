"""The engine scheduler alone under bench_fairness's load: how many steps a light tenant's new
request waits before its first admission while a heavy tenant's backlog grows.

    .venv/bin/python -m loadtests.fair_sim [--steps 3000] [--step-s 0.07] [--slice-tokens 128]

The real `Scheduler` (fair queuing, the step cap, lead steps, slices) on a simulated clock, no
model: each step lasts ``--step-s`` seconds; tenant A sends ``--rate-a`` and tenant B
``--rate-b`` requests a second (Poisson), each ``--prompt`` tokens and ``--max-tokens`` out,
every step's sampled token accepted. Prints B's wait in steps (p50 / p90 / p99 / max), the lead
steps by tenant and A's backlog at the end. Only the scheduling policy is measured: what a step
costs is the parameter, so compare runs with the same ``--step-s``. Deterministic per ``--seed``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random

from shared.engine.block_manager import BlockManager
from shared.engine.fair_queue import FairQueue, Tenant
from shared.engine.scheduler import FairShare, Scheduler
from shared.engine.sequence import Sequence
from shared.protocol.sampling import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(a: argparse.Namespace) -> dict:
    clock = Clock()
    sched = Scheduler(
        BlockManager(1_000_000, 16),
        b"s" * 16,
        a.max_num_seqs,
        a.budget,
        eos_token_ids=[-1],
        fair=FairQueue(True),
        share=FairShare(a.step_tokens, 5.0, clock, True, a.slice_tokens),
    )
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(a.seed)
    added: dict[str, int] = {}
    waits: list[int] = []
    lead_by: collections.Counter[str] = collections.Counter()
    n = 0
    for step in range(a.steps):
        clock.t += a.step_s
        for tenant, rate in (("A", a.rate_a), ("B", a.rate_b)):
            for _ in range(_poisson(rng, rate * a.step_s)):
                n += 1
                seq = Sequence(f"{tenant}{n}", list(range(n, n + a.prompt)), a.prompt, params)
                seq.tenant = Tenant(tenant)
                sched.add(seq)
                if tenant == "B":
                    added[seq.request_id] = step
        leads = sched.lead_steps
        out = sched.schedule()
        if sched.lead_steps > leads:
            lead_by[out.scheduled[0].seq.tenant.name] += 1
        for sch in out.scheduled:
            if sch.start == 0 and sch.seq.request_id in added:
                waits.append(step - added.pop(sch.seq.request_id))
        sched.postprocess(out, [[7] if sch.samples else [] for sch in out.scheduled])
    waits.sort()
    pick = lambda q: waits[min(len(waits) - 1, int(q * len(waits)))]  # noqa: E731
    return {
        "B_admitted": len(waits),
        "B_still_waiting": len(added),
        "B_wait_steps_p50_p90_p99_max": [pick(0.5), pick(0.9), pick(0.99), waits[-1]],
        "lead_steps_by_tenant": dict(lead_by),
        "A_backlog_at_end": sum(1 for s in sched.waiting if s.tenant.name == "A"),
    }


def _poisson(rng: random.Random, mean: float) -> int:
    k, t = 0, rng.expovariate(1.0)
    while t < mean:
        k += 1
        t += rng.expovariate(1.0)
    return k


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--step-s", type=float, default=0.07, help="seconds a step lasts")
    ap.add_argument("--rate-a", type=float, default=25.0)
    ap.add_argument("--rate-b", type=float, default=2.5)
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--slice-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    print(json.dumps(simulate(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
