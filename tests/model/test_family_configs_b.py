"""Gemma (1), SmolLM3 and OLMo-3: config parsing (each family's transformers defaults, the 4.x and
5.x spellings, one clear line for what Strata cannot serve) and Strata against transformers on
random tiny checkpoints saved with ``save_pretrained`` (logits, chunked prefill exact in
float64, 32 greedy tokens, mixed batches, the sliding-window cap), with the decoder-layer path
that runs: SmolLM3 (NoPE layers on identity RoPE tables) takes the one-call native layer, Gemma
and OLMo-3 run op by op.

The oracle tests are `test_text_models`' and `test_sliding_window`'s, run here on these
families' checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from shared.model import cpu_kernels
from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED, sliding_window_of
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.model.parallel import check_shardable
from shared.model.validate import validate_checkpoint
from tests.acceptance.checkpoints import VOCAB as TOK_VOCAB
from tests.acceptance.checkpoints import hf_tokenizer
from tests.infra.fake_apps import write_fake_checkpoint
from tests.model import test_sliding_window as sw
from tests.model.paged_driver import PagedDriver
from tests.model.test_text_models import (  # noqa: F401  (run here on this file's `pair`)
    VOCAB,
    _prompt,
    test_chunked_prefill_exact_in_fp64,
    test_chunked_prefill_fp32,
    test_greedy_32_tokens_identical,
    test_half_precision_close_to_fp32,
    test_logits_match,
    test_mixed_batch_matches_single_sequences,
)

transformers = pytest.importorskip("transformers")

NEW = {
    "gemma": "GemmaForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
}


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


# ---------------------------------------------------------------------------- config parsing


def test_gemma_defaults_and_refusal():
    c = config_from_dict(_cfg("gemma"))
    assert c.head_dim == 256 and c.tie_word_embeddings and not c.qk_norm
    assert c.hidden_act == "gelu_pytorch_tanh" and c.intermediate_size == 24576
    assert c.query_pre_attn_scalar is None  # attention scale head_dim ** -0.5
    assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None
    assert c.sliding_window is None and c.max_model_len == 8192
    # the legacy "gelu" of Gemma's first checkpoints is the tanh approximation
    assert config_from_dict(_cfg("gemma", hidden_act="gelu")).hidden_act == "gelu_pytorch_tanh"
    assert config_from_dict(_cfg("gemma", attention_bias=True)).o_proj_bias
    check_shardable(config_from_dict(_cfg("gemma", head_dim=16)), 2)  # shards like Gemma-2
    with pytest.raises(CheckpointError) as e:
        config_from_dict(_cfg("gemma", use_bidirectional_attention=True))
    assert "\n" not in str(e.value) and "use_bidirectional_attention is not supported" in str(
        e.value
    )


def test_smollm3_defaults_no_rope_layers_and_windows():
    c = config_from_dict(_cfg("smollm3", num_hidden_layers=8))
    assert c.nope_layers == (3, 7)  # a NoPE layer every no_rope_layer_interval-th (4)
    assert (c.rope_theta, c.rope_scaling) == (2e6, None) and c.tie_word_embeddings
    assert c.sliding_window is None and not c.qk_norm
    c = config_from_dict(_cfg("smollm3", num_hidden_layers=6, no_rope_layer_interval=3))
    assert c.nope_layers == (2, 5)
    c = config_from_dict(_cfg("smollm3", num_hidden_layers=3, no_rope_layers=[0, 1, 0]))
    assert c.nope_layers == (0, 2)
    check_shardable(config_from_dict(_cfg("smollm3", num_hidden_layers=2)), 2)
    # transformers windows the NoPE layers when use_sliding_window and a window are set
    on = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=64)
    assert config_from_dict(_cfg("smollm3", **on)).max_model_len == 64
    assert sliding_window_of(_cfg("smollm3", num_hidden_layers=4, sliding_window=64)) is None
    types = ["full_attention"] * 4
    assert sliding_window_of(_cfg("smollm3", **on, layer_types=types)) is None
    with pytest.raises(CheckpointError) as e:
        config_from_dict(_cfg("smollm3", num_hidden_layers=4, no_rope_layers=[1, 0]))
    assert "\n" not in str(e.value)
    assert "no_rope_layers has 2 entries for 4 layers" in str(e.value)


def test_olmo3_defaults_rope_pair_and_refusals():
    c = config_from_dict(_cfg("olmo3", num_hidden_layers=8))
    assert c.qk_norm and c.rms_norm_eps == 1e-5 and not c.tie_word_embeddings
    assert c.sliding_layers == (0, 1, 2, 4, 5, 6)  # every 4th layer full
    assert (c.rope_theta, c.rope_scaling, c.rope_local) == (5e5, None, (5e5, None))
    assert c.sliding_window == 4096 and c.max_model_len == 2048  # the window is past the limit
    assert config_from_dict(_cfg("olmo3", max_position_embeddings=65536)).max_model_len == 4096
    # 4.x: rope_theta + rope_scaling, the scaling only on the full layers
    c = config_from_dict(
        _cfg("olmo3", rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0})
    )
    assert (c.rope_theta, c.rope_scaling) == (1e4, {"rope_type": "linear", "factor": 4.0})
    assert c.rope_local == (1e4, None)
    # 5.x: rope_parameters keyed by layer type
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    types = ["sliding_attention", "full_attention"]
    c = config_from_dict(_cfg("olmo3", rope_parameters=rope, layer_types=types))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0} and c.rope_theta == 1e6
    assert c.rope_local == (1e4, None) and c.sliding_layers == (0,)
    full = ["full_attention"] * 2
    assert config_from_dict(_cfg("olmo3", layer_types=full)).sliding_window is None
    yarn = dict(rope, full_attention={"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5})
    with pytest.raises(CheckpointError, match="unsupported rope_type 'yarn'"):
        config_from_dict(_cfg("olmo3", rope_parameters=yarn))
    check_shardable(c, 1)
    with pytest.raises(CheckpointError, match="does not shard OLMo-3: its q/k norm spans"):
        check_shardable(c, 2)


def _checkpoint(tmp_path, cfg: dict):
    d = tmp_path / "m"
    write_fake_checkpoint(d)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("model_type", list(NEW))
def test_validate_accepts_them_and_a_llava_around_them_is_refused(tmp_path, model_type):
    assert NEW[model_type] in SUPPORTED
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(model_type, max_position_embeddings=64)))
    assert info.architecture == NEW[model_type] and not info.multimodal
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    assert model_type not in LLAVA_TEXT_TYPES
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path, bad))


# ------------------------------------------------------------------- against transformers

CASES = {
    # Gemma: (1 + w) norms (perturbed off 0), sqrt(hidden) embedding scale, GELU-tanh, tied,
    # head_dim 16 from the config, GQA 4:2, attention bias (o_proj too)
    "gemma": dict(
        cls="Gemma",
        kw=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True),
    ),
    # SmolLM3: layer 1 NoPE, GQA 4:2, untied (head_dim 16: decodes take the native layer,
    # prefills op by op; `test_smollm3_native_and_op_by_op_agree` has a native prefill)
    "smollm3": dict(
        cls="SmolLM3",
        perturb_norms=False,  # Llama's, left at 1 (perturbed, float32 rounding nears 1e-4)
        kw=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            no_rope_layers=[1, 0],
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # OLMo-3: layer 0 sliding on its own RoPE base, layer 1 full with linear scaling, window
    # 48 (past every prompt below: 41 tokens, 9 + 32 greedy), q/k norm over all heads
    "olmo3": dict(
        cls="Olmo3",
        kw=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=48,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
            },
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
}


def _build(name, path, vocab=VOCAB, **extra):
    case = CASES[name]
    cfg = getattr(transformers, case["cls"] + "Config")(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        initializer_range=0.5,
        max_position_embeddings=256,
        **(case["kw"] | extra),
    )
    torch.manual_seed(0)
    hf = getattr(transformers, case["cls"] + "ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norms off their start (1, Gemma's 0): a misplaced norm shows
        for n, p in hf.named_parameters():
            if "norm" in n and case.get("perturb_norms", True):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _build(request.param, path)
    return hf, load_model(path), request.param


def test_config_follows_the_checkpoint(pair):
    hf, ours, name = pair
    c = ours.config
    assert c.architecture == NEW[name] and c.head_dim == 16
    assert c.nope_layers == ((1,) if name == "smollm3" else ())
    assert c.sliding_layers == ((0,) if name == "olmo3" else ())
    if name == "olmo3":
        assert c.rope_local == (1e4, None) and c.rope_scaling["rope_type"] == "linear"
        assert c.max_model_len == 48
    assert c.tie_word_embeddings == (name == "gemma")
    assert ours.model.lm_head.weight is not None


def test_the_decoder_layer_path_that_runs(pair, monkeypatch):
    """SmolLM3's layers, its NoPE layer included, run as one native call each (`layer.c` on
    identity RoPE tables); Gemma ((1 + w) norms, GELU) and OLMo-3 (post-norms) layers say why
    they run op by op and make no such call (OLMo-3's forwards count as fallbacks)."""
    from shared.model.models import llama

    _, ours, name = pair
    if not cpu_kernels.available():
        pytest.skip("no native kernels on this machine")
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)
    drv = PagedDriver(ours.model, block_size=4)
    seq = drv.new_seq()
    drv.prefill(seq, _prompt(9))
    before = cpu_kernels.layer_calls
    fallbacks = cpu_kernels.FALLBACKS.labels("decoder_layer", "unsupported")._value.get()
    for tok in (5, 6, 7):
        drv.step([(seq, [tok])])
    native = name == "smollm3"
    assert cpu_kernels.layer_calls - before == (3 * ours.model.num_layers if native else 0)
    counted = cpu_kernels.FALLBACKS.labels("decoder_layer", "unsupported")._value.get()
    assert counted - fallbacks == (3 if name == "olmo3" else 0)
    for layer in ours.model.model.layers:
        assert (layer.native() is None) == (not native)
        assert (layer.native_reason is None) == native


