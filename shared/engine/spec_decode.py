"""Speculative decoding: draft proposers and exact verification.

A proposer suggests the next few tokens of each running sequence; the target model scores the
last real token plus the drafts in one forward (``k + 1`` rows of logits) and the engine keeps a
prefix of the drafts plus one token of its own:

- greedy requests keep the longest prefix of drafts that equals the target's argmax, then the
  target's argmax (`verify_greedy`): the output is exactly the plain greedy output;
- sampled requests use rejection sampling (`Sampler.verify`): drafts here are deterministic
  (the draft model's argmax, or an n-gram continuation), so the draft distribution q is one-hot
  and draft ``d`` is accepted with probability ``min(1, p(d) / q(d)) = p(d)``; on rejection the
  token is drawn from ``p`` with ``d`` removed and renormalised, ``(p - q)+``. Each emitted
  token is therefore distributed exactly as ``p``, the target's filtered distribution
  (temperature, top-k, top-p, min-p), whatever the drafts are;
- structured requests: drafts are cut at the first token the grammar refuses
  (`Constraint.valid_prefix`), and each of the ``k + 1`` rows is verified under the grammar's
  bitmask at its position, so a draft never leads the output outside the grammar.

Proposers:

- `NgramProposer`: prompt lookup, no model;
- `DraftModelProposer`: a small checkpoint with the target's vocabulary, run greedily for ``k``
  steps over all proposing sequences at once. It keeps its own paged KV cache and block
  allocator, and per sequence how many leading tokens have draft KV; before proposing it
  computes the rest (the tokens accepted last step, or a whole context that arrived by a prefix
  hit, a PD hand-off, a pool load or a swap-in, which hold the target's KV only), so its state
  never depends on how the target got its KV.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.engine.model_runner import PreparedBatch
from shared.engine.sequence import Sequence
from shared.model.api import AttentionMetadata
from shared.model.errors import CheckpointError


class Proposer(Protocol):
    """Suggests draft tokens to follow ``seq.token_ids`` (may return an empty list).
    A proposer may also define ``propose_batch(seqs) -> list[list[int]]`` (one call per step
    for every proposing sequence), which the engine prefers."""

    def propose(self, seq: Sequence) -> list[int]: ...


def propose_all(proposer, seqs: list[Sequence]) -> list[list[int]]:
    """Drafts for each of ``seqs`` (one batched call when the proposer has one)."""
    batch = getattr(proposer, "propose_batch", None)
    if batch is not None:
        return batch(seqs)
    return [proposer.propose(s) for s in seqs]


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix n-gram and
    propose the tokens that followed it."""

    def __init__(self, num_tokens: int, ngram_min: int = 1, ngram_max: int = 4):
        self.k = num_tokens
        self.nmin = ngram_min
        self.nmax = ngram_max

    def propose(self, seq: Sequence) -> list[int]:
        return ngram_lookup(seq.token_ids, self.k, self.nmin, self.nmax)


def ngram_lookup(tokens: Seq[int], k: int, nmin: int, nmax: int) -> list[int]:
    t = list(tokens)
    n_tok = len(t)
    for n in range(min(nmax, n_tok - 1), nmin - 1, -1):
        suffix = t[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):  # latest match first
            if t[start : start + n] == suffix:
                follow = t[start + n : start + n + k]
                if follow:
                    return follow
    return []


def eligible(seq: Sequence) -> bool:
    """Whether ``seq`` may get drafts this step. Greedy, sampled and structured requests may;
    not those whose logits depend on the tokens before them in ways a row of the verify batch
    does not see (penalties, bad words, min_tokens still pending), nor those that want
    logprobs (reported per sampled token) or splice image embeddings (the draft model is text
    only)."""
    p = seq.params
    return (
        p.speculation
        and p.logprobs is None
        and not p.masked
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and seq.num_output_tokens >= p.min_tokens
        and not seq.mm_inputs
    )


def verify_greedy(drafts: Seq[int], target: Seq[int]) -> list[int]:
    """``target[j]`` is the model's greedy token after draft ``j-1`` (``len(drafts) + 1`` of them).
    Returns accepted drafts followed by the bonus token."""
    out: list[int] = []
    for d, t in zip(drafts, target, strict=False):
        out.append(t)
        if d != t:
            return out
    out.append(target[len(drafts)])
    return out


