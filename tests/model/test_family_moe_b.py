"""OLMoE, GraniteMoE, GraniteMoeShared, PhiMoE and ERNIE 4.5 MoE: config parsing (transformers'
defaults, the 4.x and 5.x RoPE spellings, one clear line for what Strata cannot serve), each
router against transformers' own, and Strata against transformers 5.x on random tiny checkpoints
saved with ``save_pretrained``: logits, 32 greedy tokens, a batch of prompts of different
lengths, chunked prefill in float64, two gloo ranks (``--ep 2``, and ``--tp 2 --ep 2`` where the
family shards), the acceptance checkpoints."""

from __future__ import annotations

import pytest
import torch

from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED, sliding_window_of
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.model.parallel import check_shardable
from shared.model.validate import validate_checkpoint
from tests.model.oracle import (
    assert_acceptance_checkpoint,
    assert_batch_matches,
    assert_chunked_fp64,
    assert_greedy_identical,
    assert_logits_match,
    assert_ranks_match,
    build_hf,
    pair_fixture,
    spawn_two_ranks,
)
from tests.model.paged_driver import PagedDriver
from tests.model.test_family_configs import _checkpoint
from tests.model.test_text_models import _prompt

transformers = pytest.importorskip("transformers")

NEW = {
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
}
PREFIX = {
    "olmoe": "Olmoe",
    "granitemoe": "GraniteMoe",
    "granitemoeshared": "GraniteMoeShared",
    "phimoe": "Phimoe",
    "ernie4_5_moe": "Ernie4_5_Moe",
}


def _experts(t) -> tuple[int, int]:
    """A transformers config's (experts, top-k) whatever its own key names."""
    n = getattr(t, "num_local_experts", None) or t.num_experts
    return n, t.num_experts_per_tok


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


# -- config parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(NEW))
def test_defaults_are_transformers(model_type):
    c = config_from_dict(_cfg(model_type))
    t = getattr(transformers, PREFIX[model_type] + "Config")()
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (
        t.vocab_size,
        t.hidden_size,
        t.num_hidden_layers,
    )
    assert (c.num_heads, c.num_kv_heads) == (t.num_attention_heads, t.num_key_value_heads)
    assert c.head_dim == t.hidden_size // t.num_attention_heads
    assert c.rms_norm_eps == t.rms_norm_eps and c.rope_theta == t.rope_parameters["rope_theta"]
    assert c.max_position_embeddings == t.max_position_embeddings
    assert c.tie_word_embeddings == t.tie_word_embeddings and c.rope_scaling is None
    assert (c.num_experts, c.num_experts_per_tok) == _experts(t)
    ernie = model_type == "ernie4_5_moe"
    width = t.moe_intermediate_size if ernie else t.intermediate_size
    assert c.moe_intermediate_size == width and c.intermediate_size == t.intermediate_size
    if ernie:  # layer 0 dense, then every layer up to the last
        assert c.moe_layers == tuple(range(1, t.num_hidden_layers)) and c.norm_topk_prob
        r = c.routing
        assert (r.scoring, r.correction_bias, r.norm_min) == ("softmax", True, t.moe_norm_min)
        assert r.shared_width == t.moe_intermediate_size * t.moe_num_shared_experts
    else:
        assert c.moe_layers == tuple(range(t.num_hidden_layers))
    if model_type == "olmoe":
        assert c.routing is None and c.qk_norm and not c.norm_topk_prob
    if model_type.startswith("granite"):
        assert c.routing.scoring == "topk_softmax_float32" and c.routing.shared_width == 0
        for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier"):
            assert getattr(c, k) == getattr(t, k)
        assert c.logits_scaling == t.logits_scaling
    if model_type == "phimoe":
        assert (c.routing.scoring, c.routing.jitter_eps) == ("sparsemixer", t.router_jitter_noise)
        assert not c.lm_head_bias and c.sliding_window is None
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias)


