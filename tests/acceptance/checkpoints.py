"""Checkpoints as a user brings them: written by today's ``transformers`` ``save_pretrained``
(model, tokenizer and, for LLaVA, the processor), random weights, offline.

Each builder returns a `Checkpoint`: the directory and the transformers objects that serve as the
oracle. The tokenizer is Strata's small byte-level BPE handed to ``PreTrainedTokenizerFast``, so
transformers writes its own tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``) the way it does for any hub model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from shared.model.default_model import CHAT_TEMPLATE, train_tokenizer

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 4096  # the trained tokenizer's size (special tokens included), a multiple of 64
WINDOW = 64  # the sliding window of the mistral_window checkpoint
IMAGE_TOKEN = "<image>"
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass
class Checkpoint:
    name: str
    path: Path
    model: object  # transformers model, eval mode
    tokenizer: object  # transformers tokenizer
    processor: object | None = None  # transformers processor (LLaVA)


@functools.lru_cache(maxsize=1)
def _bpe():
    return train_tokenizer()


def hf_tokenizer():
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_bpe(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _rope(theta: float, scaling: dict | None = None) -> dict:
    return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta}}


def _text_config(kind: str, tok) -> object:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    common = dict(
        vocab_size=VOCAB,
        intermediate_size=128,
        num_hidden_layers=2,
        initializer_range=0.5,
        max_position_embeddings=4096,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    if kind == "llama":  # llama3 rope scaling, GQA 6:2, head_dim 16
        return transformers.LlamaConfig(
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            **_rope(
                500000.0,
                dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
            ),
            **common,
        )
    if kind == "qwen2":  # tied embeddings, qkv bias (Qwen2 always has it), GQA 4:2
        return transformers.Qwen2Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            **_rope(1e6),
            **common,
        )
    if kind == "qwen3":  # odd GQA ratio 3:1, head_dim 16 != hidden / heads, q/k norm
        return transformers.Qwen3Config(
            hidden_size=64,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            **_rope(1e6),
            **common,
        )
    if kind == "qwen3_moe":  # 8 experts top-2, raw top-k weights, layer 1 dense, q/k norm
        return transformers.Qwen3MoeConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            **_rope(1e6),
            **common,
        )
    if kind == "mixtral":  # 4 experts top-2 (renormalised), GQA 4:1
        return transformers.MixtralConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            **_rope(1e6),
            **common,
        )
    if kind == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint, GQA 4:2
        return transformers.Phi3Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **_rope(1e4),
            **common,
        )
    if kind == "mistral_window":  # a sliding window (64) far under max_position_embeddings
        return transformers.MistralConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            **_rope(1e4),
            **common,
        )
    if kind == "gemma2":  # soft-capping, (1 + w) and sandwich norms, tied, head_dim 16
        return transformers.Gemma2Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            **_rope(1e4),
            **common,
        )
    # (1 + w) q/k norms, a sliding layer on its local RoPE, head_dim 16; untied (tied, the
    # sqrt(hidden)-scaled embedding of the last token decides every greedy token here)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
            **common,
        )
    if kind == "olmo2":  # post-norms, q/k norm over all heads, GQA 4:2
        return transformers.Olmo2Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **_rope(5e5),
            **common,
        )
    if kind == "phi":  # parallel attention + MLP, half the head rotated, q/k LayerNorms, GQA 4:2
        return transformers.PhiConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            qk_layernorm=True,
            tie_word_embeddings=False,
            **_rope(1e4, dict(partial_rotary_factor=0.5)),
            **common,
        )
    if kind == "starcoder2":  # LayerNorms, biases, ungated GELU MLP, GQA 4:2, untied
        return transformers.Starcoder2Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **_rope(1e5),
            **common,
        )
    if kind == "gemma":  # (1 + w) norms, GELU-tanh, head_dim 16; untied (as gemma3's, above)
        return transformers.GemmaConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            **_rope(1e4),
            **common,
        )
    if kind == "smollm3":  # layer 1 NoPE, GQA 4:2, untied
        return transformers.SmolLM3Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            no_rope_layers=[1, 0],
            tie_word_embeddings=False,
            **_rope(2e6),
            **common,
        )
    if kind == "olmo3":  # OLMo-2's layer, layer 0 sliding (window 4096: the whole context)
        return transformers.Olmo3Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
            **common,
        )
    dense = _dense_config(kind, common)
    if dense is not None:
        return dense
    if kind in ("deepseek_v3", "deepseek_v2"):  # latent attention, DeepSeekMoE
        return _deepseek_config(kind, common)
    if kind in _MOE_FAMILIES:  # OLMoE, GraniteMoE(Shared), PhiMoE, ERNIE MoE (`config_moe`)
        cls, kw = _MOE_FAMILIES[kind]
        return getattr(transformers, cls + "Config")(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **kw,
            **{**common, "intermediate_size": 32},
        )
    if kind in _NEOX:  # GPT-NeoX, StableLM, Cohere (`shared.model.config_neox`)
        cls, kw = _NEOX[kind]
        return getattr(transformers, cls + "Config")(
            hidden_size=64, num_attention_heads=4, **kw, **common
        )
    if kind in _MORE:  # EXAONE-4, HunYuan-V1-Dense, Arcee, Nemotron (`shared.model.config_more`)
        cls, kw = _MORE[kind]
        return getattr(transformers, cls + "Config")(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **kw, **common
        )
    if kind == "gpt_oss":  # sinks, YaRN, layer 0 sliding (4096: the whole context), MoE top-2 of 4
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
        return transformers.GptOssConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4096,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            **_rope(1e4, yarn),
            **{**common, "intermediate_size": 32},
        )
    raise ValueError(kind)


# `shared.model.config_more`'s families: class prefix, config keys (all untied, GQA 4:2)
_MORE = {
    # post-norms, per-head q/k norms, layer 0 sliding (window 4096: the whole context), layer 1
    # full attention without RoPE
    "exaone4": (
        "Exaone4",
        dict(
            head_dim=16,
            sliding_window=4096,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
    ),
    # q/k norms after RoPE, q/k/v/o bias, its dynamic NTK-alpha RoPE
    "hunyuan_v1_dense": (
        "HunYuanDenseV1",
        dict(
            head_dim=16,
            attention_bias=True,
            tie_word_embeddings=False,
            **_rope(1e4, dict(rope_type="dynamic", alpha=1000.0, factor=1.0)),
        ),
    ),
    # Llama with the ungated relu2 MLP, YaRN (original context 1024 of 4096)
    "arcee": (
        "Arcee",
        dict(
            tie_word_embeddings=False,
            **_rope(1e4, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)),
        ),
    ),
    # LayerNorm1p, the ungated relu2 MLP, half of each head rotated
    "nemotron": (
        "Nemotron",
        dict(tie_word_embeddings=False, **_rope(1e4, dict(partial_rotary_factor=0.5))),
    ),
}


# the dense Llama-like families (`shared.model.config_dense`): class prefix, config keys
_DENSE = {
    # Mistral's layer, every layer windowed (4096: the whole context here), GQA 4:2
    "ministral": ("Ministral", dict(num_key_value_heads=2, head_dim=16, sliding_window=4096)),
    # q/k/v bias and its own o_proj bias, GQA 4:2, head_dim 16
    "seed_oss": ("SeedOss", dict(num_key_value_heads=2, head_dim=16, attention_out_bias=True)),
    # interleaved RoPE on half of each head, q/k/v bias, fused gate_up_proj
    "glm": ("Glm", dict(num_key_value_heads=2, head_dim=16)),
    # GLM plus post-attention / post-MLP norms, a quarter of each head rotated
    "glm4": (
        "Glm4",
        dict(num_key_value_heads=2, head_dim=16, **_rope(1e4, dict(partial_rotary_factor=0.25))),
    ),
    # interleaved RoPE on the whole head, use_bias everywhere, untied (see gemma3's note)
    "ernie4_5": (
        "Ernie4_5",
        dict(num_key_value_heads=2, head_dim=16, use_bias=True, tie_word_embeddings=False),
    ),
    # interleaved RoPE on the whole head, q/k/v bias
    "helium": ("Helium", dict(num_key_value_heads=2, head_dim=16, attention_bias=True)),
}


def _dense_config(kind: str, common: dict) -> object | None:
    if kind not in _DENSE:
        return None
    cls, kw = _DENSE[kind]
    kw = {"tie_word_embeddings": False, **kw}
    return getattr(transformers, cls + "Config")(
        hidden_size=64, num_attention_heads=4, **kw, **common
    )


def _deepseek_config(kind: str, common: dict) -> object:
    """DeepSeek-V3: q through q_a / q_b, interleaved RoPE with YaRN, 8 experts in 2 groups (1
    kept), top-2, one shared expert, layer 0 dense. DeepSeek-V2: one q_proj, its complex
    RoPE, softmax group-limited routing, two shared experts."""
    mla = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2)
    moe |= dict(topk_group=1, first_k_dense_replace=1)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    if kind == "deepseek_v3":
        extra = dict(q_lora_rank=24, n_shared_experts=1, **_rope(1e4, yarn))
    else:
        extra = dict(q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy")
        extra |= _rope(1e4)
    cls = transformers.DeepseekV3Config if kind == "deepseek_v3" else transformers.DeepseekV2Config
    return cls(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        **mla,
        **moe,
        **extra,
        **common,
    )


# `shared.model.config_moe`'s mixture-of-experts families: class prefix, config keys (8 experts,
# width 32, untied, GQA 4:2)
_MOE_FAMILIES = {
    # q/k norm over all heads, renormalised top-2
    "olmoe": ("Olmoe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    # the four multipliers, softmax over the top-2 logits, experts fused in the checkpoint
    "granitemoe": (
        "GraniteMoe",
        dict(num_local_experts=8, embedding_multiplier=2.0, residual_multiplier=0.5)
        | dict(attention_multiplier=0.25, logits_scaling=2.0),
    ),
    # plus a shared MLP
    "granitemoeshared": (
        "GraniteMoeShared",
        dict(num_local_experts=8, shared_intermediate_size=32, attention_multiplier=0.25),
    ),
    # LayerNorms, sparsemixer top-2
    "phimoe": ("Phimoe", dict(num_local_experts=8)),
    # interleaved RoPE, layer 0 dense, top-2 of 8 with 1 shared expert
    "ernie4_5_moe": (
        "Ernie4_5_Moe",
        dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1),
    ),
}


# the LayerNorm families on Phi's pieces: class prefix, config keys
_NEOX = {
    # two LayerNorms, parallel residual, q/k/v fused per head, a quarter of each head rotated
    "gpt_neox": ("GPTNeoX", dict(rotary_pct=0.25, tie_word_embeddings=False)),
    # sequential residual, per-head q/k LayerNorms, q/k/v bias, GQA 4:2, a quarter rotated
    "stablelm": (
        "StableLm",
        dict(
            num_key_value_heads=2, qk_layernorm=True, use_qkv_bias=True, tie_word_embeddings=False
        ),
    ),
    # one bias-free LayerNorm, parallel attention + MLP, interleaved RoPE, per-head q/k norms,
    # GQA 4:2, logit_scale 0.0625 (the default); untied
    "cohere": (
        "Cohere",
        dict(num_key_value_heads=2, use_qk_norm=True, tie_word_embeddings=False),
    ),
}


def build_text(kind: str, path: Path) -> Checkpoint:
    """``kind``: llama | qwen2 | qwen3 | qwen3_moe | mixtral | phi3 | gemma2 | gemma3 | olmo2 |
    phi | starcoder2 | gemma | smollm3 | olmo3 | mistral_window | ministral | seed_oss | glm |
    glm4 | ernie4_5 | helium | deepseek_v3 | deepseek_v2 | gpt_neox | stablelm | cohere |
    exaone4 | hunyuan_v1_dense | arcee | nemotron | gpt_oss | olmoe | granitemoe |
    granitemoeshared | phimoe | ernie4_5_moe (shapes above)."""
    tok = hf_tokenizer()
    cfg = _text_config(kind, tok)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "olmo2": transformers.Olmo2ForCausalLM,
        "phi": transformers.PhiForCausalLM,
        "starcoder2": transformers.Starcoder2ForCausalLM,
        "gemma": transformers.GemmaForCausalLM,
        "smollm3": transformers.SmolLM3ForCausalLM,
        "olmo3": transformers.Olmo3ForCausalLM,
        "mistral_window": transformers.MistralForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "deepseek_v2": transformers.DeepseekV2ForCausalLM,
        "gpt_oss": transformers.GptOssForCausalLM,
        **{k: getattr(transformers, c + "ForCausalLM") for k, (c, _) in _DENSE.items()},
        **{k: getattr(transformers, c + "ForCausalLM") for k, (c, _) in _NEOX.items()},
        **{k: getattr(transformers, c + "ForCausalLM") for k, (c, _) in _MORE.items()},
        **{k: getattr(transformers, c + "ForCausalLM") for k, (c, _) in _MOE_FAMILIES.items()},
    }[kind]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Checkpoint(kind, Path(path), model, tok)


def tiny_vision_config(kind: str = "clip", num_hidden_layers: int = 2) -> object:
    """A tiny ViT: 32 px images, 8 px patches (16 patches), width 32, 4 heads.
    ``kind``: clip | siglip."""
    cls = {"clip": transformers.CLIPVisionConfig, "siglip": transformers.SiglipVisionConfig}[kind]
    return cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )


def tiny_decoder_config(cls, **kwargs) -> object:
    """A tiny decoder config of transformers class ``cls`` (``Qwen2Config``, ``LlamaConfig``...) to
    go with `tiny_vision_config`: width 64, MLP 96, 2 layers, 4 heads; ``kwargs`` give the rest
    (vocab_size, num_key_value_heads, initializer_range...)."""
    return cls(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, **kwargs
    )


def random_llava(vision_config, text_config, **llava_kwargs) -> object:
    """``LlavaForConditionalGeneration`` with seed-0 random weights, eval mode, the projector's
    last layer scaled by 20 so that images matter (its output on the scale of embeddings)."""
    cfg = transformers.LlavaConfig(
        vision_config=vision_config, text_config=text_config, **llava_kwargs
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(20)
    return model


def build_llava(path: Path) -> Checkpoint:
    """CLIP ViT (32 px, 8 px patches: 16 image tokens) + projector + Qwen2, saved with today's
    ``LlavaProcessor.save_pretrained`` (``processor_config.json`` with the image processor
    nested, no ``preprocessor_config.json``)."""
    tok = hf_tokenizer()
    model = random_llava(
        tiny_vision_config("clip"),
        _text_config("qwen2", tok),
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=16,
    )
    model.save_pretrained(path)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return Checkpoint("llava", Path(path), model, tok, processor)


def test_image(seed: int = 3, size: tuple[int, int] = (45, 37)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


test_image.__test__ = False  # a helper, not a pytest test


def greedy(ck: Checkpoint, ids: list[int], n: int, pixel_values=None):
    """``n`` greedy tokens (no stop rule) and each step's log-probabilities, with transformers'
    own KV cache."""
    out, logprobs, past = [], [], None
    inp = torch.tensor([ids])
    extra = {} if pixel_values is None else {"pixel_values": pixel_values}
    with torch.no_grad():
        for _ in range(n):
            res = ck.model(input_ids=inp, past_key_values=past, use_cache=True, **extra)
            extra = {}
            past = res.past_key_values
            lp = torch.log_softmax(res.logits[0, -1].float(), -1)
            out.append(int(lp.argmax()))
            logprobs.append(lp)
            inp = torch.tensor([[out[-1]]])
    return out, logprobs
