"""EXAONE-4 (``Exaone4ForCausalLM``) over the paged KV cache: OLMo-2's post-norm layer
(`models/olmo2.py`) with Qwen3's per-head q/k norms.

* no input norm: each layer norms its attention and MLP outputs before the residual add,
  ``h += post_attn(attn(h))``, ``h += post_ff(mlp(h))``, with Llama's RMSNorm;
* ``q_norm`` / ``k_norm``: an RMSNorm over each q and k head (``head_dim``), before RoPE (the
  fused norm + RoPE kernel computes them, as Qwen3's);
* no bias on any projection, the gated SiLU MLP;
* the layers ``layer_types`` marks ``sliding_attention`` (default: all but every
  ``sliding_window_pattern``-th, 4) attend within ``sliding_window``; while a window is set the
  full-attention layers apply no RoPE (`ModelConfig.nope_layers`: identity tables from
  `LlamaForCausalLM.layer_ropes`, SmolLM3's mechanism). A checkpoint with sliding layers is
  served with its context capped at the window (`ModelConfig.max_model_len`), where full
  attention is exact.

The one-call native layer (`layer.c`: pre-norms) does not apply: the layers run op by op on the
fused q/k/v and gate/up GEMMs and the native norm + RoPE and attention kernels. The q/k norms
act within a head, so tensor parallelism splits the heads as Llama's.
"""

from __future__ import annotations

from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import MLP, Attention, RMSNorm
from shared.model.models.llama import LlamaForCausalLM
from shared.model.models.olmo2 import Olmo2DecoderLayer


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """OLMo-2's post-normed block (its forward) on Llama's RMSNorm and per-head q/k norms."""

    def __init__(self, c: ModelConfig, index: int = 0):
        nn.Module.__init__(self)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            qk_norm=True,
            eps=c.rms_norm_eps,
        )
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.native_reason = "EXAONE-4 (norms on the attention and MLP outputs) runs op by op"


class Exaone4ForCausalLM(LlamaForCausalLM):
    """Paged-KV EXAONE-4; the batch contract of ``shared/model/api.py``."""

    layer_class = Exaone4DecoderLayer
