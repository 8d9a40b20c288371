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

from loadtests.bench_peer import model_for, native_vs_torch
from shared.model import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="standard,long-prompts")
    ap.add_argument("--repeats", type=int, default=4, help="runs per side")
    a = ap.parse_args()
    model_dir = model_for("25m")
    real = cpu_kernels.prefill_attention

    def use(side: str) -> None:
        cpu_kernels.prefill_attention = real if side == "native" else _off

    native_vs_torch(model_dir, a.workloads.split(","), a.repeats, use, "torch SDPA")


def _off(*args, **kwargs) -> bool:
    return False


if __name__ == "__main__":
    main()
