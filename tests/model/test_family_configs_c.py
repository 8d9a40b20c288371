"""Phi (1 / 1.5 / 2) and StarCoder2: config parsing (transformers' defaults, 4.x and 5.x keys,
one clear line for what Strata cannot serve) and Strata against transformers 5.x on random
tiny checkpoints saved with ``save_pretrained``: logits, 32 greedy tokens, batches of prompts
of different lengths, chunked prefill in float64, two tensor-parallel ranks, StarCoder2's
sliding window."""

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
    assert_low_precision_close,
    assert_tp_matches_unsharded,
    assert_window_caps,
    build_hf,
    pair_fixture,
)
from tests.model.paged_driver import PagedDriver
from tests.model.test_family_configs import _checkpoint
from tests.model.test_text_models import _prompt

transformers = pytest.importorskip("transformers")

NEW = {"phi": "PhiForCausalLM", "starcoder2": "Starcoder2ForCausalLM"}
WINDOW = 48  # StarCoder2's sliding window in the oracle cases


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


# -- config parsing ----------------------------------------------------------------------------


def test_phi_defaults_and_keys():
    c = config_from_dict(_cfg("phi", hidden_size=64, num_attention_heads=4))
    assert c.partial_rotary_factor == 0.5 and c.head_dim == 16  # transformers' default: half
    assert c.attention_bias and c.o_proj_bias and c.mlp_bias and not c.qk_norm
    assert c.hidden_act == "gelu_new" and c.rms_norm_eps == 1e-5 and not c.tie_word_embeddings
    assert c.sliding_window is None and c.max_position_embeddings == 2048
    # 5.x: rope_parameters; 4.x: top-level partial_rotary_factor and rope_theta
    five = dict(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.4}
    )
    c = config_from_dict(
        _cfg(
            "phi",
            hidden_size=64,
            num_attention_heads=4,
            qk_layernorm=True,
            layer_norm_eps=1e-6,
            **five,
        )
    )
    assert c.partial_rotary_factor == 0.4 and c.qk_norm and c.rms_norm_eps == 1e-6
    c = config_from_dict(_cfg("phi", partial_rotary_factor=0.25, rope_theta=5e4))
    assert (c.partial_rotary_factor, c.rope_theta, c.rope_scaling) == (0.25, 5e4, None)


def test_starcoder2_defaults_and_keys():
    c = config_from_dict(_cfg("starcoder2", num_attention_heads=24))
    assert c.num_kv_heads == 2 and c.tie_word_embeddings  # transformers' defaults
    assert c.attention_bias and c.o_proj_bias and c.mlp_bias and not c.qk_norm
    assert c.hidden_act == "gelu_pytorch_tanh" and c.rms_norm_eps == 1e-5
    assert c.sliding_window is None and c.partial_rotary_factor == 1.0
    c = config_from_dict(_cfg("starcoder2", use_bias=False, norm_epsilon=1e-6, sliding_window=4096))
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias) and c.rms_norm_eps == 1e-6
    assert c.sliding_window == 4096 and c.max_model_len == 4096
    assert sliding_window_of({"model_type": "starcoder2", "sliding_window": 64}) == 64
    assert sliding_window_of({"model_type": "phi", "sliding_window": 64}) is None


@pytest.mark.parametrize(
    "kw,rot",
    [
        (dict(partial_rotary_factor=0.3), 9),  # 32 * 0.3: an odd number of dims
        (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.0}), 0),
        (dict(partial_rotary_factor=1.5), 48),
    ],
)
def test_phi_rotary_that_cannot_rotate_is_refused(tmp_path, kw, rot):
    cfg = _cfg("phi", hidden_size=128, num_attention_heads=4, **kw)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, cfg))
    msg = str(e.value)
    assert "\n" not in msg and "partial_rotary_factor" in msg and f"gives {rot} rotary dims" in msg
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        config_from_dict(cfg)


def test_other_families_still_refuse_partial_rotary():
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.5 is not supported"):
        config_from_dict({"model_type": "starcoder2", "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("model_type", list(NEW))
def test_validate_accepts_them_and_llava_refuses_them(tmp_path, model_type):
    assert NEW[model_type] in SUPPORTED and model_type not in LLAVA_TEXT_TYPES
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(model_type, max_position_embeddings=64)))
    assert info.architecture == NEW[model_type]
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))


def test_tensor_parallel_checks():
    c = config_from_dict(_cfg("phi", num_attention_heads=4, intermediate_size=96))
    check_shardable(c, 2)
    with pytest.raises(CheckpointError, match=r"3 must divide num_heads \(4\)"):
        check_shardable(c, 3)


# -- against transformers ----------------------------------------------------------------------

