"""Expert parallelism at 2 gloo ranks: Qwen3-MoE, Mixtral and Qwen2-MoE (its shared expert run by
each rank over its token slice) against the unsharded model, and EPLB moving experts between
steps on a router skewed towards two experts."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from shared.engine import tp_kv
from shared.engine.engine import LLMEngine
from shared.engine.model_runner import ModelRunner
from shared.model import ep, eplb
from shared.model.loader import load_model
from shared.model.parallel import TPGroup, shard_model
from tests.engine.test_tensor_parallel_engine import CFG, PROMPTS, SP, _generate
from tests.model.paged_driver import PagedDriver
from tests.model.test_tensor_parallel import _free_port, quit_rank
from tests.ranks import spawn_ranks

pytest.importorskip("transformers")
LOGIT_IDS = [(37 * i) % 4000 + 3 for i in range(23)]


def _rank(rank, port, path, out, rebalance, tp, mb):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = TPGroup(rank, 2)
        loaded = load_model(path, dtype=torch.float32)
        if tp:  # --tp 2 --ep 2: heads and dense MLPs by TP, experts by EP, over the same ranks
            shard_model(loaded.model, group, experts=True)
        spare = 1 if rebalance else 0
        ep.shard_experts(loaded.model, group, spare, replicated_kv=not tp, micro_batches=mb)
        drv = PagedDriver(loaded.model, block_size=4)  # every rank runs the same prefill
        logits = drv.prefill(drv.new_seq(), LOGIT_IDS)
        got = dict(
            logits=logits,
            slots=[m.experts.gate_up_proj.shape[0] for m in ep.moe_layers(loaded.model)],
        )
        if rank == 0:
            engine = LLMEngine(loaded, CFG)
            got["gen"] = _generate(engine)
            if rebalance:
                got["expected"] = engine.runner.rebalance_experts()
                got["placement"] = [m.placement.phys for m in ep.moe_layers(loaded.model)]
                # run 2 rebalances again mid-flight, every 4 steps (EngineConfig's interval)
                engine.config = replace(engine.config, eplb_interval_steps=4)
                got["gen2"] = _generate(engine)
            group.broadcast(None)
            engine.close()
        else:
            runner = ModelRunner.follower(loaded.model)
            runner.follow()
            got["kv_heads"] = runner.kv.k.shape[3]
        got["allreduce"] = group.allreduce_bytes
        got["served"] = [m.served for m in ep.moe_layers(loaded.model)]
        got["served_log"] = [m.served_log for m in ep.moe_layers(loaded.model)]
        got["moved"] = sum(m.moved_bytes for m in ep.moe_layers(loaded.model))
        got["micro"] = [m.micro_batches_run for m in ep.moe_layers(loaded.model)]
        got["bytes"] = sum(m.alltoall_bytes for m in ep.moe_layers(loaded.model))
        torch.save(got, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    quit_rank()


def _run(path, tmp_path, rebalance=False, tp=False, mb=1):
    args = (_free_port(), str(path), str(tmp_path), rebalance, tp, mb)
    spawn_ranks(_rank, args)
    return [torch.load(tmp_path / f"{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize(
    "kind,tp,mb",
    [
        ("qwen3_moe", False, 1),
        ("mixtral", False, 2),
        ("qwen3_moe", True, 1),
        ("qwen2_moe", True, 1),
    ],
    ids=str,
)
def test_two_rank_experts_match_one_rank(tmp_path_factory, tmp_path, kind, tp, mb):
    """``tp``: ``--tp 2 --ep 2``; each rank also holds 1 of the 2 KV heads and all-reduces.
    ``mb`` 2: two micro-batches per layer, one's all-to-alls in flight while the other's experts
    run."""
    from tests.model.test_moe_models import _build

    path = tmp_path_factory.mktemp(kind)
    _build(kind, path)
    one = load_model(path, dtype=torch.float32)
    drv = PagedDriver(one.model, block_size=4)
    ref_logits = drv.prefill(drv.new_seq(), LOGIT_IDS)
    ref = _generate(LLMEngine(one, CFG))
    r0, r1 = _run(path, tmp_path, tp=tp, mb=mb)
    assert r1["kv_heads"] == (1 if tp else 2)
    assert (r0["allreduce"] > 0) == tp and (r1["allreduce"] > 0) == tp
    for r in (r0, r1):
        assert (r["logits"] - ref_logits).abs().max().item() < 1e-4
        assert r["slots"] and all(s == 4 for s in r["slots"])  # 8 experts: 4 per rank
        assert r["bytes"] > 0  # tokens crossed ranks both ways
        # every layer call ran mb micro-batches (the engine's forwards come after the prefill)
        assert r["micro"] and all(m % mb == 0 and m >= mb for m in r["micro"])
    assert r0["gen"] == ref
    assert all(len(v) == SP.max_tokens for v in ref.values()) and len(ref) == len(PROMPTS)


def _skewed(path):
    """Qwen3-MoE whose router sends most rows to experts 0 and 1 (both on rank 0 at start)."""
    from tests.model.test_moe_models import _build

    _build("qwen3_moe", path)
    f = path / "model.safetensors"
    state = load_file(str(f))
    gate = state["model.layers.0.mlp.gate.weight"]
    gate[:2] *= 30.0
    save_file(state, str(f), metadata={"format": "pt"})


def test_eplb_rebalances_a_skewed_router_without_changing_tokens(tmp_path_factory, tmp_path):
    path = tmp_path_factory.mktemp("skewed")
    _skewed(path)
    ref = _generate(LLMEngine(load_model(path, dtype=torch.float32), CFG))
    r0, r1 = _run(path, tmp_path, rebalance=True)
    assert r0["gen"] == ref and r0["gen2"] == ref
    # rows each rank's experts computed in the run before and the run after rebalancing
    assert len(r0["served_log"][0]) >= 2  # the explicit rebalance, then the interval's
    runs = [
        [r["served_log"][0][0] for r in (r0, r1)],
        [sum(r["served_log"][0][1:]) + r["served"][0] for r in (r0, r1)],  # all of run 2
    ]
    measured = [eplb.imbalance(x) for x in runs]
    exp_before, exp_after = r0["expected"][0]
    assert measured[1] < measured[0] and exp_after < exp_before
    assert measured[0] > 1.2  # the skew is real: experts 0 and 1 start on rank 0
    assert r0["placement"][0] != eplb.initial(8, 2, 1).phys
    assert r0["moved"] + r1["moved"] > 0  # experts crossed ranks (a multiple of one expert)
    one = 3 * 64 * 48 * 4  # gate, up and down of one expert, float32
    assert (r0["moved"] + r1["moved"]) % one == 0


def _kv_rank(rank, port, path, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = TPGroup(rank, 2)
        loaded = load_model(path, dtype=torch.float32)
        ep.shard_experts(loaded.model, group)
        if rank == 0:
            engine = LLMEngine(loaded, CFG)
            runner = engine.runner
            L, nb, bs, h, hd = runner.kv.k.shape
            data = torch.randn((L, 2, 2, bs, h, hd), generator=torch.Generator().manual_seed(5))
            runner.write_blocks([nb - 1, nb - 2], data)  # a pool load's write: broadcast
            got = dict(back=runner.read_blocks([nb - 1, nb - 2]), data=data, heads=runner.kv_heads)
            got["bytes"] = tp_kv.EP_KV_BYTES._value.get()
            group.broadcast(None)
            engine.close()
        else:
            runner = ModelRunner.follower(loaded.model)
            runner.follow()
            nb = runner.kv.k.shape[1]
            got = dict(k=runner.kv.k[:, [nb - 1, nb - 2]].clone())
        torch.save(got, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    quit_rank()


def test_two_rank_kv_plane_broadcasts_whole_blocks(tmp_path_factory, tmp_path):
    """Under --ep alone every rank holds every KV head: whole blocks written on rank 0 land
    unchanged on rank 1 too, and read back from rank 0's own copy."""
    from tests.model.test_moe_models import _build

    path = tmp_path_factory.mktemp("moekv")
    _build("qwen3_moe", path)
    spawn_ranks(_kv_rank, (_free_port(), str(path), str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert r0["heads"] == 2 and torch.equal(r0["back"], r0["data"])
    assert torch.equal(r1["k"], r0["data"][:, 0])  # rank 1's K of both blocks, every head
    assert r0["bytes"] == r0["data"].numel() * 4  # float32, sent once to the one other rank
