"""PD benchmarks on real NATS + gRPC with real engines (services in-process):

- P5: handoff time, from prefill's last layer to decode's first token, layer-wise overlapped
  transfer vs transfer after prefill, at several prompt lengths;
- P4: TTFT of a long prompt: recompute vs a kvstore DRAM-tier hit vs a MinIO-tier hit.

    .venv/bin/python -m loadtests.bench_pd [--lengths 512,2048,8192] [--repeats 3] [--skip-p4]

Both sides of each comparison run in the same process run, alternating, on fresh random prompts
(no accidental prefix hits). Prints Markdown tables (docs/benchmarks/pd.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

import torch

from services.cluster_config import ensure_model
from services.decode.service import DecodeService
from services.infra.minio_server import start_minio
from services.infra.nats_server import start_nats
from services.kvstore.app import run_kvstore
from services.kvstore.config import KVStoreConfig
from services.prefill.service import PrefillService
from shared import bus
from shared.engine.port_types import KVConnector, LayerKV
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.sampling import SamplingParams
from shared.protocol.stream import TokenChunk
from shared.protocol.work import PrefillWork, SubmitAck
from shared.worker.app import start_worker
from shared.worker.config import WorkerConfig


class LastLayerClock(KVConnector):
    """Wraps the prefill engine's KV connector: records when the sampling chunk's last layer
    ends, for every request (the wrapped connector still gets the requests it wants)."""

    def __init__(self, inner: KVConnector | None):
        self.inner = inner
        self.t: dict[str, float] = {}

    def wants(self, request_id: str) -> bool:
        return True

    def save_layer(self, request_id: str, layer: int, kv: LayerKV) -> None:
        if self.inner is not None and self.inner.wants(request_id):
            self.inner.save_layer(request_id, layer, kv)
        if kv.final:
            self.t[request_id] = time.perf_counter()

    def wait_for_save(self) -> None:
        if self.inner is not None:
            self.inner.wait_for_save()


async def one_request(nc, prefill, decode_w, prompt, max_tokens=2, mode="direct"):
    rid = f"b{random.getrandbits(48):x}"
    times: dict[int, float] = {}
    done = asyncio.Event()

    async def on(msg):
        c = decode(msg.data, TokenChunk)
        times.setdefault(c.index, time.perf_counter())
        if c.error:
            raise RuntimeError(c.error.message)
        if c.finish_reason:
            done.set()

    sub = await nc.subscribe(subjects.req_out(rid), cb=on)
    item = PrefillWork(
        request_id=rid,
        prompt_token_ids=prompt,
        transfer_mode=mode,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        decode_instance=decode_w.rt.cfg.instance_id,
        decode_addr=decode_w.addr,
    )
    t0 = time.perf_counter()
    await bus.request(nc, subjects.prefill_submit(prefill.rt.cfg.instance_id), item, SubmitAck)
    await asyncio.wait_for(done.wait(), 600)
    await sub.unsubscribe()
    return rid, t0, times


def rand_prompt(n: int, vocab: int) -> list[int]:
    return [random.randrange(10, vocab) for _ in range(n)]


async def p5(nc, prefill, dec, lengths, repeats, vocab) -> list[str]:
    tap = prefill.svc.tap
    clock = LastLayerClock(tap)
    rows = [
        "| prompt tokens | after-prefill handoff (ms) | layer-wise handoff (ms) | ratio | "
        "after-prefill TTFT (ms) | layer-wise TTFT (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        res: dict[str, list[tuple[float, float]]] = {"after": [], "layer": []}
        for _ in range(repeats):
            for mode in ("after", "layer"):
                prefill.svc.tap = tap if mode == "layer" else None
                clock.inner = tap if mode == "layer" else None
                prefill.rt.port.set_connector(clock)
                rid, t0, times = await one_request(nc, prefill, dec, rand_prompt(n, vocab))
                handoff = times[1] - clock.t.pop(rid)
                res[mode].append((handoff * 1e3, (times[0] - t0) * 1e3))
        a = statistics.median(h for h, _ in res["after"])
        lw = statistics.median(h for h, _ in res["layer"])
        ta = statistics.median(t for _, t in res["after"])
        tl = statistics.median(t for _, t in res["layer"])
        rows.append(f"| {n} | {a:.1f} | {lw:.1f} | {a / lw:.2f}x | {ta:.0f} | {tl:.0f} |")
        print(rows[-1], flush=True)
    prefill.svc.tap = tap
    prefill.rt.port.set_connector(tap)
    return rows


async def p4(nc, prefill_a, prefill_b, dec, n, repeats, vocab, fillers: int, kvstore) -> list[str]:
    """TTFT on prefill B (which never saw the prompt) when its prefix is nowhere (recompute),
    in the kvstore's DRAM (computed by A), or only in MinIO (A's blocks spilled out of DRAM by
    ``fillers`` other prompts of the same length)."""
    res: dict[str, list[float]] = {"recompute": [], "dram": [], "ssd": []}
    gets = restored = 0
    for _ in range(repeats):
        _, t0, times = await one_request(nc, prefill_b, dec, rand_prompt(n, vocab))
        res["recompute"].append((times[0] - t0) * 1e3)
        for case in ("dram", "ssd"):
            prompt = rand_prompt(n, vocab)
            await one_request(nc, prefill_a, dec, prompt)  # A computes and stores the blocks
            await wait_pool(prefill_a, prompt, "dram")
            if case == "ssd":  # push them out of DRAM: they spill to MinIO
                for _ in range(fillers):
                    await one_request(nc, prefill_a, dec, rand_prompt(n, vocab))
                await wait_pool(prefill_a, prompt, "ssd")
                await kvstore.flush(timeout=120)  # fillers' writes done: B's read is measured
            g0, b0 = kvstore.reader.gets, kvstore.core.stats.restore_bytes
            _, t0, times = await one_request(nc, prefill_b, dec, prompt[:-1] + [7])
            res[case].append((times[0] - t0) * 1e3)
            if case == "ssd":
                gets += kvstore.reader.gets - g0
                restored += kvstore.core.stats.restore_bytes - b0
    base = statistics.median(res["recompute"])
    rows = [f"| case ({n}-token prompt) | TTFT (ms) | speed-up vs recompute |", "|---|---:|---:|"]
    for case, label in (
        ("recompute", "recompute"),
        ("dram", "kvstore DRAM hit"),
        ("ssd", "MinIO (SSD tier) hit"),
    ):
        m = statistics.median(res[case])
        rows.append(f"| {label} | {m:.0f} | {base / m:.2f}x |")
        print(rows[-1], flush=True)
    rows.append(
        f"\nMinIO hits restored {restored / repeats / 2**20:.1f} MiB per request in "
        f"{gets / repeats:.0f} GETs (the kvstore's ranged reads)."
    )
    return rows


async def wait_pool(prefill, prompt, tier: str) -> None:
    """Until every full block of ``prompt`` is in the pool, all in ``tier``."""
    link = prefill.svc.pool
    hashes = (await prefill.rt.port.match_prefix(prompt)).hashes
    for _ in range(1200):
        tiers = await link.pool.lookup(hashes, link.fingerprint)
        if all(t == tier for t in tiers):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"blocks never all reached the {tier} tier: {tiers}")


async def main_async(args) -> None:
    model = ensure_model(args.model)
    nats = start_nats()
    minio = start_minio() if not args.skip_p4 else None
    try:
        nc = await bus.connect(nats.url, "bench")
        common = dict(
            nats_url=nats.url,
            model=model,
            kv_cache_bytes=args.kv_bytes,
            torch_threads=args.threads,
            max_num_batched_tokens=args.chunk,
            frame_merge_bytes=args.merge_bytes,
        )
        stop_kv, kv_task = asyncio.Event(), None
        if minio is not None:
            kv_cfg = KVStoreConfig.load(
                [],
                role="kvstore",
                instance_id="bkv",
                nats_url=nats.url,
                minio_endpoint=minio.endpoint,
                minio_access_key=minio.kv_access_key,
                minio_secret_key=minio.kv_secret_key,
                dram_bytes=args.kvstore_dram_bytes,
            )
            ready = asyncio.get_running_loop().create_future()
            kv_task = asyncio.create_task(
                run_kvstore(kv_cfg, stop_kv, on_ready=lambda s, a: ready.set_result((s, a)))
            )
            kvstore, common["kvstore_addrs"] = await asyncio.wait_for(ready, 60)
        workers = []
        for role, iid, cls in (
            ("prefill", "bp", PrefillService),
            ("decode", "bd", DecodeService),
            ("prefill", "bp2", PrefillService),
        ):
            if iid == "bp2" and minio is None:
                continue
            # P5's prefill has the layer tap (it switches it per request); the others run the
            # default transfer mode (STRATA_LAYERWISE_TRANSFER=auto unless set)
            mode = {"layerwise_transfer": True} if iid == "bp" else {}
            cfg = WorkerConfig.load([], role=role, instance_id=iid, **common, **mode)
            workers.append(await start_worker(cfg, role, cls, nc))
        prefill, dec = workers[:2]
        cfg = prefill.rt.loaded.config
        vocab = cfg.vocab_size
        params = sum(p.numel() for p in prefill.rt.loaded.model.parameters()) / 1e6
        print(
            f"model: {model} ({params:.1f}M params, {cfg.num_layers} layers, "
            f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, {cfg.dtype}), torch threads "
            f"{args.threads}/process, prefill chunk {args.chunk} tokens, "
            f"{len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f}"
        )
        await one_request(nc, prefill, dec, rand_prompt(64, vocab))  # warm-up
        print("\n### P5: PD handoff (prefill's last layer -> decode's first token)\n")
        rows = await p5(nc, prefill, dec, args.lengths, args.repeats, vocab)
        print("\n".join(rows))
        if minio is not None:
            n = args.p4_tokens
            lw = "layer-wise" if workers[2].rt.cfg.layerwise_transfer else "after-prefill"
            print(
                f"\n### P4: TTFT of a {n}-token prompt on a prefill instance that never saw it "
                f"(default transfer mode here: {lw})\n"
            )
            rows = await p4(
                nc,
                prefill,
                workers[2],
                dec,
                n,
                args.repeats,
                vocab,
                kvstore=kvstore,
                fillers=args.fillers,
            )
            print("\n".join(rows))
        for w in workers:
            await w.stop()
        stop_kv.set()
        if kv_task is not None:
            await kv_task
        await nc.drain()
    finally:
        nats.stop()
        if minio is not None:
            minio.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="", help="checkpoint (default: the built-in model)")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--merge-bytes", type=int, default=256 << 10)
    ap.add_argument("--kv-bytes", type=int, default=512 << 20)
    ap.add_argument("--skip-p4", action="store_true")
    ap.add_argument("--p4-tokens", type=int, default=8192)
    ap.add_argument(
        "--kvstore-dram-bytes",
        type=int,
        default=40 << 20,
        help="kvstore DRAM budget (P4 spills to MinIO past it)",
    )
    ap.add_argument(
        "--fillers",
        type=int,
        default=2,
        help="P4: prompts pushed through A to spill the measured prefix to MinIO",
    )
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
