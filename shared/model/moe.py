"""Sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 / V2) with a grouped
expert forward.

Routing follows transformers: router logits ``x @ gate.T``, softmax in float32, top-k, the top-k
probabilities renormalised to sum to 1 when ``norm_topk_prob`` (always for Mixtral), cast to the
activation dtype. Qwen2-MoE adds a shared expert, a gated MLP every token runs, scaled by
``sigmoid(shared_expert_gate(x))``, to the routed sum. The routing is pluggable: a
``ModelConfig.routing`` (DeepSeek) runs `route_grouped` instead, and its ungated shared experts
are added to the routed sum; GPT-OSS's (``scoring`` "topk_softmax") a softmax over the top-k of a
biased router's logits (`route_topk_softmax`), with biased experts gated by `clamped_swiglu`.
GraniteMoE's ("topk_softmax_float32") the same on float32 logits; PhiMoE's ("sparsemixer")
`route_sparsemixer`; ERNIE 4.5 MoE's DeepSeek-V2-like `route_grouped` with a correction bias and
the weights' sum clamped at ``norm_min`` (`shared.model.config_moe.MoeRouting`).
The experts run grouped: the ``T x k`` (token, expert) pairs are sorted by expert once, and each
expert that received tokens runs one fused gate/up GEMM and one down GEMM over all of its rows;
the weighted rows are summed back per token with one ``index_add_``.

Expert weights are held as transformers 5.x holds them in memory: ``experts.gate_up_proj``
``[E, 2I, H]`` (gate rows first) and ``experts.down_proj`` ``[E, H, I]``. The loader fills them
from that fused layout or from the per-expert tensors ``save_pretrained`` writes
(`expert_slice`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from prometheus_client import Counter
from torch import nn

from shared.model.layers import MLP, Gemm, activation, project

# Rows each expert received, per layer: proves the grouped path ran and is the load signal an
# expert-placement balancer (EPLB) reads.
EXPERT_TOKENS = Counter(
    "strata_moe_expert_tokens_total", "Token rows routed to each expert", ["layer", "expert"]
)
# GEMMs the grouped expert forward ran (two per active expert per layer call).
EXPERT_GEMMS = Counter("strata_moe_expert_gemms_total", "Expert GEMMs run (grouped MoE)")


class ExpertTokens:
    """One MoE layer's `EXPERT_TOKENS` series, each made when its expert first gets rows: a
    model built and never run (on the meta device, to size it) adds none to the process's
    registry, where DeepSeek-V3's 61 x 256 experts would be 15,616 series every scrape and
    every registry read walks."""

    def __init__(self, layer: int):
        self.layer = str(layer)
        self._children: dict[int, object] = {}

    def inc(self, expert: int, rows: int) -> None:
        child = self._children.get(expert)
        if child is None:
            child = self._children[expert] = EXPERT_TOKENS.labels(self.layer, str(expert))
        child.inc(rows)


class Experts(nn.Module):
    """``E`` gated MLPs stored stacked; ``run`` computes one expert over the rows grouped for it.

    ``bias``: each expert's gate/up and down projections carry a bias (``gate_up_proj_bias``
    ``[E, 2I]``, ``down_proj_bias`` ``[E, H]``, GPT-OSS); ``swiglu``: ``(alpha, limit)`` of
    GPT-OSS's clamped SwiGLU (`clamped_swiglu`) instead of ``act(gate) * up``."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: str,
        bias: bool = False,
        swiglu: tuple[float, float] | None = None,
    ):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.hidden, self.intermediate, self.act_name = hidden, intermediate, act
        self.bias, self.swiglu = bias, swiglu
        self.act = activation(act)
        self._gemms: list[tuple[Gemm, Gemm]] | None = None  # per expert, packed on first use

    def stacked(self) -> tuple[str, ...]:
        """The names of the per-expert stacked parameters (what expert parallelism moves)."""
        names = ("gate_up_proj", "down_proj")
        return names + ("gate_up_proj_bias", "down_proj_bias") if self.bias else names

    def like(self, num_experts: int) -> Experts:
        """Empty experts of the same kind (shapes, biases, gating), ``num_experts`` of them."""
        return Experts(
            num_experts, self.hidden, self.intermediate, self.act_name, self.bias, self.swiglu
        )

    def _biases(self, e: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.bias:
            return None, None
        return self.gate_up_proj_bias[e], self.down_proj_bias[e]

    def gemms(self, e: int) -> tuple[Gemm, Gemm]:
        """Expert ``e``'s (gate_up, down) GEMMs, packed again when a weight changed."""
        g = self._gemms
        if (
            g is None
            or not g[e][0].current(self.gate_up_proj[e], self._biases(e)[0])
            or not g[e][1].current(self.down_proj[e], self._biases(e)[1])
        ):
            g = self._gemms = [
                (
                    Gemm(self.gate_up_proj[i], self._biases(i)[0]),
                    Gemm(self.down_proj[i], self._biases(i)[1]),
                )
                for i in range(self.gate_up_proj.shape[0])
            ]
        return g[e]

    def run(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` over the rows ``xs`` routed to it: one gate/up GEMM, the gating, one
        down GEMM."""
        gate_up, down = self.gemms(e)
        gu, n = gate_up(xs), self.intermediate
        if self.swiglu is not None:
            return down(clamped_swiglu(gu[:, :n], gu[:, n:], *self.swiglu))
        return down(self.act(gu[:, :n]).mul_(gu[:, n:]))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float):
    """GPT-OSS's gating, as transformers computes it: the gate clamped from above and the up
    projection on both sides at ``limit``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's router over its (biased) router logits ``[T, E]``: the ``top_k`` largest
    logits, then a softmax over just those (in the logits' dtype): ``(weights, ids)``."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def route_sparsemixer(scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's sparsemixer at inference (deterministic: transformers samples only in training)
    over router logits ``[T, E]``: ``(weights [T, 2], ids [T, 2])`` in the logits' dtype. The
    first expert is the best logit ``m``; its weight is the softmax, at it, over the experts whose
    logit ``s`` is close to ``m`` (``(m - s) / max(|s|, m) <= 2 * eps``, the rest at -inf). The
    second is the best of the others, weighted the same way among the others (the threshold
    measured on the original logits)."""
    out_w, out_i, masked = [], [], scores
    for _ in range(2):
        best, idx = masked.max(dim=-1, keepdim=True)
        far = (best - scores) / scores.abs().clamp(min=best) > 2 * eps
        gates = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)
        out_w.append(gates.gather(-1, idx))
        out_i.append(idx)
        masked = torch.scatter(scores, -1, idx, float("-inf"))
    return torch.cat(out_w, dim=-1), torch.cat(out_i, dim=-1)


def route_grouped(
    logits: torch.Tensor, r, top_k: int, norm: bool, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routers (`shared.model.deepseek_config.Routing` ``r``) over float32 router
    logits ``[T, E]``: ``(weights [T, k] float32, expert ids [T, k])``. Scores are the sigmoid
    (V3) or softmax (V2) of the logits; the experts are chosen on the scores plus V3's
    correction ``bias``, only among the ``topk_group`` best groups of ``E / n_group`` experts
    when ``r.group_score`` is set (a group scored by its two best experts' sum, V3, or its best,
    V2); the weights are the chosen experts' scores (without the bias), renormalised when
    ``norm`` (V3), times ``routed_scaling_factor``."""
    scores = torch.sigmoid(logits) if r.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias
    if r.group_score is not None:
        t, e = choice.shape
        grouped = choice.view(t, r.n_group, e // r.n_group)
        if r.group_score == "top2_sum":
            group = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group = grouped.max(dim=-1).values
        keep = torch.topk(group, r.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group, dtype=torch.bool).scatter_(1, keep, True)
        mask = mask.unsqueeze(-1).expand(t, r.n_group, e // r.n_group).reshape(t, e)
        # V3 rules the other groups' experts out with -inf, V2 with a score of 0
        choice = choice.masked_fill(~mask, float("-inf") if r.scoring == "sigmoid" else 0.0)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm:
        total = weights.sum(dim=-1, keepdim=True)
        norm_min = getattr(r, "norm_min", None)  # ERNIE 4.5 MoE clamps the sum instead
        weights = weights / (total + 1e-20 if norm_min is None else total.clamp(min=norm_min))
    return weights * r.scaling, ids


class SparseMoE(nn.Module):
    """Router + experts (transformers' ``mlp.gate`` / ``mlp.experts`` names), and Qwen2-MoE's
    ``mlp.shared_expert`` / ``mlp.shared_expert_gate``. The routing is pluggable:
    ``c.routing`` None is the softmax top-k of Qwen-MoE / Mixtral; a DeepSeek `Routing` runs
    `route_grouped` on float32 logits (V3's ``mlp.gate.e_score_correction_bias`` a parameter
    of the gate) and adds the ungated shared experts (``mlp.shared_experts``)."""

    def __init__(self, c, layer: int):
        super().__init__()
        # DeepSeek's `Routing`, or GPT-OSS's (``scoring`` "topk_softmax": `route_topk_softmax`
        # over a biased router, experts with biases and the clamped SwiGLU)
        self.routing = r = getattr(c, "routing", None)
        router_bias = bool(getattr(r, "router_bias", False))
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=router_bias)
        self.experts = Experts(
            c.num_experts,
            c.hidden_size,
            c.moe_intermediate_size,
            c.hidden_act,
            bias=bool(getattr(r, "expert_bias", False)),
            swiglu=getattr(r, "swiglu", None),
        )
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.layer = layer
        self._counters = ExpertTokens(layer)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        self.shared_experts: MLP | None = None  # DeepSeek's, ungated
        if self.routing is not None:
            if self.routing.correction_bias:
                self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(c.num_experts))
            if self.routing.shared_width:
                width, bias = self.routing.shared_width, c.mlp_bias
                self.shared_experts = MLP(c.hidden_size, width, c.hidden_act, bias=bias)

    def add_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """``routed`` plus the gated shared expert over the same rows ``x`` (DeepSeek: the
        ungated shared experts; none: ``routed``)."""
        if self.shared_experts is not None:
            return routed.add_(self.shared_experts(x))
        if self.shared_expert is None:
            return routed
        gate = torch.sigmoid(project(self.shared_expert_gate, x))
        return routed.add_(gate * self.shared_expert(x))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids [T, k])``."""
        if getattr(self.routing, "scoring", None) == "topk_softmax":  # GPT-OSS
            weights, ids = route_topk_softmax(project(self.gate, x), self.top_k)
            return weights.to(x.dtype), ids
        scoring = getattr(self.routing, "scoring", None)
        if scoring == "topk_softmax_float32":  # GraniteMoE: the same on float32 logits
            weights, ids = route_topk_softmax(project(self.gate, x).float(), self.top_k)
            return weights.to(x.dtype), ids
        if scoring == "sparsemixer":  # PhiMoE
            return route_sparsemixer(project(self.gate, x), self.routing.jitter_eps)
        if self.routing is not None:  # DeepSeek: float32 logits, grouped choice
            logits = F.linear(x.float(), self.gate.weight.float())
            bias = getattr(self.gate, "e_score_correction_bias", None)
            bias = None if bias is None else bias.float()
            weights, ids = route_grouped(
                logits, self.routing, self.top_k, self.norm_topk_prob, bias
            )
            return weights.to(x.dtype), ids
        probs = torch.softmax(project(self.gate, x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.gate.out_features).tolist()
        rows = order // self.top_k
        xs = x.index_select(0, rows)
        ws = weights.reshape(-1, 1).index_select(0, order)
        ys = torch.empty_like(xs)
        start, gemms = 0, 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            y = self.experts.run(e, xs[start : start + n])  # one GEMM each over e's rows
            torch.mul(y, ws[start : start + n], out=ys[start : start + n])
            self._counters.inc(e, n)
            start, gemms = start + n, gemms + 2
        EXPERT_GEMMS.inc(gemms)
        return self.add_shared(x, torch.zeros_like(x).index_add_(0, rows, ys))


# Per-expert tensor names `save_pretrained` writes (and older hub checkpoints hold): Qwen3-MoE
# ``mlp.experts.N.{gate,up,down}_proj.weight``, Mixtral ``block_sparse_moe.experts.N.w{1,3,2}``.
_PER_EXPERT = re.compile(
    r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$"
)
_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


_MIXTRAL_EXPERT = re.compile(r"(\.experts\.\d+)\.(w1|w2|w3)\.weight$")


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor name in Qwen3-MoE's spelling, ours: Mixtral's ``block_sparse_moe.``
    is ``mlp.`` and its expert ``w1`` / ``w3`` / ``w2`` are ``gate_proj`` / ``up_proj`` /
    ``down_proj``."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f"{m[1]}.{_PART[m[2]]}.weight", name)


def expert_slice(name: str, intermediate: int) -> tuple[str, int, slice, str] | None:
    """Where a per-expert tensor (named as `checkpoint_name` returns) goes: ``(stacked parameter, expert, row slice, part)``; None
    when ``name`` is not one."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    part, e = m["part"], int(m["e"])
    if part == "down_proj":
        return f"{m['pre']}.down_proj", e, slice(None), part
    rows = slice(0, intermediate) if part == "gate_proj" else slice(intermediate, 2 * intermediate)
    return f"{m['pre']}.gate_up_proj", e, rows, part


def expected_parts(param: str, num_experts: int) -> list[str] | None:
    """The per-expert pieces that together fill stacked parameter ``param`` (for the missing
    tensor check); None when ``param`` is not a stacked expert weight."""
    if param.endswith(".experts.gate_up_proj"):
        parts = ("gate_proj", "up_proj")
    elif param.endswith(".experts.down_proj"):
        parts = ("down_proj",)
    else:
        return None
    pre = param.rsplit(".", 1)[0]
    return [f"{pre}.{e}.{p}.weight" for e in range(num_experts) for p in parts]
