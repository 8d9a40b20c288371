"""Expert parallelism: a MoE model's experts over N ranks, tokens moved by all-to-all.

Attention and the dense layers are replicated: every rank runs the same batch (rank 0's,
broadcast as under tensor parallelism) and holds the whole KV. In each sparse MoE layer rank r
routes its 1/N slice of the batch's tokens, sends each (token, expert) row to the rank holding
that expert (`all_to_all_single`: the dispatch), runs its local experts on the rows it received
(grouped, as `shared.model.moe` does), sends the outputs back (the combine), weighs and sums
them per token, and all-gathers the slices so every rank has the whole batch's MLP output.

Placement (`shared.model.eplb`): contiguous blocks at start (rank r holds experts
``r*E/N .. (r+1)*E/N - 1``), optionally with spare slots for replicas; `apply_placement` moves
experts between forwards (EPLB). The same code runs on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from prometheus_client import Counter, Gauge
from torch import nn

from shared.model import eplb
from shared.model.errors import CheckpointError
from shared.model.moe import EXPERT_GEMMS, SparseMoE

ALLTOALL_BYTES = Counter(
    "strata_ep_alltoall_bytes_total",
    "Bytes this expert-parallel rank sent to other ranks in MoE dispatch and combine all-to-alls",
)
EPLB_MOVED_BYTES = Counter(
    "strata_eplb_moved_bytes_total", "Expert weight bytes this rank received in EPLB moves"
)
EPLB_IMBALANCE = Gauge(
    "strata_eplb_imbalance",
    "Max/mean rank load of the last EPLB placement for the counts it was computed from",
    ["layer"],
)
REBALANCE = "eplb-rebalance"
"""Rank 0's broadcast before `rebalance_all`: the followers run it too."""
LOCAL_EXPERTS = Gauge("strata_ep_local_experts", "Expert slots this expert-parallel rank holds")


def check_ep(c, ep: int) -> None:
    """A `ModelConfig` whose experts split over ``ep`` ranks, else one clear `CheckpointError`."""
    if ep < 1:
        raise CheckpointError(f"expert parallel size must be at least 1, not {ep}")
    if ep == 1:
        return
    if not c.moe_layers:
        raise CheckpointError(f"--ep {ep} needs a mixture-of-experts checkpoint; this one has none")
    if ep > c.num_experts:
        raise CheckpointError(
            f"--ep {ep} is more ranks than the checkpoint's {c.num_experts} experts"
        )
    if c.num_experts % ep:
        raise CheckpointError(f"--ep {ep} must divide the checkpoint's {c.num_experts} experts")


