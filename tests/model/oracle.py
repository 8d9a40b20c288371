"""The checks every model family's test runs against transformers (the oracle), in one place:
a tiny random checkpoint saved with ``save_pretrained`` (`build_hf`, `pair_fixture`), then
Strata's logits (`assert_logits_match`), float64 chunked prefill (`assert_chunked_fp64`), 32
greedy tokens (`assert_greedy_identical`), a batch of prompts of different lengths decoded
together (`assert_batch_matches`), bf16 / float16 logits (`assert_low_precision_close`,
`assert_as_close_as_transformers`), a prompt past a sliding window (`assert_window_caps`), two
gloo ranks (`spawn_two_ranks`, `assert_ranks_match`, `assert_tp_matches_unsharded`) and the
acceptance checkpoints (`assert_acceptance_checkpoint`). The family test files keep their cases
and what is theirs alone."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shared.model.loader import load_model
from shared.model.validate import validate_checkpoint
from tests.model.paged_driver import PagedDriver
from tests.model.test_text_models import VOCAB, _prompt, hf_greedy
from tests.ranks import spawn_ranks


def build_hf(
    cls: str,
    path: Path,
    moved_bias: str = ".bias",
    adjust: Callable[[str, torch.Tensor], object] | None = None,
    **kw,
):
    """transformers' ``<cls>ForCausalLM`` from ``<cls>Config`` (2 layers, hidden 64, 4 heads,
    the test vocabulary; ``kw`` overrides), seeded, its norms and biases (parameters named
    ``*<moved_bias>``) moved off their initial (1, 0) so a dropped one shows, then
    ``adjust(name, parameter)`` for each parameter where given, saved to ``path``."""
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
            if "norm" in n or n.endswith(moved_bias):
                p.add_(torch.randn_like(p) * 0.3)
            if adjust is not None:
                adjust(n, p)
    hf.save_pretrained(path)
    return hf


def pair_fixture(build: Callable, names: Iterable[str]):
    """A module-scoped fixture ``pair``, one param per name: ``(hf, Strata's loaded model,
    name)`` of ``build(name, path)``'s checkpoint."""

    @pytest.fixture(scope="module", params=list(names))
    def pair(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        hf = build(request.param, path)
        return hf, load_model(path), request.param

    return pair


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
    zeroed: tuple[str, ...] = (),
    one_tol: float = 1e-9,
) -> None:
    """In float64, the prompt in ``chunk``-token steps over cached context and block
    boundaries gives Strata's one-step prefill (hidden states and logits to ``one_tol``) and
    transformers' float64 logits (to ``hf_tol``: looser where transformers computes a part in
    float32 even in float64). ``head(model, hidden)``: the logits of the final hidden states
    (default ``lm_head``). ``zeroed``: name endings of parameters (routers) zeroed in both
    models first. transformers' experts run eager (its grouped GEMM takes no float64)."""
    ids = _prompt(n)
    cfg = copy.deepcopy(hf.config)
    cfg._experts_implementation = "eager"
    hf64 = type(hf)(cfg).double().eval()
    state = hf.state_dict()
    hf64.load_state_dict(
        {k: torch.zeros_like(w) if k.endswith(zeroed) else w for k, w in state.items()}
    )
    with torch.no_grad():
        ref = hf64(torch.tensor([ids])).logits[0]
    m64 = load_model(path, dtype=torch.float64).model
    with torch.no_grad():
        for key, p in m64.named_parameters():
            if key.endswith(zeroed):
                p.zero_()
    logits = head or (lambda m, h: m.lm_head(h))
    drv = PagedDriver(m64, block_size=block_size)
    seq = drv.new_seq()
    hidden = torch.cat([drv.step([(seq, ids[s : s + chunk])])[0] for s in range(0, n, chunk)])
    one = PagedDriver(m64, block_size=block_size)
    whole = one.step([(one.new_seq(), ids)])[0]
    with torch.no_grad():
        got, got_whole = logits(m64, hidden), logits(m64, whole)
    assert (hidden - whole).abs().max().item() < one_tol
    assert (got - got_whole).abs().max().item() < one_tol
    assert (got - ref).abs().max().item() < hf_tol


def assert_greedy_identical(hf, model, n: int = 32) -> None:
    """``n`` greedy tokens of a 9-token prompt, paged at 4 and at 16 with 4-token prefill
    chunks, are transformers'."""
    ids = _prompt(9, seed=3)
    ref = hf_greedy(hf, ids, n)
    assert PagedDriver(model, block_size=4).greedy(ids, n) == ref
    assert PagedDriver(model, block_size=16).greedy(ids, n, chunk=4) == ref


