"""The native prefill attention kernel against torch's SDPA in the in-process engine.

    .venv/bin/python -m loadtests.bench_prefill_attn [--workloads standard,long-prompts]
        [--repeats 4]

Each run builds a fresh `LLMEngine` as the decode service does (benchmark model, 2 threads) and
generates one of bench_peer's workloads, all prompts at once; the two sides alternate, the
torch side with `cpu_kernels.prefill_attention` switched off (every prompt chunk then takes the
SDPA paths of `paged_attention`). Prints out tok/s per side (median and spread) and how many
requests' greedy tokens are identical between the sides.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loadtests.bench_peer import WORKLOADS, model_for
from shared.model import cpu_kernels


def run(model_dir: str, name: str, ids: list[list[int]]) -> tuple[float, list[list[int]]]:
    from shared.engine.engine import LLMEngine
    from shared.model.loader import load_model
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    wl = WORKLOADS[name]
    wcfg = WorkerConfig.load([], role="decode", max_num_seqs=wl.conc)
    loaded = load_model(model_dir)
    eng = LLMEngine(loaded, wcfg.engine_config(kv_budget_for(wcfg, loaded)[0]))
    with torch.inference_mode():
        eng.generate(ids[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t = time.perf_counter()
        out = eng.generate(ids, SamplingParams(temperature=0, max_tokens=wl.out, ignore_eos=True))
        wall = time.perf_counter() - t
    eng.close()
    return sum(map(len, out)) / wall, out


def main() -> None:
    from shared.model.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="standard,long-prompts")
    ap.add_argument("--repeats", type=int, default=4, help="runs per side")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = model_for("25m")
    tok = Tokenizer.from_dir(model_dir)
    real = cpu_kernels.prefill_attention
    print("| workload | runs | native out tok/s (median, spread) | torch SDPA | greedy identical |")
    print("| --- | ---: | --- | --- | --- |")
    for name in a.workloads.split(","):
        ids = [tok.encode(p) for p in WORKLOADS[name].prompts(name)]
        tok_s: dict[str, list[float]] = {"native": [], "torch": []}
        outs = {}
        for rep in range(a.repeats):
            for side in ("native", "torch") if rep % 2 == 0 else ("torch", "native"):
                cpu_kernels.prefill_attention = real if side == "native" else _off
                try:
                    t, outs[side] = run(model_dir, name, ids)
                finally:
                    cpu_kernels.prefill_attention = real
                tok_s[side].append(t)
        same = sum(x == y for x, y in zip(outs["native"], outs["torch"], strict=True))
        cell = {
            k: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in tok_s.items()
        }
        print(f"| {name} | {a.repeats} | {cell['native']} | {cell['torch']} | {same}/{len(ids)} |")


def _off(*args, **kwargs) -> bool:
    return False


if __name__ == "__main__":
    main()
