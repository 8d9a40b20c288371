"""DeepSeek-V3 and DeepSeek-V2: config parsing (transformers' defaults, 4.x and 5.x keys, one
clear line for what Strata cannot serve), the routers against transformers' own, and Strata
against transformers 5.x on random tiny checkpoints saved with ``save_pretrained``: logits, 32
greedy tokens, batches of prompts of different lengths, chunked prefill in float64, two ranks
(heads and the dense MLP over tensor parallelism, the experts over expert parallelism). The
paged cache holds the latent (one KV head of ``kv_lora_rank + qk_rope_head_dim``, K and V one
tensor) with ``kv_b_proj`` absorbed into q and the output; it flows through the engine's
prefix cache and the prefill -> decode KV hand-off."""

from __future__ import annotations

import pytest
import torch

from shared.engine.model_runner import ModelRunner
from shared.model.api import KVCache
from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.model.parallel import check_shardable, kv_heads_split
from shared.model.validate import validate_checkpoint
from tests.model.oracle import (
    assert_acceptance_checkpoint,
    assert_batch_matches,
    assert_chunked_fp64,
    assert_greedy_identical,
    assert_logits_match,
    assert_ranks_match,
    build_hf,
    low_precision_logits,
    pair_fixture,
    spawn_two_ranks,
)
from tests.model.paged_driver import PagedDriver
from tests.model.test_family_configs import _checkpoint
from tests.model.test_text_models import _prompt, hf_greedy

transformers = pytest.importorskip("transformers")

NEW = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
YARN_M = {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7}


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


# -- config parsing ----------------------------------------------------------------------------


def test_v3_defaults_are_transformers():
    c = config_from_dict(_cfg("deepseek_v3"))
    t = transformers.DeepseekV3Config()
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (t.vocab_size, 7168, 61)
    assert c.num_heads == 128 and c.num_kv_heads == 1 and c.head_dim == 576  # the latent
    m = c.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim) == (1536, 512, 128)
    assert (m.qk_rope_head_dim, m.v_head_dim, m.rope) == (64, 128, "interleave")
    assert m.scale == 192**-0.5 and m.attention_factor == 1.0 and c.rope_theta == 1e4
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 8, 2048)
    assert c.moe_layers == tuple(range(3, 61)) and c.norm_topk_prob
    r = c.routing
    assert (r.scoring, r.group_score, r.n_group, r.topk_group) == ("sigmoid", "top2_sum", 8, 4)
    assert (r.scaling, r.shared_width, r.correction_bias) == (2.5, 2048, True)
    assert c.intermediate_size == 18432 and c.rms_norm_eps == 1e-6 and not c.tie_word_embeddings
    assert c.max_position_embeddings == 4096 and not (c.attention_bias or c.mlp_bias)


def test_v2_defaults_are_transformers():
    cfg = _cfg("deepseek_v2", num_experts_per_tok=6)
    c = config_from_dict(cfg)
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads) == (102400, 4096, 32, 32)
    assert c.mla.rope == "complex" and c.mla.q_lora_rank == 1536
    assert c.num_kv_heads == 1 and c.head_dim == 512 + 64  # the latent
    assert (c.num_experts, c.moe_intermediate_size, c.moe_layers) == (64, 1407, tuple(range(32)))
    r = c.routing
    assert (r.scoring, r.group_score, r.scaling, r.shared_width) == ("softmax", None, 1.0, 2814)
    assert not r.correction_bias and not c.norm_topk_prob and c.max_position_embeddings == 2048
    # transformers 5.x's V2 router never renormalises, whatever norm_topk_prob says
    assert not config_from_dict(cfg | {"norm_topk_prob": True}).norm_topk_prob
    c = config_from_dict(
        cfg | dict(topk_method="group_limited_greedy", n_group=8, topk_group=3, num_experts=16)
    )
    assert (c.routing.group_score, c.routing.n_group, c.routing.topk_group) == ("max", 8, 3)
    assert c.num_experts == 16  # V2's alias of n_routed_experts