CASES = {
    # Phi-2 shape: half the head rotated, q/k LayerNorms, GQA 4:2, untied head with its bias
    "phi_qkln": ("Phi", dict(num_key_value_heads=2, partial_rotary_factor=0.5, qk_layernorm=True)),
    # a quarter of the head rotated (4 of 16 dims), no q/k norm, MHA, tied head (its own bias)
    "phi_tied": ("Phi", dict(partial_rotary_factor=0.25, tie_word_embeddings=True)),
    # StarCoder2: GQA 4:2, biases, every layer windowed, tied
    "starcoder2": ("Starcoder2", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    # use_bias off, MQA, no window, untied
    "starcoder2_nobias": (
        "Starcoder2",
        dict(num_key_value_heads=1, use_bias=False, tie_word_embeddings=False),
    ),
}


def _build(name, path):
    cls, kw = CASES[name]
    return build_hf(cls, path, **kw)


pair = pair_fixture(_build, CASES)


def test_config_read_from_the_checkpoint(pair):
    hf, ours, name = pair
    c = ours.config
    phi = name.startswith("phi")
    assert c.partial_rotary_factor == ({"phi_qkln": 0.5, "phi_tied": 0.25}.get(name, 1.0))
    assert c.qk_norm == (name == "phi_qkln")
    assert c.attention_bias == c.mlp_bias == (name != "starcoder2_nobias")
    assert c.sliding_window == (WINDOW if name == "starcoder2" else None)
    assert c.tie_word_embeddings == (name in ("phi_tied", "starcoder2"))
    assert (ours.model.lm_head.bias is not None) == phi
    if c.tie_word_embeddings:
        assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    assert_logits_match(hf, ours.model, block_size)


@pytest.mark.parametrize("block_size,chunk", [(4, 1), (4, 3), (16, 7)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunks over cached context and block boundaries change nothing, in float64 (the LM
    head's bias too)."""
    hf, ours, _ = pair
    assert_chunked_fp64(hf, ours.path, block_size, chunk)


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    assert_greedy_identical(hf, ours.model)


def test_a_batch_of_prompts_of_different_lengths(pair):
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for 32
    greedy tokens: each prompt's logits and tokens are transformers' for that prompt alone (16 +
    32 tokens fill StarCoder2's window exactly)."""
    hf, ours, _ = pair
    assert_batch_matches(hf, ours.model)


def test_the_layers_run_op_by_op_and_count_it(pair, monkeypatch):
    """No one-call native layer (`layer.c`: RMSNorm, SiLU gating): each layer says why, and on
    CPU float32 the forward counts a ``decoder_layer`` fallback (Phi also ``qk_norm_rope``: RoPE
    on part of the head runs in torch)."""
    from prometheus_client import REGISTRY

    from shared.model import cpu_kernels
    from shared.model.models import llama

    _, ours, name = pair
    for layer in ours.model.model.layers:
        assert layer.native() is None and "runs op by op" in layer.native_reason
    if not cpu_kernels.available():
        pytest.skip("no native kernels on this machine")
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)

    def count(op):
        labels = {"op": op, "reason": "unsupported"}
        return REGISTRY.get_sample_value("strata_kernel_fallback_total", labels) or 0.0

    before = (count("decoder_layer"), count("qk_norm_rope"), cpu_kernels.layer_calls)
    drv = PagedDriver(ours.model, block_size=4)
    drv.prefill(drv.new_seq(), _prompt(9))
    assert count("decoder_layer") == before[0] + 1 and cpu_kernels.layer_calls == before[2]
    rope = 2 if name.startswith("phi") else 0  # one per layer
    assert count("qk_norm_rope") == before[1] + rope


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(pair, dtype):
    hf, ours, _ = pair
    assert_low_precision_close(hf, ours.path, dtype, 0.1)


def test_two_tensor_parallel_ranks_match_unsharded(tmp_path):
    """Heads and MLP columns over two gloo ranks: q/k/v rows with their biases, ``dense``
    row-parallel (bias once), the gate-less MLP (`PlainMLP`, StarCoder2's too) split by its two
    projections, Phi's per-head q/k LayerNorms and partial RoPE per rank. One case (the one
    with every piece) keeps the suite's time: each run spawns two ranks."""
    _build("phi_qkln", tmp_path / "ck")
    assert_tp_matches_unsharded([tmp_path / "ck"], tmp_path)


# -- StarCoder2's sliding window ---------------------------------------------------------------


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = tmp_path_factory.mktemp("starcoder2_window")
    return _build("starcoder2", path), load_model(path)


def test_the_served_context_is_the_window(windowed):
    _, ours = windowed
    assert ours.config.max_model_len == WINDOW < ours.config.max_position_embeddings


def test_a_prompt_longer_than_the_window(windowed):
    """At 80 tokens transformers' windowed logits differ from full attention's past the window
    (why the context is capped there), and the gateway refuses such a prompt with a 400."""
    from services.gateway.config import GatewayConfig
    from services.gateway.core import ApiError, build_spec, sampling_for

    hf, ours = windowed
    assert_window_caps(hf, ours, WINDOW)
    cfg = GatewayConfig()
    spec = build_spec("completion", {"model": "m", "prompt": "x"}, cfg, "m")
    with pytest.raises(ApiError, match=f"this model's context length is {WINDOW}") as e:
        sampling_for(spec, 80, ours.config.max_model_len, cfg)
    assert e.value.http_status == 400


@pytest.mark.parametrize("kind", ["phi", "starcoder2"])
def test_the_acceptance_checkpoints_load_and_match(kind, tmp_path):
    assert_acceptance_checkpoint(kind, tmp_path / kind, NEW[kind])
