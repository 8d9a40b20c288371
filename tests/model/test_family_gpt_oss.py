"""gpt-oss: config parsing (transformers' defaults, 4.x and 5.x RoPE keys, one clear line for
what Strata cannot serve, MXFP4 included), the router and the clamped-SwiGLU experts against
transformers' own, the attention sinks on the native attention kernels (counted), and
Strata against transformers 5.x on random tiny checkpoints saved with ``save_pretrained``:
logits, 32 greedy tokens, batches of prompts of different lengths, chunked prefill in float64,
two ranks (``--tp 2 --ep 2``: heads and sinks over tensor parallelism, experts over expert
parallelism)."""

from __future__ import annotations

import pytest
import torch

from shared.model import cpu_kernels
from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED, layer_types_of
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
    assert_low_precision_close,
    assert_ranks_match,
    build_hf,
    pair_fixture,
    spawn_two_ranks,
)
from tests.model.paged_driver import PagedDriver
from tests.model.test_family_configs import _checkpoint
from tests.model.test_text_models import _prompt

transformers = pytest.importorskip("transformers")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

ARCH = "GptOssForCausalLM"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _cfg(**kw) -> dict:
    return {"architectures": [ARCH], "model_type": "gpt_oss", **kw}


def _hf_config(**kw):
    return transformers.GptOssConfig(**{k: v for k, v in kw.items() if k != "architectures"})


# -- config parsing ----------------------------------------------------------------------------


def test_defaults_are_transformers():
    c, t = config_from_dict(_cfg()), _hf_config()
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (t.vocab_size, 2880, 36)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (64, 8, 64)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 4, 2880)
    assert c.moe_layers == tuple(range(36)) and c.routing.swiglu == (1.702, 7.0)
    assert c.attention_bias and c.o_proj_bias and not c.tie_word_embeddings
    assert c.rms_norm_eps == t.rms_norm_eps and c.max_position_embeddings == 131072
    # YaRN by default (factor 32 over 4096 positions, not truncated), theta 150000
    assert c.rope_theta == t.rope_parameters["rope_theta"] == 150000.0
    assert c.rope_scaling == {k: v for k, v in t.rope_parameters.items() if k != "rope_theta"}
    # every other layer sliding from layer 0, window 128: the served context is the window
    assert layer_types_of(_cfg()) == t.layer_types and c.sliding_window == 128
    assert c.max_model_len == 128


def test_4x_and_5x_rope_spellings_agree_and_match_transformers():
    """YaRN as ``rope_scaling`` + ``rope_theta`` (4.x, ``type``) and as ``rope_parameters``
    (5.x) read the same; the inverse frequencies and the cos/sin factor are transformers'."""
    from shared.model.models.deepseek import YarnRotary

    shape = dict(head_dim=16, max_position_embeddings=256)
    four = _cfg(
        rope_theta=5e4, rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 16.0}, **shape
    )
    five = _cfg(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "rope_theta": 5e4},
        **shape,
    )
    a, b = config_from_dict(four), config_from_dict(five)
    assert a.rope_scaling == b.rope_scaling and a.rope_theta == b.rope_theta == 5e4
    assert a.rope_scaling["original_max_position_embeddings"] == 256  # transformers' default
    for cfg, c in ((five, b), (_cfg(rope_theta=5e4, **shape), None), (_cfg(**shape), None)):
        c = c or config_from_dict(cfg)
        rot = gpt_oss.GptOssRotaryEmbedding(_hf_config(**cfg))
        ours = YarnRotary.whole_head(c, "cpu")
        assert torch.equal(ours.inv_freq, rot.inv_freq)
        assert ours.factor == pytest.approx(rot.attention_scaling, rel=1e-12)
    plain = _cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **shape)
    assert config_from_dict(plain).rope_scaling is None


@pytest.mark.parametrize(
    "kw,msg",
    [
        (
            dict(quantization_config={"quant_method": "mxfp4"}),
            "quantized gpt-oss (quantization_config quant_method 'mxfp4') is not supported",
        ),
        (dict(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok 5 exceeds the 4"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
        (dict(rope_parameters={"rope_type": "yarn"}), "YaRN rope parameters without 'factor'"),
        (dict(head_dim=15), "head_dim 15 must be even"),
        (dict(sliding_window=16), "sliding_window 16 is under 32 tokens"),
    ],
)
def test_what_cannot_be_served_is_refused_in_one_line(tmp_path, kw, msg):
    cfg = _cfg(**kw)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, cfg))  # torch-free, at `strata up`
    assert msg in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="config.json"):
        config_from_dict(cfg)


