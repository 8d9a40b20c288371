"""This box's limits next to Strata's engine: memory bandwidth, GEMM FLOP/s at the model's
shapes, and the decode step / prefill roofline of the benchmark model against measured times.

    .venv/bin/python -m loadtests.roofline [--model-size 25m|250m] [--threads 1,2] [--quick]

- bandwidth: STREAM-like on 256 MiB fp32 tensors: copy (``dst.copy_(src)``, read + write
  counted) and read (``src.sum()``), best of several, at each thread count;
- GEMM: ``torch.mm`` fp32 at the model's projection shapes (qkv, o, gate_up, down, lm_head)
  with M = 16 (a decode batch) and M = 512 (a prefill chunk), at each thread count;
- decode roofline = bytes one step must read (every weight but the embedding table, plus the
  batch's KV cache) / read bandwidth, and the step's FLOPs / GEMM FLOP/s at M = batch, the
  larger of the two; prefill roofline = FLOPs (projections + causal attention + one lm_head
  row) / GEMM FLOP/s at M = 512;
- measured: the in-process `LLMEngine` at the largest thread count: decode ms per step with
  ``batch`` sequences of ``ctx`` tokens, and prefill time of one prompt (1 output token).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def best_time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def bandwidth(threads: int, mib: int, repeats: int) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s) with ``threads`` torch threads."""
    torch.set_num_threads(threads)
    n = mib * (1 << 20) // 4
    src, dst = torch.rand(n), torch.empty(n)
    copy = best_time(lambda: dst.copy_(src), repeats)
    read = best_time(lambda: src.sum(), repeats)
    return 2 * n * 4 / copy / 1e9, n * 4 / read / 1e9


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection of one layer, and the lm_head."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {
        "qkv": (h, q + 2 * kv),
        "o": (q, h),
        "gate_up": (h, 2 * i),
        "down": (i, h),
        "lm_head": (h, cfg.vocab_size),
    }


