"""Strata's Qwen3-MoE, Qwen2-MoE and Mixtral against transformers on random tiny checkpoints.

Each case routes differently: Qwen3-MoE without and with ``norm_topk_prob`` (a dense layer from
``mlp_only_layers``, resp. ``decoder_sparse_step``), Qwen2-MoE (renormalised, a gated shared
expert beside the routed ones, qkv bias), Mixtral (always renormalised, every layer sparse). The grouped expert forward is proven by its counters: every (token, slot) pair lands
on exactly one expert's rows and two GEMMs run per active expert.
"""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model import moe
from shared.model.loader import CheckpointError, load_model
from tests.model.oracle import close_logits
from tests.model.paged_driver import PagedDriver

transformers = pytest.importorskip("transformers")

VOCAB = 4096
CASES = {
    # 8 experts, top-2, raw top-k probabilities, layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(
        cls="Qwen3Moe",
        kw=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            head_dim=16,
        ),
        moe_layers=(0,),
    ),
    # 6 experts, top-3, renormalised; decoder_sparse_step 2 makes layer 0 dense, layer 1 sparse
    "qwen3_moe_norm": dict(
        cls="Qwen3Moe",
        kw=dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            head_dim=16,
        ),
        moe_layers=(1,),
    ),
    # Qwen2-MoE: 8 experts, top-2, renormalised, a shared expert (width 40) gated by a sigmoid,
    # qkv bias; decoder_sparse_step 2 makes layer 0 dense (intermediate_size), layer 1 sparse
    "qwen2_moe": dict(
        cls="Qwen2Moe",
        kw=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
        moe_layers=(1,),
    ),
    # Mixtral: 8 experts, top-2, always renormalised, every layer sparse
    "mixtral": dict(
        cls="Mixtral",
        kw=dict(num_local_experts=8, num_experts_per_tok=2),
        moe_layers=(0, 1),
    ),
}


def _build(name, path):
    case = CASES[name]
    cfg = getattr(transformers, case["cls"] + "Config")(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,
        max_position_embeddings=256,
        **case["kw"],
    )
    torch.manual_seed(0)
    hf = getattr(transformers, case["cls"] + "ForCausalLM")(cfg).eval()
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _build(request.param, path)
    return hf, load_model(path), request.param