def test_validate_accepts_it_and_llava_refuses_it(tmp_path):
    assert ARCH in SUPPORTED and "gpt_oss" not in LLAVA_TEXT_TYPES
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(max_position_embeddings=131072)))
    assert info.architecture == ARCH and "serving a context of 128 tokens" in info.context_note
    full = _cfg(sliding_window=None)  # no window: every layer attends to the full context
    assert config_from_dict(full).sliding_window is None
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": "gpt_oss"}}
    with pytest.raises(CheckpointError, match="unsupported LLaVA text model_type 'gpt_oss'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))


def test_tensor_parallel_checks():
    """Heads (and their sinks) shard; the experts go by --ep, so plain --tp is refused."""
    c = config_from_dict(_cfg(num_attention_heads=4, num_key_value_heads=2))
    check_shardable(c, 2, experts=True)
    with pytest.raises(CheckpointError, match="add --ep 2"):
        check_shardable(c, 2)
    with pytest.raises(CheckpointError, match=r"4 must divide num_heads \(4\) and num_kv_heads"):
        check_shardable(c, 4, experts=True)


# -- the router and the experts against transformers' -------------------------------------------


def test_router_and_experts_are_transformers():
    """256 tokens over 8 experts, top-3, a clamp that bites (limit 1.5): the same experts and
    weights as transformers' router, and the same MoE output from the checkpoint's interleaved
    gate_up layout, turned into ours at load."""
    from shared.model import moe
    from shared.model.models.gpt_oss import GptOssDecoderLayer

    kw = dict(hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3)
    kw |= dict(swiglu_limit=1.5, swiglu_alpha=1.3, num_attention_heads=4, num_key_value_heads=2)
    kw |= dict(head_dim=8, num_hidden_layers=1)
    t = _hf_config(**kw, initializer_range=0.5)
    t._experts_implementation = "eager"
    torch.manual_seed(0)
    ref = gpt_oss.GptOssMLP(t)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    layer = GptOssDecoderLayer(config_from_dict(_cfg(**kw)))
    ours = layer.mlp
    with torch.no_grad():
        ours.gate.weight.copy_(ref.router.weight)
        ours.gate.bias.copy_(ref.router.bias)
        for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(ours.experts, n).copy_(getattr(ref.experts, n))
    layer.fold_experts()
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    w, ids = ours.route(x)
    _, ref_w, ref_ids = ref.router(x)
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, atol=1e-6, rtol=0)
    with torch.no_grad():
        out, want = ours(x), ref(x[None])[0][0]
    assert (out - want).abs().max().item() < 1e-5
    gu = x @ ref.experts.gate_up_proj[0] + ref.experts.gate_up_proj_bias[0]
    assert gu[:, ::2].max() > 1.5 and gu[:, 1::2].min() < -1.5  # both clamps bite
    assert moe.clamped_swiglu is not None


# -- against transformers ----------------------------------------------------------------------

CASES = {
    # GQA 4:2, YaRN (not truncated), biases, 4 experts top-2, layer 0 sliding (window 128: the
    # whole served context), a clamp that bites (limit 2)
    "yarn": dict(
        num_key_value_heads=2,
        rope_parameters={**YARN, "truncate": False, "rope_theta": 1e4},
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=2.0,
    ),
    # MHA, default RoPE, no attention bias, layer types the other way round, 8 experts top-3,
    # transformers' default clamp (7) and alpha
    "plain": dict(
        num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        attention_bias=False,
        layer_types=["full_attention", "sliding_attention"],
        num_local_experts=8,
        num_experts_per_tok=3,
    ),
}


def _sinks(name, p):
    if name.endswith("sinks"):  # sinks comparable to the scores: they move the softmax
        p.mul_(8.0)


def _build(name, path, **over):
    """The experts' biases (``*_proj_bias``) moved too."""
    kw = dict(intermediate_size=32, head_dim=16, initializer_range=0.25, sliding_window=128)
    return build_hf("GptOss", path, "bias", _sinks, **kw, **(CASES[name] | over))


pair = pair_fixture(_build, CASES)


def test_config_read_from_the_checkpoint(pair):
    hf, ours, _ = pair
    c, t = ours.config, hf.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, t.num_key_value_heads, 16)
    assert c.num_experts == t.num_local_experts and c.moe_layers == (0, 1)
    assert c.attention_bias == t.attention_bias and c.sliding_window == 128
    assert c.routing.swiglu == (t.swiglu_alpha, t.swiglu_limit)
    sinks = ours.model.model.layers[0].self_attn.sinks
    assert torch.equal(sinks, hf.model.layers[0].self_attn.sinks)


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    assert_logits_match(hf, ours.model, block_size)


