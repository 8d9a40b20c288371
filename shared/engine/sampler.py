"""Token selection: penalties, masks, greedy or filtered random sampling, logprobs.

Randomness for a seeded request is keyed by ``(seed, position)`` only: each row draws Gumbel-style
exponential noise from its own generator seeded with a stable mix of the two, so the same request
picks the same tokens alone, in any batch, and when resumed from already-emitted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.structured import apply_bitmask
from shared.protocol.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position); stable across processes and platforms."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


_ACCEPT_SALT = 0x5EC0_DEC0DE  # separates the acceptance draw from the token draw


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits`` (one row or a batch of rows of one request) at ``p.temperature``,
    with top-k, top-p and min-p applied (dropped tokens get 0, the rest is not renormalised:
    `draw` does not need it)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp > p.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs.cpu()


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the (unnormalised) distribution ``probs``: the argmax of
    ``probs / Exp(1)`` noise, which picks token i with probability ``probs[i] / sum``."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + outputs so far (the context of this row)
    num_prompt_tokens: int

    @property
    def position(self) -> int:
        return len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # chosen token first, then the top-n


def bad_word_bans(rows: Sequence[SampleRow]) -> tuple[list[int], list[int]]:
    """(row, token) pairs that vLLM's ``bad_words`` bans now: a bad word's last id, when the
    row's outputs end with the ids before it (a one-id word is always banned)."""
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, r in enumerate(rows):
        words = r.params.bad_words_ids
        if not words:
            continue
        outs = list(r.token_ids[r.num_prompt_tokens :])
        for w in words:
            k = len(w) - 1
            if k <= len(outs) and (k == 0 or outs[-k:] == list(w[:-1])):
                ban_rows.append(i)
                ban_ids.append(w[-1])
    return ban_rows, ban_ids


def _flat(pairs: list[tuple[int, Sequence[int]]]) -> tuple[list[int], list[int]]:
    rows = [i for i, ids in pairs for _ in ids]
    return rows, [t for _, ids in pairs for t in ids]