def close_logits(got, ref, tol: float = 1e-4) -> bool:
    """float32 logits equal to ``tol`` of their scale: ``tol`` absolute for logits within +-1,
    relative above. Summation order differs with the GEMM a CPU runs (AVX2 boxes measured up to
    1.4e-4 absolute on logits of magnitude 10, 1.4e-5 of it); a wrong kernel is off by far more."""
    return (got - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def assert_batch_matches(hf, model, n: int = 32, tol: float = 1e-4) -> None:
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for
    ``n`` greedy tokens: each prompt's last logits and tokens are transformers' for that prompt
    alone (`close_logits`)."""
    prompts = [_prompt(5, seed=4), _prompt(11, seed=5), _prompt(16, seed=6)]
    drv = PagedDriver(model, block_size=4)
    seqs = [drv.new_seq() for _ in prompts]
    _, logits = drv.step(list(zip(seqs, prompts, strict=True)))
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert close_logits(logits[row], ref, tol), row
    toks = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(n - 1):
        _, logits = drv.step([(s, [t[-1]]) for s, t in zip(seqs, toks, strict=True)])
        for t, nxt in zip(toks, logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    assert toks == [hf_greedy(hf, ids, n) for ids in prompts]


def low_precision_logits(hf, path: Path, dtype=torch.bfloat16, n: int = 20):
    """Strata loaded in ``dtype`` (its cache in ``dtype`` too) on an ``n``-token prompt, paged
    at 4 in 6-token chunks: ``(ids, its logits, transformers' float32 logits)``."""
    low = load_model(path, dtype=dtype)
    ids = _prompt(n)
    drv = PagedDriver(low.model, block_size=4)
    got = drv.prefill(drv.new_seq(), ids, chunk=6)
    assert drv.cache.k.dtype == dtype
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    return ids, got, ref


def assert_low_precision_close(hf, path: Path, dtype=torch.bfloat16, tol: float = 0.1) -> None:
    """In ``dtype`` the logits within ``tol`` of float32's, relative to the largest logit."""
    _, got, ref = low_precision_logits(hf, path, dtype)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < tol


def assert_as_close_as_transformers(hf, path: Path, dtype=torch.bfloat16) -> None:
    """In ``dtype`` the logits are as close to float32's as transformers' own in that dtype
    (1.5x its error, plus 1% of the largest logit)."""
    ids, got, ref = low_precision_logits(hf, path, dtype)
    hf_low = type(hf)(hf.config).to(dtype).eval()
    hf_low.load_state_dict(hf.state_dict())
    with torch.no_grad():
        own = hf_low(torch.tensor([ids])).logits[0].float()
    scale = ref.abs().max()
    err, hf_err = ((got - ref).abs().max() / scale).item(), ((own - ref).abs().max() / scale).item()
    assert err < 1.5 * hf_err + 0.01


def assert_window_caps(hf, ours, window: int, n: int = 80) -> None:
    """The served context is the sliding window; on an ``n``-token prompt Strata's logits are
    transformers' up to the window, and transformers' windowed logits differ from full
    attention's past it (why the context is capped there)."""
    assert ours.config.max_model_len == window < ours.config.max_position_embeddings
    ids = _prompt(n)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    drv = PagedDriver(ours.model, block_size=4)
    got = drv.prefill(drv.new_seq(), ids)
    assert (got[:window] - ref[:window]).abs().max().item() < 1e-4
    assert (got[window:] - ref[window:]).abs().max().item() > 1e-2


# -- two gloo ranks ------------------------------------------------------------------------------


def _two_ranks_main(rank, port, work, out, args):
    from tests.model.test_tensor_parallel import quit_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(work(rank, *args), f"{out}/{rank}.pt")
        dist.barrier()  # no rank tears the group down while the other is in a collective
    finally:
        dist.destroy_process_group()
    quit_rank()


def spawn_two_ranks(work: Callable, out: Path, *args) -> tuple[dict, dict]:
    """``work(rank, *args)`` (a module-level function returning a dict) on each of two gloo
    ranks of one spawn, one thread each: rank 0's and rank 1's dicts, saved under ``out``."""
    from tests.model.test_tensor_parallel import _free_port

    spawn_ranks(_two_ranks_main, (_free_port(), work, str(out), args))
    return tuple(torch.load(Path(out) / f"{r}.pt") for r in (0, 1))


def assert_ranks_match(r0: dict, r1: dict, ref_logits, ref_toks, what=None) -> None:
    """Rank 0's logits within 1e-4 of the unsharded model's (`close_logits`), both ranks'
    greedy tokens its."""
    assert close_logits(r0["logits"], ref_logits), what
    assert r0["toks"] == ref_toks and r1["toks"] == ref_toks, what


def _tp_work(rank, paths):
    """Each checkpoint of ``paths`` sharded over heads and MLP columns (``--tp 2``) and run
    (`_run`): the layers run op by op, saying why."""
    from shared.model.parallel import TPGroup, shard_model
    from tests.model.test_tensor_parallel import _run

    results = {}
    for i, path in enumerate(paths):
        model = shard_model(load_model(path, dtype=torch.float32).model, TPGroup(rank, 2))
        logits, toks, _ = _run(model)
        layer = model.model.layers[0]
        assert layer.native() is None and "tensor parallel" in layer.native_reason
        q = tuple(layer.self_attn.q_proj.weight.shape)
        results[i] = dict(logits=logits, toks=toks, q=q)
    return results


def assert_tp_matches_unsharded(paths: Iterable[Path], out: Path) -> None:
    """Every checkpoint of ``paths`` over two gloo ranks in one spawn (``--tp 2``): the same
    logits and greedy tokens as unsharded, each rank half of the query heads."""
    from tests.model.test_tensor_parallel import _run

    paths = [str(p) for p in paths]
    r0, r1 = spawn_two_ranks(_tp_work, out, paths)
    for i, path in enumerate(paths):
        ours = load_model(path)
        ref_logits, ref_toks, _ = _run(ours.model)
        assert_ranks_match(r0[i], r1[i], ref_logits, ref_toks, path)
        c = ours.config
        assert r0[i]["q"] == (c.num_heads // 2 * c.head_dim, c.hidden_size), path


def assert_acceptance_checkpoint(kind: str, path: Path, architecture: str) -> None:
    """`tests.acceptance.checkpoints.build_text` (the real tokenizer, its 4096 ids): the light
    check accepts the directory, and Strata's greedy tokens are transformers'."""
    from tests.acceptance.checkpoints import build_text

    ck = build_text(kind, path)
    assert validate_checkpoint(ck.path).architecture == architecture
    ids = ck.tokenizer("def tiers(kv_cache):")["input_ids"]
    ours = load_model(ck.path)
    assert PagedDriver(ours.model, block_size=4).greedy(ids, 12) == hf_greedy(ck.model, ids, 12)
