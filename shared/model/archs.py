"""The architectures Strata serves, torch-free: `strata up` checks a checkpoint with these before
any process imports torch (`shared.model.validate`); `shared.model.config` builds on them."""

from __future__ import annotations

from typing import Any

from shared.model.config_more import exaone4_sliding

# model_type -> (causal LM architecture, defaults that differ between families)
TEXT_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048}),
    "mistral": ("MistralForCausalLM", {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}),
    "qwen2": ("Qwen2ForCausalLM", {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}),
    "qwen3": ("Qwen3ForCausalLM", {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "intermediate_size": 14336,
            "rope_theta": 1e6,
        },
    ),
    # Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), split by the loader
    "phi3": (
        "Phi3ForCausalLM",
        {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "intermediate_size": 8192},
    ),
    # Gemma-2: (1 + w) RMSNorm, sqrt(hidden) embedding scale, pre/post feed-forward norms,
    # soft-capped attention scores and logits; every other layer windowed (layer_types)
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 8192,
            "intermediate_size": 9216,
            "head_dim": 256,
            "tie_word_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh",
        },
    ),
    # Qwen2-MoE: Qwen3-MoE's routed experts (no q/k norm, qkv bias) plus a shared expert whose
    # output a sigmoid gate scales
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "intermediate_size": 5632},
    ),
    # Granite: Llama with embedding / residual / attention multipliers and a logits divisor
    "granite": ("GraniteForCausalLM", {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048}),
    # OLMo-2: norms on the attention and MLP outputs (no input norm), q/k norm over all heads
    "olmo2": ("Olmo2ForCausalLM", {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048}),
    # Gemma-3 (text): Gemma-2's layer with per-head (1 + w) q/k norms, no attention cap, the
    # sliding layers (layer_types) on their own RoPE base
    "gemma3_text": (
        "Gemma3ForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            "intermediate_size": 9216,
            "head_dim": 256,
            "tie_word_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh",
            "rope_theta": 1e6,
        },
    ),
    # Gemma (1): Llama's layer with (1 + w) RMSNorms, GELU-tanh and the sqrt(hidden) embedding
    # scale of Gemma-2 (no sandwich norms, caps nor window)
    "gemma": (
        "GemmaForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 8192,
            "intermediate_size": 24576,
            "head_dim": 256,
            "tie_word_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh",
        },
    ),
    # SmolLM3: Llama whose no_rope_layers (0) apply no RoPE; sliding layers (layer_types) when
    # use_sliding_window
    "smollm3": (
        "SmolLM3ForCausalLM",
        {
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "rope_theta": 2e6,
        },
    ),
    # OLMo-3: OLMo-2 with sliding layers (layer_types, default 3 in 4) on their own RoPE
    "olmo3": (
        "Olmo3ForCausalLM",
        {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 5e5},
    ),
    # Phi (1 / 1.5 / 2): attention and MLP in parallel on one LayerNorm (with bias), RoPE on
    # part of each head (partial_rotary_factor), biases everywhere, lm_head with a bias
    "phi": (
        "PhiForCausalLM",
        {
            "rms_norm_eps": 1e-5,  # layer_norm_eps
            "max_position_embeddings": 2048,
            "intermediate_size": 8192,
            "hidden_act": "gelu_new",
        },
    ),
    # StarCoder2: LayerNorms with bias, biased projections (use_bias), an ungated GELU MLP
    "starcoder2": (
        "Starcoder2ForCausalLM",
        {
            "rms_norm_eps": 1e-5,  # norm_epsilon
            "max_position_embeddings": 4096,
            "intermediate_size": 12288,
            "hidden_act": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
        },
    ),
}
# Dense families close to Llama (`shared.model.config_dense` reads their fields):
# Ministral: Mistral whose layer_types window every layer by default (no biases at all);
# Seed-OSS: Llama with q/k/v bias (attention_bias, default on) and o_proj's own attention_out_bias;
# GLM: interleaved RoPE on part of each head (partial_rotary_factor, default 0.5), q/k/v bias,
# gate_up_proj fused; GLM-4: GLM plus norms on the attention and MLP outputs; ERNIE 4.5:
# interleaved RoPE on the whole head, use_bias on every projection; Helium: Llama with
# interleaved RoPE (`models/rope_pairs.py` turns interleaved RoPE into Llama's at load)
TEXT_FAMILIES.update(
    {
        "ministral": (
            "MinistralForCausalLM",
            {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
        ),
        "seed_oss": (
            "SeedOssForCausalLM",
            {"rms_norm_eps": 1e-6, "max_position_embeddings": 524288},
        ),
        "glm": ("GlmForCausalLM", {"rms_norm_eps": 1.5625e-7, "max_position_embeddings": 131072}),
        "glm4": ("Glm4ForCausalLM", {"rms_norm_eps": 1.5625e-7, "max_position_embeddings": 131072}),
        "ernie4_5": (
            "Ernie4_5ForCausalLM",
            {
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 131072,
                "tie_word_embeddings": True,
                "rope_theta": 5e5,
            },
        ),
        "helium": (
            "HeliumForCausalLM",
            {"rms_norm_eps": 1e-8, "max_position_embeddings": 4096, "rope_theta": 1e5},
        ),
    }
)
# DeepSeek-V3 / V2: multi-head latent attention (q and the K/V latent through low-rank
# projections, RoPE on part of each head, YaRN), DeepSeekMoE (routed experts with a grouped
# sigmoid (V3) or softmax (V2) router plus ungated shared experts) after the first
# first_k_dense_replace dense layers; `shared.model.deepseek_config` reads their fields
TEXT_FAMILIES["deepseek_v3"] = (
    "DeepseekV3ForCausalLM",
    {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "intermediate_size": 18432},
)
TEXT_FAMILIES["deepseek_v2"] = (
    "DeepseekV2ForCausalLM",
    {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "intermediate_size": 11008},
)
# GPT-NeoX: two LayerNorms (with bias), attention and MLP in parallel (use_parallel_residual) or
# in sequence, q/k/v fused per head (query_key_value), RoPE on rotary_pct of each head, an
# ungated GELU MLP, the head embed_out (`shared.model.config_neox` reads the fields of these)
TEXT_FAMILIES["gpt_neox"] = (
    "GPTNeoXForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "gelu"},
)
# StableLM: LayerNorms (with bias), parallel (use_parallel_residual) or sequential residual,
# RoPE on partial_rotary_factor of each head, q/k/v bias use_qkv_bias, per-head q/k LayerNorms
TEXT_FAMILIES["stablelm"] = (
    "StableLmForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
)
# Cohere: one bias-free LayerNorm feeding attention and MLP in parallel, interleaved RoPE pairs
# (reordered into Llama's at load, `models/rope_pairs.py`), logit_scale, tied, optional qk norm
TEXT_FAMILIES["cohere"] = (
    "CohereForCausalLM",
    {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 5e5,
    },
)
# `shared.model.config_more` reads the fields of these four:
# EXAONE-4: OLMo-2's post-norm layer with per-head q/k RMSNorms, sliding layers (layer_types,
# default all but every sliding_window_pattern-th) and, while a window is set, no RoPE on the
# full-attention layers; HunYuan-V1-Dense: Llama with per-head q/k RMSNorms after RoPE and its
# dynamic NTK-alpha RoPE; Arcee: Llama with an ungated relu2 MLP (up_proj / down_proj); Nemotron:
# LayerNorm1p ((1 + w) LayerNorm), the ungated relu2 MLP, RoPE on part of each head
TEXT_FAMILIES["exaone4"] = (
    "Exaone4ForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
)
TEXT_FAMILIES["hunyuan_v1_dense"] = (
    "HunYuanDenseV1ForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
)
TEXT_FAMILIES["arcee"] = (
    "ArceeForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "hidden_act": "relu2"},
)
TEXT_FAMILIES["nemotron"] = (
    "NemotronForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "hidden_act": "relu2"},
)
# gpt-oss: attention with a learned sink logit per head (in each softmax's denominator), q/k/v/o
# biases, every other layer sliding (layer_types, window 128), YaRN RoPE, every layer a MoE of
# biased experts (fused gate_up stored interleaved) with a clamped SwiGLU and a biased router
# whose top-k logits are softmaxed (`shared.model.config_gpt_oss` reads its fields; MXFP4 refused)
TEXT_FAMILIES["gpt_oss"] = (
    "GptOssForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 150000.0},
)
# Mixture-of-experts families on a dense family's layer (`shared.model.config_moe` reads their
# fields, `models/moe_families.py` runs them): OLMoE: Llama's layer with OLMo-2's q/k norm over
# all heads, softmax top-k; GraniteMoE / GraniteMoeShared: Granite's multipliers, a softmax over
# the top-k logits, experts fused in the checkpoint (input_linear / output_linear), plus a shared
# MLP; PhiMoE: LayerNorms, biases, the sparsemixer top-2 router, a window on every layer; ERNIE
# 4.5 MoE: ERNIE 4.5's layer, a biased-choice softmax router, ungated shared experts
TEXT_FAMILIES["olmoe"] = (
    "OlmoeForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
)
for _mt, _arch in (
    ("granitemoe", "GraniteMoeForCausalLM"),
    ("granitemoeshared", "GraniteMoeSharedForCausalLM"),
):
    TEXT_FAMILIES[_mt] = (_arch, {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048})
TEXT_FAMILIES["phimoe"] = (
    "PhimoeForCausalLM",
    {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1e6},
)
TEXT_FAMILIES["ernie4_5_moe"] = (
    "Ernie4_5_MoeForCausalLM",
    {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_theta": 5e5,
    },
)
TEXT_ARCHITECTURES = {arch: mt for mt, (arch, _) in TEXT_FAMILIES.items()}
LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
# decoders a LLaVA may hold: those of the Llama-family class its language model is (Gemma,
# Granite and OLMo have their own; SmolLM3's NoPE layers are not wired through a LLaVA)
_OWN_LAYERS = ("gemma2", "gemma3_text", "granite", "olmo2", "gemma", "smollm3", "olmo3")
_OWN_LAYERS += ("phi", "starcoder2")  # LayerNorms, ungated MLPs (Phi: parallel, partial RoPE)
_OWN_LAYERS += ("deepseek_v3", "deepseek_v2")  # latent attention, DeepSeekMoE
_OWN_LAYERS += ("gpt_neox", "stablelm", "cohere")  # LayerNorms, parallel residual
# the dense Llama-like families of `shared.model.config_dense` (not wired through a LLaVA)
_OWN_LAYERS += ("ministral", "seed_oss", "glm", "glm4", "ernie4_5", "helium")
_OWN_LAYERS += ("exaone4", "hunyuan_v1_dense", "arcee", "nemotron")  # `config_more`'s
_OWN_LAYERS += ("gpt_oss",)  # attention sinks, its own MoE
_OWN_LAYERS += ("olmoe", "granitemoe", "granitemoeshared", "phimoe", "ernie4_5_moe")  # MoE
LLAVA_TEXT_TYPES = tuple(mt for mt in TEXT_FAMILIES if mt not in _OWN_LAYERS)
SUPPORTED = (*TEXT_ARCHITECTURES, LLAVA_ARCHITECTURE)


def architecture_of(cfg: dict) -> str | None:
    """The architecture a parsed ``config.json`` declares (``architectures[0]``, else implied by
    ``model_type``); None when neither names one. Not checked against `SUPPORTED`."""
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    mt = cfg.get("model_type")
    return LLAVA_ARCHITECTURE if mt == "llava" else TEXT_FAMILIES.get(mt, (None,))[0]


# Sliding-window attention is not implemented in the paged attention (the native kernels, the
# prefix cache and the KV hand-off all assume full attention). As vLLM does for a backend without
# it, the served context is capped at the window instead: no sequence is ever longer than the
# window, so full attention equals windowed attention exactly. A window shorter than this is
# refused (a context that short serves no real prompt).
MIN_WINDOW_LEN = 32
_QWEN = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
_WINDOWED = ("mistral", "mixtral", "phi3", "gemma2", "gemma3_text", "smollm3", "olmo3", *_QWEN)
_WINDOWED += ("starcoder2",)  # every layer, like Mistral
_WINDOWED += ("ministral",)  # the layers layer_types marks (default: every one)
_WINDOWED += ("phimoe",)  # every layer, like Mistral (no window by default)
# families that window only the layers `layer_types_of` marks
_TYPED = ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text", "smollm3", "olmo3")
# transformers' default when config.json has no sliding_window key
_DEFAULT_WINDOW = {
    "mistral": 4096,
    "gemma2": 4096,
    "gemma3_text": 4096,
    "olmo3": 4096,
    **dict.fromkeys(_QWEN, 4096),
}
_DEFAULT_LAYERS = {"gemma2": 26, "gemma3_text": 26, "qwen2_moe": 24, "smollm3": 36}
_TYPED += ("ministral",)
_DEFAULT_WINDOW["ministral"] = 4096
_WINDOWED += ("exaone4",)  # the layers layer_types marks (default 3 in 4)
_TYPED += ("exaone4",)
_DEFAULT_WINDOW["exaone4"] = 4096
_WINDOWED += ("gpt_oss",)  # the layers layer_types marks (default: every other, from 0)
_TYPED += ("gpt_oss",)
_DEFAULT_WINDOW["gpt_oss"] = 128
_DEFAULT_LAYERS["gpt_oss"] = 36


def rope_layers_of(cfg: dict) -> list[int]:
    """SmolLM3's ``no_rope_layers`` as transformers reads it: per layer 1 (RoPE) or 0 (none);
    default a NoPE layer every ``no_rope_layer_interval``-th (4). Other families: all 1."""
    n = int(cfg.get("num_hidden_layers", _DEFAULT_LAYERS.get(cfg.get("model_type"), 32)))
    if cfg.get("model_type") != "smollm3":
        return [1] * n
    if cfg.get("no_rope_layers") is not None:
        return [int(x) for x in cfg["no_rope_layers"]]
    interval = int(cfg.get("no_rope_layer_interval", 4))
    return [int((i + 1) % interval != 0) for i in range(n)]


def layer_types_of(cfg: dict) -> list[str]:
    """Each decoder layer's attention, ``"sliding_attention"`` or ``"full_attention"``, as
    transformers reads ``cfg`` of a family in `_TYPED`: ``layer_types``, else the family's
    default. Gemma-2 windows every other layer (0, 2, 4...), Gemma-3 all but every
    ``sliding_window_pattern``-th (default 6), OLMo-3 all but every 4th, Qwen2-MoE every other
    one below ``max_window_layers``, Qwen2 / Qwen3 those from ``max_window_layers`` on, SmolLM3
    its NoPE layers when ``use_sliding_window`` and a ``sliding_window`` are set, Ministral every
    layer unless ``sliding_window`` is null, EXAONE-4 all but every ``sliding_window_pattern``-th
    (default 4) unless ``sliding_window`` is null."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    mt = cfg.get("model_type", "llama")
    n = int(cfg.get("num_hidden_layers", _DEFAULT_LAYERS.get(mt, 32)))
    if mt == "exaone4":  # all but every sliding_window_pattern-th (4) while a window is set
        slides = [exaone4_sliding(cfg, i) for i in range(n)]
        return ["sliding_attention" if s else "full_attention" for s in slides]
    first = int(cfg.get("max_window_layers", 28))
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    smol = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
    rope = rope_layers_of(cfg) if mt == "smollm3" else []
    sliding = {
        "gemma2": lambda i: (i + 1) % 2,
        "gpt_oss": lambda i: (i + 1) % 2,  # as Gemma-2: 0, 2, 4... (GptOssConfig)
        "gemma3_text": lambda i: (i + 1) % pattern,
        "olmo3": lambda i: (i + 1) % 4,
        "qwen2_moe": lambda i: (i + 1) % 2 and i < first,
        "smollm3": lambda i: smol and not rope[i],
        "ministral": lambda i: cfg.get("sliding_window", 4096) is not None,
    }.get(mt, lambda i: i >= first)
    return ["sliding_attention" if sliding(i) else "full_attention" for i in range(n)]


def sliding_window_of(cfg: dict) -> int | None:
    """The attention window (in tokens) some layer of the decoder config ``cfg`` applies, as
    transformers reads it; None when every layer attends to the full context.

    Mistral / Mixtral / Phi-3 / StarCoder2: ``sliding_window`` (null: none); Gemma-2 /
    Gemma-3 / OLMo-3 / SmolLM3 / Ministral / EXAONE-4 the layers `layer_types_of` marks
    (SmolLM3's mask windows them whatever ``use_sliding_window`` says). Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE: only with
    ``use_sliding_window``; Qwen2 / Qwen3 / Qwen2-MoE then only the layers `layer_types_of`
    marks. Llama, Gemma, Granite, OLMo-2 and Phi have no window."""
    mt = cfg.get("model_type", "llama")
    window = cfg.get("sliding_window", _DEFAULT_WINDOW.get(mt))
    if window is None or mt not in _WINDOWED:
        return None
    if mt in _QWEN and not cfg.get("use_sliding_window", False):
        return None
    if mt in _TYPED and "sliding_attention" not in layer_types_of(cfg):
        return None
    return int(window)


def decoder_config(cfg: dict) -> dict:
    """The decoder part of a parsed ``config.json`` (a LLaVA's ``text_config``)."""
    if architecture_of(cfg) == LLAVA_ARCHITECTURE:
        text = cfg.get("text_config")
        return text if isinstance(text, dict) else {"model_type": "llama"}
    return cfg