@pytest.mark.parametrize("block_size,chunk", [(4, 1), (16, 7)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunks over cached context and block boundaries change nothing, in float64 (the router
    included: transformers computes it in the model's dtype)."""
    hf, ours, _ = pair
    assert_chunked_fp64(hf, ours.path, block_size, chunk)


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    assert_greedy_identical(hf, ours.model)


def test_a_batch_of_prompts_of_different_lengths(pair):
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for 32
    greedy tokens: each prompt's logits and tokens are transformers' for that prompt alone."""
    hf, ours, _ = pair
    assert_batch_matches(hf, ours.model)


def _fallbacks(op: str, reason: str) -> float:
    return cpu_kernels.FALLBACKS.labels(op, reason)._value.get()


def _native_calls(op: str) -> int:
    return sum(n for (_, o), n in cpu_kernels.calls.items() if o == op)


def _all_fallbacks(op: str) -> float:
    """``op``'s fallbacks to torch, whatever the reason."""
    return sum(c._value.get() for (o, _), c in cpu_kernels._fallback_children.items() if o == op)


def test_sinks_run_on_the_native_attention_kernels(pair):
    """On CPU float32 every layer's attention runs on the native prefill and decode kernels
    with the sink term (the logits tests above compare what they give with transformers), no
    attention call falls back to torch, and the layers run op by op, saying why."""
    _, ours, _ = pair
    if not cpu_kernels.available():
        pytest.skip(f"no native kernels here: {cpu_kernels.off_reason()}")
    m = ours.model
    ops = ("decode_attention", "prefill_attention")
    before = {op: (_native_calls(op), _all_fallbacks(op)) for op in ops}
    layers_before = _fallbacks("decoder_layer", "unsupported")
    drv = PagedDriver(m, block_size=4)
    seq = drv.new_seq()
    drv.step([(seq, _prompt(6))])  # one prefill per layer
    drv.step([(seq, [3])])  # one decode per layer
    n = m.config.num_layers
    for op in ops:
        assert _native_calls(op) - before[op][0] == n, op
        assert _all_fallbacks(op) == before[op][1], f"{op} fell back to torch"
    assert _fallbacks("decoder_layer", "unsupported") - layers_before == 2
    for layer in m.model.layers:
        assert layer.native() is None and "attention sinks" in layer.native_reason


def test_bf16_close_to_fp32(pair):
    hf, ours, _ = pair
    assert_low_precision_close(hf, ours.path, torch.bfloat16, 0.1)


# -- two ranks ---------------------------------------------------------------------------------


def _rank(rank, path):
    """``--tp 2 --ep 2``: heads, their sinks and the KV heads over tensor parallelism, the
    experts (with their biases) over expert parallelism, the router whole on each rank."""
    from shared.model.ep import shard_experts
    from shared.model.parallel import TPGroup, shard_model
    from tests.model.test_tensor_parallel import _run

    tp = TPGroup(rank, 2)
    model = shard_model(load_model(path, dtype=torch.float32).model, tp, experts=True)
    shard_experts(model, tp, replicated_kv=False)
    logits, toks, cache = _run(model)
    a = model.model.layers[0].self_attn
    moe = model.model.layers[1].mlp
    return dict(
        logits=logits,
        toks=toks,
        q=tuple(a.q_proj.weight.shape),
        sinks=a.sinks.detach().clone(),
        kv=tuple(cache.k.shape),
        experts=moe.experts.gate_up_proj.shape[0],
        bias=tuple(moe.experts.down_proj_bias.shape),
        a2a=moe.alltoall_bytes,
        ar=tp.allreduce_bytes,
    )


def test_two_ranks_match_unsharded(tmp_path):
    from tests.model.test_tensor_parallel import _run

    _build("yarn", tmp_path / "ck")
    ours = load_model(tmp_path / "ck")
    ref_logits, ref_toks, ref_cache = _run(ours.model)
    r0, r1 = spawn_two_ranks(_rank, tmp_path, str(ours.path))
    assert_ranks_match(r0, r1, ref_logits, ref_toks)
    c = ours.config
    sinks = ours.model.model.layers[0].self_attn.sinks
    assert torch.equal(torch.cat([r0["sinks"], r1["sinks"]]), sinks)  # each rank its heads'
    assert r0["q"] == (2 * c.head_dim, c.hidden_size)  # 2 of 4 heads
    kv = list(ref_cache.k.shape)
    kv[-2] //= 2
    assert list(r0["kv"]) == kv and r0["experts"] == c.num_experts // 2
    assert r0["bias"] == (c.num_experts // 2, c.hidden_size)
    assert r0["a2a"] > 0 and r0["ar"] > 0


# -- the acceptance checkpoint -----------------------------------------------------------------


def test_the_acceptance_checkpoint_loads_and_matches(tmp_path):
    assert_acceptance_checkpoint("gpt_oss", tmp_path / "gpt_oss", ARCH)