def test_the_other_keys_are_read():
    """Aliases (OLMoE's num_local_experts, ERNIE's num_experts / num_experts_per_tok), biases,
    GraniteMoeShared's shared MLP, PhiMoE's window and LM head bias, ERNIE's MoE layer range."""
    c = config_from_dict(
        _cfg("olmoe", num_local_experts=4, num_experts_per_tok=2, attention_bias=True)
    )
    assert c.num_experts == 4 and c.attention_bias and c.o_proj_bias
    c = config_from_dict(_cfg("granitemoeshared", shared_intermediate_size=24))
    assert c.routing.shared_width == 24
    c = config_from_dict(_cfg("phimoe", sliding_window=256, lm_head_bias=True))
    assert c.sliding_window == 256 and c.max_model_len == 256 and c.lm_head_bias
    assert sliding_window_of(_cfg("phimoe")) is None
    kw = dict(num_experts=8, num_experts_per_tok=3, use_bias=True, num_hidden_layers=8)
    kw |= dict(moe_layer_start_index=2, moe_layer_end_index=6, moe_layer_interval=2)
    c = config_from_dict(_cfg("ernie4_5_moe", **kw))
    assert (c.num_experts, c.num_experts_per_tok, c.moe_layers) == (8, 3, (3, 5))
    assert c.attention_bias and c.o_proj_bias and c.mlp_bias and c.lm_head_bias


@pytest.mark.parametrize("model_type", ["olmoe", "granitemoe", "ernie4_5_moe"])
def test_4x_and_5x_rope_spellings_agree(model_type):
    four = _cfg(model_type, rope_theta=5e4, rope_scaling={"type": "linear", "factor": 2.0})
    five = _cfg(
        model_type, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4}
    )
    a, b = config_from_dict(four), config_from_dict(five)
    linear = {"rope_type": "linear", "factor": 2.0}
    assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling) == (5e4, linear)
    p4 = config_from_dict(_cfg("phimoe", rope_theta=5e4))
    p5 = config_from_dict(_cfg("phimoe", rope_parameters={"rope_theta": 5e4}))
    assert p4.rope_theta == p5.rope_theta == 5e4 and p4.rope_scaling is p5.rope_scaling is None


@pytest.mark.parametrize(
    "model_type,kw,msg",
    [
        ("olmoe", dict(clip_qkv=8.0), "OLMoE clip_qkv 8.0 is not supported"),
        ("olmoe", dict(head_dim=64), "OLMoE head_dim 64 x 16 heads is not hidden_size 2048"),
        ("olmoe", dict(num_experts_per_tok=65), "num_experts_per_tok 65 must be between 1 and"),
        ("granitemoe", dict(num_experts_per_tok=9), "num_experts_per_tok 9 must be between"),
        ("phimoe", dict(num_experts_per_tok=4), "PhiMoE num_experts_per_tok 4 is not supported"),
        (
            "phimoe",
            dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
            "PhiMoE rope_type 'longrope' is not supported",
        ),
        ("phimoe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "'linear'"),
        ("ernie4_5_moe", dict(moe_k=65), "num_experts_per_tok 65 must be between"),
        ("ernie4_5_moe", dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
        ("granitemoeshared", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "yarn"),
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
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(model_type)))
    assert info.architecture == NEW[model_type] and not info.multimodal
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))


def test_tensor_parallel_checks():
    """The experts go by --ep (plain --tp refused); OLMoE's q/k norm spans every head, so its
    heads do not shard at all (--ep alone serves it)."""
    c = config_from_dict(_cfg("granitemoe", num_attention_heads=4))
    check_shardable(c, 2, experts=True)
    with pytest.raises(CheckpointError, match="add --ep 2"):
        check_shardable(c, 2)
    olmoe = config_from_dict(_cfg("olmoe", num_attention_heads=4))
    with pytest.raises(CheckpointError, match="does not shard OLMoE: its q/k norm spans"):
        check_shardable(olmoe, 2, experts=True)


# -- the routers against transformers' ---------------------------------------------------------


def _hf_router(model_type: str, kw: dict):
    mod = getattr(transformers.models, model_type)
    p = PREFIX[model_type]
    tcfg = getattr(transformers, p + "Config")(**kw)
    names = {"granitemoeshared": "GraniteMoeShared"}
    router = getattr(
        getattr(mod, f"modeling_{model_type}"), f"{names.get(model_type, p)}TopKRouter"
    )
    return router(tcfg).eval(), tcfg


