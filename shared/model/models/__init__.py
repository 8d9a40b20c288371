"""Model classes by Hugging Face architecture name (lazy imports keep start-up light)."""

from __future__ import annotations

from importlib import import_module

from torch import nn

from shared.model.config import LLAVA_ARCHITECTURE, TEXT_ARCHITECTURES, ModelConfig

_REGISTRY = {arch: "shared.model.models.llama:LlamaForCausalLM" for arch in TEXT_ARCHITECTURES}
# their own layers (the rest, SmolLM3 included: Llama's)
for _arch in ("Gemma2", "Gemma3", "Granite", "Olmo2", "Gemma", "Olmo3"):
    _REGISTRY[f"{_arch}ForCausalLM"] = f"shared.model.models.{_arch.lower()}:{_arch}ForCausalLM"
for _arch in ("Phi", "Starcoder2"):  # LayerNorm families with ungated MLPs
    _REGISTRY[f"{_arch}ForCausalLM"] = f"shared.model.models.{_arch.lower()}:{_arch}ForCausalLM"
# interleaved RoPE turned into Llama's at load (Ministral and Seed-OSS: Llama's class)
for _arch in ("Glm", "Glm4", "Ernie4_5", "Helium"):
    _REGISTRY[f"{_arch}ForCausalLM"] = f"shared.model.models.rope_pairs:{_arch}ForCausalLM"
for _arch in ("DeepseekV3", "DeepseekV2"):  # latent attention, DeepSeekMoE
    _REGISTRY[f"{_arch}ForCausalLM"] = f"shared.model.models.deepseek:{_arch}ForCausalLM"
# LayerNorm families on Phi's parallel / partial-RoPE pieces
_REGISTRY["GPTNeoXForCausalLM"] = "shared.model.models.gpt_neox:GPTNeoXForCausalLM"
_REGISTRY["StableLmForCausalLM"] = "shared.model.models.stablelm:StableLmForCausalLM"
_REGISTRY["CohereForCausalLM"] = "shared.model.models.cohere:CohereForCausalLM"
_REGISTRY["GptOssForCausalLM"] = "shared.model.models.gpt_oss:GptOssForCausalLM"  # sinks, MoE
# post-norms (EXAONE-4), q/k norms after RoPE (HunYuan), ungated relu2 MLPs (Arcee, Nemotron)
_REGISTRY["Exaone4ForCausalLM"] = "shared.model.models.exaone4:Exaone4ForCausalLM"
_REGISTRY["HunYuanDenseV1ForCausalLM"] = "shared.model.models.hunyuan:HunYuanDenseV1ForCausalLM"
_REGISTRY["ArceeForCausalLM"] = "shared.model.models.arcee:ArceeForCausalLM"
_REGISTRY["NemotronForCausalLM"] = "shared.model.models.nemotron:NemotronForCausalLM"
# mixture-of-experts families on a dense family's layer (OLMo-2, Granite, PhiMoE's LayerNorms, ERNIE)
for _arch in ("Olmoe", "GraniteMoe", "GraniteMoeShared", "Phimoe", "Ernie4_5_Moe"):
    _REGISTRY[f"{_arch}ForCausalLM"] = f"shared.model.models.moe_families:{_arch}ForCausalLM"
_REGISTRY[LLAVA_ARCHITECTURE] = "shared.model.models.llava:LlavaForConditionalGeneration"


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The Strata module class implementing ``config.architecture``."""
    module, name = _REGISTRY[config.architecture].split(":")
    return getattr(import_module(module), name)
