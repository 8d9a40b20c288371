"""bfloat16 weights on CPU (`shared/model/gemm_bf16.c`) against float32 and against bf16 through
torch / oneDNN: the GEMM over a whole model's projections, and the engine's prefill and decode
step, alternated in one process.

    .venv/bin/python -m loadtests.bench_bf16 [--model-size 25m|250m] [--rounds 6] [--quick]

GEMM: one pass over every layer's projections of the benchmark model (q/k/v and gate/up fused,
as the layers run them: the whole model's weights, more than the caches, so at decode sizes they
come from memory as in a step) at 1-512 rows: the packed float32 kernel (`cpu_kernels.linear`),
the bf16 kernel's widen path (``dot_rows`` 0), its ``vdpbf16ps`` path (``dot_rows`` 1: the
``avx512bf16`` variant only, else the widen path again) and oneDNN's bf16 GEMM on its blocked
copy (bf16 rows, what bf16 ran on before), called in turn, median ms per pass. `bf16.DOT_ROWS`
should be the fewest rows from which the dot path is the faster.
Engine: three in-process `LLMEngine`s as the decode worker builds them on the same checkpoint:
``fp32`` (native GEMM, one call per layer), ``bf16`` (the native bf16 GEMM, one call per layer,
float32 hidden state, bf16 KV) and ``bf16 torch`` (bf16 with the GEMMs on oneDNN, as
``STRATA_CPU_GEMM=onednn``: layers op at a time in bf16). Prefill: one fresh ``--prompt``-token
prompt per side per round; decode: ``--batch`` sequences prefilled to ``--ctx`` tokens, then
rounds of ``--steps`` timed steps (after 3 untimed ones) per side; the order of the sides
flipped each round, so all see the same VM drift. Reports each side's median per round, their
median and spread, the bf16 GEMM calls from Python and the one-call layers each side ran, and
the load average; the header names the CPU and the kernel variant.
``--dot-rows N`` sets `bf16.DOT_ROWS` for the engines (the crossover to try; 0: widen only).
``--quick``: a smoke run (fewer rows, 2 short rounds, 4 sequences, a 64-token prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

import torch

from loadtests.bench_int8 import projections
from loadtests.bench_kernels import alternate
from loadtests.bench_peer import cpu_name as cpu_model

GEMM_ROWS = (1, 4, 8, 16, 32, 64, 512)
SIDES = ("fp32", "bf16", "bf16 torch")


def gemm(cfg, rows: tuple[int, ...], repeats: int) -> list[str]:
    from shared.model import bf16, cpu_kernels
    from shared.model.layers import _pack

    g = torch.Generator().manual_seed(0)
    shapes = projections(cfg)
    ws = [
        torch.randn(n, k, generator=g) * k**-0.5
        for _ in range(cfg.num_layers)
        for _, k, n in shapes
    ]
    fp = [cpu_kernels.pack_linear(w) for w in ws]
    wide = [bf16.pack_bf16(w.bfloat16(), dot_rows=0) for w in ws]
    dot = [bf16.pack_bf16(w.bfloat16(), dot_rows=1) for w in ws]
    onednn = [_pack(w.bfloat16()) for w in ws]
    if any(p is None for p in (*fp, *wide, *onednn)):
        raise SystemExit("bench_bf16: the native kernels or oneDNN are unavailable")
    out = [
        "| rows | fp32 ms | bf16 widen ms | bf16 dot ms | oneDNN bf16 ms | widen vs fp32 |"
        " dot vs widen | dot vs oneDNN |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in rows:
        xs = [torch.randn(m, w.shape[1], generator=g) for w in ws]
        xb = [x.bfloat16() for x in xs]

        def native(packs, fn=bf16.linear_bf16, xs=xs):
            for x, p in zip(xs, packs, strict=True):
                fn(x, p, None)

        def mkldnn(xb=xb):
            for x, p in zip(xb, onednn, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

        ms = alternate(
            {
                "fp32": lambda: native(fp, cpu_kernels.linear),
                "widen": lambda: native(wide),
                "dot": lambda: native(dot),
                "onednn": mkldnn,
            },
            repeats if m < 64 else max(3, repeats // 5),
        )
        out.append(
            f"| {m} | {ms['fp32']:.2f} | {ms['widen']:.2f} | {ms['dot']:.2f} | {ms['onednn']:.2f}"
            f" | {ms['fp32'] / ms['widen']:.2f}x | {ms['widen'] / ms['dot']:.2f}x"
            f" | {ms['onednn'] / ms['dot']:.2f}x |"
        )
    return out


def engines(a, path: str) -> dict:
    """The three sides' engines, each with its own weights, packed as the side runs them."""
    from shared.engine.engine import LLMEngine
    from shared.model import layers
    from shared.model.loader import load_model
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    wcfg = WorkerConfig.load([], role="decode", max_num_seqs=a.batch)
    out = {}
    for name, dtype in zip(SIDES, (torch.float32, torch.bfloat16, torch.bfloat16), strict=True):
        loaded = load_model(path, dtype=dtype)
        ecfg = wcfg.engine_config(kv_budget_for(wcfg, loaded)[0])
        eng = LLMEngine(loaded, dataclasses.replace(ecfg, enable_prefix_caching=False))
        layers.NATIVE_CPU_GEMM = name != "bf16 torch"  # read when a projection is packed
        eng.generate([[11] * 16], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        out[name] = eng
    layers.NATIVE_CPU_GEMM = True
    return out


def run(a, path: str) -> tuple[list[str], str]:
    from shared.model import cpu_kernels
    from shared.protocol.sampling import SamplingParams

    sides = engines(a, path)
    vocab = min(next(iter(sides.values())).loaded.config.vocab_size, 4096)
    rng = random.Random("bench_bf16")

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prefill: dict[str, list[float]] = {k: [] for k in sides}
    decode: dict[str, list[float]] = {k: [] for k in sides}
    counted = {k: {"bf16_gemm": 0, "layers": 0} for k in sides}
    isa, loads = cpu_kernels.loaded_isa(), []

    def measured(name: str, fn) -> None:
        calls, layers = cpu_kernels.calls[isa, "bf16_gemm"], cpu_kernels.layer_calls
        fn()
        counted[name]["bf16_gemm"] += cpu_kernels.calls[isa, "bf16_gemm"] - calls
        counted[name]["layers"] += cpu_kernels.layer_calls - layers

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    sp = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    with torch.inference_mode():
        for r in range(a.rounds):
            for name in SIDES if r % 2 == 0 else SIDES[::-1]:
                p = prompt(a.prompt)  # fresh tokens (and no prefix cache)
                t = time.perf_counter()
                measured(name, lambda name=name, p=p: sides[name].generate([p], one))
                prefill[name].append(time.perf_counter() - t)
        for eng in sides.values():
            for i in range(a.batch):
                eng.add_request(f"d{i}", prompt(a.ctx), sp)
            while any(s.num_computed_tokens < a.ctx for s in eng.seqs.values()):
                eng.step()
        for r in range(a.rounds):
            for name in SIDES if r % 2 == 0 else SIDES[::-1]:
                eng = sides[name]
                for _ in range(3):
                    eng.step()
                ts = []
                for _ in range(a.steps):
                    t = time.perf_counter()
                    measured(name, eng.step)
                    ts.append(time.perf_counter() - t)
                decode[name].append(statistics.median(ts))
            loads.append(os.getloadavg()[0])
    for eng in sides.values():
        eng.close()
    out = [
        "| side | prefill ms (median of rounds) | spread | decode step ms | spread | out tok/s"
        " | bf16 GEMM calls | one-call layers |",
        "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for name in SIDES:
        p, d = [t * 1e3 for t in prefill[name]], [t * 1e3 for t in decode[name]]
        med = statistics.median(d)
        out.append(
            f"| {name} | {statistics.median(p):.1f} | {min(p):.1f}-{max(p):.1f} | {med:.2f} |"
            f" {min(d):.2f}-{max(d):.2f} | {a.batch / med * 1e3:.0f} |"
            f" {counted[name]['bf16_gemm']} | {counted[name]['layers']} |"
        )

    def ratio(times: dict[str, list[float]], base: str) -> float:
        return statistics.median(times[base]) / statistics.median(times["bf16"])

    summary = (
        f"bf16 against fp32: prefill of {a.prompt} tokens {ratio(prefill, 'fp32'):.2f}x, decode"
        f" ({a.batch} seqs x {a.ctx} ctx) {ratio(decode, 'fp32'):.2f}x; against bf16 torch:"
        f" {ratio(prefill, 'bf16 torch'):.2f}x, {ratio(decode, 'bf16 torch'):.2f}x; load average"
        f" {min(loads):.2f}-{max(loads):.2f}"
    )
    return out, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("25m", "250m"), default="25m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20, help="GEMM: timed passes per side")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dot-rows", type=int, default=None, help="bf16.DOT_ROWS for the engines")
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.batch, a.ctx, a.prompt, a.steps, a.rounds = 3, 4, 32, 64, 3, 2

    from loadtests.bench_peer import model_for
    from shared.model import bf16, cpu_kernels
    from shared.model.config import load_config

    torch.set_num_threads(a.threads)
    if a.dot_rows is not None:
        bf16.DOT_ROWS = a.dot_rows  # before the engines pack their weights
    path = model_for(a.model_size)
    cfg = load_config(path)
    variant = cpu_kernels.loaded_isa() or "none"
    print(
        f"### bench_bf16: {a.model_size} model (hidden {cfg.hidden_size}, {cfg.num_layers} "
        f"layers), {cpu_model()}, kernels {variant}, {a.threads} threads, bf16.DOT_ROWS "
        f"{bf16.DOT_ROWS}; load average {os.getloadavg()[0]:.2f}\n"
    )
    rows = (1, 16, 64) if a.quick else GEMM_ROWS
    print("GEMM, one pass over the model's projections, alternated pass by pass:\n")
    print("\n".join(gemm(cfg, rows, a.repeats)) + "\n")
    table, summary = run(a, path)
    print("Engine in-process, alternated by round:\n")
    print("\n".join(table) + "\n")
    print(summary)


if __name__ == "__main__":
    main()
