"""``ModelConfig``: one normalised view of a Hugging Face ``config.json``.

Handles what transformers 4.x and 5.x write: ``torch_dtype`` vs ``dtype``, ``rope_theta`` +
``rope_scaling`` vs a nested ``rope_parameters`` dict, ``image_token_index`` vs
``image_token_id``. Missing keys fall back to the transformers defaults of the model type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.model.archs import (
    LLAVA_ARCHITECTURE,
    LLAVA_TEXT_TYPES,
    TEXT_ARCHITECTURES,
    architecture_of,
    sliding_window_of,
)
from shared.model.archs import TEXT_FAMILIES as _TEXT_FAMILIES
from shared.model.config_dense import dense_fields
from shared.model.config_fields import (
    gemma_fields,
    granite_fields,
    layernorm_fields,
    moe_fields,
    rope_fields,
)
from shared.model.config_gpt_oss import gpt_oss_fields
from shared.model.config_moe import moe_family_fields
from shared.model.config_more import more_fields
from shared.model.config_neox import neox_fields
from shared.model.deepseek_config import LatentAttention, Routing, deepseek_fields
from shared.model.errors import CheckpointError
from shared.model.validate import check_decoder, declared_dtype, read_config_json
from shared.protocol.dtypes import canonical_name, torch_dtype

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class VisionConfig:
    """Vision tower + projector settings of a LLaVA-style checkpoint."""

    model_type: str  # "clip_vision_model" or "siglip_vision_model"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # square input resolution in pixels
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # activation inside the tower's MLP
    feature_layer: (
        int | tuple[int, ...]
    )  # hidden-state index (or indices, concatenated) fed to the projector
    select_strategy: str  # "default" drops the CLS token, "full" keeps every token
    projector_act: str  # activation between the projector's two linears
    projector_bias: bool

    @property
    def has_cls_token(self) -> bool:
        """CLIP prepends a class token; SigLIP does not."""
        return self.model_type.startswith("clip")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Projected tokens per image (what one image placeholder expands to)."""
        n = self.num_patches + int(self.has_cls_token)
        return n - 1 if self.select_strategy == "default" else n


@dataclass(frozen=True)
class ModelConfig:
    """Decoder (and optional vision) hyper-parameters, independent of the transformers version."""

    architecture: str  # HF architecture name, e.g. "Qwen3ForCausalLM"
    model_type: str  # HF model_type of the checkpoint ("llava" for VLMs)
    text_model_type: str  # model_type of the decoder ("llama", "qwen2", "qwen3")
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # the norms' eps (Phi / StarCoder2: their LayerNorms')
    rope_theta: float
    rope_scaling: dict | None  # rope parameters besides theta when rope_type != "default"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool  # bias on the output projection (Llama: attention_bias; Qwen2: never)
    mlp_bias: bool
    qk_norm: bool  # RMSNorm on q and k before RoPE (Qwen3, Gemma-3 per head; OLMo-2 all heads)
    hidden_act: str
    dtype_name: str  # checkpoint dtype's wire name, "bfloat16" (the loader may override)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    num_image_tokens: int = 0  # tokens per image after placeholder expansion; 0 for text-only
    image_size: int = 0  # vision input resolution; 0 for text-only
    num_experts: int = 0  # routed experts per MoE layer (0: dense model)
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # hidden width of one expert's gated MLP
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()  # indices of the layers whose MLP is the sparse MoE block
    sliding_window: int | None = None  # attention window some layer applies (None: full)
    attn_logit_softcapping: float | None = None  # Gemma-2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma-2: logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # Gemma-2/3: attention scale is its -1/2 power
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the gated shared expert's width (0: none)
    embedding_multiplier: float = 1.0  # Granite: token embeddings are multiplied by it
    residual_multiplier: float = 1.0  # Granite: attention / MLP outputs times it before the add
    attention_multiplier: float | None = None  # Granite: the attention scale (None: head_dim^-1/2)
    logits_scaling: float = 1.0  # Granite: logits are divided by it
    rope_local: tuple[float, dict | None] | None = None  # Gemma-3/OLMo-3: sliding layers' RoPE
    sliding_layers: tuple[int, ...] = ()  # Gemma-3/OLMo-3: the layers on `rope_local`
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers that apply no RoPE (no_rope_layers 0)
    partial_rotary_factor: float = 1.0  # Phi / GLM: RoPE on the first int(head_dim * this) dims
    mla: LatentAttention | None = None  # DeepSeek: multi-head latent attention's shapes
    routing: Routing | None = None  # DeepSeek's router and shared experts (None: softmax top-k)
    parallel_residual: bool = False  # GPT-NeoX / StableLM / Cohere: attention and MLP in parallel
    logit_scale: float = 1.0  # Cohere: logits are multiplied by it
    lm_head_bias: bool = False  # PhiMoE: the LM head has a bias (lm_head_bias)

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint dtype as torch's (imports torch: processes that run no model, such as
        the tokenizer, read `dtype_name`)."""
        return torch_dtype(self.dtype_name)

    @property
    def is_multimodal(self) -> bool:
        return self.vision is not None

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output tokens) Strata serves: the position limit, capped
        at the sliding window (the paged attention attends to the full context, which equals the
        window's attention exactly while no sequence is longer than it)."""
        return min(
            self.max_position_embeddings, self.sliding_window or self.max_position_embeddings
        )


