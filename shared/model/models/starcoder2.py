"""StarCoder2 over the paged KV cache: the Llama-family model with GPT-style parts.

* ``input_layernorm`` / ``post_attention_layernorm`` and the final ``norm`` are LayerNorms with
  a bias (``norm_epsilon``), torch's ``nn.LayerNorm`` as in transformers;
* q/k/v/o and the MLP carry biases when ``use_bias`` (the default);
* the MLP is ungated: ``c_proj(gelu_tanh(c_fc(x)))`` (`PlainMLP`);
* GQA (default 2 KV heads), full-head RoPE, tied embeddings by default.

A ``sliding_window`` applies to every layer; Strata serves such a checkpoint with its context
capped at the window (`ModelConfig.max_model_len`), where full attention is exact. The
attention is the Llama family's (fused q/k/v GEMM, native RoPE and paged attention kernels);
the one-call native layer (`layer.c`: RMSNorms, SiLU gating) does not apply, so the layers run
op by op (counted as a ``decoder_layer`` fallback, reason ``unsupported``).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import PreNormBlock, activation, project
from shared.model.models.llama import LlamaForCausalLM


class PlainMLP(nn.Module):
    """Ungated MLP ``out(act(in(x)))`` whose two projections take the checkpoint's names
    (``names``: StarCoder2's ``c_fc`` / ``c_proj``, Phi's ``fc1`` / ``fc2``); tensor parallelism
    splits them by ``fc_names`` (`shared.model.parallel.shard_model`)."""

    def __init__(self, c: ModelConfig, names: tuple[str, str]):
        super().__init__()
        self.fc_names = names
        setattr(self, names[0], nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias))
        setattr(self, names[1], nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias))
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc_in, fc_out = (getattr(self, n) for n in self.fc_names)
        return project(fc_out, self.act(project(fc_in, x)))


class Starcoder2DecoderLayer(PreNormBlock):
    """Pre-LayerNorm block: ``h += attn(ln1(h)); h += mlp(ln2(h))``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        mlp = PlainMLP(c, ("c_fc", "c_proj"))
        reason = "StarCoder2 (LayerNorms, ungated GELU MLP) runs op by op"
        super().__init__(c, mlp, nn.LayerNorm, reason)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """Paged-KV StarCoder2; the batch contract of ``shared/model/api.py``."""

    layer_class = Starcoder2DecoderLayer
    norm_class = nn.LayerNorm
