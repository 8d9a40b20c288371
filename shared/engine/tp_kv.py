"""Whole KV blocks in and out of the paged cache under tensor parallelism.

Each rank's paged cache holds its own KV heads (`shared.model.parallel.shard_model`), but
everything that moves KV outside the forward -- swap, evicted and computed blocks for the pool,
pool loads, reads for a push to a decode instance, pushed KV received -- works on whole blocks
(all KV heads). On rank 0 `ModelRunner`'s raw KV methods broadcast a `KVOp` on the channel the
followers already listen on (`ModelRunner.follow`); every rank runs it on its heads, and reads
are gathered to rank 0, writes scattered from rank 0, along the KV-head axis (the second to last
of every KV layout). The layer-wise push reads KV inside the forward, after each layer: rank 0
runs such a batch with ``layer_sync`` and the followers take its KV ops after the same layer
(`layer_sync`, `follow_layer`). The same code runs on gloo and NCCL.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from prometheus_client import Counter

KV_BYTES = Counter(
    "strata_tp_kv_bytes_total",
    "KV bytes rank 0 gathered from (op=gather) or scattered to (op=scatter) the tensor-parallel "
    "ranks, whole blocks moved outside the forward",
    ["op"],
)
EP_KV_BYTES = Counter(
    "strata_ep_kv_bytes_total",
    "KV bytes rank 0 broadcast to its expert-parallel ranks (each holds every KV head)",
)

READS = frozenset({"read_blocks", "read_tokens"})
WRITES = frozenset({"write_blocks", "write_token_layers"})
_in_forward = threading.local()


@dataclass
class KVOp:
    """A raw KV operation every rank runs on its own heads: ``ModelRunner._local_<name>``."""

    name: str
    args: tuple
    part_shape: tuple[int, ...] | None = None  # a write: the shape of each rank's slice


LAYER_DONE = "layer-done"
"""Rank 0's broadcast after its layer callback: the followers go on to the next layer."""


def forward_scope(on: bool) -> None:
    """Mark this thread as inside a TP forward (a KV op there would interleave collectives)."""
    _in_forward.on = on


def layer_sync(tp, callback):
    """Rank 0's layer callback under TP (the batch was sent with ``layer_sync``): the KV reads
    ``callback`` makes run on every rank, which wait in `follow_layer` after the same layer."""

    def each(layer: int) -> None:
        _in_forward.layer = True
        try:
            callback(layer)
        finally:
            _in_forward.layer = False
            tp.broadcast(LAYER_DONE)

    return each


def follow_layer(runner, tp) -> None:
    """A rank > 0 after each layer of a ``layer_sync`` batch: rank 0's KV ops until it is done."""
    while (op := tp.broadcast(None)) != LAYER_DONE:
        follow(runner, tp, op)


def run(runner, tp, name: str, args: tuple, data: torch.Tensor | None = None):
    """Rank 0: run ``name`` on every rank. A read returns the gathered whole-head tensor; a write
    scatters ``data`` (whole heads) so each rank stores its own."""
    in_layer = getattr(_in_forward, "layer", False)  # rank 0 holds the lock for the forward
    if getattr(_in_forward, "on", False) and not in_layer:
        raise RuntimeError(f"KV {name} inside a tensor-parallel forward, outside a layer callback")
    if not tp.shards_kv:  # expert parallel: every rank holds the same whole blocks
        return _replicated(runner, tp, name, args, data, in_layer)
    parts = None
    if data is not None:
        data = data.to(runner.device, runner.kv.k.dtype)
        parts = [p.contiguous() for p in data.chunk(tp.world_size, dim=-2)]
    op = KVOp(name, args, None if parts is None else tuple(parts[0].shape))
    if in_layer:
        tp.broadcast(op)
        return _on_rank(runner, tp, op, parts)
    with tp.lock:
        tp.broadcast(op)
        return _on_rank(runner, tp, op, parts)


def follow(runner, tp, op: KVOp) -> None:
    """A rank > 0: its part of rank 0's ``op``."""
    if not tp.shards_kv:
        _broadcast_write(runner, tp, op, None)
        return
    _on_rank(runner, tp, op, None)


def _replicated(runner, tp, name: str, args: tuple, data, in_layer: bool):
    """Rank 0 under expert parallelism alone: a read is its own copy (no collective), a write
    is broadcast so every rank stores the same."""
    local = getattr(runner, "_local_" + name)
    if name in READS:
        return local(*args)
    if name not in WRITES:
        raise ValueError(f"unknown KV op {name!r}")
    data = data.to(runner.device, runner.kv.k.dtype).contiguous()
    op = KVOp(name, args, tuple(data.shape))
    if in_layer:
        tp.broadcast(op)
        return _broadcast_write(runner, tp, op, data)
    with tp.lock:
        tp.broadcast(op)
        return _broadcast_write(runner, tp, op, data)


def _broadcast_write(runner, tp, op: KVOp, data: torch.Tensor | None) -> None:
    if op.name not in WRITES:
        raise ValueError(f"unknown KV op {op.name!r}")
    if data is None:
        data = torch.empty(op.part_shape, dtype=runner.kv.k.dtype, device=runner.device)
    else:
        EP_KV_BYTES.inc(data.numel() * data.element_size() * (tp.world_size - 1))
    dist.broadcast(data, 0, group=tp.group)
    getattr(runner, "_local_" + op.name)(*op.args, data)


def _on_rank(runner, tp, op: KVOp, parts: list[torch.Tensor] | None):
    local = getattr(runner, "_local_" + op.name)
    if op.name in READS:
        mine = local(*op.args).contiguous()
        bucket = [torch.empty_like(mine) for _ in range(tp.world_size)] if tp.rank == 0 else None
        dist.gather(mine, bucket, dst=0, group=tp.group)
        if bucket is None:
            return None
        out = torch.cat(bucket, dim=-2)
        KV_BYTES.labels("gather").inc(out.numel() * out.element_size())
        return out
    if op.name not in WRITES:
        raise ValueError(f"unknown KV op {op.name!r}")
    mine = torch.empty(op.part_shape, dtype=runner.kv.k.dtype, device=runner.device)
    dist.scatter(mine, parts, src=0, group=tp.group)
    if parts is not None:
        KV_BYTES.labels("scatter").inc(mine.numel() * mine.element_size() * tp.world_size)
    local(*op.args, mine)
    return None


def on_device(batch, device: torch.device):
    """A `PreparedBatch` broadcast from rank 0 on this rank's device (NCCL: a GPU per rank)."""
    if batch.input_ids.device == device:
        return batch
    meta = dataclasses.replace(
        batch.meta,
        **{k: v.to(device) for k, v in vars(batch.meta).items() if isinstance(v, torch.Tensor)},
    )
    moved = {k: v.to(device) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    return dataclasses.replace(batch, meta=meta, **moved)
