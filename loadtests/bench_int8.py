"""int8 weights (W8A8, `shared/model/gemm_int8.c`) against float32 on CPU: the GEMM alone and the
engine's decode step, alternated.

    .venv/bin/python -m loadtests.bench_int8 [--model-size 25m|250m] [--rounds 6] [--quick]

GEMM: the benchmark model's projections (q/k/v and gate/up fused, as the layers run them) at
decode batch sizes 1, 16 and 64: the packed float32 kernel (`cpu_kernels.linear`, what
`layers.Gemm` runs) against the int8 one (`cpu_kernels.linear_int8`, what `Int8Gemm` runs, the
activations' per-row quantisation included), called in turn, median ms; and the int8 result's
max error against the float32 one, relative to its largest output.
Decode: two in-process `LLMEngine`s as the decode worker builds them on the same checkpoint, one
with ``quantization="int8"``, each with ``--batch`` sequences prefilled to ``--ctx`` tokens;
then rounds of ``--steps`` timed steps (after 3 untimed ones) per engine, the order flipped each
round, so both sides see the same VM drift and the same number of steps. Reports the step's
median per round, their median and spread, out tok/s (``--batch`` tokens a step), how many
int8 GEMMs each side called from Python (op at a time; `layer.c` calls its own inside) and how
many one-call layers, and the load average; the header names the CPU and the kernel variant.
``--op-at-a-time`` adds a third side, int8 with `llama.NATIVE_LAYER` off.
``--quick``: a smoke run (a few shapes, 2 short rounds, 4 sequences).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

import torch

from loadtests.bench_kernels import alternate
from loadtests.bench_peer import cpu_name as cpu_model

GEMM_ROWS = (1, 16, 64)


def projections(cfg) -> list[tuple[str, int, int]]:
    """(name, K, N) of a decoder layer's GEMMs as the layers run them."""
    att, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [("qkv", h, att + 2 * kv), ("o", att, h), ("gate_up", h, 2 * i), ("down", i, h)]