def test_smollm3_native_and_op_by_op_agree(tmp_path, monkeypatch):
    """The NoPE layer on both paths, prefill and decode: one native call per layer (`layer.c`
    on identity RoPE tables; head_dim 32, whole panels of the native prefill kernel) and op by
    op (the fused norm + RoPE kernel on them). Each is as close to transformers in float64 as
    transformers' own float32 is (which at this head size strays past 1e-4)."""
    from shared.model.models import llama

    if not cpu_kernels.available():
        pytest.skip("no native kernels on this machine")
    kw = dict(num_attention_heads=2, num_key_value_heads=1, no_rope_layers=[0, 1])
    hf = _build("smollm3", tmp_path, **kw)
    hf64 = type(hf)(hf.config).double().eval()
    hf64.load_state_dict(hf.state_dict())
    ids = _prompt(41)
    with torch.no_grad():
        ref = hf64(torch.tensor([ids])).logits[0]
        own = (hf(torch.tensor([ids])).logits[0].double() - ref).abs().max().item()
    model = load_model(tmp_path).model
    assert model.config.nope_layers == (0,) and model.head_dim == 32
    for on in (True, False):
        monkeypatch.setattr(llama, "NATIVE_LAYER", on)
        drv = PagedDriver(model, block_size=4)
        seq = drv.new_seq()
        before = cpu_kernels.layer_calls
        got = drv.prefill(seq, ids[:30])
        got = torch.cat([got] + [drv.step([(seq, [t])])[1] for t in ids[30:]])
        assert cpu_kernels.layer_calls - before == (2 * 12 if on else 0)
        err = (got.double() - ref).abs().max().item()
        assert err < 1.5 * own, on


