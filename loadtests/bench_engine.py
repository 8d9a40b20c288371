"""Engine benchmarks (P1 throughput, P3 prefix cache, TBT under long prompts, spec decode, int8).

    .venv/bin/python -m loadtests.bench_engine [--quick] [--only p1,p3,tbt,spec,int8]

Every side of a comparison runs in this one process on the standard benchmark model
(``build_benchmark_model``), greedy with EOS ignored. Prints a markdown report.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.default_model import build_benchmark_model
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams

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


def p1(lm, path, n: int, out_len: int, repeats: int = 3) -> list[str]:
    from transformers import AutoModelForCausalLM

    ps = workload(n)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Ignore EOS like the engine. ``min_new_tokens`` would instead *ban* the eos ids (the
    # checkpoint's generation_config lists [2, 0]) and make transformers pick the runner-up.
    hf.generation_config.eos_token_id = None
    gen = dict(max_new_tokens=out_len, do_sample=False, pad_token_id=0)

    def hf_batched() -> None:
        with torch.no_grad():
            for i in range(0, n, 16):
                chunk = ps[i : i + 16]
                m = max(map(len, chunk))
                ids = torch.tensor([[0] * (m - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (m - len(p)) + [1] * len(p) for p in chunk])
                hf.generate(ids, attention_mask=mask, **gen)

    def hf_single() -> list:
        with torch.no_grad():
            return [
                hf.generate(
                    torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **gen
                )[0, len(p) :]
                for p in ps
            ]

    times: dict[str, list[float]] = {"strata": [], "batched": [], "single": []}
    for _ in range(repeats):  # every side the same number of runs, alternated
        eng = engine(lm)  # fresh: no prefix-cache hits from the previous round
        eng.generate(workload(1, seed=99), SamplingParams(temperature=0, max_tokens=2))
        t = time.perf_counter()
        ours = eng.generate(ps, sp)
        times["strata"].append(time.perf_counter() - t)
        t = time.perf_counter()
        hf_batched()
        times["batched"].append(time.perf_counter() - t)
        t = time.perf_counter()
        single = hf_single()
        times["single"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    agree = sum(o == s.tolist() for o, s in zip(ours, single, strict=True))
    toks = n * out_len
    st = eng.stats()
    diverged = [
        divergence(hf, p, o, s.tolist())
        for p, o, s in zip(ps, ours, single, strict=True)
        if o != s.tolist()
    ]
    return [
        f"P1 throughput ({n} prompts 64-480 tok, {out_len} out, concurrency 16):",
        f"- {repeats} runs per side, alternated; load average (1 min) now {os.getloadavg()[0]:.2f}",
        f"- strata engine: median {med['strata']:.2f} s ({toks / med['strata']:.1f} out tok/s), "
        f"best {best['strata']:.2f} s, spread {min(times['strata']):.2f}-{max(times['strata']):.2f} s",
        f"- transformers one-at-a-time: median {med['single']:.2f} s, best {best['single']:.2f} s "
        f"-> ratio {med['single'] / med['strata']:.2f}x (medians), {best['single'] / best['strata']:.2f}x (bests)",
        f"- transformers batched (16, left pad): median {med['batched']:.2f} s, best "
        f"{best['batched']:.2f} s -> ratio {med['batched'] / med['strata']:.2f}x (medians), "
        f"{best['batched'] / best['strata']:.2f}x (bests)",
        f"- greedy outputs identical to transformers: {agree}/{n}",
        *diverged,
        f"- engine: {st.steps} steps, forward {st.forward_time_s:.2f} s, step {st.step_time_s:.2f} s"
        f" (non-forward {100 * (1 - st.forward_time_s / st.step_time_s):.1f}%), idle gap between"
        f" steps {st.idle_gap_s * 1e3:.1f} ms total",
        f"- KV pool {st.kv_pool_bytes / 2**20:.0f} MiB, peak RSS {rss_mib():.0f} MiB",
    ]


def divergence(hf, prompt, ours, theirs) -> str:
    """Where two greedy outputs part: the fp32 top-2 logit gap there and float64's choice."""
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    ids = torch.tensor([prompt + ours[:at]])
    with torch.no_grad():
        l32 = hf(ids).logits[0, -1]
        hf64 = copy.deepcopy(hf).double()
        l64 = hf64(ids).logits[0, -1]
    top = l32.topk(2)
    return (
        f"- differs at output {at}: strata {ours[at]}, transformers {theirs[at]}; fp32 top-2 "
        f"{top.indices.tolist()} gap {(top.values[0] - top.values[1]).item():.2e}; float64 argmax "
        f"{int(l64.argmax())} (gap {(l64[ours[at]] - l64[theirs[at]]).item():+.2e} strata-hf)"
    )


