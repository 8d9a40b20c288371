"""Tensor parallelism for the Llama family: attention heads and MLP columns over N ranks.

Each rank keeps the q/k/v rows of its heads, the matching o_proj columns, its gate/up rows and
the matching down_proj columns (an ungated MLP: its input projection's rows and its output
projection's columns; Phi's per-head q/k LayerNorms and partial RoPE need nothing more);
o_proj and down_proj outputs are summed over ranks with one all-reduce each (bias added once,
on rank 0). Embeddings, norms and lm_head are replicated. A model whose KV heads do not split
(DeepSeek's cached latent: one KV head for every query head, `kv_heads_split`) keeps them whole
on every rank, as vLLM does for MLA: the KV plane then treats the cache as replicated
(``TPGroup.shards_kv`` False: reads from rank 0's copy, writes broadcast, `shared.engine.tp_kv`).
The same code runs on gloo (CPU) and NCCL (CUDA): only the process group differs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from prometheus_client import Counter, Gauge
from torch import nn
from torch.nn import functional as F

from shared.model.errors import CheckpointError

ALLREDUCE_BYTES = Counter("strata_tp_allreduce_bytes_total", "Bytes all-reduced by this TP rank")
WORLD_SIZE = Gauge("strata_tp_world_size", "Tensor-parallel ranks of this model instance")


@dataclass
class TPGroup:
    """One rank's view of a tensor-parallel group; counts the bytes it all-reduces."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None  # None: the default group
    allreduce_bytes: int = field(default=0)
    # False under expert parallelism alone (attention is replicated) or for a model whose KV
    # heads do not split (`kv_heads_split`): every rank holds every KV head, so the KV plane
    # reads rank 0's and broadcasts writes (`shared.engine.tp_kv`)
    shards_kv: bool = True
    # Rank 0 holds it over each broadcast and the collectives that follow it (a forward, or a
    # KV gather/scatter, `shared.engine.tp_kv`): the followers run them in broadcast order, so
    # two threads of rank 0 must not interleave theirs.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place; returns it."""
        n = x.numel() * x.element_size()
        self.allreduce_bytes += n
        ALLREDUCE_BYTES.inc(n)
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (a pickled object: the engine's prepared batch, or
        ``None`` to stop the followers)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class RowParallelLinear(nn.Module):
    """``all_reduce(x_shard @ w_shard.T) + b``: the input-dim slice of a linear on this rank."""

    all_reduces = True  # DecoderLayer.native: layer.c has no collective inside it

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _rows(m: nn.Linear, lo: int, hi: int) -> None:
    m.weight = nn.Parameter(m.weight.data[lo:hi].clone(), requires_grad=False)
    if m.bias is not None:
        m.bias = nn.Parameter(m.bias.data[lo:hi].clone(), requires_grad=False)
    m.out_features = hi - lo


def _row_parallel(m: nn.Linear, lo: int, hi: int, tp: TPGroup) -> RowParallelLinear:
    return RowParallelLinear(m.weight.data[:, lo:hi], m.bias, tp)


