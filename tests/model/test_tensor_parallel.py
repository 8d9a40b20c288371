"""Two gloo ranks, each on its shard, against the unsharded model on the same paged batch."""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.model.parallel import TPGroup, check_divisible, shard_model
from tests.model.paged_driver import PagedDriver
from tests.ranks import spawn_ranks

pytest.importorskip("transformers")
PROMPTS = [[3, 17, 52, 9, 100, 7, 4], [11, 2, 5, 80, 33]]
NEW = 6


def _run(model):
    """Prefill both prompts in one batch, then greedy decode both together."""
    torch.manual_seed(0)
    d = PagedDriver(model, block_size=4)
    seqs = [d.new_seq() for _ in PROMPTS]
    _, logits = d.step(list(zip(seqs, PROMPTS, strict=True)))
    all_logits, toks = [logits], [logits.argmax(-1).tolist()]
    for _ in range(NEW - 1):
        _, logits = d.step([(s, [t]) for s, t in zip(seqs, toks[-1], strict=True)])
        all_logits.append(logits)
        toks.append(logits.argmax(-1).tolist())
    return torch.stack(all_logits), toks, d.cache


def _rank(rank, port, path, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = TPGroup(rank, 2)
        model = shard_model(load_model(path, dtype=torch.float32).model, tp)
        logits, toks, cache = _run(model)
        assert model.model.layers[0].native() is None  # op by op: the all-reduces sit inside
        assert "tensor parallel" in model.model.layers[0].native_reason
        q = model.model.layers[0].self_attn.q_proj.weight
        torch.save(
            dict(
                logits=logits,
                toks=toks,
                bytes=tp.allreduce_bytes,
                q=tuple(q.shape),
                kv=tuple(cache.k.shape),
            ),
            f"{out}/{rank}.pt",
        )
        dist.barrier()  # no rank tears the group down while the other is in a collective
    finally:
        dist.destroy_process_group()
    quit_rank()


def quit_rank() -> None:
    """A test rank whose work went through leaves without the interpreter's teardown, where
    gloo's threads were seen to abort ("terminate called without an active exception": SIGABRT,
    failing the spawn), as `shared.worker.tp.follower_main` does. Reached only on success."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.model.test_text_models import _build

    path = tmp_path_factory.mktemp("qwen3")
    _build("qwen3", path)
    return path


def test_two_ranks_match_unsharded(ckpt, tmp_path):
    full = load_model(ckpt, dtype=torch.float32)
    ref_logits, ref_toks, ref_cache = _run(full.model)
    spawn_ranks(_rank, (_free_port(), str(ckpt), str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    c = full.config
    assert (r0["logits"] - ref_logits).abs().max() < 1e-4
    assert r0["toks"] == ref_toks and r1["toks"] == ref_toks
    tokens = sum(len(p) for p in PROMPTS) + (NEW - 1) * len(PROMPTS)
    assert r0["bytes"] == r1["bytes"] == 2 * c.num_layers * tokens * c.hidden_size * 4
    assert r0["q"] == (c.num_heads // 2 * c.head_dim, c.hidden_size)
    kv = list(ref_cache.k.shape)
    kv[-2] //= 2  # [layers, blocks, block_size, kv_heads, head_dim]: half the KV heads
    assert list(r0["kv"]) == kv, (r0["kv"], ref_cache.k.shape)


def test_indivisible_heads_refused():
    with pytest.raises(CheckpointError, match=r"3 must divide num_heads \(8\) and num_kv_heads"):
        check_divisible(8, 8, 3)