def ttft(eng: LLMEngine, prompt) -> float:
    t = time.perf_counter()
    eng.add_request(f"t{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def p3(lm, repeats: int = 3) -> list[str]:
    """Best of ``repeats`` (fresh prompt each time, cold and warm alternated)."""
    cold, hit, hits = [], [], 0
    for r in range(repeats):
        [p] = workload(1, seed=3 + r, lo=2048, hi=2048)
        warm = engine(lm)
        warm.generate([p[: int(0.9 * len(p))]], SamplingParams(temperature=0, max_tokens=1))
        hit.append(ttft(warm, p))
        cold.append(ttft(engine(lm), p))
        hits = warm.stats().prefix_hit_tokens
    t_cold, t_hit = min(cold), min(hit)
    return [
        f"P3 prefix cache (2048-token prompt, first 90% served before; best of {repeats}):",
        f"- TTFT cold {t_cold * 1e3:.0f} ms, warm {t_hit * 1e3:.0f} ms -> {t_cold / t_hit:.1f}x",
        f"- prefix-cache hit tokens of the warm request: {hits} of 2048",
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
        unfinished = {f"L{i}" for i in range(len(longs))}
        while unfinished:
            outs = eng.step()
            unfinished -= {o.request_id for o in outs if o.finished}
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


def cyclic_prompts(lm, n: int, seed_len: int = 32, warm: int = 128) -> list[list[int]]:
    """Prompts whose greedy continuation repeats them: greedy decoding of a random model falls
    into a cycle; a prompt made of a seed plus ``warm`` greedy tokens already holds the cycle,
    so its continuation is the cycle again (what n-gram lookup predicts)."""
    eng = engine(lm, max_num_seqs=16)
    seeds = [workload(1, seed=100 + i, lo=seed_len, hi=seed_len)[0] for i in range(4 * n)]
    outs = eng.generate(seeds, SamplingParams(temperature=0, max_tokens=warm, ignore_eos=True))
    cyclic = [s + o for s, o in zip(seeds, outs, strict=True) if period(o[-48:]) is not None]
    return cyclic[:n]


def period(t: list[int]) -> int | None:
    """Smallest period ``p <= len(t) // 2`` of ``t``, or None."""
    return next((p for p in range(1, len(t) // 2 + 1) if t[p:] == t[:-p]), None)


class OracleProposer:
    """Drafts the known greedy continuation (``wrong_from``: drafts from that index on are
    corrupted), to measure what verification costs and gains at a chosen acceptance rate."""

    def __init__(self, refs: dict[tuple, list[int]], k: int, wrong_from: int = 99):
        self.refs, self.k, self.wrong_from = refs, k, wrong_from

    def propose(self, seq) -> list[int]:
        ref = self.refs[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        done = seq.num_tokens - seq.num_prompt_tokens
        d = ref[done : done + self.k]
        return [t if j < self.wrong_from else (t + 1) % VOCAB[0] for j, t in enumerate(d)]


def spec(lm, n: int) -> list[str]:
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    cyclic = cyclic_prompts(lm, n)
    rows = [f"Cyclic prompts found: {len(cyclic)} of {4 * n} seeds (greedy tail periodic)"]
    sets = {
        "random prompts repeated 4x": [
            workload(1, seed=6 + i, lo=32, hi=32)[0] * 4 for i in range(n)
        ]
    }
    if cyclic:
        sets["cyclic (greedy continuation repeats the prompt)"] = cyclic
    for name, ps in sets.items():
        rows += spec_run(lm, f"n-gram, {name}", ps, sp)
    ps = workload(n, seed=8, lo=64, hi=128)
    refs = engine(lm).generate(ps, sp)
    table = {tuple(p): r for p, r in zip(ps, refs, strict=True)}
    for wrong_from, label in ((99, "all drafts right"), (2, "drafts 3-4 wrong")):
        prop = OracleProposer(table, 4, wrong_from)
        rows += spec_run(lm, f"oracle, {label}", ps, sp, prop)
    rows += draft_rows(lm, ps, sp, table)
    return rows


def truncated_draft(src: Path, layers: int) -> Path:
    """A draft checkpoint made of the target's first ``layers`` decoder layers (embedding, final
    norm and LM head kept: an early-exit draft), beside the target in ``.cache``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = src.parent / f"{src.name}-draft{layers}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    ts = load_file(src / "model.safetensors")
    keep = {
        k: v
        for k, v in ts.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    return out


class PacedProposer:
    """Runs a draft model's forwards (its cost) and proposes an oracle's tokens instead."""

    def __init__(self, draft, oracle):
        self.draft, self.oracle, self.stats = draft, oracle, draft.stats

    def propose_batch(self, seqs) -> list[list[int]]:
        self.draft.propose_batch(seqs)
        return [self.oracle.propose(s) for s in seqs]


def draft_rows(lm, ps, sp, table) -> list[str]:
    """Draft-model speculation (`DraftModelProposer`), batch 1. The benchmark model has random
    weights, so no smaller model agrees with it: rows show the target as its own draft
    (acceptance 1, a draft as costly as the target), a one-layer early-exit draft as it is
    (acceptance ~0: the cost of drafting for nothing), and that draft's forwards with the
    oracle's tokens put in their place (the cost of the real one-layer draft at the acceptance
    of a draft that agrees)."""
    from shared.engine.model_runner import ModelRunner
    from shared.engine.spec_decode import DraftModelProposer

    one = load_model(truncated_draft(lm.path, 1))

    def proposer(draft, oracle=None):
        eng = engine(lm, max_num_seqs=1, num_speculative_tokens=4)
        runner = ModelRunner(draft.model, eng.bm.num_blocks, eng.config.block_size, torch.float32)
        prop = DraftModelProposer(runner, 4, lm.config.vocab_size, 2048)
        if oracle is None:
            return prop

        return PacedProposer(prop, oracle)

    rows = spec_run(lm, "draft model = the target itself", ps, sp, proposer(lm))
    rows += spec_run(lm, "draft model = its first layer", ps, sp, proposer(one))
    for wrong_from, label in ((99, "all right"), (2, "drafts 3-4 wrong")):
        prop = proposer(one, OracleProposer(table, 4, wrong_from))
        rows += spec_run(lm, f"first-layer draft's forwards, oracle tokens ({label})", ps, sp, prop)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=64, ignore_eos=True)
    rows += spec_run(
        lm, "draft model = the target itself, sampled at 0.8", ps, sampled, proposer(lm)
    )
    return rows


def spec_run(lm, name: str, ps, sp, proposer=None, repeats: int = 3) -> list[str]:
    """Plain vs speculative, alternated prompt by prompt; per prompt the best of ``repeats``
    (the shared box's load swings several-fold within a minute). Repeats hit the prompt's
    cached blocks on both sides alike, so the best times are mostly decode."""
    e0 = engine(lm, max_num_seqs=1)
    e1 = engine(lm, max_num_seqs=1, num_speculative_tokens=4)
    if proposer is not None:
        e1.proposer = proposer
    t0 = t1 = 0.0
    same = True
    for p in ps:
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            outs = []
            for j, e in enumerate((e0, e1)):
                t = time.perf_counter()
                outs.append(e.generate([p], sp)[0])
                best[j] = min(best[j], time.perf_counter() - t)
            same &= outs[0] == outs[1]
        t0, t1 = t0 + best[0], t1 + best[1]
    st = e1.stats()
    return [
        f"Spec decode, {name} (k=4, {len(ps)} prompts, 64 out, batch 1, best of {repeats}):",
        f"- identical to plain: {same if sp.greedy else 'n/a (sampled)'}; acceptance {st.spec_acceptance_rate:.2f} "
        f"({st.spec_accepted_tokens}/{st.spec_draft_tokens}); plain {t0:.2f} s, spec {t1:.2f} s "
        f"-> speedup {t0 / t1:.2f}x",
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


def overlap(lm, n: int, out_len: int, rounds: int = 3) -> list[str]:
    """Async scheduling on vs off, alternated, on the P1 workload (same engine settings).

    Forward = time inside the model forward (forward thread); device idle = time that thread
    waited between two forwards (schedule, prepare, sample, postprocess, detokenize, hand-off);
    engine idle = time between two ``step()`` calls of the caller."""
    ps = workload(n)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    best: dict[bool, tuple] = {}
    outs: dict[bool, list] = {}
    for _ in range(rounds):
        for on in (False, True):
            eng = engine(lm, async_scheduling=on)
            eng.generate(workload(1, seed=99), SamplingParams(temperature=0, max_tokens=2))
            t = time.perf_counter()
            outs[on] = eng.generate(ps, sp)
            wall = time.perf_counter() - t
            st = eng.stats()
            eng.close()
            if on not in best or wall < best[on][0]:
                best[on] = (wall, st)
    lines = [
        f"Overlap ({n} prompts, {out_len} out, best of {rounds}, alternated):",
        "| async scheduling | wall s | steps | ahead steps | forward s | step s | "
        "device idle ms (per step) | engine idle ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for on in (False, True):
        wall, st = best[on]
        lines.append(
            f"| {'on' if on else 'off'} | {wall:.2f} | {st.steps} | {st.ahead_steps} | "
            f"{st.forward_time_s:.2f} | {st.step_time_s:.2f} | {st.device_idle_s * 1e3:.0f} "
            f"({st.device_idle_s * 1e3 / max(st.steps, 1):.2f}) | {st.idle_gap_s * 1e3:.0f} |"
        )
    lines.append(f"- outputs identical on/off: {outs[False] == outs[True]}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens for P1 etc.")
    ap.add_argument("--only", default="p1,p3,overlap,tbt,spec,int8")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    ap.add_argument("--repeats", type=int, default=3, help="P1 runs per side, alternated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = build_benchmark_model(MODEL_DIR)
    lm = load_model(path)
    VOCAB[0] = lm.config.vocab_size - 64  # stay clear of special and padding ids
    n, out_len = (16, 32) if args.quick else (64, 64)
    parts = {
        "p1": lambda: p1(lm, path, n, out_len, args.repeats),
        "p3": lambda: p3(lm),
        "overlap": lambda: overlap(lm, n, out_len),
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