class DraftBackoff:
    """Pauses a sequence's speculation while its drafts are not being accepted.

    A step with drafts costs more than a plain one (the verify rows, the draft model's
    forwards), so drafts that are refused only slow a stream down. Per sequence, the share of
    its drafts accepted is followed as an exponential moving average (weight ``alpha`` per
    verify step, starting at 1); when it falls under ``min_acceptance`` the sequence proposes
    nothing for a pause of 2 steps, doubled on each further miss up to ``max_pause``, then
    probes again (the average restarts at the threshold, so one good step resumes drafting and
    resets the pause). ``min_acceptance`` 0 never pauses. Output is unchanged either way
    (greedy output is exact, sampled output keeps its distribution)."""

    def __init__(self, min_acceptance: float, alpha: float = 0.5, max_pause: int = 64):
        self.min, self.alpha, self.max_pause = min_acceptance, alpha, max_pause
        self.paused_steps = 0  # sequence-steps without drafts because of a pause

    def allows(self, seq: Sequence) -> bool:
        """Whether ``seq`` may propose this step (a paused one counts a step of its pause)."""
        if seq.spec_pause > 0:
            seq.spec_pause -= 1
            self.paused_steps += 1
            return False
        return True

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verify step of ``seq`` kept ``accepted`` of its ``drafted`` drafts."""
        if drafted <= 0 or self.min <= 0:
            return
        seq.spec_rate += self.alpha * (accepted / drafted - seq.spec_rate)
        if seq.spec_rate < self.min:
            seq.spec_backoff = min(self.max_pause, max(2, 2 * seq.spec_backoff))
            seq.spec_pause = seq.spec_backoff
            seq.spec_rate = self.min
        else:
            seq.spec_backoff = 0


# ----- draft model ---------------------------------------------------------------------------


@dataclass(eq=False)
class _DraftState:
    """A sequence's draft KV: its blocks in the draft cache, and how many leading tokens of
    ``seq.token_ids`` have their K/V written there (positions past it may hold stale drafts)."""

    seq: Sequence
    blocks: list[int]
    computed: int = 0
    last_used: int = 0


@dataclass
class DraftStats:
    forwards: int = 0  # draft model forwards
    catch_up_tokens: int = 0  # context tokens the draft computed before proposing
    proposed: int = 0  # draft tokens proposed
    no_room: int = 0  # proposals skipped: the draft cache had no free block


class DraftModelProposer:
    """Greedy drafts from a small model of the same vocabulary (see the module docstring).

    ``runner`` is a `ModelRunner` over the draft model whose KV cache has ``num_blocks`` blocks
    of ``block_size`` tokens; ``max_tokens_per_forward`` bounds a catch-up forward (a long
    context is computed in pieces, like a chunked prefill); ``vocab_size`` is the target's:
    draft logits past it are ignored.
    """

    def __init__(self, runner, num_tokens: int, vocab_size: int, max_tokens_per_forward: int):
        self.runner = runner
        self.k = num_tokens
        self.vocab_size = vocab_size
        self.chunk = max(1, max_tokens_per_forward)
        self.bs = runner.block_size
        self.free: list[int] = list(range(runner.kv.k.shape[1] - 1, -1, -1))
        self.states: dict[int, _DraftState] = {}  # id(seq) -> state
        self.stats = DraftStats()
        self._tick = 0

    # ----- blocks ------------------------------------------------------------------------------
    def _gc(self) -> None:
        for key, st in list(self.states.items()):
            if st.seq.is_finished:
                self._drop(key)

    def _drop(self, key: int) -> None:
        st = self.states.pop(key)
        self.free.extend(reversed(st.blocks))

    def _room(self, st: _DraftState, tokens: int, busy: set[int]) -> bool:
        """Blocks for ``tokens`` positions of ``st``; evicts idle sequences' draft KV (least
        recently used first) when the free list runs short."""
        need = -(-tokens // self.bs) - len(st.blocks)
        if need <= 0:
            return True
        if need > len(self.free):
            idle = sorted(
                (s for k, s in self.states.items() if k not in busy), key=lambda s: s.last_used
            )
            for s in idle:
                if need <= len(self.free):
                    break
                self._drop(id(s.seq))
        if need > len(self.free):
            return False
        st.blocks += [self.free.pop() for _ in range(need)]
        return True

    # ----- proposing -------------------------------------------------------------------------
    def propose(self, seq: Sequence) -> list[int]:
        return self.propose_batch([seq])[0]

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence]) -> list[list[int]]:
        self._gc()
        self._tick += 1
        busy = {id(s) for s in seqs}
        live: list[_DraftState] = []
        for s in seqs:
            st = self.states.get(id(s))
            if st is None:
                st = self.states[id(s)] = _DraftState(s, [])
            st.last_used = self._tick
            # positions written: the context, then drafts 1..k-1
            if self._room(st, s.num_tokens + self.k - 1, busy):
                live.append(st)
            else:
                self.stats.no_room += 1
                self._drop(id(s))
        drafts: dict[int, list[int]] = {id(st.seq): [] for st in live}
        # 1. catch up: every token of the context without draft KV; the last one's logits
        #    give draft 1
        todo = [st for st in live if st.computed < st.seq.num_tokens]
        while todo:
            rows, budget = [], self.chunk
            for st in todo:
                if budget <= 0:
                    break
                n = min(st.seq.num_tokens - st.computed, budget)
                rows.append((st, st.computed, st.seq.token_ids[st.computed : st.computed + n]))
                budget -= n
            last = [st.computed + len(t) == st.seq.num_tokens for st, _, t in rows]
            ids = self._forward(rows, last)
            self.stats.catch_up_tokens += sum(len(t) for _, _, t in rows)
            it = iter(ids)
            for (st, _, toks), is_last in zip(rows, last, strict=True):
                st.computed += len(toks)
                if is_last:
                    drafts[id(st.seq)].append(next(it))
            todo = [st for st in todo if st.computed < st.seq.num_tokens]
        # 2. drafts 2..k, one token per sequence per forward
        for j in range(1, self.k):
            rows = [
                (st, st.seq.num_tokens + j - 1, [drafts[id(st.seq)][-1]])
                for st in live
                if len(drafts[id(st.seq)]) == j
            ]
            if not rows:
                break
            for (st, _, _), t in zip(rows, self._forward(rows, [True] * len(rows)), strict=True):
                drafts[id(st.seq)].append(t)
        out = [drafts.get(id(s), []) for s in seqs]
        self.stats.proposed += sum(len(d) for d in out)
        return out

    def _forward(self, rows: list[tuple[_DraftState, int, list[int]]], want: list[bool]):
        """One draft forward: ``rows`` are (state, first position, tokens); the argmax of the
        last row of each sequence with ``want`` set, in order."""
        bs, dev = self.bs, self.runner.device
        ids, pos, slots, qsl, ctx, qlens, last = [], [], [], [0], [], [], []
        width = max(len(st.blocks) for st, _, _ in rows)
        tables = []
        for (st, start, toks), w in zip(rows, want, strict=True):
            n = len(toks)
            ids += toks
            pos += range(start, start + n)
            slots += [st.blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
            qsl.append(qsl[-1] + n)
            ctx.append(start + n)
            qlens.append(n)
            if w:
                last.append(qsl[-1] - 1)
            tables.append(st.blocks + [0] * (width - len(st.blocks)))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=qlens,
            context_lens_list=ctx,
        )
        batch = PreparedBatch(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            None,
            torch.tensor(last, dtype=torch.long, device=dev),
            [1 if w else 0 for w in want],
        )
        logits = self.runner.execute(batch)
        self.stats.forwards += 1
        if not last:
            return []
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()


def check_draft_model(target_config, draft_config, path) -> None:
    """A draft model must share the target's vocabulary (its token ids mean the same text);
    raises `CheckpointError` naming the draft checkpoint and the mismatch."""
    tv, dv = target_config.vocab_size, draft_config.vocab_size
    if tv != dv:
        raise CheckpointError(
            f"{path}: the draft model's vocab_size is {dv}, the target's {tv} "
            "(speculative_model must use the target's tokenizer)"
        )
