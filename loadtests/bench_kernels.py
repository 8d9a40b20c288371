"""Micro-benchmarks behind docs/benchmarks/model.md: the GEMM and decode-attention numbers.

    .venv/bin/python -m loadtests.bench_kernels [--threads 1,2] [--repeats 50] [--only decode-step,...]

GEMM: ``F.linear`` (MKL), oneDNN on its prepacked weight, and the native kernel
(`shared.model.cpu_kernels.linear`, what `shared.model.layers.Gemm` runs for float32 on CPU) at
the benchmark model's shapes, median ms, and the max error of each against a float64 product;
then the same three over a whole model's projections (8 layers of qkv, o, gate_up, down: 94 MB,
more than the caches, so every weight comes from memory as in a decode step) for 1-256 rows.
Decode attention: one layer, 16 and 64 sequences with contexts 64-544, block 16, 8 heads over 4 KV
heads of 64: the torch path (per-sequence gather + SDPA on one thread, what `paged_attention` runs
without the kernel) against the native kernel (`shared.model.cpu_kernels.decode_attention`).
Decode attention as a decode step meets it: 8 layers' caches in turn in one pool allocated as the
engine's (~65 MB of K/V for 16 sequences, more than L3, so K/V come from memory), the native
kernel only, ms per step and GB/s of K/V read.
Prefill attention: one layer, one prompt of 64-2048 tokens, same heads: torch's causal SDPA (what
`paged_attention` runs without the kernel) against the native kernel reading the paged cache
(`shared.model.cpu_kernels.prefill_attention`).
int8: at the same shapes, the packed fp32 GEMM against fbgemm's dynamic W8A8 linear (int8 weights
and per-row dynamically quantised activations) and ``aten._weight_int8pack_mm`` (int8 weights,
float activations), with the max error of each against the fp32 product.
Both sides alternate call by call; the report gives the median and the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from shared.model import cpu_kernels
from shared.model.api import KVCache
from shared.model.attention import _context, _serial
from shared.model.layers import Gemm, _pack

GEMM_SHAPES = [
    (16, 512, 2816),
    (16, 1408, 512),
    (64, 512, 2816),
    (1024, 512, 2816),
    (1024, 1408, 512),
]


def alternate(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each callable, called in turn ``repeats`` times (after one warm-up each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _onednn(w: torch.Tensor):
    packed = _pack(w)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _native(w: torch.Tensor):
    packed = cpu_kernels.pack_linear(w)
    return lambda x: cpu_kernels.linear(x, packed, None)


def gemm(repeats: int) -> list[str]:
    rows = [
        "| rows x in -> out | F.linear (MKL) ms | oneDNN prepacked ms | native ms"
        " | native vs oneDNN | max err MKL | max err oneDNN | max err native |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    g = torch.Generator().manual_seed(0)
    for m, k, n in GEMM_SHAPES:
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g) * k**-0.5
        fns = {"mkl": partial(F.linear, weight=w), "onednn": _onednn(w), "native": _native(w)}
        ms = alternate({name: partial(fn, x) for name, fn in fns.items()}, repeats)
        exact = (x.double() @ w.double().T).float()
        err = {name: (fn(x) - exact).abs().max().item() for name, fn in fns.items()}
        rows.append(
            f"| {m} x {k} -> {n} | {ms['mkl']:.3f} | {ms['onednn']:.3f} | {ms['native']:.3f} | "
            f"{ms['onednn'] / ms['native']:.2f}x | {err['mkl']:.1e} | {err['onednn']:.1e} |"
            f" {err['native']:.1e} |"
        )
    return rows


def gemm_model(repeats: int) -> list[str]:
    """Every projection of the benchmark model's 8 layers in turn (weights from memory)."""
    rows = [
        "| rows | F.linear (MKL) ms | oneDNN prepacked ms | native ms | native vs oneDNN |"
        " native GB/s of weights |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    g = torch.Generator().manual_seed(2)
    shapes = [(512, 1024), (512, 512), (512, 2816), (1408, 512)] * 8
    ws = [torch.randn(n, k, generator=g) * k**-0.5 for k, n in shapes]
    sides = {
        "mkl": [partial(F.linear, weight=w) for w in ws],
        "onednn": [_onednn(w) for w in ws],
        "native": [_native(w) for w in ws],
    }
    nbytes = sum(w.numel() * 4 for w in ws)
    for m in (1, 4, 16, 64, 256):
        xs = {k: torch.randn(m, k, generator=g) for k in (512, 1408)}

        def run(fns, xs=xs):
            for fn, (k, _) in zip(fns, shapes, strict=True):
                fn(xs[k])

        ms = alternate(
            {name: partial(run, fns) for name, fns in sides.items()}, max(3, repeats // 5)
        )
        rows.append(
            f"| {m} | {ms['mkl']:.2f} | {ms['onednn']:.2f} | {ms['native']:.2f} | "
            f"{ms['onednn'] / ms['native']:.2f}x | {nbytes / ms['native'] / 1e6:.1f} |"
        )
    return rows


def int8(repeats: int) -> list[str]:
    import warnings

    import torch.ao.nn.quantized.dynamic as nnqd

    rows = [
        "| rows x in -> out | fp32 prepacked ms | fbgemm W8A8 dynamic ms | int8pack_mm ms |"
        " max err W8A8 | max err int8pack |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    g = torch.Generator().manual_seed(1)
    for m, k, n in GEMM_SHAPES:
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g) * k**-0.5
        scale = w.abs().amax(1) / 127
        w8 = torch.round(w / scale[:, None]).to(torch.int8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dyn = nnqd.Linear(k, n, bias_=False, dtype=torch.qint8)
            dyn.set_weight_bias(
                torch.quantize_per_channel(
                    w, scale, torch.zeros(n, dtype=torch.long), 0, torch.qint8
                ),
                None,
            )
        packed = Gemm(w, None)  # the float32 path the engine runs (native where it builds)
        ms = alternate(
            {
                "fp32": partial(packed, x),
                "w8a8": partial(dyn, x),
                "pack": partial(torch.ops.aten._weight_int8pack_mm, x, w8, scale),
            },
            repeats,
        )
        ref = F.linear(x, w)
        e_dyn = (dyn(x) - ref).abs().max().item()
        e_pack = (torch.ops.aten._weight_int8pack_mm(x, w8, scale) - ref).abs().max().item()
        rows.append(
            f"| {m} x {k} -> {n} | {ms['fp32']:.3f} | {ms['w8a8']:.3f} | {ms['pack']:.3f}"
            f" | {e_dyn:.1e} | {e_pack:.1e} |"
        )
    return rows


def _scattered_tables(nblocks: list[int], total: int, g: torch.Generator) -> torch.Tensor:
    """Block tables of sequences with ``nblocks`` blocks each, placed at random among ``total``
    (a long-running pool's scattered blocks), padded with 0."""
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(nblocks), max(nblocks), dtype=torch.long)
    used = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    return tables


def _attention_case(n_seq: int, repeats: int) -> dict[str, float]:
    heads, kvh, dim, bs = 8, 4, 64, 16
    rng = random.Random(n_seq)
    ctx = [rng.randint(64, 544) for _ in range(n_seq)]
    nblocks = [-(-c // bs) for c in ctx]
    g = torch.Generator().manual_seed(n_seq)
    total = sum(nblocks) + 8
    k_cache = torch.randn(total, bs, kvh, dim, generator=g)
    v_cache = torch.randn(total, bs, kvh, dim, generator=g)
    tables = _scattered_tables(nblocks, total, g)
    q = torch.randn(n_seq, heads, dim, generator=g)
    lens = torch.tensor(ctx)
    scale = dim**-0.5
    qg = q.view(n_seq, kvh, heads // kvh, dim)

    def torch_path() -> None:
        with _serial(q.device):
            for j, c in enumerate(ctx):
                blocks = tables[j, : nblocks[j]]
                kd, vd = _context(k_cache, blocks, c), _context(v_cache, blocks, c)
                F.scaled_dot_product_attention(qg[j], kd, vd, scale=scale)

    fns = {"torch": torch_path}
    if cpu_kernels.available():
        fns["native"] = partial(
            cpu_kernels.decode_attention, q, k_cache, v_cache, tables, lens, scale
        )
    return alternate(fns, repeats)


def decode_attention(repeats: int) -> list[str]:
    rows = [
        "| sequences | torch path ms | native kernel ms | speed-up |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n_seq in (16, 64):
        ms = _attention_case(n_seq, repeats)
        nat = ms.get("native", float("nan"))
        rows.append(f"| {n_seq} | {ms['torch']:.2f} | {nat:.2f} | {ms['torch'] / nat:.2f}x |")
    return rows


def decode_attention_step(repeats: int, layers: int = 8, n_seq: int = 16) -> list[str]:
    """The native kernel over ``layers`` layers' caches in turn, as one decode step calls it."""
    heads, kvh, dim, bs = 8, 4, 64, 16
    rng = random.Random(7)
    ctx = [rng.randint(64, 544) for _ in range(n_seq)]
    nblocks = [-(-c // bs) for c in ctx]
    total = sum(nblocks) + 8
    g = torch.Generator().manual_seed(7)
    cache = KVCache.allocate(layers, total, bs, kvh, dim, torch.float32)  # as the engine's
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    kv = list(zip(cache.k, cache.v, strict=True))
    tables = _scattered_tables(nblocks, total, g)
    q, lens = torch.randn(n_seq, heads, dim, generator=g), torch.tensor(ctx)
    if cpu_kernels.decode_attention(q, *kv[0], tables, lens, dim**-0.5) is None:
        return ["(native kernel unavailable)"]

    def step() -> None:
        for k, v in kv:
            cpu_kernels.decode_attention(q, k, v, tables, lens, dim**-0.5)

    ms = alternate({"native": step}, repeats)["native"]
    read = 2 * sum(ctx) * kvh * dim * 4 * layers
    return [
        "| layers | sequences | K/V read per step | native kernel ms per step | GB/s |",
        "| ---: | ---: | ---: | ---: | ---: |",
        f"| {layers} | {n_seq} | {read / 1e6:.1f} MB | {ms:.2f} | {read / ms / 1e6:.1f} |",
    ]


def prefill_attention(repeats: int) -> list[str]:
    rows = [
        "| prompt tokens | torch SDPA ms | native kernel ms | speed-up |",
        "| ---: | ---: | ---: | ---: |",
    ]
    h, kvh, d, bs = 8, 4, 64, 16
    g = torch.Generator().manual_seed(0)
    for n in (64, 272, 1024, 2048):
        nb = -(-n // bs)
        k_cache = torch.randn(nb + 8, bs, kvh, d, generator=g)
        v_cache = torch.randn(nb + 8, bs, kvh, d, generator=g)
        tables = torch.randperm(nb + 8, generator=g)[:nb].view(1, nb)
        q = torch.randn(n, h + 2 * kvh, d, generator=g)[:, :h]  # a view into a qkv output
        k = k_cache[tables[0]].view(-1, kvh, d)[:n].transpose(0, 1).contiguous()
        v = v_cache[tables[0]].view(-1, kvh, d)[:n].transpose(0, 1).contiguous()
        one = torch.tensor([n])
        out = torch.empty(n, h, d)
        fns = {
            "torch": partial(
                F.scaled_dot_product_attention,
                q.transpose(0, 1),
                k,
                v,
                is_causal=True,
                scale=d**-0.5,
                enable_gqa=True,
            )
        }
        args = (tables, one, torch.tensor([0]), one, d**-0.5, out)
        if cpu_kernels.prefill_attention(q, k_cache, v_cache, *args):
            fns["native"] = partial(cpu_kernels.prefill_attention, q, k_cache, v_cache, *args)
        ms = alternate(fns, repeats)
        nat = ms.get("native", float("nan"))
        rows.append(f"| {n} | {ms['torch']:.3f} | {nat:.3f} | {ms['torch'] / nat:.2f}x |")
    return rows


PARTS = {
    "gemm": ("GEMM, benchmark-model shapes", gemm),
    "gemm-model": (
        "GEMM, every projection of the model's 8 layers in turn (94 MB, from memory)",
        gemm_model,
    ),
    "decode": (
        "Decode attention, one layer, contexts 64-544, block 16, 8 heads / 4 KV heads x 64",
        decode_attention,
    ),
    "decode-step": (
        "Decode attention over 8 layers' caches in turn (K/V from memory), same shapes",
        decode_attention_step,
    ),
    "prefill": (
        "Prefill attention, one layer, one prompt, 8 heads / 4 KV heads x 64",
        prefill_attention,
    ),
    "int8": ("int8 GEMM options, same shapes", int8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="torch thread counts to run (comma list)")
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per side")
    ap.add_argument("--only", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    a = ap.parse_args()
    only = {p.strip() for p in a.only.split(",") if p.strip()}
    if not only or only - set(PARTS):
        raise SystemExit(f"bench_kernels: --only takes {', '.join(PARTS)}")
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        print(f"## {threads} torch thread(s); load average (1 min) {os.getloadavg()[0]:.2f}\n")
        for part in PARTS:
            if part in only:
                title, fn = PARTS[part]
                print(title + ":\n")
                print("\n".join(fn(a.repeats)) + "\n", flush=True)


if __name__ == "__main__":
    main()