@pytest.mark.parametrize(
    "model_type,kw",
    [
        ("olmoe", dict(num_experts=16, num_experts_per_tok=3, norm_topk_prob=True)),
        ("olmoe", dict(num_experts=16, num_experts_per_tok=3, norm_topk_prob=False)),
        ("granitemoe", dict(num_local_experts=16, num_experts_per_tok=3)),
        ("phimoe", dict(num_local_experts=16, router_jitter_noise=0.01)),
        ("phimoe", dict(num_local_experts=16, router_jitter_noise=0.2)),
        ("ernie4_5_moe", dict(moe_num_experts=16, moe_k=3, moe_num_shared_experts=0)),
    ],
)
def test_routing_is_transformers(model_type, kw):
    """256 tokens over 16 experts: the same experts and weights as transformers' router (in eval
    mode: PhiMoE's sparsemixer samples only in training); ERNIE's correction bias moves some
    choice; PhiMoE's wider threshold gives weights other than 1."""
    from shared.model import moe

    kw = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2) | kw
    router, _ = _hf_router(model_type, kw)
    ours = moe.SparseMoE(config_from_dict(_cfg(model_type, **kw)), 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        ours.gate.weight.copy_(router.weight)
        if model_type == "ernie4_5_moe":
            bias = router.moe_statics.e_score_correction_bias
            bias.copy_(torch.rand(1, 16, generator=g) * 0.2)
            ours.gate.e_score_correction_bias = torch.nn.Parameter(bias.clone())
    x = torch.randn(256, 32, generator=g)
    w, ids = ours.route(x)
    with torch.no_grad():
        _, ref_w, ref_ids = router(x)
    if model_type != "phimoe":  # PhiMoE's order is its own (first, second): kept
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        ids, ref_ids = ids.gather(1, order), ref_ids.gather(1, ref_order)
        w, ref_w = w.gather(1, order), ref_w.gather(1, ref_order)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w, atol=1e-6, rtol=0)
    if model_type == "phimoe" and kw["router_jitter_noise"] > 0.1:
        assert (w < 0.999).any()
    if model_type == "ernie4_5_moe":
        plain = torch.topk(torch.softmax(x @ router.weight.T, -1), 3).indices.sort(-1).values
        assert not torch.equal(plain, ids)


# -- against transformers ----------------------------------------------------------------------

_SMALL = dict(num_key_value_heads=2, intermediate_size=32)
CASES = {
    # q/k norm over all heads, biases on q/k/v/o, renormalised top-2 of 8
    "olmoe": (
        "Olmoe",
        dict(num_experts=8, num_experts_per_tok=2, attention_bias=True, norm_topk_prob=True),
    ),
    # the four multipliers, softmax over the top-2 logits, fused experts in the checkpoint
    "granitemoe": (
        "GraniteMoe",
        dict(num_local_experts=8, embedding_multiplier=2.0, residual_multiplier=0.5)
        | dict(attention_multiplier=0.1, logits_scaling=3.0, attention_bias=True),
    ),
    # plus a shared MLP (input_linear split at load), top-3, an inexact residual multiplier
    "granitemoeshared": (
        "GraniteMoeShared",
        dict(num_local_experts=8, num_experts_per_tok=3, shared_intermediate_size=24)
        | dict(residual_multiplier=0.7, embedding_multiplier=1.5, attention_multiplier=0.25),
    ),
    # LayerNorms, biases, LM head bias, sparsemixer with a threshold wide enough to mix
    "phimoe": (
        "Phimoe",
        dict(num_local_experts=8, attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3),
    ),
    # interleaved RoPE, use_bias (LM head too), layer 0 dense, a correction bias, 1 shared expert
    "ernie4_5_moe": (
        "Ernie4_5_Moe",
        dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1)
        | dict(moe_layer_start_index=1, use_bias=True, tie_word_embeddings=False),
    ),
}


def _build(name, path):
    cls, kw = CASES[name]
    hf = build_hf(cls, path, **_SMALL, **kw)
    if name == "ernie4_5_moe":  # build_hf moves ``.bias`` ones; this one decides the choice too
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("e_score_correction_bias"):
                    p.copy_(torch.rand_like(p) * 0.2)
        hf.save_pretrained(path)
    return hf


pair = pair_fixture(_build, CASES)


def test_config_read_from_the_checkpoint(pair):
    hf, ours, name = pair
    c, t = ours.config, hf.config
    assert (c.num_experts, c.num_experts_per_tok) == _experts(t)
    assert c.num_kv_heads == 2 and len(c.moe_layers) == (1 if name == "ernie4_5_moe" else 2)


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    assert_logits_match(hf, ours.model, block_size)