def gemm_flops(cfg, m: int, threads: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of each projection at M = ``m`` and ``"layer"``: one layer's projections
    together (total FLOPs / total time)."""
    torch.set_num_threads(threads)
    out, tot_f, tot_t = {}, 0.0, 0.0
    for name, (k, n) in shapes(cfg).items():
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = best_time(lambda a=a, b=b: torch.mm(a, b), repeats)
        out[name] = 2 * m * k * n / t / 1e9
        if name != "lm_head":
            tot_f, tot_t = tot_f + 2 * m * k * n, tot_t + t
    out["layer"] = tot_f / tot_t / 1e9
    return out


def linear_params(cfg) -> tuple[int, int]:
    """(parameters of every layer's projections, lm_head parameters)."""
    per_layer = sum(k * n for name, (k, n) in shapes(cfg).items() if name != "lm_head")
    return per_layer * cfg.num_layers, cfg.hidden_size * cfg.vocab_size


def kv_bytes_per_token(cfg) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def decode_roofline(cfg, batch: int, ctx: int, read_gbs: float, gflops: float) -> float:
    lin, head = linear_params(cfg)
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    byts = (lin + head + norms) * 4 + batch * ctx * kv_bytes_per_token(cfg)
    attn = 4 * batch * ctx * cfg.num_layers * cfg.num_heads * cfg.head_dim
    flops = 2 * batch * (lin + head) + attn
    return max(byts / (read_gbs * 1e9), flops / (gflops * 1e9))


def prefill_flops(cfg, n: int) -> float:
    lin, head = linear_params(cfg)
    attn = 2 * n * n * cfg.num_layers * cfg.num_heads * cfg.head_dim  # causal: half of 4 n^2 d
    return 2 * n * lin + 2 * head + attn


def measure_engine(
    model_dir: str, threads: int, batch: int, ctx: int, steps: int, prefill_lens: list[int]
) -> tuple[float, dict[int, float]]:
    """(decode seconds per step at ``batch`` x ``ctx``, {prompt length: prefill seconds})."""
    import random

    from shared.engine.engine import LLMEngine
    from shared.model.loader import load_model
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    torch.set_num_threads(threads)
    loaded = load_model(model_dir)
    wcfg = WorkerConfig.load([], role="decode", max_num_seqs=max(batch, 1))
    eng = LLMEngine(loaded, wcfg.engine_config(kv_budget_for(wcfg, loaded)[0]))  # as decode's
    rng = random.Random("roofline")
    vocab = min(loaded.config.vocab_size, 4096)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    with torch.inference_mode():
        eng.generate([prompt(32)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        sp = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"d{i}", prompt(ctx), sp)
        while any(s.num_computed_tokens < ctx for s in eng.seqs.values()):  # prefill first
            eng.step()
        for _ in range(4):
            eng.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        for i in range(batch):
            eng.abort_request(f"d{i}")
        while eng.has_unfinished_requests():
            eng.step()
        prefill = {}
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for n in prefill_lens:
            ts = []
            for _ in range(3):
                p = prompt(n)  # fresh tokens: no prefix-cache hit
                t = time.perf_counter()
                eng.generate([p], one)
                ts.append(time.perf_counter() - t)
            prefill[n] = min(ts)
    eng.close()
    return statistics.median(times), prefill


def main() -> None:
    from loadtests.bench_peer import model_for
    from services.shape import usable_cores
    from shared.model.loader import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=["25m", "250m"], default="25m")
    ap.add_argument("--threads", default="", help="thread counts (default 1 and all cores)")
    ap.add_argument("--batch", type=int, default=16, help="decode batch (sequences)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per sequence at decode")
    ap.add_argument("--prefill", default="512,2048", help="prompt lengths to prefill")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 64 MiB buffers")
    a = ap.parse_args()
    cores = len(usable_cores())
    threads = [int(t) for t in a.threads.split(",")] if a.threads else sorted({1, cores})
    reps = 3 if a.quick else 10
    model_dir = model_for(a.model_size)
    cfg = load_config(model_dir)
    lin, head = linear_params(cfg)
    print(
        f"### roofline: {cfg.architecture} {a.model_size}: hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layers, {lin / 1e6:.1f}M projection + {head / 1e6:.1f}M lm_head "
        f"params (fp32); {cores} usable cores; load average {os.getloadavg()[0]:.2f}\n"
    )
    print(
        "| threads | copy GB/s | read GB/s | GEMM GFLOP/s M=16 (layer / lm_head) | "
        "GEMM GFLOP/s M=512 (layer / lm_head) |\n| ---: | ---: | ---: | ---: | ---: |"
    )
    box = {}
    for t in threads:
        copy, read = bandwidth(t, 64 if a.quick else 256, reps)
        g16, g512 = gemm_flops(cfg, 16, t, reps), gemm_flops(cfg, 512, t, reps)
        box[t] = (read, g16, g512)
        print(
            f"| {t} | {copy:.1f} | {read:.1f} | {g16['layer']:.0f} / {g16['lm_head']:.0f} | "
            f"{g512['layer']:.0f} / {g512['lm_head']:.0f} |"
        )
    t = max(threads)
    read, g16, g512 = box[t]
    lens = [int(x) for x in a.prefill.split(",")]
    step, pre = measure_engine(model_dir, t, a.batch, a.ctx, 10 if a.quick else 30, lens)
    print(f"\nStrata's in-process engine at {t} torch threads against the roofline at {t}:\n")
    print("| phase | roofline | measured | measured / roofline |\n| --- | ---: | ---: | ---: |")
    roof = decode_roofline(cfg, a.batch, a.ctx, read, g16["layer"])
    print(
        f"| decode step, {a.batch} seqs x {a.ctx} ctx (bytes / read BW vs FLOPs / GEMM) | "
        f"{roof * 1e3:.2f} ms | {step * 1e3:.2f} ms | {step / roof:.2f}x |"
    )
    for n in lens:
        roof = prefill_flops(cfg, n) / (g512["layer"] * 1e9)
        print(
            f"| prefill {n} tokens (FLOPs / GEMM M=512) | {roof * 1e3:.1f} ms | "
            f"{pre[n] * 1e3:.1f} ms | {pre[n] / roof:.2f}x |"
        )


if __name__ == "__main__":
    main()