def test_4x_and_5x_rope_spellings_agree_and_match_transformers():
    """YaRN as ``rope_scaling`` + ``rope_theta`` (4.x, ``type``) and as ``rope_parameters``
    (5.x) read the same; the softmax scale, attention factor and inverse frequencies are
    transformers'."""
    from shared.model.models.deepseek import YarnRotary

    shape = dict(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=8, qk_nope_head_dim=16)
    shape |= dict(max_position_embeddings=256, num_hidden_layers=1, first_k_dense_replace=1)
    four = _cfg(
        "deepseek_v3",
        rope_theta=5e4,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        | {"mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 16},
        **shape,
    )
    five = _cfg(
        "deepseek_v3", rope_parameters={**YARN_M, "beta_fast": 16, "rope_theta": 5e4}, **shape
    )
    a, b = config_from_dict(four), config_from_dict(five)
    assert a.mla == b.mla and a.rope_scaling == b.rope_scaling and a.rope_theta == 5e4
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in five.items() if k != "architectures"})
    attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(cfg, 0)
    rot = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(cfg)
    assert a.mla.scale == pytest.approx(attn.scaling, rel=1e-12)
    assert a.mla.attention_factor == pytest.approx(rot.attention_scaling, rel=1e-12)
    m = a.mla
    ours = YarnRotary(m.qk_rope_head_dim, a.rope_theta, a.rope_scaling, m.attention_factor, "cpu")
    assert torch.equal(ours.inv_freq, rot.inv_freq)
    # no mscale pair: the attention factor is mscale(factor); orig defaults to max positions
    yarn = {"rope_type": "yarn", "factor": 2.0}
    c = config_from_dict(_cfg("deepseek_v2", num_experts_per_tok=2, rope_parameters=yarn))
    assert c.rope_scaling["original_max_position_embeddings"] == 2048
    assert c.mla.attention_factor == pytest.approx(0.1 * 0.6931471805599453 + 1)


@pytest.mark.parametrize(
    "model_type,kw,msg",
    [
        ("deepseek_v3", dict(n_routed_experts=12, n_group=8), "n_group 8 must divide the 12"),
        ("deepseek_v3", dict(n_group=8, topk_group=9), "best 9 of 8 groups"),
        ("deepseek_v3", dict(n_routed_experts=8, n_group=8, topk_group=4), "groups of 1"),
        ("deepseek_v3", dict(num_experts_per_tok=300), "num_experts_per_tok 300 exceeds"),
        ("deepseek_v3", dict(qk_rope_head_dim=7), "qk_rope_head_dim 7 must be even"),
        ("deepseek_v3", dict(rope_scaling={"type": "yarn"}), "YaRN rope parameters without"),
        ("deepseek_v3", dict(rope_scaling={"type": "dynamic", "factor": 2}), "rope_type 'dynamic'"),
        ("deepseek_v2", dict(num_experts_per_tok=2, topk_method="noaux_tc"), "'noaux_tc' is not"),
        ("deepseek_v2", dict(), "num_experts_per_tok is not set"),
        (
            "deepseek_v2",
            dict(num_experts_per_tok=2, topk_method="group_limited_greedy"),
            "n_group None must divide",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_in_one_line(tmp_path, model_type, kw, msg):
    cfg = _cfg(model_type, **kw)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, cfg))  # torch-free, at `strata up`
    assert msg in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="config.json"):
        config_from_dict(cfg)


@pytest.mark.parametrize("model_type", list(NEW))
def test_validate_accepts_them_and_llava_refuses_them(tmp_path, model_type):
    assert NEW[model_type] in SUPPORTED and model_type not in LLAVA_TEXT_TYPES
    cfg = _cfg(model_type, num_experts_per_tok=2)
    assert validate_checkpoint(_checkpoint(tmp_path, cfg)).architecture == NEW[model_type]
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))


def test_tensor_parallel_checks():
    """Query heads and the dense MLP shard; the one latent KV head does not split (replicated
    on every rank), so only num_heads must divide; the experts go by --ep, so plain --tp on a
    MoE checkpoint is refused in one line."""
    c = config_from_dict(_cfg("deepseek_v3", num_attention_heads=4, intermediate_size=96))
    assert not kv_heads_split(c) and c.num_kv_heads == 1
    check_shardable(c, 2, experts=True)
    check_shardable(c, 4, experts=True)
    with pytest.raises(CheckpointError, match="add --ep 2"):
        check_shardable(c, 2)
    with pytest.raises(CheckpointError) as e:
        check_shardable(c, 3, experts=True)
    msg = "tensor parallel size 3 must divide num_heads (4); the latent KV head is replicated"
    assert msg in str(e.value) and "\n" not in str(e.value)
    dense = config_from_dict(
        _cfg("deepseek_v3", num_attention_heads=4, num_hidden_layers=2, first_k_dense_replace=2)
    )
    assert not dense.moe_layers and dense.routing is None
    check_shardable(dense, 2)