def adjust_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """``logits`` (a copy when anything applies) with each row's logit_bias added, every id
    outside its allowed_token_ids and every id its bad_words ban now set to -inf: one indexed
    write per kind for the whole batch. Ids beyond the logits' width are ignored."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    allowed = [
        (i, r.params.allowed_token_ids)
        for i, r in enumerate(rows)
        if r.params.allowed_token_ids is not None
    ]
    ban_rows, ban_ids = bad_word_bans(rows)
    if not (biased or allowed or ban_rows):
        return logits
    logits = logits.clone()
    dev, width = logits.device, logits.shape[-1]

    def index(rs: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        r_t = torch.tensor(rs, dtype=torch.long, device=dev)
        t_t = torch.tensor(ids, dtype=torch.long, device=dev)
        ok = t_t < width
        return r_t[ok], t_t[ok]

    if biased:
        rs, ids = _flat([(i, list(b)) for i, b in biased])
        vals = torch.tensor([v for _, b in biased for v in b.values()], device=dev)
        r_t, t_t = index(rs, ids)
        vals = vals[torch.tensor(ids, device=dev) < width]
        logits.index_put_((r_t, t_t), vals, accumulate=True)
    if allowed:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        r_t, t_t = index(*_flat(allowed))
        keep[r_t, t_t] = True
        masked = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        masked[torch.tensor([i for i, _ in allowed], device=dev)] = True
        logits.masked_fill_(masked[:, None] & ~keep, float("-inf"))
    if ban_rows:
        r_t, t_t = index(ban_rows, ban_ids)
        logits[r_t, t_t] = float("-inf")
    return logits


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None):
        self.eos_token_ids = list(eos_token_ids)
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        bitmask: torch.Tensor | None = None,
        mask_rows: Sequence[int] = (),
    ) -> SampleResult:
        """Pick one token per row. ``bitmask[j]`` (xgrammar layout, bit set = allowed) limits
        row ``mask_rows[j]`` to its grammar's next tokens; other rows are free. Logprobs are
        those of the model (before bias and mask)."""
        logits = logits.float()
        raw = logits
        logits = adjust_logits(logits, rows)
        if bitmask is not None and mask_rows:
            logits = logits.clone() if logits is raw else logits
            apply_bitmask(logits, bitmask, list(mask_rows))
        out = [0] * len(rows)
        plain = [i for i, r in enumerate(rows) if self._is_plain_greedy(r)]
        if plain:
            ids = logits[plain].argmax(dim=-1).tolist()
            for i, t in zip(plain, ids, strict=True):
                out[i] = t
        for i, r in enumerate(rows):
            if i not in plain:
                out[i] = self._sample_row(logits[i].clone(), r)
        lps: list[dict[int, float] | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            logp = torch.log_softmax(raw[want], dim=-1)
            for j, i in enumerate(want):
                n = rows[i].params.logprobs or 0
                d = {out[i]: float(logp[j, out[i]])}
                if n:
                    vals, idx = logp[j].topk(n)
                    for v, t in zip(vals.tolist(), idx.tolist(), strict=True):
                        d.setdefault(t, v)
                lps[i] = d
        return SampleResult(out, lps)

    @staticmethod
    def _is_plain_greedy(r: SampleRow) -> bool:
        p = r.params
        return (
            p.greedy
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and r.num_outputs >= p.min_tokens
        )

    def _sample_row(self, logits: torch.Tensor, r: SampleRow) -> int:
        p = r.params
        self._apply_penalties(logits, r)
        if r.num_outputs < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            if banned:
                logits[banned] = float("-inf")
        if p.greedy:
            return int(logits.argmax())
        probs = filtered_probs(logits, p)
        return draw(probs, self._generator(p, r.position))

    def _generator(self, p: SamplingParams, position: int, salt: int = 0) -> torch.Generator | None:
        """The generator of the draw at ``position``: keyed by (seed, position) for a seeded
        request (``salt`` separates a second draw at the same position), the engine's own
        otherwise."""
        if p.seed is None:
            return self.generator
        return torch.Generator().manual_seed(mix_seed(p.seed ^ salt, position))

    def verify(self, logits: torch.Tensor, drafts: Sequence[int], r: SampleRow) -> list[int]:
        """Rejection sampling of a sampled request's drafts (spec_decode's module docstring):
        ``logits`` holds ``len(drafts) + 1`` rows (after any grammar mask), row ``j`` the
        target's logits after draft ``j - 1``. Draft ``d`` at row ``j`` is kept with probability
        ``p_j(d)``; the first one refused is replaced by a draw from ``p_j`` without ``d``;
        when every draft is kept, one more token is drawn from the last row. Returns the
        emitted tokens. Each is distributed as the plain sampler's token at its position."""
        p = r.params
        probs = filtered_probs(logits.float(), p)
        out: list[int] = []
        pos = r.position
        for j, d in enumerate(drafts):
            u = torch.rand(1, generator=self._generator(p, pos + j, _ACCEPT_SALT)).item()
            pd = float(probs[j, d]) if 0 <= d < probs.shape[-1] else 0.0
            if u < pd:
                out.append(int(d))
                continue
            rest = probs[j].clone()
            if 0 <= d < rest.shape[-1]:
                rest[d] = 0.0
            if float(rest.sum()) <= 0.0:  # p was all on d (u == p(d) == 1.0 cannot happen)
                out.append(int(d))
                continue
            out.append(draw(rest, self._generator(p, pos + j)))
            return out
        out.append(draw(probs[len(drafts)], self._generator(p, pos + len(drafts))))
        return out

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, r: SampleRow) -> None:
        p = r.params
        if p.repetition_penalty != 1.0 and r.token_ids:
            ids = torch.tensor(sorted(set(r.token_ids)), device=logits.device)
            sel = logits[ids]
            logits[ids] = torch.where(
                sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and r.num_outputs > 0:
            outs = torch.tensor(list(r.token_ids[r.num_prompt_tokens :]), device=logits.device)
            counts = torch.bincount(outs, minlength=logits.numel())[: logits.numel()].float()
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
