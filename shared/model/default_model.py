"""The built-in default model and the standard benchmark model, generated offline.

Both are written by Strata's own code (transformers is only a test oracle) in the Hugging Face
layout: ``config.json``, ``model.safetensors``, ``tokenizer.json`` (byte-level BPE trained on
``corpus.corpus_lines``), ``tokenizer_config.json`` (ChatML template), ``generation_config.json``
and, for the VLM, ``preprocessor_config.json``. A marker file with ``VERSION`` is written last;
a directory that already holds it is reused as is.

    python -m shared.model.default_model OUT_DIR [--benchmark] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from shared.model.config import config_from_dict
from shared.model.corpus import corpus_lines
from shared.model.loader import meta_model

VERSION = "strata-model-v2"
MARKER = ".strata_model_version"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
TOKENIZER_VOCAB = 4096

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def train_tokenizer(seed: int = 0) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenizer, NFC) with the ChatML special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(seed), trainer)
    return tok


def _text_config(vocab: int, eos: int, **dims) -> dict:
    theta = 1_000_000.0
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "max_position_embeddings": 16384,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos,
        "initializer_range": 0.5,
        "torch_dtype": "float32",
        "dtype": "float32",
        **dims,
    }


def _init_weights(model: torch.nn.Module, seed: int, text_std: float) -> dict[str, torch.Tensor]:
    """Deterministic weights: N(0, std) matrices, ones for norms, zeros for biases."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or "layer_norm" in name:
            t = torch.ones(p.shape) if name.endswith("weight") else torch.zeros(p.shape)
        elif name.endswith("bias"):
            t = torch.zeros(p.shape)
        else:
            vision = name.startswith(("vision_tower.", "multi_modal_projector."))
            fan_in = math.prod(p.shape[1:]) if p.dim() > 1 else p.shape[0]
            std = 1.0 / math.sqrt(fan_in) if vision else text_std
            if name.startswith("multi_modal_projector.linear_2"):
                std = 0.8 / math.sqrt(fan_in)  # image embeddings on the scale of token embeddings
            t = torch.randn(p.shape, generator=g) * std
        out[name] = t.contiguous()
    return out


def _write(out: Path, config: dict, tok: Tokenizer, seed: int, extra: dict[str, dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    marker = out / MARKER
    if marker.exists() and marker.read_text().strip() == f"{VERSION} seed={seed}":
        return out
    mc = config_from_dict(config)
    model = meta_model(mc)
    save_file(
        _init_weights(model, seed, 0.5), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(out / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "image_token": "<image>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": CHAT_TEMPLATE,
        },
        "generation_config.json": {"bos_token_id": None, "eos_token_id": eos, "do_sample": False},
        **extra,
    }
    for name, body in files.items():
        (out / name).write_text(json.dumps(body, indent=2, ensure_ascii=False))
    marker.write_text(f"{VERSION} seed={seed}\n")
    return out


def _vocab_size(tok: Tokenizer) -> int:
    return -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64


def build_default_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Tiny LLaVA (Qwen3 text + CLIP ViT 64px/16 + MLP projector), 16 tokens per image."""
    tok = train_tokenizer()
    eos = tok.token_to_id("<|im_end|>")
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "torch_dtype": "float32",
        "dtype": "float32",
        "image_token_index": tok.token_to_id("<image>"),
        "image_seq_length": 16,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "multimodal_projector_bias": True,
        "tie_word_embeddings": False,
        "text_config": _text_config(
            _vocab_size(tok),
            eos,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
        ),
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 64,
            "patch_size": 16,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "num_channels": 3,
            "projection_dim": 64,
        },
    }
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": 64},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 64, "width": 64},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_convert_rgb": True,
    }
    return _write(Path(out_dir), config, tok, seed, {"preprocessor_config.json": preprocessor})


def build_benchmark_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Text-only Qwen3: hidden 512, 8 layers, 8 heads / 4 KV heads of 64, fp32 (~24M params)."""
    tok = train_tokenizer()
    config = _text_config(
        _vocab_size(tok),
        tok.token_to_id("<|im_end|>"),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    return _write(Path(out_dir), config, tok, seed, {})


def build_benchmark_model_250m(out_dir: str | Path, seed: int = 0) -> Path:
    """Text-only Qwen3 of ~253M params for `loadtests.bench_peer --model-size 250m`: hidden
    1024, 16 layers, 16 heads / 8 KV heads of 64, intermediate 2816, fp32; the vocab is padded
    to 32768 (the tokenizer has 4096 ids; the rest are never produced by it)."""
    tok = train_tokenizer()
    config = _text_config(
        32768,
        tok.token_to_id("<|im_end|>"),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
    )
    return _write(Path(out_dir), config, tok, seed, {})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--benchmark", action="store_true", help="build the benchmark model instead")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    build = build_benchmark_model if args.benchmark else build_default_model
    print(build(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
