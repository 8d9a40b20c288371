"""The simulator's policy comparison on a real cluster: round_robin vs prefix_aware on N prefill
instances with a multi-tenant workload (tenants share long system prompts, arriving in random
order), engine-tier prefix hits only (no kvstore), against the single-instance hit rate of the
same requests run in-process by `LLMEngine`.

    .venv/bin/python -m loadtests.simulator.realcluster --requests 64 --rate 8 \\
        --out /tmp/realcluster.json

`tests/cluster/test_prefix_routing.py` runs a smaller version of the same comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from loadtests.loadgen.client import RunConfig, run_jobs
from loadtests.loadgen.stats import percentile
from loadtests.loadgen.workload import Job, poisson_arrivals, words
from services.cluster_config import ensure_model
from services.infra.supervisor import ServiceFailed
from services.launcher import Cluster


@dataclass(frozen=True)
class TenantWorkload:
    """Completions whose prompt = a tenant's system prompt + a unique user part.

    Fields:
        requests: number of requests.
        tenants: tenants; each request picks one uniformly at random (not cyclically, so round
            robin cannot line tenants up with instances by accident).
        system_words: words (about tokens) of each tenant's system prompt.
        user_words: words of each request's own part.
        max_tokens: completion tokens per request.
        rate: Poisson arrivals per second.
        seed: everything above is a function of the seed.
    """

    requests: int = 64
    tenants: int = 16
    system_words: int = 768
    user_words: int = 24
    max_tokens: int = 2
    rate: float = 8.0
    seed: int = 0

    def _system(self, tenant: int) -> str:
        return " ".join(words(random.Random(f"sys:{self.seed}:{tenant}"), self.system_words))

    def warmup_jobs(self) -> list[Job]:
        """One request per tenant, sent one at a time before the measured run: every policy
        starts from a fleet that has seen each system prompt once (steady state)."""
        rng = random.Random(f"warmup:{self.seed}")
        return [
            Job(
                -1 - t,
                self.max_tokens,
                tenant=t,
                prompt=self._system(t) + " " + " ".join(words(rng, self.user_words)),
            )
            for t in range(self.tenants)
        ]

    def jobs(self) -> list[Job]:
        rng = random.Random(f"realcluster:{self.seed}")
        arrivals = poisson_arrivals(self.requests, self.rate, self.seed)
        out = []
        for i in range(self.requests):
            t = rng.randrange(self.tenants)
            prompt = self._system(t) + " " + " ".join(words(rng, self.user_words))
            out.append(Job(i, self.max_tokens, prompt=prompt, arrival=arrivals[i], tenant=t))
        return out


@dataclass
class PolicyRun:
    """What one policy achieved on the real cluster."""

    policy: str
    ok: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_p50_s: float = float("nan")
    ttft_p99_s: float = float("nan")
    wall_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)  # per request: start, tenant, hit, ttft

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def reference_hit_rate(
    model_dir: str, jobs: list[Job], warmup: list[Job] = (), block_size: int = 16
) -> float:
    """Engine-tier prefix hit rate of ``jobs`` run one by one, in arrival order (after
    ``warmup``, not counted), on a single in-process `LLMEngine` whose cache holds everything
    (the best any routing can do)."""
    import torch

    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer
    from shared.protocol.sampling import SamplingParams

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tok = Tokenizer.from_dir(model_dir)
    engine = LLMEngine(
        load_model(model_dir), EngineConfig(kv_cache_bytes=256 << 20, block_size=block_size)
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cached = total = 0
    with torch.inference_mode():
        for j in [*warmup, *jobs]:
            ids = tok.encode(j.prompt)
            engine.add_request(f"ref-{j.index}", ids, params)
            first = None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    first = first or o
            if j.index >= 0:  # warm-up jobs have negative indexes
                cached += first.num_cached_tokens
                total += len(ids)
    return cached / total


def start_cluster(model_dir: str, attempts: int = 3, **overrides) -> Cluster:
    """`Cluster(...).start()`, retried when a port picked free was taken meanwhile by another
    process on a shared machine (the only start-up failure worth retrying)."""
    overrides.setdefault("ready_timeout", 240.0)
    overrides.setdefault("die_with_parent", True)
    overrides.setdefault("log_stream", open(os.devnull, "w"))  # noqa: SIM115 - lives with it
    for i in range(attempts):
        try:
            return Cluster(model_dir, **overrides).start()
        except ServiceFailed as exc:
            if "address already in use" not in str(exc).lower() or i == attempts - 1:
                raise
    raise AssertionError("unreachable")


def run_policy(
    model_dir: str,
    policy: str,
    jobs: list[Job],
    warmup: list[Job] = (),
    prefill: int = 4,
    prefill_kv_bytes: int = 16 << 20,
    log_dir: str = "",
    dtype: str = "",
    scheduler_args: Sequence[str] = (),
    warmup_concurrency: int = 1,
) -> PolicyRun:
    """Start a cluster (``prefill`` instances, 1 decode, no kvstore; ``dtype`` as
    ``strata up --dtype``; ``scheduler_args`` added to the scheduler's flags), send ``warmup``
    (``warmup_concurrency`` at a time: its requests are of distinct tenants, so none can hit
    another's prefix whatever their order), then ``jobs`` open-loop through the REST gateway
    (measured), stop it. Engine caches are ``prefill_kv_bytes`` per prefill instance: one
    instance cannot hold every tenant's prefix, the fleet can."""
    log = open(os.path.join(log_dir, f"{policy}.log") if log_dir else os.devnull, "w")
    sched = ["--policy", policy, "--short-prompt-tokens", "0", *scheduler_args]
    if log_dir:  # keep every service's log (and the scheduler's routing decisions)
        sched += ["--log-level", "DEBUG"]
    c = start_cluster(
        model_dir,
        prefill=prefill,
        decode=1,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        dtype=dtype,
        log_stream=log,
        data_dir=os.path.join(log_dir, policy) if log_dir else "",
        role_args={"scheduler": sched, "prefill": ["--kv-cache-bytes", str(prefill_kv_bytes)]},
    )
    try:
        cfg = RunConfig(url=c.gateway_url, request_timeout=120.0, deadline=300.0, progress=False)
        from loadtests.loadgen.client import served_model

        cfg.model = asyncio.run(served_model(c.gateway_url))
        if warmup:
            asyncio.run(run_jobs(list(warmup), cfg, concurrency=warmup_concurrency))
            time.sleep(1.0)  # the warm-up's KV events reach the scheduler
        results, wall = asyncio.run(run_jobs(jobs, cfg))
    finally:
        c.stop()
        log.close()
    run = PolicyRun(policy, wall_s=wall)
    for r in results:
        run.requests.append(
            {
                "start": round(r.start, 3),
                "tenant": r.tenant,
                "ok": r.ok,
                "prompt": r.prompt_tokens,
                "cached": r.cached_tokens,
                "ttft": round(r.ttft or r.e2e or 0.0, 3),
            }
        )
        if not r.ok:
            run.errors += 1
            run.error_samples = (run.error_samples + [f"{r.status}: {r.error}"])[:3]
            continue
        run.ok += 1
        run.prompt_tokens += r.prompt_tokens
        run.cached_tokens += r.cached_tokens
        # a first token whose text is still incomplete (byte-level BPE) carries no content
        run.ttfts.append(r.ttft if r.ttft is not None else r.e2e)
    run.ttft_p50_s = percentile(run.ttfts, 50)
    run.ttft_p99_s = percentile(run.ttfts, 99)
    return run


def table(ref: float, runs: list[PolicyRun]) -> str:
    lines = [
        "| policy | ok | errors | prefix hit | of single-instance | TTFT p50 (s) | TTFT p99 (s) |",
        "|---|---|---|---|---|---|---|",
        f"| single instance (in-process reference) | | | {ref:.1%} | 100% | | |",
    ]
    for r in runs:
        lines.append(
            f"| {r.policy} | {r.ok} | {r.errors} | {r.hit_rate:.1%} | "
            f"{r.hit_rate / ref:.0%} | {r.ttft_p50_s:.3f} | {r.ttft_p99_s:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = TenantWorkload()
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--system-words", type=int, default=d.system_words)
    p.add_argument("--user-words", type=int, default=d.user_words)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--rate", type=float, default=d.rate)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--prefill-kv-mib", type=int, default=16)
    p.add_argument("--policies", default="round_robin,prefix_aware")
    p.add_argument("--model", default="", help="checkpoint (default: the built-in model)")
    p.add_argument("--log-dir", default="", help="keep each run's service logs here")
    p.add_argument("--out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)
    w = TenantWorkload(
        a.requests, a.tenants, a.system_words, a.user_words, a.max_tokens, a.rate, a.seed
    )
    model = ensure_model(a.model)
    jobs, warm = w.jobs(), w.warmup_jobs()
    t0 = time.perf_counter()
    ref = reference_hit_rate(model, jobs, warm)
    runs = [
        run_policy(model, pol, jobs, warm, a.prefill, a.prefill_kv_mib << 20, a.log_dir)
        for pol in a.policies.split(",")
    ]
    print(table(ref, runs))
    print(f"({time.perf_counter() - t0:.0f}s; workload {asdict(w)})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "workload": asdict(w),
                    "reference_hit_rate": ref,
                    "runs": [asdict(r) | {"hit_rate": r.hit_rate} for r in runs],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
