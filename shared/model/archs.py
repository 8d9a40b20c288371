"""The architectures Strata serves, torch-free: `strata up` checks a checkpoint with these before
any process imports torch (`shared.model.validate`); `shared.model.config` builds on them."""

from __future__ import annotations

from typing import Any

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
}
TEXT_ARCHITECTURES = {arch: mt for mt, (arch, _) in TEXT_FAMILIES.items()}
LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
# decoders a LLaVA may hold: those of the Llama-family class its language model is (Gemma,
# Granite and OLMo-2 have their own)
LLAVA_TEXT_TYPES = tuple(
    mt for mt in TEXT_FAMILIES if mt not in ("gemma2", "gemma3_text", "granite", "olmo2")
)
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
_WINDOWED = ("mistral", "mixtral", "phi3", "gemma2", "gemma3_text", *_QWEN)
# families that window only the layers `layer_types_of` marks
_TYPED = ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text")
# transformers' default when config.json has no sliding_window key
_DEFAULT_WINDOW = {
    "mistral": 4096,
    "gemma2": 4096,
    "gemma3_text": 4096,
    **dict.fromkeys(_QWEN, 4096),
}
_DEFAULT_LAYERS = {"gemma2": 26, "gemma3_text": 26, "qwen2_moe": 24}


def layer_types_of(cfg: dict) -> list[str]:
    """Each decoder layer's attention, ``"sliding_attention"`` or ``"full_attention"``, as
    transformers reads ``cfg`` of a family in `_TYPED`: ``layer_types``, else the family's
    default. Gemma-2 windows every other layer (0, 2, 4...), Gemma-3 all but every
    ``sliding_window_pattern``-th (default 6), Qwen2-MoE every other one below
    ``max_window_layers``, Qwen2 / Qwen3 those from ``max_window_layers`` on."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    mt = cfg.get("model_type", "llama")
    n = int(cfg.get("num_hidden_layers", _DEFAULT_LAYERS.get(mt, 32)))
    first = int(cfg.get("max_window_layers", 28))
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    sliding = {
        "gemma2": lambda i: (i + 1) % 2,
        "gemma3_text": lambda i: (i + 1) % pattern,
        "qwen2_moe": lambda i: (i + 1) % 2 and i < first,
    }.get(mt, lambda i: i >= first)
    return ["sliding_attention" if sliding(i) else "full_attention" for i in range(n)]


def sliding_window_of(cfg: dict) -> int | None:
    """The attention window (in tokens) some layer of the decoder config ``cfg`` applies, as
    transformers reads it; None when every layer attends to the full context.

    Mistral / Mixtral / Phi-3: ``sliding_window`` (null: none); Gemma-2 / Gemma-3 the layers
    `layer_types_of` marks. Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE: only with
    ``use_sliding_window``; Qwen2 / Qwen3 / Qwen2-MoE then only the layers `layer_types_of`
    marks. Llama, Granite and OLMo-2 have no window."""
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
