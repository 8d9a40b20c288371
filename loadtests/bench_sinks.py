"""GPT-OSS's attention sinks on the native attention kernels against the torch path they took
before, in the in-process engine.

    .venv/bin/python -m loadtests.bench_sinks [--workloads standard,long-outputs] [--repeats 4]

The model: a random gpt-oss checkpoint that transformers saves here (``.cache/models/
bench-gpt-oss``) with the benchmark model's shapes (hidden 512, 8 layers, 8 query and 4 KV
heads of 64, its tokenizer and vocabulary) and 4 experts of 2 per token; the sliding window
past every prompt. Each run is bench_peer's in-process engine side (`engine_run`: a fresh
`LLMEngine` as the decode service builds it, 2 threads, all prompts at once); the sides
alternate, the torch side with `SinkAttention.attend` on `softcap_attention` (what every gpt-oss
attention call ran before the kernels took the sink term). Prints output tok/s per side
(median and spread) and how many requests' greedy tokens are identical between the sides.
"""

from __future__ import annotations

import argparse
import os
import shutil

from loadtests.bench_peer import model_for, native_vs_torch


def gpt_oss_checkpoint() -> str:
    """The checkpoint, saved by transformers once (random weights, seed 0)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    path = os.path.join(".cache", "models", "bench-gpt-oss")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    base = model_for("25m")
    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=2240,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=512,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8192,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = GptOssForCausalLM(cfg).float()
    with torch.no_grad():  # sinks of the size a trained model has, so their term matters
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(base, name), os.path.join(path, name))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="standard,long-outputs")
    ap.add_argument("--repeats", type=int, default=4, help="runs per side")
    a = ap.parse_args()
    from shared.model.models import gpt_oss
    from shared.model.softcap import softcap_attention

    model_dir = gpt_oss_checkpoint()
    native = gpt_oss.SinkAttention.attend

    def torch_path(self, q, k, v, plan, slot_mapping, k_cache, v_cache):
        return softcap_attention(
            q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale, None, self.sinks
        )

    def use(side: str) -> None:
        gpt_oss.SinkAttention.attend = native if side == "native" else torch_path

    native_vs_torch(model_dir, a.workloads.split(","), a.repeats, use, "torch path")


if __name__ == "__main__":
    main()
