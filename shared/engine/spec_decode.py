"""Speculative decoding: draft proposers and greedy verification.

A ``Proposer`` looks at a running sequence and suggests the next few tokens; the target model
scores the last real token plus the drafts in one forward and keeps the longest prefix of drafts
that equals its own greedy choice, plus one bonus token. The output is therefore exactly the
plain greedy output. Only greedy requests without penalties, logprobs, min_tokens or a structured
output constraint get drafts.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from shared.engine.sequence import Sequence


class Proposer(Protocol):
    """Suggests draft tokens to follow ``seq.token_ids`` (may return an empty list)."""

    def propose(self, seq: Sequence) -> list[int]: ...


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
    p = seq.params
    return (
        p.greedy
        and p.speculation
        and p.structured is None  # drafts are not checked against a grammar: no speculation
        and p.logprobs is None
        and not p.masked  # drafts are verified against the unmasked argmax
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and seq.num_output_tokens >= p.min_tokens
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
