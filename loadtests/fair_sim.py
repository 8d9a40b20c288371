"""The engine scheduler alone under bench_fairness's load: how many steps a light tenant's new
request waits before its first admission while a heavy tenant's backlog grows.

    .venv/bin/python -m loadtests.fair_sim [--steps 3000] [--step-s 0.07] \
        [--prompt-token-s 0] [--slice-tokens 128]

The real `Scheduler` (fair queuing, the step cap, lead steps, slices) on a simulated clock, no
model: each step lasts ``--step-s`` seconds plus ``--prompt-token-s`` per prompt token it
computes; tenant A sends ``--rate-a`` and tenant B ``--rate-b`` requests a second (Poisson, each
arriving at a uniform time within the step before it is seen), each ``--prompt`` tokens and
``--max-tokens`` out, every step's sampled token accepted. Prints B's wait in steps before its
first admission and its time to first token (arrival to the end of the step that sampled it),
p50 / p90 / p99 / max, the lead steps by tenant and A's backlog at the end. Only the scheduling
policy is measured: what a step costs is the parameter, so compare runs with the same costs.
Deterministic per ``--seed``.
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
    added: dict[str, tuple[int, float]] = {}  # B's waiting requests: (step, time) added
    firsts: dict[str, float] = {}  # B's admitted requests: time added, until the first token
    waits: list[int] = []
    ttfts: list[float] = []
    lead_by: collections.Counter[str] = collections.Counter()
    n, dt = 0, a.step_s
    for step in range(a.steps):
        for tenant, rate in (("A", a.rate_a), ("B", a.rate_b)):
            for _ in range(_poisson(rng, rate * dt)):  # arrived during the last step
                n += 1
                seq = Sequence(f"{tenant}{n}", list(range(n, n + a.prompt)), a.prompt, params)
                seq.tenant = Tenant(tenant)
                sched.add(seq)
                if tenant == "B":
                    added[seq.request_id] = (step, clock.t - rng.random() * dt)
        leads = sched.lead_steps
        out = sched.schedule()
        if sched.lead_steps > leads:
            lead_by[out.scheduled[0].seq.tenant.name] += 1
        for sch in out.scheduled:
            if sch.start == 0 and sch.seq.request_id in added:
                at_step, at = added.pop(sch.seq.request_id)
                waits.append(step - at_step)
                firsts[sch.seq.request_id] = at
        prompt_tokens = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        dt = a.step_s + a.prompt_token_s * prompt_tokens
        clock.t += dt  # the step runs
        for sch in out.scheduled:
            if sch.samples and sch.seq.request_id in firsts:
                ttfts.append(clock.t - firsts.pop(sch.seq.request_id))
        sched.postprocess(out, [[7] if sch.samples else [] for sch in out.scheduled])
    waits.sort()
    ttfts.sort()
    pick = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {
        "B_admitted": len(waits),
        "B_still_waiting": len(added),
        "B_wait_steps_p50_p90_p99_max": [pick(waits, q) for q in (0.5, 0.9, 0.99)] + waits[-1:],
        "B_ttft_ms_p50_p90_p99_max": [round(1000 * pick(ttfts, q)) for q in (0.5, 0.9, 0.99)]
        + [round(1000 * ttfts[-1])],
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
    ap.add_argument(
        "--prompt-token-s",
        type=float,
        default=0.0,
        help="seconds each prompt token adds to its step (0: every step lasts --step-s)",
    )
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
