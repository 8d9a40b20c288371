"""Strata's model forward vs transformers' on the same weights (CPU by default).

Uses the standard benchmark checkpoint (``build_benchmark_model``: Qwen3, hidden 512, 8 layers,
~24M params, fp32) built once into a cache directory. Measures

* prefill: ``--batch`` prompts of ``--prompt-len`` tokens in one forward (Strata: one flat
  varlen step into the paged cache; transformers: a padded-free ``[B, T]`` batch with its
  ``DynamicCache``), logits for the last token of each prompt only (both sides);
* decode: one new token for each of ``--batch`` sequences holding ``--context`` tokens
  (Strata: pure-decode fast path over the paged cache; transformers: its KV cache).

    .venv/bin/python -m loadtests.bench_model [--threads 2] [--repeats 5]

Prints a markdown table; ratio = transformers time / Strata time (>= 1.0: Strata is faster).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from shared.model.api import AttentionMetadata, KVCache
from shared.model.default_model import build_benchmark_model
from shared.model.loader import load_model


def _meta(q_lens: list[int], ctx_lens: list[int], blocks_per_seq: int, block_size: int):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    tables = torch.arange(len(q_lens) * blocks_per_seq).view(len(q_lens), blocks_per_seq)
    slots = torch.cat(
        [
            tables[i].repeat_interleave(block_size)[c - q : c] * block_size
            + torch.arange(c - q, c) % block_size
            for i, (q, c) in enumerate(zip(q_lens, ctx_lens, strict=True))
        ]
    )
    return AttentionMetadata(
        torch.tensor(qsl), torch.tensor(ctx_lens), tables, slots, list(q_lens), list(ctx_lens)
    )


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _compare(ours_fn, hf_fn, repeats: int) -> tuple[float, float]:
    """Median seconds of each side; samples alternate so machine load hits both alike.
    ``hf_fn`` may set ``.elapsed`` to exclude its own set-up from the measurement."""
    ours_fn(), hf_fn()  # warm-up
    ours_s, hf_s = [], []
    for _ in range(repeats):
        ours_s.append(_timed(ours_fn))
        t = _timed(hf_fn)
        hf_s.append(getattr(hf_fn, "elapsed", t))
    return statistics.median(ours_s), statistics.median(hf_s)


def bench(args) -> list[tuple[str, float, float]]:
    path = build_benchmark_model(Path(args.cache_dir))
    ours = load_model(path).model
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    b, t, ctx, bs = args.batch, args.prompt_len, args.context, 16
    g = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    blocks = -(-max(t, ctx + 1) // bs)
    cache = KVCache.allocate(
        ours.num_layers, b * blocks, bs, ours.num_kv_heads, ours.head_dim, ours.dtype
    )
    rows = []

    # prefill: B fresh prompts of T tokens
    prompts = torch.randint(0, vocab, (b, t), generator=g)
    meta = _meta([t] * b, [t] * b, blocks, bs)
    pos = torch.arange(t).repeat(b)
    last = torch.arange(1, b + 1) * t - 1

    def ours_prefill():
        h = ours(prompts.flatten(), pos, meta, cache)
        return ours.compute_logits(h[last])

    def hf_prefill():
        with torch.inference_mode():
            return hf(
                prompts, cache=DynamicCache(config=hf.config), use_cache=True, logits_to_keep=1
            ).logits

    ref = hf_prefill()[:, -1]
    assert (ours_prefill() - ref).abs().max() < 1e-3, "outputs differ"
    rows.append((f"prefill {b}x{t}", *_compare(ours_prefill, hf_prefill, args.repeats)))

    # decode: B sequences with CTX cached tokens, one new token each
    ctx_ids = torch.randint(0, vocab, (b, ctx), generator=g)
    ours(
        ctx_ids.flatten(),
        torch.arange(ctx).repeat(b),
        _meta([ctx] * b, [ctx] * b, blocks, bs),
        cache,
    )
    new = torch.randint(0, vocab, (b,), generator=g)
    dmeta = _meta([1] * b, [ctx + 1] * b, blocks, bs)
    dpos = torch.full((b,), ctx)

    def ours_decode():  # rewrites the same slot each time: same work as a real step
        return ours.compute_logits(ours(new, dpos, dmeta, cache))

    with torch.inference_mode():
        past = DynamicCache(config=hf.config)
        hf(ctx_ids, cache=past, use_cache=True, logits_to_keep=1)

    def hf_decode():  # a fresh copy of the ctx cache so every step sees CTX tokens
        with torch.inference_mode():
            p = copy.deepcopy(past)
            t0 = time.perf_counter()
            out = hf(new[:, None], cache=p, use_cache=True).logits
            hf_decode.elapsed = time.perf_counter() - t0
            return out

    assert (ours_decode() - hf_decode()[:, -1]).abs().max() < 1e-3, "outputs differ"
    rows.append(
        (f"decode step {b}x1 @ctx {ctx}", *_compare(ours_decode, hf_decode, args.repeats * 4))
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Strata vs transformers model forward")
    p.add_argument("--cache-dir", default=".cache/strata-models/benchmark")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"threads {args.threads}, device cpu"
    )
    print("| case | strata ms | transformers ms | ratio (hf/strata) |")
    print("| --- | ---: | ---: | ---: |")
    for name, ours_s, hf_s in bench(args):
        print(f"| {name} | {ours_s * 1e3:.1f} | {hf_s * 1e3:.1f} | {hf_s / ours_s:.2f} |")


if __name__ == "__main__":
    main()
