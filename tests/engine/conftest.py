"""Tiny random HF checkpoints (built offline with transformers) and engine helpers."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)

VOCAB = 256
EOS = 255


def _save(kind: str, out):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,
        eos_token_id=EOS,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = tf.Qwen3Config(head_dim=16, **common)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        cfg = tf.LlamaConfig(**common)
        model = tf.LlamaForCausalLM(cfg)
    model = model.float().eval()
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def hf_ckpt(request, tmp_path_factory):
    """(hf_model, path) for a tiny random checkpoint."""
    out = tmp_path_factory.mktemp(request.param)
    return _save(request.param, out), out


@pytest.fixture(scope="session")
def qwen_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_only")
    return _save("qwen3", out), out


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, EOS, (n,), generator=g).tolist() for n in lengths]