# -- the routers against transformers' ----------------------------------------------------------


@pytest.mark.parametrize(
    "model_type,kw",
    [
        ("deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True)),
        ("deepseek_v3", dict(n_group=1, topk_group=1, norm_topk_prob=False)),
        ("deepseek_v2", dict(topk_method="greedy")),
        ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ],
)
def test_routing_is_transformers(model_type, kw):
    """256 tokens over 16 experts, top-3, scaled: the same experts and weights as transformers'
    router (V3 with a correction bias that changes the choice)."""
    from shared.model import moe

    kw = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3) | kw
    kw |= dict(routed_scaling_factor=1.7, num_hidden_layers=1, first_k_dense_replace=0)
    kw |= dict(num_attention_heads=4)
    c = config_from_dict(_cfg(model_type, **kw))
    v3 = model_type == "deepseek_v3"
    mod = getattr(transformers.models, model_type)
    name = "DeepseekV3" if v3 else "DeepseekV2"
    tcfg = getattr(mod, f"configuration_{model_type}").__dict__[f"{name}Config"](**kw)
    router = getattr(mod, f"modeling_{model_type}").__dict__[f"{name}TopkRouter"](tcfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        if v3:
            router.e_score_correction_bias.copy_(torch.rand(16, generator=g) * 0.5)
    x = torch.randn(256, 32, generator=g)
    ours = moe.SparseMoE(c, 0)
    with torch.no_grad():
        ours.gate.weight.copy_(router.weight)
        if v3:
            ours.gate.e_score_correction_bias.copy_(router.e_score_correction_bias)
    w, ids = ours.route(x)
    _, ref_w, ref_ids = router(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=0)
    if v3:  # the bias moved some choice (else the test would not see it)
        plain = torch.topk(torch.sigmoid(x @ router.weight.T), 3).indices.sort(-1).values
        assert not torch.equal(plain, ids.sort(-1).values)


# -- against transformers ----------------------------------------------------------------------

MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16)
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    # q through q_a / q_b, interleaved RoPE, YaRN with both mscales (softmax scale and cos/sin),
    # v_head_dim 12 < 24 (V padded in the cache), layer 0 dense, 4 groups keep 2, renormalised
    "v3": dict(
        q_lora_rank=24,
        v_head_dim=12,
        rope_parameters={**YARN_M, "rope_theta": 1e4},
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        n_shared_experts=1,
        **MLA,
        **MOE,
    ),
    # one q_proj, rotate_half RoPE, default RoPE, v_head_dim 32 > 24 (q and k padded), biases,
    # raw top-k weights, 2 shared experts, both layers sparse
    "v3_plain": dict(
        q_lora_rank=None,
        v_head_dim=32,
        rope_interleave=False,
        attention_bias=True,
        norm_topk_prob=False,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        **(MLA | dict(kv_lora_rank=20)),  # the latent wider than the nope key: 28-wide cache
        **MOE,
    ),
    # V2: complex (interleaved, float32) RoPE with YaRN, q through q_a / q_b, greedy softmax
    # top-k scaled, 2 shared experts, biases on the attention and every MLP, layer 0 dense
    "v2": dict(
        q_lora_rank=24,
        v_head_dim=16,
        rope_parameters={**YARN_M, "rope_theta": 1e4},
        topk_method="greedy",
        first_k_dense_replace=1,
        n_shared_experts=2,
        routed_scaling_factor=1.3,
        attention_bias=True,
        mlp_bias=True,
        **MLA,
        **MOE,
    ),
    # V2: one q_proj, default RoPE, group-limited routing (4 groups keep 2), v_head_dim 32 > 24
    "v2_group": dict(
        q_lora_rank=None,
        v_head_dim=32,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        first_k_dense_replace=0,
        n_shared_experts=1,
        **(MLA | dict(kv_lora_rank=12)),  # the latent narrower than the nope key: 20-wide cache
        **MOE,
    ),
}


def _build(name, path):
    """V3's router correction bias (``e_score_correction_bias``) moved too."""
    cls = "DeepseekV2" if name.startswith("v2") else "DeepseekV3"
    return build_hf(cls, path, "bias", num_key_value_heads=4, **CASES[name])


pair = pair_fixture(_build, CASES)


