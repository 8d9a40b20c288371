"""Cost of structured outputs: engine throughput with 0 %, 50 % and 100 % of the requests
constrained by a JSON schema, and grammar compile time cold and cached.

    .venv/bin/python -m loadtests.bench_structured [--n 16] [--out-len 64] [--repeats 3]

In-process engine on the standard benchmark model (``build_benchmark_model``), the P1 workload
(``bench_engine.workload``: prompts of 64-480 tokens), greedy, EOS ignored. The constrained
requests follow a schema (an array of at least 64 records) that keeps them generating for the
whole ``--out-len``, so every run generates the same number of tokens. Shares are alternated
per repeat; prints a markdown report with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from loadtests.bench_engine import MODEL_DIR, VOCAB, engine, workload
from shared.engine.structured import GrammarCache, tokenizer_info
from shared.model.default_model import build_benchmark_model
from shared.model.loader import load_model
from shared.model.tokenizer import Tokenizer
from shared.protocol.sampling import SamplingParams, StructuredSpec

RECORD = {
    "type": "object",
    "required": ["sku", "in_stock", "quantity", "size"],
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "in_stock": {"type": "boolean"},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 99},
        "size": {"enum": ["S", "M", "L"]},
    },
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 64}
SPEC = StructuredSpec(kind="json_schema", spec=json.dumps(SCHEMA))


def throughput(lm, tok, prompts, out_len: int, share: float) -> tuple[float, int]:
    """(generated tokens per second, tokens) for one run with ``share`` of requests constrained."""
    eng = engine(lm, max_num_seqs=16)
    eng.tokenizer = tok
    n_con = round(share * len(prompts))
    free = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    con = free.model_copy(update={"structured": SPEC})
    params = [con if i < n_con else free for i in range(len(prompts))]
    eng.generate(workload(1, seed=99), free.model_copy(update={"max_tokens": 2}))  # warm-up
    if n_con:
        eng.grammars.get(SPEC)  # compile outside the timed run (cached per engine)
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    dt = time.perf_counter() - t
    toks = sum(len(o) for o in outs)
    if n_con:  # the constraint held: the constrained outputs are prefixes of valid JSON
        text = tok.decode(outs[0])
        assert text.startswith('[{"sku": "'), text[:80]
    eng.close()
    return toks / dt, toks


def compile_times(tok, vocab: int, repeats: int) -> list[str]:
    rows = []
    tools = {
        "format": "hermes",
        "parallel": True,
        "schema": {
            "anyOf": [
                {
                    "type": "object",
                    "required": ["name", "arguments"],
                    "properties": {"name": {"const": f"fn_{i}"}, "arguments": RECORD},
                }
                for i in range(8)
            ]
        },
    }
    specs = {
        "record schema": StructuredSpec(kind="json_schema", spec=json.dumps(RECORD)),
        "array-of-records schema": SPEC,
        "8 tools, hermes, parallel": StructuredSpec(kind="tool_calls", spec=json.dumps(tools)),
    }
    for name, spec in specs.items():
        cold, hot = [], []
        for _ in range(repeats):
            cache = GrammarCache(tokenizer_info(tok, vocab, [2]))
            t = time.perf_counter()
            cache.get(spec)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            cache.get(spec)
            hot.append(time.perf_counter() - t)
        rows.append(
            f"| {name} | {statistics.median(cold) * 1e3:.1f} | {statistics.median(hot) * 1e6:.1f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16, help="requests per run")
    ap.add_argument("--out-len", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=3, help="runs per share (alternated)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("STRATA_TORCH_THREADS", "1")))
    path = build_benchmark_model(MODEL_DIR)
    lm = load_model(path)
    VOCAB[0] = lm.config.vocab_size
    tok = Tokenizer.from_dir(path)
    prompts = workload(args.n)
    load_before = os.getloadavg()[0]
    shares = (0.0, 0.5, 1.0)
    rates: dict[float, list[float]] = {s: [] for s in shares}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for s in shares:
                rates[s].append(throughput(lm, tok, prompts, args.out_len, s)[0])
    base = statistics.median(rates[0.0])
    print(
        f"load average (1 min) before/after: {load_before:.2f}/{os.getloadavg()[0]:.2f}; torch threads "
        f"{torch.get_num_threads()}; n={args.n}, out_len={args.out_len}, "
        f"repeats={args.repeats}\n"
    )
    print("| constrained | tokens/s (median) | best | spread | vs 0 % |")
    print("| --- | --- | --- | --- | --- |")
    for s in shares:
        r = rates[s]
        print(
            f"| {s:.0%} | {statistics.median(r):.1f} | {max(r):.1f} | "
            f"{max(r) - min(r):.1f} | {statistics.median(r) / base:.2f}x |"
        )
    print("\n| grammar | compile cold (ms, median) | cached lookup (µs, median) |")
    print("| --- | --- | --- |")
    print("\n".join(compile_times(tok, lm.config.vocab_size, args.repeats)))


if __name__ == "__main__":
    main()
