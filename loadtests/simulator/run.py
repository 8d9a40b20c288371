"""Replay the Mooncake trace through the simulator for every policy; print a Markdown table,
write a PNG (TTFT CDF per policy and load) and a JSON of the rows, and measure decision latency.

    .venv/bin/python -m loadtests.simulator.run --prefill 16 --decode 4 --engine-blocks 10000 \\
        --pool off --rate-scales 1,2,3 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

from loadtests.simulator.cluster import SimConfig
from loadtests.simulator.latency import decision_latency
from loadtests.simulator.sim import SimResult, Simulation
from loadtests.simulator.trace import DEFAULT_TRACE, load_trace
from services.scheduler.policies import make_policy
from services.scheduler.types import CostModel

POOL_MODES = ("off", "on", "write-through")
VARIANTS = {
    "round_robin": ("round_robin", {}),
    "least_loaded": ("least_loaded", {}),
    "prefix_aware": ("prefix_aware", {"slo_reject": False}),
    "prefix_aware+slo_reject": ("prefix_aware", {"slo_reject": True}),
}


def run_all(cfg: SimConfig, trace, variants=VARIANTS) -> list[tuple[str, SimResult]]:
    cost = CostModel(
        prefill_tokens_per_s=cfg.prefill_tokens_per_s,
        dram_tokens_per_s=cfg.dram_tokens_per_s,
        ssd_tokens_per_s=cfg.ssd_tokens_per_s,
        decode_step_s=cfg.decode_step_s,
        decode_step_per_seq_s=cfg.decode_step_per_seq_s,
    )
    out = []
    for label, (name, opts) in variants.items():
        out.append((label, Simulation(cfg, make_policy(name, cost, **opts)).run(trace)))
    return out


def table(rows: list[tuple[float, str, SimResult]], slo: float) -> str:
    head = (
        "| load | policy | local hit | pool hit | load max/mean | TTFT p50 (s) | TTFT p99 (s) | "
        f"SLO (TTFT<={slo:g}s) | rejected | out tok/s | self-prefill | policy p99 (us) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| x{s:g} | {label} | {r.hit_rate:.1%} | {r.pool_hit_rate:.1%} | "
        f"{r.load_max_over_mean:.2f} | {r.ttft_p50:.2f} | {r.ttft_p99:.2f} | "
        f"{r.slo_attainment:.1%} | {r.rejected} | {r.throughput_tok_s:.0f} | "
        f"{r.self_prefill_frac:.1%} | {r.decision_p99_us:.0f} |"
        for s, label, r in rows
    ]
    return head + "\n".join(lines)


def json_rows(rows: list[tuple[float, str, SimResult]], pool: str) -> list[dict]:
    """One dict per (rate scale, policy): the fields of `SimResult` except the TTFT list."""
    out = []
    for s, label, r in rows:
        d = {k: v for k, v in vars(r).items() if k not in ("ttfts", "policy")}
        out.append({"policy": label, "rate_scale": s, "pool": pool, **d})
    return out


def plot(rows: list[tuple[float, str, SimResult]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({s for s, _, _ in rows})
    fig, axes = plt.subplots(1, len(scales), figsize=(6 * len(scales), 4), squeeze=False)
    for ax, s in zip(axes[0], scales, strict=True):
        for sc, label, r in rows:
            if sc != s or not r.ttfts:
                continue
            xs = sorted(r.ttfts)
            ax.plot(xs, [(i + 1) / r.requests for i in range(len(xs))], label=label)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"Mooncake trace, arrival rate x{s:g}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def calibrated(path: str, model: str) -> tuple[dict[str, float], float]:
    """(SimConfig cost fields measured by `loadtests.calibrate`, arrival speed factor)."""
    if not path:
        return {}, 1.0
    with open(path) as f:
        models = {m["model"]: m for m in json.load(f)["models"]}
    c = models[model]["constants"]
    fields = (
        "prefill_tokens_per_s",
        "decode_step_s",
        "decode_step_per_seq_s",
        "dram_tokens_per_s",
        "ssd_tokens_per_s",
    )
    consts = {k: float(c[k]) for k in fields if k in c}
    return consts, consts["prefill_tokens_per_s"] / SimConfig.prefill_tokens_per_s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=0, help="first N requests only (0 = all)")
    ap.add_argument("--rate-scales", default="1.0,1.5")
    ap.add_argument("--num-prefill", "--prefill", type=int, default=SimConfig.num_prefill)
    ap.add_argument("--num-decode", "--decode", type=int, default=SimConfig.num_decode)
    ap.add_argument(
        "--engine-blocks",
        type=int,
        default=SimConfig.engine_cache_blocks,
        help="engine-cache capacity per instance in 512-token trace blocks",
    )
    ap.add_argument(
        "--pool",
        choices=POOL_MODES,
        default="write-through",
        help="off: no pool; on: blocks evicted from engine caches go to the pool; "
        "write-through: prefill also writes every block to it",
    )
    ap.add_argument(
        "--policies",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)}",
    )
    ap.add_argument("--json", default="", help="write the rows to this JSON file")
    ap.add_argument("--num-long", type=int, default=SimConfig.num_long)
    ap.add_argument("--ttft-slo", type=float, default=SimConfig.ttft_slo_s)
    ap.add_argument("--plot", default="")
    ap.add_argument("--latency-instances", type=int, default=1000)
    ap.add_argument(
        "--calibration",
        default="",
        help="JSON written by loadtests.calibrate: use the measured cost constants of "
        "--calibration-model; arrivals are slowed by the same factor as prefill, so a load "
        "multiplier means the same demand/capacity ratio as with the default constants",
    )
    ap.add_argument("--calibration-model", default="benchmark")
    args = ap.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"--policies: unknown {', '.join(sorted(unknown))}")
    variants = {k: VARIANTS[k] for k in args.policies.split(",")}
    trace = load_trace(args.trace, args.limit)
    consts, speed = calibrated(args.calibration, args.calibration_model)
    rows = []
    for s in (float(x) for x in args.rate_scales.split(",")):
        cfg = SimConfig(
            num_prefill=args.num_prefill,
            num_decode=args.num_decode,
            num_long=args.num_long,
            ttft_slo_s=args.ttft_slo,
            rate_scale=s * speed,
            engine_cache_blocks=args.engine_blocks,
            pool_enabled=args.pool != "off",
            pool_write_through=args.pool == "write-through",
            **consts,
        )
        t0 = time.time()
        for label, r in run_all(cfg, trace, variants):
            rows.append((s, label, r))
        print(f"# rate x{s:g}: simulated in {time.time() - t0:.0f}s; {cfg}", flush=True)
    print(table(rows, args.ttft_slo))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_rows(rows, args.pool), f, indent=1)
        print(f"json: {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    if args.latency_instances:
        print("\n| policy | instances | index blocks | p50 ms | p99 ms | CPU p50 ms | CPU p99 ms |")
        print("|---|---|---|---|---|---|---|")
        for p in ("round_robin", "least_loaded", "prefix_aware"):
            d = decision_latency(args.latency_instances, p)
            print(
                f"| {p} | {d['instances']} | {d['index_blocks']} | {d['p50_ms']:.3f} | "
                f"{d['p99_ms']:.3f} | {d['cpu_p50_ms']:.3f} | {d['cpu_p99_ms']:.3f} |"
            )


if __name__ == "__main__":
    main()