def test_config_read_from_the_checkpoint(pair):
    hf, ours, name = pair
    c, t = ours.config, hf.config
    assert c.mla.q_lora_rank == t.q_lora_rank and c.mla.v_head_dim == t.v_head_dim
    assert c.head_dim == t.kv_lora_rank + t.qk_rope_head_dim  # the cached latent's width
    assert c.num_heads == 4 and c.num_kv_heads == ours.model.num_kv_heads == 1
    assert ours.model.kv_shared and ours.model.head_dim == c.head_dim
    assert c.moe_layers == tuple(range(t.first_k_dense_replace, 2))
    assert c.mla.scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert c.routing.shared_width == t.moe_intermediate_size * t.n_shared_experts


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    assert_logits_match(hf, ours.model, block_size)


@pytest.mark.parametrize("block_size,chunk", [(4, 1), (4, 3), (16, 7)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunks over cached context and block boundaries change nothing, in float64. The router
    weights are zeroed here: transformers computes the router in float32 even in a float64
    model, and float32 GEMMs, sigmoid and softmax round a row otherwise in a one-row chunk
    than in a 41-row one (their vector and scalar paths), which moves expert weights by
    ~1e-7. With zero logits every score is exact (V3's correction bias then picks the experts;
    `test_routing_is_transformers` and the float32 tests check the router itself). V2 is held
    to 1e-4: transformers rounds its RoPE input to float32 in any dtype, so float64 noise of
    another GEMM shape (1e-15) flips a float32 ulp of some key now and then (seen: 1.6e-5).
    The chunks also match Strata's own one-step prefill of the prompt: V3 bit for bit (held to
    1e-12), V2 to 1e-4 (its float32 complex RoPE rounds otherwise in another batch shape:
    seen 1.6e-5)."""
    hf, ours, name = pair
    v2 = name.startswith("v2")
    assert_chunked_fp64(
        hf,
        ours.path,
        block_size,
        chunk,
        1e-4 if v2 else 1e-9,
        zeroed=("mlp.gate.weight",),
        one_tol=1e-4 if v2 else 1e-12,
    )


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    assert_greedy_identical(hf, ours.model)


def test_a_batch_of_prompts_of_different_lengths(pair):
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for 32
    greedy tokens: each prompt's logits and tokens are transformers' for that prompt alone."""
    hf, ours, _ = pair
    assert_batch_matches(hf, ours.model)


def test_the_cache_holds_the_latent(pair):
    """One KV head per token, K and V one tensor: ``[kv_a_layernorm(latent), rotated k_rope]``,
    the latent exactly transformers' normed latent and the rope key its ``k_pe`` rotated (each
    pair's norm kept, times YaRN's attention factor); 24 values per token and layer, counted
    once. The layers run op by op and say why."""
    hf, ours, _ = pair
    m, c = ours.model, ours.config
    r, dr = c.mla.kv_lora_rank, c.mla.qk_rope_head_dim
    ids = _prompt(6)
    seen = {}
    attn = hf.model.layers[0].self_attn
    hooks = [
        attn.kv_a_layernorm.register_forward_hook(lambda _m, _i, o: seen.setdefault("lat", o)),
        attn.kv_a_proj_with_mqa.register_forward_hook(lambda _m, _i, o: seen.setdefault("a", o)),
    ]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    drv = PagedDriver(m, block_size=4)
    seq = drv.new_seq()
    drv.prefill(seq, ids)
    k, v = drv.cache.k, drv.cache.v
    assert v is k and tuple(k.shape[-2:]) == (1, r + dr)  # one tensor, one latent head
    slots = torch.tensor([seq.blocks[p // 4] * 4 + p % 4 for p in range(len(ids))])
    cached = k[0].reshape(-1, r + dr)[slots]  # layer 0's entries, in prompt order
    assert (cached[:, :r] - seen["lat"][0]).abs().max() < 1e-5
    k_pe = seen["a"][0, :, r:]
    pairs = k_pe.reshape(len(ids), -1, 2).norm(dim=-1)  # interleaved pairs (V2, V3 interleave)
    if c.mla.rope == "half":
        pairs = torch.stack((k_pe[:, : dr // 2], k_pe[:, dr // 2 :]), -1).norm(dim=-1)
    rot = cached[:, r:]
    got = torch.stack((rot[:, : dr // 2], rot[:, dr // 2 :]), -1).norm(dim=-1)
    if c.mla.rope == "complex":  # V2 keeps the rotated pairs interleaved
        got = rot.reshape(len(ids), -1, 2).norm(dim=-1)
    assert (got - pairs * c.mla.attention_factor).abs().max() < 1e-4
    # position 0 is not rotated: k_pe times the attention factor, in the cache's pair layout
    # (V3's interleaved pairs split into rotate_half's halves); later positions are rotated
    plain = k_pe * c.mla.attention_factor
    if c.mla.rope == "interleave":
        plain = torch.cat((plain[:, 0::2], plain[:, 1::2]), -1)
    assert (rot[0] - plain[0]).abs().max() < 1e-5
    assert ((rot[1:] - plain[1:]).abs().amax(-1) > 1e-3).all()
    per_token = ModelRunner.bytes_per_block(m, 1, torch.float32)
    assert per_token == c.num_layers * (r + dr) * 4  # K and V one tensor: counted once
    for layer in m.model.layers:
        assert layer.native() is None and "runs op by op" in layer.native_reason


def test_v3_kv_bytes_per_token():
    """DeepSeek-V3's real shape (its config's defaults, the model built on the meta device):
    the cache takes 576 values per token and layer (512 latent + 64 rope, one head, K and V one
    tensor) where the decompressed heads took 2 x 128 x 192 = 49,152: 85x less, 70,272 bytes a
    token over the 61 layers in bf16 instead of 5,996,544."""
    from shared.model.models.deepseek import DeepseekV3ForCausalLM

    c = config_from_dict(_cfg("deepseek_v3"))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(c)
    assert (model.num_kv_heads, model.head_dim, model.kv_shared) == (1, 576, True)
    per_layer = model.num_kv_heads * model.head_dim  # values per token and layer
    decompressed = 2 * c.num_heads * max(c.mla.qk_head_dim, c.mla.v_head_dim)
    assert (per_layer, decompressed) == (576, 49152)
    token = ModelRunner.bytes_per_block(model, 1, torch.bfloat16)
    assert token == 61 * 576 * 2 == 70272
    assert KVCache.bytes_per_block(61, 1, 128, 192, torch.bfloat16) == 5996544  # decompressed
    assert 5996544 / token == pytest.approx(85.33, abs=0.01)
    cache = KVCache.allocate(61, 2, 16, 1, 576, torch.bfloat16, "meta", shared=True)
    assert cache.v is cache.k and tuple(cache.k.shape) == (61, 2, 16, 1, 576)


def test_bf16_close_to_fp32(pair):
    """bf16 against transformers' float32 logits, per row relative to the largest logit: the
    median row within 4%, three rows in four within 10%. Not every row: on these random tiny
    MoE checkpoints bf16 noise flips an expert choice now and then, and a flipped row is off by
    20-80% (seen on v3_plain: 4 rows of 20, the same rows with the decompressed cache before)."""
    hf, ours, _ = pair
    _, got, ref = low_precision_logits(hf, ours.path, torch.bfloat16)
    err = (got - ref).abs().amax(-1) / ref.abs().max()
    assert err.median().item() < 0.04 and err.quantile(0.75).item() < 0.1


# -- two ranks ---------------------------------------------------------------------------------


def _rank(rank, path):
    """``--tp 2 --ep 2``: query heads and the dense layer's MLP over tensor parallelism, the
    sparse layer's experts over expert parallelism (the router and the shared experts whole on
    each rank); the latent KV head whole on every rank (the KV plane's replicated mode)."""
    from shared.model.ep import shard_experts
    from shared.model.parallel import TPGroup, shard_model
    from tests.model.test_tensor_parallel import _run

    tp = TPGroup(rank, 2)
    model = shard_model(load_model(path, dtype=torch.float32).model, tp, experts=True)
    shard_experts(model, tp, replicated_kv=False)
    logits, toks, cache = _run(model)
    runner = ModelRunner(model, 8, 4, torch.float32)  # what the engine would build here
    a = model.model.layers[0].self_attn
    moe = model.model.layers[1].mlp
    return dict(
        logits=logits,
        toks=toks,
        q=tuple(a.q_b_proj.weight.shape),
        kv_b=tuple(a.kv_b_proj.weight.shape),
        kv=tuple(cache.k.shape),
        experts=moe.experts.gate_up_proj.shape[0],
        a2a=moe.alltoall_bytes,
        ar=tp.allreduce_bytes,
        shards_kv=tp.shards_kv,
        block_heads=runner.kv_heads,
        one_tensor=runner.kv.v is runner.kv.k,
    )


def test_two_ranks_match_unsharded(tmp_path):
    from tests.model.test_tensor_parallel import _run

    _build("v3", tmp_path / "ck")
    ours = load_model(tmp_path / "ck")
    ref_logits, ref_toks, ref_cache = _run(ours.model)
    r0, r1 = spawn_two_ranks(_rank, tmp_path, str(ours.path))
    assert_ranks_match(r0, r1, ref_logits, ref_toks)
    c, m = ours.config, ours.config.mla
    assert r0["q"] == (2 * m.qk_head_dim, m.q_lora_rank)  # 2 of 4 heads
    assert r0["kv_b"] == (2 * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    # the latent KV head is not split: each rank's cache is the unsharded model's, and a whole
    # block (what the KV hand-off and the pool move) holds one head, read from rank 0's copy
    assert r0["kv"] == r1["kv"] == tuple(ref_cache.k.shape) and r0["kv"][-2:] == (1, 24)
    assert not r0["shards_kv"] and not r1["shards_kv"]
    assert r0["block_heads"] == 1 and r0["one_tensor"] and r0["experts"] == c.num_experts // 2
    assert r0["a2a"] > 0 and r0["ar"] > 0


# -- the acceptance checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_the_acceptance_checkpoints_load_and_match(kind, tmp_path):
    assert_acceptance_checkpoint(kind, tmp_path / kind, NEW[kind])


# -- the latent through the engine ---------------------------------------------------------------


async def test_the_latent_through_the_engine_prefix_cache_and_kv_hand_off(tmp_path):
    """The engine sizes, caches and moves the latent like any KV: one tensor for K and V (twice
    the blocks of a split cache in the same bytes), `KVSpec` of one 24-wide head, a prefix-cache
    hit, prefill on engine A and decode on engine B after the held KV is read from A and written
    into B (the gRPC hand-off's payload, K and V halves equal), and pool blocks taken in by a
    third engine: every path gives transformers' greedy tokens."""
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.engine.port import EnginePort
    from shared.engine.port_types import ExternalKV
    from shared.protocol.sampling import SamplingParams

    hf = _build("v3", tmp_path / "ck")
    model = load_model(tmp_path / "ck")
    p = _prompt(14, seed=7)
    want = hf_greedy(hf, p, 10)
    cfg = dict(kv_cache_bytes=1 << 16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    one = LLMEngine(model, EngineConfig(**cfg))
    kv = one.runner.kv
    assert kv.v is kv.k and tuple(kv.k.shape[-2:]) == (1, 24)
    assert kv.k.shape[1] == (1 << 16) // (2 * 4 * 24 * 4)  # layers x block x 24 floats, once
    assert one.runner.kv_bytes == kv.k.numel() * 4
    assert one.generate([p], sp)[0] == want
    assert one.generate([p], sp)[0] == want  # its 3 full blocks from the prefix cache now
    assert one.stats().prefix_hit_tokens >= 12

    ports = [EnginePort(LLMEngine(model, EngineConfig(**cfg))) for _ in range(3)]
    a, b, c = ports
    try:
        assert a.kv_spec == (2, 1, 24, 4, torch.float32) and a.kv_spec.token_bytes() == 384
        one_tok = SamplingParams(temperature=0, max_tokens=1)
        first = [o async for o in a.generate("r", p, one_tok, hold_kv=True)]
        got = await a.read_kv("r")
        flat = got.tokens()  # [layers, 2 (k/v), tokens, 1, 24]
        assert tuple(flat.shape) == (2, 2, 14, 1, 24) and torch.equal(flat[:, 0], flat[:, 1])
        tok = first[0].new_token_ids[0]
        assert tok == want[0]
        assert await b.reserve_kv("r", len(p)) == 0
        assert await b.write_kv("r", range(2), 0, flat) == 14
        outs = [o.new_token_ids async for o in b.generate_prefilled("r", p, tok, sp)]
        assert [tok] + sum(outs, []) == want
        hashes, cached = await a.match_prefix(p)  # the pool's blocks: A's full ones
        assert cached == 12
        ext = ExternalKV(hashes, got.blocks[:, :, :3])
        outs = [o async for o in c.generate("y", p, sp, external_kv=ext)]
        assert outs[0].num_cached_tokens == 12
        assert sum((o.new_token_ids for o in outs), []) == want
    finally:
        for port in ports:
            port.shutdown()
