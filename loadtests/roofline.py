"""This box's limits next to Strata's engine: memory bandwidth, GEMM FLOP/s at the model's
shapes, and the decode step / prefill roofline of the benchmark model against measured times.

    .venv/bin/python -m loadtests.roofline [--model-size 25m|250m] [--threads 1,2] [--quick]

- bandwidth: STREAM-like on 256 MiB fp32 tensors: copy (``dst.copy_(src)``, read + write
  counted) and read (``src.sum()``), best of several, at each thread count;
- FMA peak: a loop of 12 independent vector FMA chains in registers per thread (built with the
  system ``cc`` at ``-march=native``), the most FLOP/s the cores sustain: the compute limit;
- GEMM: ``torch.mm`` fp32 at the model's projection shapes (qkv, o, gate_up, down, lm_head)
  with M = 16 (a decode batch) and M = 512 (a prefill chunk), at each thread count, and the
  engine's own native kernel (``shared/model/gemm.c``) at the same shapes;
- decode roofline = bytes one step must read (every weight but the embedding table, plus the
  batch's KV cache) / read bandwidth, and the step's FLOPs / compute rate, the larger of the
  two; prefill roofline = FLOPs (projections + causal attention + one lm_head row) / compute
  rate. Each is given twice: against the FMA peak (the box's limit) and against the best GEMM
  measured at that M (``torch.mm`` or native; what a GEMM reaches on these shapes). A decode
  roofline against ``torch.mm`` alone flattered the engine where MKL is slow at 16 rows (an
  AMD EPYC, Zen 3: 53-61 GFLOP/s, the native kernel 85-108, the FMA peak 191-200);
- measured: the in-process `LLMEngine` at the largest thread count: decode ms per step with
  ``batch`` sequences of ``ctx`` tokens, and prefill time of one prompt (1 output token).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

FMA_SOURCE = r"""
#include <omp.h>
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
int fma_width(void) { return VW; }
/* seconds for iters rounds of 12 independent a = a * b + c chains on each of nthreads */
double fma_run(long iters, int nthreads) {
    volatile float sink = 0.f;
    double t0 = omp_get_wtime();
    #pragma omp parallel num_threads(nthreads)
    {
        vf a[12], b = (vf){0} + 0.9999f, c = (vf){0} + 1e-4f;
        for (int i = 0; i < 12; i++) a[i] = (vf){0} + 1e-3f * i;
        for (long it = 0; it < iters; it++)
            for (int i = 0; i < 12; i++) a[i] = a[i] * b + c;
        float s = 0.f;
        for (int i = 0; i < 12; i++) s += a[i][0];
        #pragma omp atomic
        sink += s;
    }
    return omp_get_wtime() - t0;
}
"""


def fma_peak(threads: int, repeats: int) -> float | None:
    """FLOP/s (GFLOP/s) of the cores' vector FMA units at ``threads`` threads, or None without
    a C compiler."""
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, so = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma.so")
        with open(src, "w") as f:
            f.write(FMA_SOURCE)
        flags = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
        try:
            subprocess.run([cc, *flags, src, "-o", so], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        lib = ctypes.CDLL(so)
    lib.fma_run.restype, lib.fma_run.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
    iters = 20_000_000
    t = min(lib.fma_run(iters, threads) for _ in range(max(repeats, 2)))
    return threads * iters * 12 * lib.fma_width() * 2 / t / 1e9


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


def _rates(cfg, m: int, threads: int, repeats: int, op) -> dict[str, float] | None:
    """GFLOP/s of each projection at M = ``m`` and ``"layer"``: one layer's projections
    together (total FLOPs / total time). ``op(m, k, n)`` gives the product to time, or None
    when it cannot run (then the result is None)."""
    torch.set_num_threads(threads)
    out, tot_f, tot_t = {}, 0.0, 0.0
    for name, (k, n) in shapes(cfg).items():
        fn = op(m, k, n)
        if fn is None:
            return None
        t = best_time(fn, repeats)
        out[name] = 2 * m * k * n / t / 1e9
        if name != "lm_head":
            tot_f, tot_t = tot_f + 2 * m * k * n, tot_t + t
    out["layer"] = tot_f / tot_t / 1e9
    return out


def gemm_flops(cfg, m: int, threads: int, repeats: int) -> dict[str, float]:
    """`_rates` of ``torch.mm``."""

    def op(m, k, n):
        a, b = torch.randn(m, k), torch.randn(k, n)
        return lambda: torch.mm(a, b)

    return _rates(cfg, m, threads, repeats, op)


def native_gemm_flops(cfg, m: int, threads: int, repeats: int) -> dict[str, float] | None:
    """`_rates` of the engine's native kernel on its packed weight, or None where the kernel
    is unavailable."""
    from shared.model import cpu_kernels

    def op(m, k, n):
        w = cpu_kernels.pack_linear(torch.randn(n, k))
        a = torch.randn(m, k)
        return None if w is None else lambda: cpu_kernels.linear(a, w, None)

    return _rates(cfg, m, threads, repeats, op)


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
        "| threads | copy GB/s | read GB/s | FMA peak GFLOP/s | torch.mm GFLOP/s M=16 "
        "(layer / lm_head) | native GFLOP/s M=16 | torch.mm GFLOP/s M=512 (layer / lm_head) "
        "| native GFLOP/s M=512 |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )

    def layer(g: dict[str, float] | None) -> str:
        return "-" if g is None else f"{g['layer']:.0f}"

    box = {}
    for t in threads:
        copy, read = bandwidth(t, 64 if a.quick else 256, reps)
        peak = fma_peak(t, reps)
        g16, g512 = gemm_flops(cfg, 16, t, reps), gemm_flops(cfg, 512, t, reps)
        n16, n512 = native_gemm_flops(cfg, 16, t, reps), native_gemm_flops(cfg, 512, t, reps)
        box[t] = (read, peak, g16, g512, n16, n512)
        print(
            f"| {t} | {copy:.1f} | {read:.1f} | {'-' if peak is None else f'{peak:.0f}'} | "
            f"{g16['layer']:.0f} / {g16['lm_head']:.0f} | {layer(n16)} | "
            f"{g512['layer']:.0f} / {g512['lm_head']:.0f} | {layer(n512)} |"
        )
    t = max(threads)
    read, peak, g16, g512, n16, n512 = box[t]
    best16 = max(g16["layer"], n16["layer"] if n16 else 0.0)
    best512 = max(g512["layer"], n512["layer"] if n512 else 0.0)
    lens = [int(x) for x in a.prefill.split(",")]
    step, pre = measure_engine(model_dir, t, a.batch, a.ctx, 10 if a.quick else 30, lens)
    print(f"\nStrata's in-process engine at {t} torch threads against the roofline at {t}:\n")
    print(
        "| phase | roofline, FMA peak | roofline, best GEMM | measured | measured / roofline "
        "(peak / best GEMM) |\n| --- | ---: | ---: | ---: | ---: |"
    )

    def row(name: str, r_peak: float | None, r_best: float, got: float, fmt: str):
        """One phase: rooflines and measured time in seconds, printed in ms with ``fmt``."""
        rp = "-" if r_peak is None else f"{r_peak * 1e3:{fmt}}"
        ratio = "-" if r_peak is None else f"{got / r_peak:.2f}x"
        print(
            f"| {name} | {rp} ms | {r_best * 1e3:{fmt}} ms | {got * 1e3:{fmt}} ms | "
            f"{ratio} / {got / r_best:.2f}x |"
        )

    row(
        f"decode step, {a.batch} seqs x {a.ctx} ctx (bytes / read BW vs FLOPs / compute)",
        None if peak is None else decode_roofline(cfg, a.batch, a.ctx, read, peak),
        decode_roofline(cfg, a.batch, a.ctx, read, best16),
        step,
        ".2f",
    )
    for n in lens:
        f = prefill_flops(cfg, n)
        row(
            f"prefill {n} tokens (FLOPs / compute)",
            None if peak is None else f / (peak * 1e9),
            f / (best512 * 1e9),
            pre[n],
            ".1f",
        )


if __name__ == "__main__":
    main()