def parse_dtype(value: Any, default: torch.dtype | None = None) -> torch.dtype:
    """Map a config dtype string (or torch dtype) to ``torch.dtype`` (None: ``default``,
    float32 when that is None too)."""
    import torch

    if value is None:
        return torch.float32 if default is None else default
    if isinstance(value, torch.dtype):
        return value
    return torch_dtype(value, floats_only=True)


def parse_dtype_name(value: Any, default: str = "float32") -> str:
    """`parse_dtype` by wire name, without torch: a config dtype string (None: ``default``)."""
    return default if value is None else canonical_name(value, floats_only=True)


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


# families whose attention_bias puts a bias on o_proj too (Qwen2 / Qwen2-MoE, Mistral, Phi-3:
# never)
_O_PROJ_BIAS = ("llama", "qwen3", "qwen3_moe", "granite", "olmo2", "gemma3_text")
_O_PROJ_BIAS += ("gemma", "smollm3", "olmo3")


# Gemma's legacy "gelu" means the tanh approximation (transformers' GemmaConfig rewrites it)
_GEMMA_GELU = {("gemma", "gelu"): "gelu_pytorch_tanh"}


def _text_fields(cfg: dict, source: str) -> dict[str, Any]:
    model_type = cfg.get("model_type", "llama")
    if model_type not in _TEXT_FAMILIES:
        raise CheckpointError(f"{source}: unsupported text model_type {model_type!r}")
    _, defaults = _TEXT_FAMILIES[model_type]
    hidden = int(cfg.get("hidden_size", 4096))
    heads = int(cfg.get("num_attention_heads", 32))
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or defaults.get("head_dim") or hidden // heads
    bias = bool(cfg.get("attention_bias", False)) and model_type != "mixtral"
    if model_type == "qwen2_moe":  # q/k/v bias unless qkv_bias is false (a 5.x key)
        bias = bool(cfg.get("qkv_bias", True))
    check_decoder(cfg, source)
    act = str(
        cfg.get("hidden_activation") or cfg.get("hidden_act", defaults.get("hidden_act", "silu"))
    )
    return (
        dict(
            **rope_fields(cfg, source),
            **moe_fields(cfg),
            **gemma_fields(cfg, source),
            **granite_fields(cfg),
            sliding_window=sliding_window_of(cfg),
            text_model_type=model_type,
            vocab_size=int(cfg.get("vocab_size", 32000)),
            hidden_size=hidden,
            intermediate_size=int(
                cfg.get("intermediate_size", defaults.get("intermediate_size", 11008))
            ),
            num_layers=int(cfg.get("num_hidden_layers", 32)),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", defaults["rms_norm_eps"])),
            max_position_embeddings=int(
                cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
            ),
            attention_bias=True if model_type == "qwen2" else bias,
            o_proj_bias=bias and model_type in _O_PROJ_BIAS,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text", "olmo3"),
            hidden_act=_GEMMA_GELU.get((model_type, act), act),
        )
        | layernorm_fields(cfg)
        | dense_fields(cfg)
        | deepseek_fields(cfg, source)
        | neox_fields(cfg)
        | more_fields(cfg)
        | gpt_oss_fields(cfg, source)
        | moe_family_fields(cfg, source)
    )
    # Phi / StarCoder2: their eps, biases, q/k LayerNorm; the dense Llama-like families
    # (`shared.model.config_dense`): shapes, biases; DeepSeek-V3 / V2 (`deepseek_config`);
    # GPT-NeoX / StableLM / Cohere (`config_neox`): shapes, biases, residual layout
    # EXAONE-4 / HunYuan-V1-Dense / Arcee / Nemotron (`config_more`): shapes, biases, NoPE
    # gpt-oss (`config_gpt_oss`): shapes, YaRN, biases, its MoE router
    # OLMoE / GraniteMoE(Shared) / PhiMoE / ERNIE 4.5 MoE (`config_moe`): shapes, biases, routers


