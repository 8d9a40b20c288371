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
}
TEXT_ARCHITECTURES = {arch: mt for mt, (arch, _) in TEXT_FAMILIES.items()}
LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
SUPPORTED = (*TEXT_ARCHITECTURES, LLAVA_ARCHITECTURE)


def architecture_of(cfg: dict) -> str | None:
    """The architecture a parsed ``config.json`` declares (``architectures[0]``, else implied by
    ``model_type``); None when neither names one. Not checked against `SUPPORTED`."""
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    mt = cfg.get("model_type")
    return LLAVA_ARCHITECTURE if mt == "llava" else TEXT_FAMILIES.get(mt, (None,))[0]
