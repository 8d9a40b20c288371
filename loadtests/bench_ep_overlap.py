"""Expert parallelism: one micro-batch vs two (all-to-all overlapped with expert compute).

    .venv/bin/python -m loadtests.bench_ep_overlap [--ranks 2] [--tokens 512] [--repeats 5]

Builds a random Qwen3-MoE (transformers, offline; ``--hidden`` / ``--expert-dim`` / 8 experts,
top-2, every layer sparse), runs it at ``--ep --ranks`` over gloo ranks on this machine, and
times a ``--tokens``-token prefill forward on every rank with ``micro_batches`` 1 and 2
(alternated per repeat). Prints the median and best milliseconds per forward of each.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _build(path: str, args) -> None:
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=args.expert_dim,
        moe_intermediate_size=args.expert_dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(path)


def _rank(rank, world, port, path, args, out):
    from shared.model import ep
    from shared.model.loader import load_model
    from shared.model.parallel import TPGroup
    from tests.model.paged_driver import PagedDriver

    torch.set_num_threads(args.threads)
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    loaded = load_model(path, dtype=torch.float32)
    ep.shard_experts(loaded.model, TPGroup(rank, world))
    layers = ep.moe_layers(loaded.model)
    ids = torch.randint(3, 4000, (args.tokens,), generator=torch.Generator().manual_seed(1))
    times: dict[int, list[float]] = {1: [], 2: []}
    for i in range(args.repeats * 2 + 2):
        mb = 1 + i % 2
        for m in layers:
            m.micro_batches = mb
        drv = PagedDriver(loaded.model, num_blocks=args.tokens // 4 + 8, block_size=16)
        seq = drv.new_seq()
        dist.barrier()
        t0 = time.perf_counter()
        drv.prefill(seq, ids.tolist())
        if i >= 2:  # the first round of each is warm-up
            times[mb].append(time.perf_counter() - t0)
    if rank == 0:
        torch.save(times, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        _build(d, args)
        out = f"{d}/times.pt"
        mp.spawn(_rank, args=(args.ranks, port, d, args, out), nprocs=args.ranks, join=True)
        times = torch.load(out)
    for mb, t in times.items():
        ms = [x * 1e3 for x in t]
        print(f"micro_batches {mb}: median {statistics.median(ms):.1f} ms, best {min(ms):.1f} ms")


if __name__ == "__main__":
    main()