def _prompt(n, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf, ids, n):
    out, past, inp = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = hf(inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            inp = torch.tensor([[out[-1]]])
    return out


def _routed_rows(layers) -> float:
    return sum(
        moe.EXPERT_TOKENS.labels(str(i), str(e))._value.get() for i in layers for e in range(8)
    )


def test_config_follows_the_checkpoint(pair):
    hf, ours, name = pair
    c, case = ours.config, CASES[name]
    assert c.moe_layers == case["moe_layers"]
    assert c.num_experts == getattr(hf.config, "num_local_experts", hf.config.num_experts)
    assert c.num_experts_per_tok == hf.config.num_experts_per_tok
    assert c.norm_topk_prob == (name != "qwen3_moe")
    want = hf.config.intermediate_size if name == "mixtral" else hf.config.moe_intermediate_size
    assert c.moe_intermediate_size == want
    shared = 40 if name == "qwen2_moe" else 0
    assert c.shared_expert_intermediate_size == shared
    assert c.attention_bias == (name == "qwen2_moe") and not c.o_proj_bias
    for i, layer in enumerate(ours.model.model.layers):
        assert isinstance(layer.mlp, moe.SparseMoE) == (i in case["moe_layers"])
        if i in case["moe_layers"]:  # Qwen2-MoE's shared expert and its one-output gate
            assert (layer.mlp.shared_expert is not None) == bool(shared)
            assert shared == (shared and layer.mlp.shared_expert.up_proj.out_features)
        else:
            assert layer.mlp.up_proj.out_features == 96
        # MoE layers say why they leave the one-call native layer; the model runs op by op
        assert (layer.native() is None) == (i in case["moe_layers"])
        assert (layer.native_reason is not None) == (i in case["moe_layers"])


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match_and_the_grouped_path_ran(pair, block_size):
    hf, ours, name = pair
    ids = _prompt(41)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    layers, k = CASES[name]["moe_layers"], ours.config.num_experts_per_tok
    gemms, rows = moe.EXPERT_GEMMS._value.get(), _routed_rows(layers)
    drv = PagedDriver(ours.model, block_size=block_size)
    got = drv.prefill(drv.new_seq(), ids)
    assert close_logits(got, ref)
    # every (token, slot) pair went to one expert's group; <= 2 GEMMs per expert per layer
    assert _routed_rows(layers) - rows == len(ids) * k * len(layers)
    ran = moe.EXPERT_GEMMS._value.get() - gemms
    assert 2 * len(layers) * 2 <= ran <= 2 * len(layers) * ours.config.num_experts
    # the whole model ran op by op (layer.c has no router), each MoE layer saying why
    assert all(ours.model.model.layers[i].native_reason for i in layers)


@pytest.mark.parametrize("block_size,chunk", [(4, 3), (16, 7)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """In float64 (transformers' experts op by op: its grouped GEMM takes no float64) routing,
    shared expert and chunking leave nothing but float64 rounding."""
    hf, ours, _ = pair
    ids = _prompt(41)
    cfg = copy.deepcopy(hf.config)
    cfg._experts_implementation = "eager"
    hf64 = type(hf)(cfg).double().eval()
    hf64.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ref = hf64(torch.tensor([ids])).logits[0]
    m64 = load_model(ours.path, dtype=torch.float64).model
    drv = PagedDriver(m64, block_size=block_size)
    seq = drv.new_seq()
    hidden = torch.cat([drv.step([(seq, ids[s : s + chunk])])[0] for s in range(0, 41, chunk)])
    assert (m64.lm_head(hidden) - ref).abs().max().item() < 1e-9


@pytest.mark.parametrize("block_size,chunk", [(4, 3), (16, 7)])
def test_chunked_prefill_fp32(pair, block_size, chunk):
    hf, ours, _ = pair
    ids = _prompt(41)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    drv = PagedDriver(ours.model, block_size=block_size)
    got = drv.prefill(drv.new_seq(), ids, chunk=chunk)
    assert (got - ref).abs().max().item() < 5e-4


def test_greedy_tokens_identical(pair):
    hf, ours, _ = pair
    for seed in (3, 4):
        ids = _prompt(9, seed=seed)
        ref = _hf_greedy(hf, ids, 24)
        assert PagedDriver(ours.model, block_size=4).greedy(ids, 24) == ref
        assert PagedDriver(ours.model, block_size=16).greedy(ids, 24, chunk=4) == ref


def test_mixed_batch_matches_single_sequences(pair):
    """Routing is per token: a fresh prefill, a chunk over cached context and two decodes in
    one step give each sequence its solo logits."""
    _, ours, _ = pair
    drv = PagedDriver(ours.model, block_size=4)
    a, b, c, d = (drv.new_seq() for _ in range(4))
    pa, pb, pc, pd = _prompt(10, 1), _prompt(13, 2), _prompt(6, 3), _prompt(5, 4)
    drv.prefill(b, pb[:8])
    drv.prefill(c, pc)
    drv.prefill(d, pd)
    _, logits = drv.step([(a, pa), (b, pb[8:]), (c, [7]), (d, [9])])
    for toks, row in [(pa, 0), (pb, 1), (pc + [7], 2), (pd + [9], 3)]:
        solo = PagedDriver(ours.model, block_size=16)
        assert (logits[row] - solo.prefill(solo.new_seq(), toks)[-1]).abs().max() < 1e-4


def test_fused_expert_layout_loads_too(pair, tmp_path):
    """transformers 5.x holds experts fused (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]); a checkpoint written in that layout loads the same."""
    hf, ours, name = pair
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ours.path / "config.json").read_text())
    fused = load_model(tmp_path).model
    for (n, p), (_, q) in zip(ours.model.named_parameters(), fused.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_missing_expert_tensor_is_one_clear_error(pair, tmp_path):
    _, ours, name = pair
    state = load_file(str(ours.path / "model.safetensors"))
    gone = next(k for k in state if ".experts.3." in k and "down" in k or k.endswith(".w2.weight"))
    del state[gone]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ours.path / "config.json").read_text())
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and "missing tensor" in msg and ".experts." in msg and "down_proj" in msg