def check_divisible(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """One clear error when the heads cannot be split evenly over ``world_size`` ranks."""
    if num_heads % world_size or num_kv_heads % world_size:
        raise CheckpointError(
            f"tensor parallel size {world_size} must divide num_heads ({num_heads}) and "
            f"num_kv_heads ({num_kv_heads})"
        )


def kv_heads_split(c) -> bool:
    """Whether tensor parallelism splits the KV heads of `ModelConfig` ``c`` over the ranks:
    not for DeepSeek's multi-head latent attention, whose cache holds one latent KV head that
    every query head reads (each rank keeps a whole copy)."""
    return getattr(c, "mla", None) is None


def check_shardable(c, world_size: int, experts: bool = False) -> None:
    """A `ModelConfig` that `shard_model` can cut into ``world_size`` shards, else one clear
    `CheckpointError` (checked before any rank starts). ``experts``: the MoE layers' experts
    are split by expert parallelism over the same ranks (`shared.model.ep`)."""
    if world_size < 1:
        raise CheckpointError(f"tensor parallel size must be at least 1, not {world_size}")
    if world_size == 1:
        return
    if c.text_model_type in ("olmo2", "olmo3", "olmoe"):
        name = {"olmo2": "OLMo-2", "olmo3": "OLMo-3", "olmoe": "OLMoE"}[c.text_model_type]
        raise CheckpointError(
            f"tensor parallelism does not shard {name}: its q/k norm spans every head; "
            "serve it with --tp 1"
        )
    if c.moe_layers and not experts:
        raise CheckpointError(
            f"tensor parallelism does not shard MoE experts: add --ep {world_size} to split "
            "them over the same ranks"
        )
    if kv_heads_split(c):
        check_divisible(c.num_heads, c.num_kv_heads, world_size)
    elif c.num_heads % world_size:
        raise CheckpointError(
            f"tensor parallel size {world_size} must divide num_heads ({c.num_heads}); the "
            "latent KV head is replicated on every rank"
        )
    dense = len(c.moe_layers) < c.num_layers
    if dense and c.intermediate_size % world_size:
        raise CheckpointError(
            f"tensor parallel size {world_size} must divide intermediate_size "
            f"({c.intermediate_size})"
        )


def shard_model(model: nn.Module, tp: TPGroup, experts: bool = False) -> nn.Module:
    """Cut a loaded Llama-family model (or a LLaVA's language model: the vision tower stays
    whole) down to rank ``tp.rank``'s shard, in place. ``experts``: sparse MoE layers are left
    for `shared.model.ep.shard_experts` (expert parallelism over the same ranks)."""
    c = model.config
    n, r = tp.world_size, tp.rank
    check_shardable(c, n, experts)
    nh, nkv, d, ff = c.num_heads // n, c.num_kv_heads // n, c.head_dim, c.intermediate_size // n
    if not kv_heads_split(c):  # every rank keeps the whole latent KV head
        nkv, tp.shards_kv = c.num_kv_heads, False
    lm = getattr(model, "language_model", model)
    for layer in lm.model.layers:
        a, m = layer.self_attn, layer.mlp
        if hasattr(a, "shard_heads"):  # DeepSeek's latent attention: its own per-head rows
            a.shard_heads(r, n, tp)
        else:
            _rows(a.q_proj, r * nh * d, (r + 1) * nh * d)
            _rows(a.k_proj, r * nkv * d, (r + 1) * nkv * d)
            _rows(a.v_proj, r * nkv * d, (r + 1) * nkv * d)
            o = getattr(a, "o_name", "o_proj")  # Phi's is ``dense``
            setattr(a, o, _row_parallel(getattr(a, o), r * nh * d, (r + 1) * nh * d, tp))
            a.num_heads, a.num_kv_heads, a._qkv = nh, nkv, None
            norms = getattr(a, "shard_head_norms", None)  # per-head q/k norms (StableLM, Cohere)
            if norms is not None:
                norms(r * nh, (r + 1) * nh, r * nkv, (r + 1) * nkv)
        # layer.c has no collective between attention and MLP: the layer runs op by op
        layer.native_reason = "tensor parallel (an all-reduce after o_proj and down_proj)"
        if hasattr(m, "fc_names"):  # ungated (Phi's fc1 / fc2, StarCoder2's c_fc / c_proj)
            fc_in, fc_out = m.fc_names
            _rows(getattr(m, fc_in), r * ff, (r + 1) * ff)
            setattr(m, fc_out, _row_parallel(getattr(m, fc_out), r * ff, (r + 1) * ff, tp))
            continue
        if not hasattr(m, "gate_proj"):  # a sparse MoE block: its experts go by --ep
            continue
        _rows(m.gate_proj, r * ff, (r + 1) * ff)
        _rows(m.up_proj, r * ff, (r + 1) * ff)
        m.down_proj = _row_parallel(m.down_proj, r * ff, (r + 1) * ff, tp)
        m._gate_up = None
    for m in {id(model): model, id(lm): lm}.values():
        m.num_kv_heads = nkv
        m.tp = tp
    return model