def gemm(rows: tuple[int, ...], shapes, repeats: int) -> list[str]:
    from shared.model import cpu_kernels

    out = [
        "| proj | rows x K -> N | fp32 packed ms | int8 ms | int8 speed-up | int8 max err |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    g = torch.Generator().manual_seed(0)
    for name, k, n in shapes:
        w = torch.randn(n, k, generator=g) * k**-0.5
        scale = w.abs().amax(1) / 127
        w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        fp, q = cpu_kernels.pack_linear(w), cpu_kernels.pack_int8(w8, scale)
        if fp is None or q is None:
            raise SystemExit("bench_int8: the native kernels are unavailable (no C compiler?)")
        for m in rows:
            x = torch.randn(m, k, generator=g)
            ms = alternate(
                {
                    "fp32": lambda x=x, fp=fp: cpu_kernels.linear(x, fp, None),
                    "int8": lambda x=x, q=q: cpu_kernels.linear_int8(x, q, None),
                },
                repeats,
            )
            ref = cpu_kernels.linear(x, fp, None)
            err = (cpu_kernels.linear_int8(x, q, None) - ref).abs().max() / ref.abs().max()
            out.append(
                f"| {name} | {m} x {k} -> {n} | {ms['fp32']:.3f} | {ms['int8']:.3f} |"
                f" {ms['fp32'] / ms['int8']:.2f}x | {err.item():.1e} |"
            )
    return out


def decode(a, path: str) -> tuple[list[str], str]:
    from shared.engine.engine import LLMEngine
    from shared.model import cpu_kernels
    from shared.model.loader import load_model
    from shared.model.models import llama
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    wcfg = WorkerConfig.load([], role="decode", max_num_seqs=a.batch)
    sides: dict[str, tuple[LLMEngine, bool]] = {}
    for name, quant, native in (
        ("fp32", None, True),
        ("int8", "int8", True),
        ("int8, op at a time", "int8", False),
    )[: 3 if a.op_at_a_time else 2]:
        loaded = load_model(path)  # each engine its own weights: int8 replaces the linears
        ecfg = wcfg.engine_config(kv_budget_for(wcfg, loaded)[0])
        sides[name] = (LLMEngine(loaded, dataclasses.replace(ecfg, quantization=quant)), native)
    vocab = min(loaded.config.vocab_size, 4096)
    rng = random.Random("bench_int8")
    times: dict[str, list[float]] = {k: [] for k in sides}
    counted: dict[str, dict[str, int]] = {k: {"int8_gemm": 0, "layers": 0} for k in sides}
    loads = []
    sp = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    with torch.inference_mode():
        for eng, native in sides.values():
            llama.NATIVE_LAYER = native
            for i in range(a.batch):
                eng.add_request(f"d{i}", [rng.randrange(10, vocab) for _ in range(a.ctx)], sp)
            while any(s.num_computed_tokens < a.ctx for s in eng.seqs.values()):
                eng.step()
        names = list(sides)
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                eng, native = sides[name]
                llama.NATIVE_LAYER = native
                for _ in range(3):
                    eng.step()
                isa = cpu_kernels.loaded_isa()
                calls, layers = cpu_kernels.calls[isa, "int8_gemm"], cpu_kernels.layer_calls
                ts = []
                for _ in range(a.steps):
                    t = time.perf_counter()
                    eng.step()
                    ts.append(time.perf_counter() - t)
                times[name].append(statistics.median(ts))
                counted[name]["int8_gemm"] += cpu_kernels.calls[isa, "int8_gemm"] - calls
                counted[name]["layers"] += cpu_kernels.layer_calls - layers
            loads.append(os.getloadavg()[0])
    llama.NATIVE_LAYER = True
    for eng, _ in sides.values():
        eng.close()
    out = [
        "| side | decode step ms (median of rounds) | spread | out tok/s | int8 GEMM calls"
        " | one-call layers |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        med = statistics.median(ms)
        out.append(
            f"| {name} | {med:.2f} | {min(ms):.2f}-{max(ms):.2f} | {a.batch / med * 1e3:.0f} |"
            f" {counted[name]['int8_gemm']} | {counted[name]['layers']} |"
        )
    ratio = statistics.median(times["fp32"]) / statistics.median(times["int8"])
    summary = (
        f"decode {a.batch} seqs x {a.ctx} ctx, {a.rounds} rounds x {a.steps} steps per side: "
        f"int8 {ratio:.2f}x fp32's out tok/s; load average {min(loads):.2f}-{max(loads):.2f}"
    )
    return out, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("25m", "250m"), default="25m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=50, help="GEMM: timed calls per side")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--op-at-a-time", action="store_true", help="add int8 without layer.c")
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.batch, a.ctx, a.steps, a.rounds = 5, 4, 32, 3, 2

    from loadtests.bench_peer import model_for
    from shared.model import cpu_kernels
    from shared.model.config import load_config

    torch.set_num_threads(a.threads)
    path = model_for(a.model_size)
    cfg = load_config(path)
    variant = cpu_kernels.loaded_isa() or "none"
    print(
        f"### bench_int8: {a.model_size} model (hidden {cfg.hidden_size}, {cfg.num_layers} "
        f"layers), {cpu_model()}, kernels {variant}, {a.threads} threads; load average "
        f"{os.getloadavg()[0]:.2f}\n"
    )
    shapes = projections(cfg)
    rows = (1, 16) if a.quick else GEMM_ROWS
    print("GEMM alone, alternated call by call:\n")
    print("\n".join(gemm(rows, shapes[2:] if a.quick else shapes, a.repeats)) + "\n")
    table, summary = decode(a, path)
    print("Decode step in-process, alternated by round:\n")
    print("\n".join(table) + "\n")
    print(summary)


if __name__ == "__main__":
    main()
