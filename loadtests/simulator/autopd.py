"""AutoPD in the simulator: the service's `RolePlanner` (services/scheduler/planner.py) flips
simulated instances between prefill and decode on a bursty trace (a prefill-heavy burst of long
prompts, then a decode-heavy phase of long outputs); the same trace without it for comparison.

    .venv/bin/python -m loadtests.simulator.autopd

A flip here follows the service's steps: the chosen instance is taken out of routing at once
(draining), and changes role at the first planner tick at least ``settle_s`` later at which it is
idle (no queued or running prefill, no running or waiting decode); decode work whose prompt was
routed to it before the change still decodes there (the service's linger).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from loadtests.simulator.cluster import SimConfig, SimInstance
from loadtests.simulator.sim import SimResult, Simulation, pct
from loadtests.simulator.trace import TraceRequest
from services.scheduler.planner import PlannerConfig, RoleLoad, RolePlanner
from services.scheduler.policies import make_policy
from services.scheduler.types import CostModel


def bursty_trace(
    seed: int = 0,
    burst_s: float = 60.0,
    burst_rps: float = 1.5,
    burst_prompt: int = 16_000,
    burst_output: int = 32,
    tail_s: float = 90.0,
    tail_rps: float = 3.0,
    tail_prompt: int = 512,
    tail_output: int = 1024,
) -> list[TraceRequest]:
    """Poisson arrivals: a prefill-heavy burst (long prompts, short outputs) for ``burst_s``,
    then a decode-heavy phase (short prompts, long outputs) for ``tail_s``. No shared prefixes
    (every block hash is unique), so routing by cache plays no part."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t, n = 0.0, 0
    for end, rps, prompt, output in (
        (burst_s, burst_rps, burst_prompt, burst_output),
        (burst_s + tail_s, tail_rps, tail_prompt, tail_output),
    ):
        while True:
            t += rng.expovariate(rps)
            if t >= end:
                t = end
                break
            blocks = -(-prompt // 512)
            out.append(TraceRequest(t, prompt, output, tuple(f"r{n}b{i}" for i in range(blocks))))
            n += 1
    return out


@dataclass(frozen=True)
class AutoPDResult:
    label: str
    sim: SimResult
    e2e_p50: float  # arrival -> last token
    e2e_p99: float
    makespan_s: float
    flips: list[tuple[float, str, str, str]]  # (time, instance, from, to), in order


class AutoPDSimulation(Simulation):
    """`Simulation` with the planner ticking every ``tick_s`` (the scheduler's state interval)."""

    def __init__(
        self,
        cfg: SimConfig,
        policy,
        planner: RolePlanner | None,
        tick_s: float = 0.5,
        settle_s: float = 1.0,
    ) -> None:
        super().__init__(cfg, policy)
        self.planner, self.tick_s, self.settle_s = planner, tick_s, settle_s
        self.draining: dict[str, float] = {}  # instance -> when it was told to change
        self.target: dict[str, str] = {}
        self.flips: list[tuple[float, str, str, str]] = []
        self.total = 0

    def run(self, trace: list[TraceRequest]) -> SimResult:
        self.total = len(trace)
        if self.planner is not None:
            self.at(0.0, self.tick)
        return super().run(trace)

    def tick(self, now: float) -> None:
        for x in self.prefill + self.decode:
            x.refresh(now, self.cfg.decode_kv_blocks if x.view.role == "decode" else 0)
        for iid, since in list(self.draining.items()):
            inst = self.by_id[iid]
            if now - since >= self.settle_s and idle(inst, now):
                self.switch(now, inst)
        loads = [
            RoleLoad(
                x.view.instance_id,
                x.view.role,
                queued_tokens=x.view.queued_tokens,
                num_running=x.view.num_running,
                num_waiting=x.view.num_waiting,
                prefill_tokens_per_s=x.rate,
                draining=x.view.instance_id in self.draining,
            )
            for x in sorted(self.prefill + self.decode, key=lambda x: x.view.instance_id)
        ]
        for f in self.planner.tick(loads):
            self.draining[f.instance_id] = now
            self.target[f.instance_id] = f.to_role
        if len(self.done) + self.rejected < self.total:
            self.at(now + self.tick_s, self.tick)

    def switch(self, now: float, inst: SimInstance) -> None:
        iid, old = inst.view.instance_id, inst.view.role
        new = self.target.pop(iid)
        del self.draining[iid]
        (self.prefill if old == "prefill" else self.decode).remove(inst)
        inst.view.role = new
        lst = self.prefill if new == "prefill" else self.decode
        lst.append(inst)
        lst.sort(key=lambda x: x.view.instance_id)
        self.flips.append((round(now, 2), iid, old, new))


def idle(inst: SimInstance, now: float) -> bool:
    return not inst.queue and inst.busy_until <= now and not inst.running and not inst.decode_wait


SIM = SimConfig(
    num_prefill=2,
    num_decode=2,
    decode_max_batch=32,
    decode_kv_blocks=4000,
    pool_enabled=False,
    ttft_slo_s=10.0,
)
PLANNER = PlannerConfig()


def run(
    trace: list[TraceRequest], cfg: SimConfig = SIM, planner: PlannerConfig | None = PLANNER
) -> AutoPDResult:
    cost = CostModel(prefill_tokens_per_s=cfg.prefill_tokens_per_s)
    pl = RolePlanner(planner, cfg.prefill_tokens_per_s) if planner is not None else None
    sim = AutoPDSimulation(cfg, make_policy("least_loaded", cost), pl)
    r = sim.run(trace)
    e2e = [j.finish - j.arrival for j in sim.done]
    span = max(j.finish for j in sim.done) - min(j.arrival for j in sim.done)
    label = "AutoPD" if planner is not None else "static"
    return AutoPDResult(label, r, pct(e2e, 0.5), pct(e2e, 0.99), span, sim.flips)


def table(rows: list[AutoPDResult]) -> str:
    head = (
        "| shape | TTFT p50 (s) | TTFT p99 (s) | TTFT<=SLO | e2e p50 (s) | e2e p99 (s) | "
        "makespan (s) | out tok/s | flips |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(
        f"| {x.label} | {x.sim.ttft_p50:.2f} | {x.sim.ttft_p99:.2f} | {x.sim.slo_attainment:.1%} "
        f"| {x.e2e_p50:.1f} | {x.e2e_p99:.1f} | {x.makespan_s:.1f} | "
        f"{x.sim.throughput_tok_s:.0f} | {len(x.flips)} |"
        for x in rows
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=SIM.num_prefill)
    ap.add_argument("--decode", type=int, default=SIM.num_decode)
    a = ap.parse_args(argv)
    cfg = replace(SIM, num_prefill=a.prefill, num_decode=a.decode)
    trace = bursty_trace(a.seed)
    rows = [run(trace, cfg, None), run(trace, cfg)]
    print(f"{len(trace)} requests, {cfg.num_prefill} prefill + {cfg.num_decode} decode (simulated)")
    print(table(rows))
    for t, iid, old, new in rows[1].flips:
        print(f"  t={t:g}s {iid}: {old} -> {new}")


if __name__ == "__main__":
    main()
