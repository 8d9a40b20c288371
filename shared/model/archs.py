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
}
TEXT_ARCHITECTURES = {arch: mt for mt, (arch, _) in TEXT_FAMILIES.items()}
LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
# decoders a LLaVA may hold (its language model is the Llama-family class; Gemma-2 is not)
LLAVA_TEXT_TYPES = tuple(mt for mt in TEXT_FAMILIES if mt != "gemma2")
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
_QWEN = ("qwen2", "qwen3", "qwen3_moe")
# transformers' default when config.json has no sliding_window key
_DEFAULT_WINDOW = {"mistral": 4096, "gemma2": 4096, **dict.fromkeys(_QWEN, 4096)}


def sliding_window_of(cfg: dict) -> int | None:
    """The attention window (in tokens) some layer of the decoder config ``cfg`` applies, as
    transformers reads it; None when every layer attends to the full context.

    Mistral / Mixtral / Phi-3: ``sliding_window`` (null: none); Gemma-2 the layers
    ``layer_types`` marks (default: every other one). Qwen2 / Qwen3 / Qwen3-MoE: only with
    ``use_sliding_window``; Qwen2 / Qwen3 window the layers from ``max_window_layers`` on (or
    those ``layer_types`` marks ``sliding_attention``). Llama has no window."""
    mt = cfg.get("model_type", "llama")
    window = cfg.get("sliding_window", _DEFAULT_WINDOW.get(mt))
    if window is None or mt not in ("mistral", "mixtral", "phi3", "gemma2", *_QWEN):
        return None
    if mt in _QWEN and not cfg.get("use_sliding_window", False):
        return None
    types = cfg.get("layer_types")
    if mt == "gemma2" and types is None:  # transformers' default: layers 0, 2, 4... windowed
        types = [
            "sliding_attention" if (i + 1) % 2 else "full"
            for i in range(cfg.get("num_hidden_layers", 26))
        ]
    if mt in ("qwen2", "qwen3", "gemma2"):
        if types is None:  # Qwen2 / Qwen3
            n, first = cfg.get("num_hidden_layers", 32), cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full" for i in range(n)]
        if "sliding_attention" not in types:
            return None
    return int(window)


def decoder_config(cfg: dict) -> dict:
    """The decoder part of a parsed ``config.json`` (a LLaVA's ``text_config``)."""
    if architecture_of(cfg) == LLAVA_ARCHITECTURE:
        text = cfg.get("text_config")
        return text if isinstance(text, dict) else {"model_type": "llama"}
    return cfg
