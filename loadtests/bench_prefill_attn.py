"""The native prefill attention kernel against torch's SDPA in the in-process engine.

    .venv/bin/python -m loadtests.bench_prefill_attn [--workloads standard,long-prompts]
        [--repeats 4]

Each run is bench_peer's in-process engine side (`engine_run`: a fresh `LLMEngine` as the decode
service builds it, benchmark model, 2 threads, all prompts at once); the two sides alternate, the
torch side with `cpu_kernels.prefill_attention` switched off (every prompt chunk then takes the
SDPA paths of `paged_attention`). Prints out tok/s per side (median and spread) and how many
requests' greedy tokens are identical between the sides.
"""

from __future__ import annotations

import argparse
import statistics

from loadtests.bench_peer import WORKLOADS, engine_run, model_for
from shared.model import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="standard,long-prompts")
    ap.add_argument("--repeats", type=int, default=4, help="runs per side")
    a = ap.parse_args()
    model_dir = model_for("25m")
    real = cpu_kernels.prefill_attention
    print("| workload | runs | native out tok/s (median, spread) | torch SDPA | greedy identical |")
    print("| --- | ---: | --- | --- | --- |")
    for name in a.workloads.split(","):
        wl = WORKLOADS[name]
        prompts = wl.prompts(name)
        tok_s: dict[str, list[float]] = {"native": [], "torch": []}
        outs = {}
        for rep in range(a.repeats):
            for side in ("native", "torch") if rep % 2 == 0 else ("torch", "native"):
                cpu_kernels.prefill_attention = real if side == "native" else _off
                try:
                    r = engine_run(model_dir, prompts, wl, 2, "float32")
                finally:
                    cpu_kernels.prefill_attention = real
                tok_s[side].append(r["tok_s"])
                outs[side] = r["outputs"]
        same = sum(x == y for x, y in zip(outs["native"], outs["torch"], strict=True))
        cell = {
            k: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in tok_s.items()
        }
        print(
            f"| {name} | {a.repeats} | {cell['native']} | {cell['torch']} | {same}/{len(prompts)} |"
        )


def _off(*args, **kwargs) -> bool:
    return False


if __name__ == "__main__":
    main()