class EPMoE(SparseMoE):
    """A `SparseMoE` whose experts live on the ranks of ``group`` (a `TPGroup`)."""

    def __init__(self, moe: SparseMoE, c, group, placement: eplb.Placement):
        nn.Module.__init__(self)
        self.gate, self.top_k, self.norm_topk_prob = moe.gate, moe.top_k, moe.norm_topk_prob
        # Qwen2-MoE's shared expert stays whole on every rank, run over the rank's token slice
        self.shared_expert, self.shared_expert_gate = moe.shared_expert, moe.shared_expert_gate
        # DeepSeek: its router (`moe.route_grouped`) and ungated shared experts, also whole
        self.routing, self.shared_experts = moe.routing, moe.shared_experts
        self.layer, self._counters, self.group = moe.layer, moe._counters, group
        self.num_experts, self.act = c.num_experts, c.hidden_act
        self.experts = moe.experts.like(placement.slots)  # biases, gating as the model's
        self.alltoall_bytes = 0  # this rank's share of ALLTOALL_BYTES from this layer
        self.served = 0  # rows this rank's experts computed (its load) since the last rebalance
        self.served_log: list[int] = []  # ``served`` at each rebalance
        self.micro_batches = 1  # >1: overlap one micro-batch's all-to-alls with another's experts
        self.micro_batches_run = 0
        self.moved_bytes = 0  # expert weights this rank received in EPLB moves
        self.load = torch.zeros(c.num_experts, dtype=torch.long)  # rows routed since rebalance
        full = [getattr(moe.experts, n).data for n in moe.experts.stacked()]
        self._install(placement, {e: tuple(t[e] for t in full) for e in set(placement.phys)})

    def _install(self, placement: eplb.Placement, weights: dict) -> None:
        """Hold ``placement``'s experts of this rank; ``weights[e]``: expert e's tensors."""
        mine = placement.on_rank(self.group.rank)
        ex = self.experts
        for i, name in enumerate(ex.stacked()):  # gate_up, down (and their biases)
            setattr(ex, name, nn.Parameter(torch.stack([weights[e][i] for e in mine]), False))
        ex._gemms = None
        self.placement = placement
        reps = [placement.replicas(e) for e in range(self.num_experts)]
        width = max(len(r) for r in reps)
        dev = ex.gate_up_proj.device
        self.log2phys = torch.tensor([r + r[:1] * (width - len(r)) for r in reps], device=dev)
        self.nrep = torch.tensor([len(r) for r in reps], device=dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, H = self.group, x.shape[1]
        n, r, S = g.world_size, g.rank, self.placement.slots
        sizes = [len(c) for c in torch.arange(x.shape[0]).tensor_split(n)]
        start = sum(sizes[:r])
        mine = x[start : start + sizes[r]]
        weights, ids = self.route(mine)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).cpu()
        self.load += counts
        for e, c in enumerate(counts.tolist()):
            if c:
                self._counters.inc(e, c)
        # a token's rows go to replica (token index mod replicas): an even split over replicas
        tok = torch.arange(start, start + sizes[r], device=x.device).unsqueeze(1).expand_as(ids)
        phys = self.log2phys[ids, tok % self.nrep[ids]]
        plans, lo = [], 0
        for m in (len(c) for c in torch.arange(len(mine)).tensor_split(self.micro_batches)):
            plans.append(_Plan(mine, phys[lo : lo + m], weights[lo : lo + m], lo, S, n))
            lo += m
        send = torch.stack([p.send for p in plans], dim=1).contiguous()  # [rank, micro-batch]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=g.group)
        for i, p in enumerate(plans):  # every dispatch in flight at once
            p.dispatch(send[:, i].tolist(), recv[:, i].tolist(), g.group)
        for p in plans:  # micro-batch i's experts run while i+1's rows (and i-1's outputs) move
            p.wait()
            p.combine(self._local(p.recv_x, p.recv_slot), g.group)
        out = torch.zeros_like(mine)
        for p in plans:
            p.wait()
            out.index_add_(0, p.rows, p.back * p.ws)
            sent = (sum(p.sc) - p.sc[r]) * (H * x.element_size() + 8)
            sent += (sum(p.rc) - p.rc[r]) * H * x.element_size()
            self.alltoall_bytes += sent
            ALLTOALL_BYTES.inc(sent)
        self.micro_batches_run += len(plans)
        out = self.add_shared(mine, out)
        if n == 1:
            return out
        pad = x.new_zeros((max(sizes), H))
        pad[: sizes[r]] = out
        parts = [torch.empty_like(pad) for _ in range(n)]
        dist.all_gather(parts, pad, group=g.group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)])

    def _local(self, xs: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the rows it received (``slots``: each row's local slot)."""
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.placement.slots).tolist()
        xs = xs.index_select(0, order)
        ys = torch.empty_like(xs)
        start, gemms = 0, 0
        for s, c in enumerate(counts):
            if c == 0:
                continue
            ys[start : start + c] = self.experts.run(s, xs[start : start + c])
            start, gemms = start + c, gemms + 2
        EXPERT_GEMMS.inc(gemms)
        self.served += len(order)
        return torch.empty_like(ys).index_copy_(0, order, ys)

    def apply_placement(self, new: eplb.Placement) -> int:
        """Every rank together: move to ``new``. An expert this rank lacks is broadcast from the
        lowest rank holding it; returns the bytes this rank received."""
        old, r, got = self.placement, self.group.rank, 0
        have = {e: i for i, e in enumerate(old.on_rank(r))}
        ex = self.experts
        stacked = [getattr(ex, n).data for n in ex.stacked()]
        weights = {e: tuple(t[i] for t in stacked) for e, i in have.items()}
        wanted = sorted(
            {e for q in range(new.ranks) for e in new.on_rank(q) if e not in old.on_rank(q)}
        )
        for e in wanted:
            src = min(q for q in range(old.ranks) if e in old.on_rank(q))
            bufs = weights[e] if src == r else tuple(torch.empty_like(t[0]) for t in stacked)
            for b in bufs:
                dist.broadcast(b, src, group=self.group.group)
            if e in new.on_rank(r) and e not in have:
                weights[e] = bufs
                got += sum(b.numel() * b.element_size() for b in bufs)
        self._install(new, weights)
        return got


class _Plan:
    """One micro-batch of a rank's tokens: its (token, expert) rows sorted by physical slot (so
    by destination rank), and the all-to-alls that move them (asynchronous: ``wait``)."""

    def __init__(self, mine, phys, weights, lo: int, slots: int, ranks: int):
        k = phys.shape[1]
        flat = phys.reshape(-1)
        order = torch.argsort(flat, stable=True)
        self.phys = flat[order]
        self.rows = order // k + lo
        self.ws = weights.reshape(-1, 1).index_select(0, order)
        self.send = torch.bincount(self.phys // slots, minlength=ranks)
        self.send_x, self.send_slot = mine.index_select(0, self.rows), self.phys % slots
        self.works: list = []

    def dispatch(self, sc: list[int], rc: list[int], group) -> None:
        self.sc, self.rc = sc, rc
        self.recv_x = self.send_x.new_empty((sum(rc), self.send_x.shape[1]))
        self.recv_slot = self.send_slot.new_empty(sum(rc))
        self.works = [
            dist.all_to_all_single(self.recv_x, self.send_x, rc, sc, group=group, async_op=True),
            dist.all_to_all_single(
                self.recv_slot, self.send_slot, rc, sc, group=group, async_op=True
            ),
        ]

    def combine(self, ys: torch.Tensor, group) -> None:
        self.ys = ys  # kept alive until the all-to-all is done
        self.back = ys.new_empty((sum(self.sc), ys.shape[1]))
        self.works = [
            dist.all_to_all_single(self.back, ys, self.sc, self.rc, group=group, async_op=True)
        ]

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


def shard_experts(
    model: nn.Module, group, spare: int = 0, replicated_kv: bool = True, micro_batches: int = 1
):
    """Keep rank ``group.rank``'s experts of every sparse MoE layer (contiguous blocks, plus
    ``spare`` replica slots per rank), in place; attention and dense layers stay whole, unless
    `shared.model.parallel.shard_model` cut them over the same ranks first (``--tp N --ep N``:
    then pass ``replicated_kv=False``, each rank holds its KV heads)."""
    c = model.config
    check_ep(c, group.world_size)
    placement = eplb.initial(c.num_experts, group.world_size, spare)
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = EPMoE(layer.mlp, c, group, placement)
            layer.mlp.micro_batches = micro_batches
            layer.native_reason = "expert parallel (all-to-all dispatch and combine)"
    # --ep alone: every rank holds every KV head, the KV plane broadcasts writes (and with --tp
    # too when `shard_model` kept the KV heads whole: DeepSeek's latent)
    if replicated_kv:
        group.shards_kv = False
    model.tp = group
    LOCAL_EXPERTS.set(placement.slots)
    return model


def moe_layers(model: nn.Module) -> list[EPMoE]:
    """The expert-parallel layers of a model cut by `shard_experts`."""
    return [m for m in model.modules() if isinstance(m, EPMoE)]


def rebalance_all(model: nn.Module) -> list[tuple[float, float]]:
    """Every rank together (between forwards): sum the ranks' routed-row counts, compute each
    layer's `eplb.rebalance` placement and move to it. Returns per layer the expected
    (before, after) max/mean rank load for those counts."""
    layers = moe_layers(model)
    if not layers:
        return []
    group = layers[0].group
    load = torch.stack([m.load for m in layers]).to(layers[0].log2phys.device)
    dist.all_reduce(load, group=group.group)
    out = []
    for m, row in zip(layers, load.cpu().tolist(), strict=True):
        new = eplb.rebalance(row, m.placement.ranks, m.placement.slots)
        before = eplb.imbalance(eplb.rank_loads(row, m.placement))
        out.append((before, eplb.imbalance(eplb.rank_loads(row, new))))
        got = m.apply_placement(new)
        m.moved_bytes += got
        EPLB_MOVED_BYTES.inc(got)
        EPLB_IMBALANCE.labels(str(m.layer)).set(out[-1][1])
        m.load.zero_()
        m.served_log.append(m.served)
        m.served = 0
    return out
