"""Calibrate the scheduler's cost constants from measurements on this machine.

- `LLMEngine` prefill seconds per token by prompt length (no prefix caching) and decode step
  time by batch size (fit: step = base + per_seq x batch), on the default and benchmark models;
- kvstore block load time per tier: DRAM (`KVStore.get` of a resident block) and SSD (a fresh
  kvstore reading each block back from MinIO), one block at a time as a prefill's prefix load,
  in-process (no gRPC hop: add the transfer cost of docs/benchmarks/kvpool.md for a remote pool).

Prints a Markdown table and writes JSON whose ``constants`` (per model) feed the simulator
(`python -m loadtests.simulator.run --calibration FILE`) and the scheduler's flags
(``--prefill-tokens-per-s``, ``--dram-tokens-per-s``, ``--ssd-tokens-per-s``).

    .venv/bin/python -m loadtests.calibrate --out docs/benchmarks/calibration.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import torch

LENGTHS = (128, 512, 1024, 2048)
BATCHES = (1, 4, 16, 32)


def _engine(model_dir: str, prefix_caching: bool = False):
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model

    cfg = EngineConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=prefix_caching)
    return LLMEngine(load_model(model_dir), cfg)


def prefill_s_per_token(engine, vocab: int, lengths=LENGTHS, repeats: int = 2) -> dict[int, float]:
    """Median seconds per prompt token of a single uncached prefill of each length."""
    from shared.protocol.sampling import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([[7] * 32], one)  # first-call overheads
    out = {}
    for n in lengths:
        times = []
        for r in range(repeats):
            ids = [(i * 7919 + r) % (vocab - 10) + 5 for i in range(n)]
            t0 = time.perf_counter()
            engine.generate([ids], one)
            times.append((time.perf_counter() - t0) / n)
        out[n] = statistics.median(times)
    return out


def decode_step_s(engine, batches=BATCHES, steps: int = 12) -> dict[int, float]:
    """Mean engine step time with ``b`` sequences all decoding (prefill steps excluded)."""
    from shared.protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    out = {}
    for b in batches:
        rids = [f"cal-{b}-{i}-{uuid.uuid4().hex[:4]}" for i in range(b)]
        for i, rid in enumerate(rids):
            engine.add_request(rid, [(i * 13 + j) % 500 + 5 for j in range(16)], params)
        started: set[str] = set()
        while len(started) < b:  # until every sequence has its first token (prefill done)
            for o in engine.step():
                if o.new_token_ids:
                    started.add(o.request_id)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        out[b] = (time.perf_counter() - t0) / steps
        while engine.has_unfinished_requests():
            engine.step()
    return out


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


async def pool_load_s(block_bytes: int, n: int = 64) -> dict[str, float]:
    """Seconds per block to load from the kvstore's DRAM tier and from its SSD (MinIO) tier."""
    from loadtests.bench_kvpool import frame_of, tier
    from services.infra.minio_server import start_minio
    from services.kvstore.core import KVStoreCore
    from services.kvstore.store import KVStore

    minio = start_minio()
    try:
        bucket = f"cal-{uuid.uuid4().hex[:8]}"
        frames = [frame_of(i, block_bytes) for i in range(n)]
        store = KVStore(
            KVStoreCore("bench", "i1", dram_bytes=1 << 40, write_behind_blocks=1 << 20),
            tier(minio, bucket),
        )
        await store.start()
        for f in frames:
            store.put(f)
        await store.flush(timeout=600)
        t0 = time.perf_counter()
        for f in frames:
            assert await store.get(("bench", f.key)) is not None
        dram = (time.perf_counter() - t0) / n
        await store.stop()
        fresh = KVStore(KVStoreCore("bench", "i2", dram_bytes=1 << 40), tier(minio, bucket))
        await fresh.start()
        t0 = time.perf_counter()
        for f in frames:
            assert await fresh.get(("bench", f.key)) is not None
        ssd = (time.perf_counter() - t0) / n
        await fresh.stop()
    finally:
        minio.stop()
    return {"dram": dram, "ssd": ssd}


def calibrate_model(name: str, model_dir: str) -> dict:
    engine = _engine(model_dir)
    pre = prefill_s_per_token(engine, min(engine.loaded.config.vocab_size, 2000))
    dec = decode_step_s(engine)
    base, per_seq = linear_fit([float(b) for b in dec], list(dec.values()))
    st = engine.stats()
    block_bytes = st.kv_pool_bytes // st.kv_blocks_total  # K and V of one block, all layers
    # the rate of the longest prompt that still fits a step (chunking costs little more)
    rate = 1.0 / pre[1024]
    return {
        "model": name,
        "prefill_s_per_token": pre,
        "decode_step_s": dec,
        "block_bytes": block_bytes,
        "constants": {
            "prefill_tokens_per_s": rate,
            "decode_step_s": max(base, 1e-4),
            "decode_step_per_seq_s": max(per_seq, 0.0),
        },
    }


def main(argv: list[str] | None = None) -> None:
    from services.cluster_config import ensure_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (as in the cluster)")
    ap.add_argument("--models", default="default,benchmark")
    ap.add_argument("--no-pool", action="store_true", help="skip the kvstore/MinIO part")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    results = []
    with torch.inference_mode():
        for name in a.models.split(","):
            results.append(calibrate_model(name, ensure_model("", benchmark=name == "benchmark")))
    for r in results:
        if not a.no_pool and r["block_bytes"]:
            pool = asyncio.run(pool_load_s(r["block_bytes"]))
            r["pool_load_s_per_block"] = pool
            r["constants"]["dram_tokens_per_s"] = 16 / pool["dram"]
            r["constants"]["ssd_tokens_per_s"] = 16 / pool["ssd"]
    print(
        "| model | prefill us/token @128/512/1024/2048 | decode step ms @batch 1/4/16/32 | "
        "fit: base ms + per-seq ms | block KiB | DRAM ms/block | SSD ms/block |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        pre = "/".join(f"{v * 1e6:.0f}" for v in r["prefill_s_per_token"].values())
        dec = "/".join(f"{v * 1e3:.1f}" for v in r["decode_step_s"].values())
        c = r["constants"]
        pool = r.get("pool_load_s_per_block", {})
        print(
            f"| {r['model']} | {pre} | {dec} | {c['decode_step_s'] * 1e3:.2f} + "
            f"{c['decode_step_per_seq_s'] * 1e3:.3f} | {r['block_bytes'] >> 10} | "
            f"{pool.get('dram', float('nan')) * 1e3:.3f} | "
            f"{pool.get('ssd', float('nan')) * 1e3:.2f} |"
        )
    for r in results:
        print(f"{r['model']}: " + ", ".join(f"{k}={v:.6g}" for k, v in r["constants"].items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "models": results}, f, indent=1)


if __name__ == "__main__":
    main()
