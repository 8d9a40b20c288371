"""Autoscaling in the simulator: the service's `Autoscaler` (services/scheduler/autoscale.py)
sizes the decode fleet on a trace whose rate rises and falls (quiet, a peak, quiet again), with
the launcher's rule of `services/infra/scaler.py` (start the instances missing to the need,
each ready ``startup_s`` later); compared with fixed fleets at the autoscaler's min and max.

    .venv/bin/python -m loadtests.simulator.autoscale

A retirement follows the service's steps: the instance leaves routing at once (draining) and is
removed once it is idle. Reported per row: TTFT and TPOT (time per output token after the first)
percentiles, SLO attainment (TTFT <= the SLO and TPOT <= the TPOT target: goodput), and the
decode instance-seconds the run paid for (starting and draining instances included).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from loadtests.simulator.cluster import SimConfig, SimInstance
from loadtests.simulator.sim import Simulation, pct
from loadtests.simulator.trace import TraceRequest
from services.scheduler.autoscale import Autoscaler, ScaleConfig
from services.scheduler.planner import RoleLoad
from services.scheduler.policies import make_policy
from services.scheduler.types import CostModel


def wave_trace(
    seed: int = 0,
    phases: tuple[tuple[float, float], ...] = ((60.0, 2.0), (120.0, 14.0), (120.0, 2.0)),
    prompt: int = 512,
    output: int = 256,
) -> list[TraceRequest]:
    """Poisson arrivals, ``(seconds, requests per second)`` per phase; decode-heavy requests
    (``prompt`` in, ``output`` out), no shared prefixes."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = start = 0.0
    for length, rps in phases:
        end = start + length
        while True:
            t += rng.expovariate(rps)
            if t >= end:
                t = end
                break
            blocks = -(-prompt // 512)
            n = len(out)
            out.append(TraceRequest(t, prompt, output, tuple(f"r{n}b{i}" for i in range(blocks))))
        start = end
    return out


@dataclass(frozen=True)
class ScaleResult:
    label: str
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    goodput: float  # share of requests with TTFT <= SLO and TPOT <= target
    decode_instance_s: float
    peak_decode: int
    adds: int
    retires: int


class AutoscaleSimulation(Simulation):
    """`Simulation` with the autoscaler ticking every ``tick_s`` (the scheduler's state
    interval) and a launcher that starts decode instances up to its need."""

    def __init__(self, cfg: SimConfig, policy, scaler: Autoscaler | None, tick_s: float = 0.5,
                 startup_s: float = 20.0) -> None:  # fmt: skip
        super().__init__(cfg, policy)
        self.scaler, self.tick_s, self.startup_s = scaler, tick_s, startup_s
        self.draining: set[str] = set()
        self.starting = 0
        self.total = 0
        self.instance_s = 0.0
        self.peak = len(self.decode)
        self.adds = self.retires = 0
        self._last = 0.0
        self._next_id = len(self.decode)

    def run(self, trace: list[TraceRequest]):
        self.total = len(trace)
        self.at(0.0, self.tick)
        return super().run(trace)

    def step_s(self, x: SimInstance) -> float:
        c = self.cfg
        return c.decode_step_s + c.decode_step_per_seq_s * x.running if x.running else 0.0

    def tick(self, now: float) -> None:
        self.instance_s += (len(self.decode) + self.starting) * (now - self._last)
        self._last = now
        for x in self.prefill + self.decode:
            x.refresh(now, self.cfg.decode_kv_blocks if x.view.role == "decode" else 0)
        for x in [x for x in self.decode if x.view.instance_id in self.draining]:
            if not x.running and not x.decode_wait and not x.queue and x.busy_until <= now:
                self.decode.remove(x)
                self.draining.discard(x.view.instance_id)
        if self.scaler is not None:
            loads = [
                RoleLoad(
                    x.view.instance_id,
                    "decode",
                    queued_tokens=x.view.queued_tokens,
                    num_running=x.view.num_running,
                    num_waiting=x.view.num_waiting,
                    prefill_tokens_per_s=x.rate,
                    draining=x.view.instance_id in self.draining,
                    step_s=self.step_s(x),
                )
                for x in self.decode
            ]
            for a in self.scaler.tick(loads):
                if a.action == "retire":
                    self.draining.add(a.instance_id)
                    self.retires += 1
            # the launcher (services/infra/scaler.py): starts what is missing up to the need
            routable = len(self.decode) - len(self.draining)
            need = self.scaler.need.get("decode", routable)
            for _ in range(need - routable - self.starting):
                self.starting += 1
                self.adds += 1
                self.at(now + self.startup_s, self.started)
        if len(self.done) + self.rejected < self.total:
            self.at(now + self.tick_s, self.tick)

    def started(self, now: float) -> None:
        self.starting -= 1
        x = self._inst(f"d{self._next_id}", "decode", False)
        self._next_id += 1
        self.decode.append(x)
        self.decode.sort(key=lambda x: x.view.instance_id)
        self.by_id[x.view.instance_id] = x
        self.peak = max(self.peak, len(self.decode))


SIM = SimConfig(num_prefill=2, num_decode=1, decode_max_batch=128, pool_enabled=False,
                ttft_slo_s=5.0, decode_kv_blocks=100_000)  # fmt: skip
SCALE = ScaleConfig(min_decode=1, max_decode=4, tpot_s=0.05, ttft_s=2.0, batch_norm=64,
                    up_ticks=4, down_ticks=20, cooldown_ticks=20)  # fmt: skip


def run(trace, cfg: SimConfig, scale: ScaleConfig | None, label: str, tpot_s: float,
        startup_s: float = 20.0) -> ScaleResult:  # fmt: skip
    cost = CostModel(prefill_tokens_per_s=cfg.prefill_tokens_per_s)
    sim = AutoscaleSimulation(
        cfg, make_policy("least_loaded", cost), Autoscaler(scale) if scale else None,
        startup_s=startup_s,
    )  # fmt: skip
    sim.run(trace)
    done = sim.done
    ttft = [j.ttft for j in done]
    tpot = [(j.finish - j.arrival - j.ttft) / max(1, j.output_len - 1) for j in done]
    good = sum(1 for a, b in zip(ttft, tpot, strict=True) if a <= cfg.ttft_slo_s and b <= tpot_s)
    return ScaleResult(
        label,
        pct(ttft, 0.5),
        pct(ttft, 0.99),
        pct(tpot, 0.5),
        pct(tpot, 0.99),
        good / max(1, len(trace)),
        sim.instance_s,
        sim.peak,
        sim.adds,
        sim.retires,
    )


def table(rows: list[ScaleResult]) -> str:
    head = (
        "| decode fleet | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) | "
        "goodput | decode instance-s | peak | adds | retires |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(
        f"| {x.label} | {x.ttft_p50:.2f} | {x.ttft_p99:.2f} | {x.tpot_p50 * 1e3:.0f} | "
        f"{x.tpot_p99 * 1e3:.0f} | {x.goodput:.1%} | {x.decode_instance_s:.0f} | {x.peak_decode} | "
        f"{x.adds} | {x.retires} |"
        for x in rows
    )


def compare(seed: int = 0, scale: ScaleConfig = SCALE, cfg: SimConfig = SIM) -> list[ScaleResult]:
    """Fixed at min, fixed at max, autoscaled (instances ready 20 s after their start, and
    5 s; and 20 s with the load's trend looked 40 s ahead): the same trace."""
    trace = wave_trace(seed)
    lo, hi = scale.min_decode, scale.max_decode
    return [
        run(trace, replace(cfg, num_decode=lo), None, f"fixed {lo}", scale.tpot_s),
        run(trace, replace(cfg, num_decode=hi), None, f"fixed {hi}", scale.tpot_s),
        run(trace, replace(cfg, num_decode=lo), scale, f"autoscaled {lo}-{hi}", scale.tpot_s),
        run(
            trace,
            replace(cfg, num_decode=lo),
            scale,
            f"autoscaled {lo}-{hi}, 5 s start",
            scale.tpot_s,
            startup_s=5.0,
        ),
        run(
            trace,
            replace(cfg, num_decode=lo),
            replace(scale, lookahead_ticks=80),
            f"autoscaled {lo}-{hi}, 40 s lookahead",
            scale.tpot_s,
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rows = compare(a.seed)
    print(f"{len(wave_trace(a.seed))} requests (60 s at 2/s, 120 s at 14/s, 120 s at 2/s), "
          f"TTFT SLO {SIM.ttft_slo_s:g} s, TPOT target {SCALE.tpot_s * 1e3:.0f} ms (simulated)")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
