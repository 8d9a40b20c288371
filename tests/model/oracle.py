"""The checks every model family's test runs against transformers (the oracle), in one place:
a tiny random checkpoint saved with ``save_pretrained`` (`build_hf`), then Strata's logits
(`assert_logits_match`), float64 chunked prefill (`assert_chunked_fp64`), 32 greedy tokens
(`assert_greedy_identical`) and a batch of prompts of different lengths decoded together
(`assert_batch_matches`). The family test files keep their cases and what is theirs alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from shared.model.loader import load_model
from tests.model.paged_driver import PagedDriver
from tests.model.test_text_models import VOCAB, _prompt, hf_greedy


def build_hf(cls: str, path: Path, **kw):
    """transformers' ``<cls>ForCausalLM`` from ``<cls>Config`` (2 layers, hidden 64, 4 heads,
    the test vocabulary; ``kw`` overrides), seeded, its norms and biases moved off their
    initial (1, 0) so a dropped one shows, saved to ``path``."""
    import transformers

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.5,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg = getattr(transformers, cls + "Config")(**{**base, **kw})
    torch.manual_seed(0)
    hf = getattr(transformers, cls + "ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    return hf


def assert_logits_match(hf, model, block_size: int, n: int = 41, tol: float = 1e-4) -> None:
    """An ``n``-token prompt's float32 logits, paged at ``block_size``, within ``tol``."""
    ids = _prompt(n)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    drv = PagedDriver(model, block_size=block_size)
    got = drv.prefill(drv.new_seq(), ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < tol


def assert_chunked_fp64(
    hf,
    path: Path,
    block_size: int,
    chunk: int,
    hf_tol: float = 1e-9,
    head: Callable | None = None,
    n: int = 41,
) -> None:
    """In float64, the prompt in ``chunk``-token steps over cached context and block
    boundaries gives Strata's one-step prefill (to 1e-9) and transformers' float64 logits (to
    ``hf_tol``: looser where transformers computes a part in float32 even in float64).
    ``head(model, hidden)``: the logits of the final hidden states (default ``lm_head``)."""
    ids = _prompt(n)
    hf64 = type(hf)(hf.config).double().eval()
    hf64.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ref = hf64(torch.tensor([ids])).logits[0]
    m64 = load_model(path, dtype=torch.float64).model
    logits = head or (lambda m, h: m.lm_head(h))
    drv = PagedDriver(m64, block_size=block_size)
    seq = drv.new_seq()
    hidden = torch.cat([drv.step([(seq, ids[s : s + chunk])])[0] for s in range(0, n, chunk)])
    one = PagedDriver(m64, block_size=block_size)
    assert (hidden - one.step([(one.new_seq(), ids)])[0]).abs().max().item() < 1e-9
    assert (logits(m64, hidden) - ref).abs().max().item() < hf_tol


def assert_greedy_identical(hf, model, n: int = 32) -> None:
    """``n`` greedy tokens of a 9-token prompt, paged at 4 and at 16 with 4-token prefill
    chunks, are transformers'."""
    ids = _prompt(9, seed=3)
    ref = hf_greedy(hf, ids, n)
    assert PagedDriver(model, block_size=4).greedy(ids, n) == ref
    assert PagedDriver(model, block_size=16).greedy(ids, n, chunk=4) == ref


def assert_batch_matches(hf, model, n: int = 32, tol: float = 1e-4) -> None:
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for
    ``n`` greedy tokens: each prompt's last logits and tokens are transformers' for that prompt
    alone."""
    prompts = [_prompt(5, seed=4), _prompt(11, seed=5), _prompt(16, seed=6)]
    drv = PagedDriver(model, block_size=4)
    seqs = [drv.new_seq() for _ in prompts]
    _, logits = drv.step(list(zip(seqs, prompts, strict=True)))
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert (logits[row] - ref).abs().max().item() < tol, row
    toks = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(n - 1):
        _, logits = drv.step([(s, [t[-1]]) for s, t in zip(seqs, toks, strict=True)])
        for t, nxt in zip(toks, logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    assert toks == [hf_greedy(hf, ids, n) for ids in prompts]