@pytest.mark.parametrize("block_size,chunk", [(4, 3)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunks over cached context and block boundaries change nothing, in float64: to 1e-9
    against Strata's one-step prefill and transformers' float64 logits. The router weights are
    zeroed (as DeepSeek's test does): OLMoE's, Granite's and ERNIE's routers take a softmax in
    float32 even in a float64 model, which rounds a row otherwise in another batch shape; with
    zero logits every score is exact (ERNIE's correction bias then picks the experts;
    `test_routing_is_transformers` and the float32 tests check the routers). ERNIE rotates in
    float32 whatever the dtype (held to 1e-4 there, as DeepSeek-V2's)."""
    hf, ours, name = pair
    scale = ours.config.logits_scaling if name.startswith("granite") else 1.0

    def head(m, hidden):  # the LM head in float64 (compute_logits gives float32)
        return torch.nn.functional.linear(hidden, m.lm_head.weight, m.lm_head.bias) / scale

    gates = ("mlp.gate.weight", "block_sparse_moe.router.weight", "mlp.router.weight")
    tol = 1e-4 if name == "ernie4_5_moe" else 1e-9
    assert_chunked_fp64(hf, ours.path, block_size, chunk, tol, head, zeroed=gates)


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    assert_greedy_identical(hf, ours.model)


def test_a_batch_of_prompts_of_different_lengths(pair):
    hf, ours, _ = pair
    assert_batch_matches(hf, ours.model)


def test_they_run_op_by_op(pair):
    """`layer.c` has no router: the sparse layers say so, and the whole model runs op by op
    (ERNIE's dense layer 0 too), counted as a ``decoder_layer`` fallback."""
    from shared.model import cpu_kernels

    _, ours, _ = pair
    for i in ours.config.moe_layers:
        layer = ours.model.model.layers[i]
        assert layer.native() is None and "MoE" in layer.native_reason
    before = cpu_kernels.FALLBACKS.labels(op="decoder_layer", reason="unsupported")._value.get()
    drv = PagedDriver(ours.model, block_size=4)
    drv.prefill(drv.new_seq(), _prompt(5))
    after = cpu_kernels.FALLBACKS.labels(op="decoder_layer", reason="unsupported")._value.get()
    assert after > before or not cpu_kernels.available()


# -- two ranks ---------------------------------------------------------------------------------

# --ep 2 for every family; --tp 2 --ep 2 where the heads shard (not OLMoE's)
TWO_RANKS = [(name, False) for name in CASES] + [
    (name, True) for name in ("granitemoeshared", "phimoe", "ernie4_5_moe")
]


def _rank(rank, root):
    from shared.model.ep import shard_experts
    from shared.model.parallel import TPGroup, shard_model
    from tests.model.test_tensor_parallel import _run

    results = {}
    for name, tp in TWO_RANKS:
        group = TPGroup(rank, 2)
        model = load_model(f"{root}/{name}", dtype=torch.float32).model
        if tp:
            shard_model(model, group, experts=True)
        shard_experts(model, group, replicated_kv=not tp)
        logits, toks, cache = _run(model)
        moe = model.model.layers[-1].mlp
        results[(name, tp)] = dict(
            logits=logits,
            toks=toks,
            kv=tuple(cache.k.shape),
            experts=moe.experts.gate_up_proj.shape[0],
            a2a=moe.alltoall_bytes,
            ar=group.allreduce_bytes,
        )
    return results


def test_two_ranks_match_unsharded(tmp_path):
    """Two gloo ranks, the experts split by expert parallelism (4 of 8 per rank, all-to-all
    dispatch and combine; routers, shared MLPs and shared experts whole on each rank), and with
    ``--tp 2 --ep 2`` the heads and KV heads too: rank 0's logits within 1e-4 of the unsharded
    model, the same greedy tokens on both ranks. One spawn for every case."""
    from tests.model.test_tensor_parallel import _run

    refs = {}
    for name in CASES:
        _build(name, tmp_path / name)
        refs[name] = _run(load_model(tmp_path / name).model)
    r0, r1 = spawn_two_ranks(_rank, tmp_path, str(tmp_path))
    for name, tp in TWO_RANKS:
        ref_logits, ref_toks, ref_cache = refs[name]
        a, b = r0[(name, tp)], r1[(name, tp)]
        assert_ranks_match(a, b, ref_logits, ref_toks, (name, tp))
        assert a["experts"] == 4 and a["a2a"] > 0, (name, tp)
        kv = list(ref_cache.k.shape)
        kv[-2] //= 2 if tp else 1
        assert list(a["kv"]) == kv and (a["ar"] > 0) == tp, (name, tp)


# -- the acceptance checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(NEW))
def test_the_acceptance_checkpoints_load_and_match(kind, tmp_path):
    assert_acceptance_checkpoint(kind, tmp_path / kind, NEW[kind])