def test_int8_leaves_the_router_and_experts_in_full_precision(pair):
    from shared.engine.quant import Int8Linear, quantize_model_

    _, ours, name = pair
    model = load_model(ours.path).model
    n = quantize_model_(model)
    sparse, shared = CASES[name]["moe_layers"], name == "qwen2_moe"
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.self_attn.q_proj, Int8Linear)
        if i in sparse:
            assert type(layer.mlp.gate) is torch.nn.Linear
            if shared:  # the shared expert is int8, its sigmoid gate is not
                assert isinstance(layer.mlp.shared_expert.down_proj, Int8Linear)
                assert type(layer.mlp.shared_expert_gate) is torch.nn.Linear
        else:
            assert isinstance(layer.mlp.gate_proj, Int8Linear)
    layers = model.config.num_layers
    assert n == 4 * layers + 3 * (layers - len(sparse)) + 3 * len(sparse) * shared
    # it still runs; how close it stays is not asserted: with std-0.5 random weights int8's
    # ~1% error upstream of a router flips experts for some tokens
    drv = PagedDriver(model, block_size=4)
    assert torch.isfinite(drv.prefill(drv.new_seq(), _prompt(20))).all()


def test_bf16_as_close_to_fp32_as_transformers_bf16(pair):
    """In bf16 a router near a tie picks another expert for some tokens, in transformers too
    (its own bf16 logits are up to ~0.7 of the logit scale off fp32 on these weights): ours
    must be no further from fp32 than transformers' bf16 is."""
    hf, ours, _ = pair
    low = load_model(ours.path, dtype=torch.bfloat16)
    hf16 = type(hf)(hf.config).to(torch.bfloat16).eval()
    hf16.load_state_dict(hf.state_dict())
    ids = _prompt(20)
    drv = PagedDriver(low.model, block_size=4)
    got = drv.prefill(drv.new_seq(), ids, chunk=6)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        theirs = hf16(torch.tensor([ids])).logits[0].float()
    assert drv.cache.k.dtype == torch.bfloat16
    scale = ref.abs().max()
    err, their_err = ((got - ref).abs().max() / scale), ((theirs - ref).abs().max() / scale)
    assert err.item() <= 1.25 * their_err.item() + 0.05


def test_expert_series_exist_only_for_experts_that_got_rows():
    """A MoE model built and never run (sized on the meta device, as the DeepSeek-V3 test
    does with its 61 x 256 experts) adds no `strata_moe_expert_tokens_total` series: each is
    made when its expert first gets rows. Thousands of idle series would be in every scrape,
    and every registry read (``get_sample_value``) walks them all."""
    from shared.model.config import config_from_dict
    from shared.model.models import model_class

    kw = dict(CASES["qwen3_moe"]["kw"], num_experts=64, mlp_only_layers=[])
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        **kw,
    )
    mc = config_from_dict(cfg.to_dict())
    before = len(moe.EXPERT_TOKENS._metrics)
    with torch.device("meta"):
        model = model_class(mc)(mc)
    assert len(moe.EXPERT_TOKENS._metrics) == before
    sparse = [m for m in model.modules() if isinstance(m, moe.SparseMoE)][-1]  # layer 5
    sparse._counters.inc(63, 3)  # a (layer, expert) no other test's model has
    assert len(moe.EXPERT_TOKENS._metrics) == before + 1
    assert moe.EXPERT_TOKENS.labels("5", "63")._value.get() >= 3
