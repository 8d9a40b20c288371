"""Engine benchmarks (P1 throughput, P3 prefix cache, TBT under long prompts, spec decode, int8).

    .venv/bin/python -m loadtests.bench_engine [--quick] [--only p1,p3,tbt,spec,int8]

Every side of a comparison runs in this one process on the standard benchmark model
(``build_benchmark_model``), greedy with EOS ignored. Prints a markdown report.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig, SamplingParams
from shared.model.default_model import build_benchmark_model
from shared.model.loader import load_model

MODEL_DIR = Path(".cache/bench_model")
VOCAB = [1000]  # set from the model config in main()


def workload(n: int, seed: int = 0, lo: int = 64, hi: int = 480) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, VOCAB[0], (k,), generator=g).tolist() for k in lens]


def engine(lm, **kw) -> LLMEngine:
    cfg = dict(kv_cache_bytes=512 << 20, max_num_seqs=16, max_num_batched_tokens=2048)
    cfg.update(kw)
    return LLMEngine(lm, EngineConfig(**cfg))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def p1(lm, path, n: int, out_len: int) -> list[str]:
    from transformers import AutoModelForCausalLM

    ps = workload(n)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    eng = engine(lm)
    eng.generate(ps[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    ours = eng.generate(ps, sp)
    t_ours = time.perf_counter() - t
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    single = []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p])
            single.append(hf.generate(ids, attention_mask=torch.ones_like(ids), **gen)[0, len(p) :])
    t_single = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        for i in range(0, n, 16):
            chunk = ps[i : i + 16]
            m = max(map(len, chunk))
            ids = torch.tensor([[0] * (m - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (m - len(p)) + [1] * len(p) for p in chunk])
            hf.generate(ids, attention_mask=mask, **gen)
    t_batch = time.perf_counter() - t
    agree = sum(o == s.tolist() for o, s in zip(ours, single, strict=True))
    toks = n * out_len
    return [
        f"P1 throughput ({n} prompts 64-480 tok, {out_len} out, concurrency 16):",
        f"- strata engine: {t_ours:.2f} s, {toks / t_ours:.1f} out tok/s",
        f"- transformers one-at-a-time: {t_single:.2f} s -> ratio {t_single / t_ours:.2f}x",
        f"- transformers batched (16, left pad): {t_batch:.2f} s -> ratio {t_batch / t_ours:.2f}x",
        f"- greedy outputs identical to transformers: {agree}/{n}",
        f"- KV pool {eng.stats().kv_pool_bytes / 2**20:.0f} MiB, peak RSS {rss_mib():.0f} MiB",
    ]


def ttft(eng: LLMEngine, prompt) -> float:
    t = time.perf_counter()
    eng.add_request(f"t{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def p3(lm) -> list[str]:
    [p] = workload(1, seed=3, lo=2048, hi=2048)
    warm = engine(lm)
    warm.generate([p[: int(0.9 * len(p))]], SamplingParams(temperature=0, max_tokens=1))
    t_hit = ttft(warm, p)
    t_cold = ttft(engine(lm), p)
    return [
        "P3 prefix cache (2048-token prompt, first 90% served before):",
        f"- TTFT cold {t_cold * 1e3:.0f} ms, warm {t_hit * 1e3:.0f} ms -> {t_cold / t_hit:.1f}x",
        f"- hit tokens {warm.stats().prefix_hit_tokens}",
    ]


def tbt(lm, n_long: int) -> list[str]:
    rows = ["TBT of 8 running decodes while 4000-token prompts arrive (budget 512 tokens):"]
    longs = workload(n_long, seed=4, lo=4000, hi=4000)
    for chunked in (True, False):
        eng = engine(lm, max_num_batched_tokens=512, enable_chunked_prefill=chunked)
        for i, p in enumerate(workload(8, seed=5, lo=64, hi=128)):
            eng.add_request(
                f"d{i}", p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            )
        for _ in range(3):
            eng.step()
        for i, p in enumerate(longs):
            eng.add_request(f"L{i}", p, SamplingParams(temperature=0, max_tokens=1))
        gaps, last = [], time.perf_counter()
        while any(
            r.request_id.startswith("L") for r in eng.scheduler.waiting + eng.scheduler.running
        ):
            outs = eng.step()
            now = time.perf_counter()
            if any(o.request_id.startswith("d") and o.new_token_ids for o in outs):
                gaps.append(now - last)
                last = now
        gaps.sort()
        p50, p99 = statistics.median(gaps), gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
        rows.append(
            f"- chunked={chunked}: TBT P50 {p50 * 1e3:.0f} ms, P99 {p99 * 1e3:.0f} ms, max "
            f"{gaps[-1] * 1e3:.0f} ms over {len(gaps)} decode steps"
        )
    return rows


def spec(lm, n: int) -> list[str]:
    ps = [([7, 8, 9, 10, 11, 12] * 20)[: 60 + 5 * i] for i in range(n)]
    ps += [workload(1, seed=6 + i, lo=32, hi=32)[0] * 4 for i in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    e0, e1 = engine(lm, max_num_seqs=1), engine(lm, max_num_seqs=1, num_speculative_tokens=4)
    t = time.perf_counter()
    a = e0.generate(ps, sp)
    t0 = time.perf_counter() - t
    t = time.perf_counter()
    b = e1.generate(ps, sp)
    t1 = time.perf_counter() - t
    st = e1.stats()
    return [
        f"Spec decode (n-gram k=4, {len(ps)} repetitive prompts, 64 out, batch 1):",
        f"- identical to greedy: {a == b}; acceptance {st.spec_acceptance_rate:.2f} "
        f"({st.spec_accepted_tokens}/{st.spec_draft_tokens}); speedup {t0 / t1:.2f}x",
    ]


def int8(path, n: int) -> list[str]:
    ps = workload(n, seed=7, lo=64, hi=128)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref, q = engine(load_model(path)), engine(load_model(path), quantization="int8")
    res = {}
    for name, e in (("fp32", ref), ("int8", q)):
        e.generate(ps[:1], SamplingParams(temperature=0, max_tokens=2))
        t = time.perf_counter()
        res[name] = (e.generate(ps, sp), time.perf_counter() - t)
    first = sum(x[0] == y[0] for x, y in zip(res["fp32"][0], res["int8"][0], strict=True))
    seq = sum(x == y for x, y in zip(res["fp32"][0], res["int8"][0], strict=True))
    ids = torch.tensor(ps[0])
    from tests.engine.test_sampling_spec_quant import _last_logits

    la, lb = _last_logits(ref, ps[0]), _last_logits(q, ps[0])
    err = (la - lb).abs().max().item()
    return [
        f"int8 weight-only ({n} prompts, 32 out):",
        f"- time fp32 {res['fp32'][1]:.2f} s, int8 {res['int8'][1]:.2f} s -> speed ratio "
        f"{res['fp32'][1] / res['int8'][1]:.2f}x",
        f"- max |logit err| {err:.4f} (logit range {(la.max() - la.min()).item():.2f}); first-token "
        f"agreement {first}/{n}; whole-sequence agreement {seq}/{n} ({ids.numel()}-tok probe)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens for P1 etc.")
    ap.add_argument("--only", default="p1,p3,tbt,spec,int8")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = build_benchmark_model(MODEL_DIR)
    lm = load_model(path)
    VOCAB[0] = lm.config.vocab_size - 64  # stay clear of special and padding ids
    n, out_len = (16, 32) if args.quick else (64, 64)
    parts = {
        "p1": lambda: p1(lm, path, n, out_len),
        "p3": lambda: p3(lm),
        "tbt": lambda: tbt(lm, 1 if args.quick else 2),
        "spec": lambda: spec(lm, 2 if args.quick else 4),
        "int8": lambda: int8(path, 8 if args.quick else 16),
    }
    for key in args.only.split(","):
        t = time.perf_counter()
        for line in parts[key]():
            print(line, flush=True)
        print(f"  ({key} took {time.perf_counter() - t:.0f} s; peak RSS {rss_mib():.0f} MiB)\n")


if __name__ == "__main__":
    main()