def _vision_config(cfg: dict) -> VisionConfig:
    vc = cfg.get("vision_config") or {}
    model_type = vc.get("model_type", "clip_vision_model")
    if model_type not in ("clip_vision_model", "siglip_vision_model"):
        raise CheckpointError(f"config.json: unsupported vision model_type {model_type!r}")
    clip = model_type == "clip_vision_model"
    # LLaVA's default vision tower is CLIP ViT-L/14-336; SigLIP defaults follow SiglipVisionConfig.
    d = (
        dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            hidden_act="quick_gelu",
            layer_norm_eps=1e-5,
        )
        if clip
        else dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=224,
            patch_size=16,
            hidden_act="gelu_pytorch_tanh",
            layer_norm_eps=1e-6,
        )
    )
    d.update({k: v for k, v in vc.items() if k in d})
    layer = cfg.get("vision_feature_layer", -2)
    return VisionConfig(
        model_type=model_type,
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=int(d["num_attention_heads"]),
        image_size=int(d["image_size"]),
        patch_size=int(d["patch_size"]),
        num_channels=int(vc.get("num_channels", 3)),
        layer_norm_eps=float(d["layer_norm_eps"]),
        hidden_act=str(d["hidden_act"]),
        feature_layer=layer if isinstance(layer, int) else tuple(int(x) for x in layer),
        select_strategy=str(cfg.get("vision_feature_select_strategy", "default")),
        projector_act=str(cfg.get("projector_hidden_act", "gelu")),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
    )


def config_from_dict(cfg: dict, source: str = "config.json") -> ModelConfig:
    """Normalise a parsed ``config.json``; ``source`` names the file in error messages."""
    arch = architecture_of(cfg)
    if arch != LLAVA_ARCHITECTURE and arch not in TEXT_ARCHITECTURES:
        raise CheckpointError(f"{source}: unknown architecture {arch!r}")
    if arch == LLAVA_ARCHITECTURE:
        text = dict(cfg.get("text_config") or {"model_type": "llama"})
        if text.get("model_type", "llama") not in LLAVA_TEXT_TYPES:
            raise CheckpointError(
                f"{source}: unsupported LLaVA text model_type {text.get('model_type')!r}"
            )
        fields = _text_fields(text, source)
        vision = _vision_config(cfg)
        image_token_id = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
        tie = bool(cfg.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
        return ModelConfig(
            architecture=arch,
            model_type="llava",
            **fields,
            tie_word_embeddings=tie,
            dtype_name=parse_dtype_name(declared_dtype(cfg)),
            bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
            eos_token_ids=_eos_tuple(text.get("eos_token_id", cfg.get("eos_token_id"))),
            vision=vision,
            image_token_id=int(image_token_id),
            num_image_tokens=vision.num_image_tokens,
            image_size=vision.image_size,
        )
    fields = _text_fields(cfg, source)
    return ModelConfig(
        architecture=arch,
        model_type=cfg.get("model_type", fields["text_model_type"]),
        **fields,
        tie_word_embeddings=bool(
            cfg.get(
                "tie_word_embeddings",
                _TEXT_FAMILIES[fields["text_model_type"]][1].get("tie_word_embeddings", False),
            )
        ),
        dtype_name=parse_dtype_name(declared_dtype(cfg)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read ``<path>/config.json`` (or a config.json path) into a ``ModelConfig``."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    raw = read_config_json(file)
    try:
        return config_from_dict(raw, source=str(file))
    except (TypeError, ValueError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: bad value ({type(e).__name__}: {e})") from e
