"""EPLB on a skewed router: max/mean expert load per rank and tokens/s before and after.

    .venv/bin/python -m loadtests.bench_eplb [--ranks 2] [--spare 1] [--prompts 8] [--tokens 32]

Builds a random Qwen3-MoE (8 experts, top-2; transformers, offline) whose router sends most rows
to experts 0 and 1 (both on rank 0 at start), runs it at ``--ep --ranks`` over gloo ranks on
this machine (rank 0 runs the engine, the others follow), generates the same greedy workload
twice, rebalancing (`ModelRunner.rebalance_experts`) in between, and prints for each run the
rows each rank's experts computed, their max/mean, and the run's tokens/s.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _skewed(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tests.model.test_moe_models import _build

    _build("qwen3_moe", path)
    f = path / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.0.mlp.gate.weight"][:2] *= 30.0
    save_file(state, str(f), metadata={"format": "pt"})


def _run(engine, prompts, sp) -> tuple[int, float]:
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    return sum(len(o) for o in out), time.perf_counter() - t0


def _rank(rank, world, port, path, args, out):
    from shared.engine.engine import LLMEngine
    from shared.engine.model_runner import ModelRunner
    from shared.engine.params import EngineConfig
    from shared.model import ep
    from shared.model.loader import load_model
    from shared.model.parallel import TPGroup
    from shared.protocol.sampling import SamplingParams

    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = TPGroup(rank, world)
    loaded = load_model(path, dtype=torch.float32)
    ep.shard_experts(loaded.model, group, args.spare)
    layers = ep.moe_layers(loaded.model)
    if rank == 0:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 4000, (48,), generator=g).tolist() for _ in range(args.prompts)]
        sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        cfg = EngineConfig(kv_cache_bytes=8 << 20, block_size=16, enable_prefix_caching=False)
        engine = LLMEngine(loaded, cfg)
        runs = [_run(engine, prompts, sp)]
        engine.runner.rebalance_experts()
        runs.append(_run(engine, prompts, sp))
        group.broadcast(None)
        engine.close()
    else:
        ModelRunner.follower(loaded.model).follow()
        runs = []
    served = [layers[0].served_log[0], layers[0].served]
    bucket = [None] * world if rank == 0 else None
    dist.gather_object(served, bucket, dst=0)
    if rank == 0:
        torch.save(dict(runs=runs, served=bucket), out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--spare", type=int, default=1, help="extra expert slots per rank")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from shared.model import eplb

    with tempfile.TemporaryDirectory() as d, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        _skewed(Path(d))
        out = f"{d}/result.pt"
        mp.spawn(_rank, args=(args.ranks, port, d, args, out), nprocs=args.ranks, join=True)
        res = torch.load(out)
    for i, name in enumerate(("before", "after")):
        per_rank = [s[i] for s in res["served"]]
        toks, secs = res["runs"][i]
        print(
            f"{name:6s} rows per rank {per_rank} max/mean {eplb.imbalance(per_rank):.3f} "
            f"tok/s {toks / secs:.1f}"
        )


if __name__ == "__main__":
    main()