@pytest.mark.parametrize("name", ["gemma"])
def test_tensor_parallel_two_ranks_match_unsharded(name, tmp_path):
    """Gemma shards as Gemma-2 does (heads and MLP columns over 2 gloo ranks):
    `test_tensor_parallel`'s ranks, logits and greedy tokens as the unsharded model's. SmolLM3
    is Llama's class (its NoPE layers only change RoPE tables, which every rank builds whole),
    so Llama's own test covers it; each case spawns two ranks, so one is run."""
    from tests.model import test_tensor_parallel as tpt
    from tests.ranks import spawn_ranks

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    _build(name, ckpt)
    ref_logits, ref_toks, _ = tpt._run(load_model(ckpt, dtype=torch.float32).model)
    spawn_ranks(tpt._rank, (tpt._free_port(), str(ckpt), str(out)))
    r0, r1 = (torch.load(out / f"{r}.pt") for r in (0, 1))
    assert (r0["logits"] - ref_logits).abs().max() < 1e-4
    assert r0["toks"] == ref_toks and r1["toks"] == ref_toks


# ------------------------------------------------------------------- sliding windows

WINDOWED = {
    "olmo3": {},  # CASES' layer 0 sliding
    # SmolLM3: use_sliding_window windows the NoPE layer (its default layer_types)
    "smollm3": dict(use_sliding_window=True),
}


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request, tmp_path_factory):
    """(transformers model, Strata's) of a checkpoint whose window (`sw.WINDOW`) is under its
    position limit, with a tokenizer (the gateway check reads it)."""
    name = request.param
    path = tmp_path_factory.mktemp(f"{name}_window")
    hf = _build(name, path, vocab=TOK_VOCAB, sliding_window=sw.WINDOW, **WINDOWED[name])
    hf_tokenizer().save_pretrained(path)
    return hf, load_model(path)


def test_windowed_the_served_context_is_the_window(windowed):
    sw.test_the_served_context_is_the_window(windowed)


def test_windowed_within_the_window_logits_and_greedy_match(windowed):
    sw.test_within_the_window_logits_and_greedy_match(windowed)


def test_windowed_past_the_window_full_attention_would_be_wrong(windowed):
    """An 80-token prompt: transformers' windowed logits part from full attention's after the
    window, which is why the context is capped there."""
    sw.test_past_the_window_full_attention_would_be_wrong(windowed)


def test_windowed_the_gateway_refuses_a_prompt_longer_than_the_window(windowed):
    sw.test_the_gateway_refuses_a_prompt_longer_than_the_window(windowed)
