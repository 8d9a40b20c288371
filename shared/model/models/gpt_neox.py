"""GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B) over the paged KV cache, built from
Phi's general pieces (`models/phi.py`):

* two LayerNorms with bias per layer; with ``use_parallel_residual`` (the default) attention and
  MLP run side by side, ``h = mlp(ln2(h)) + attn(ln1(h)) + h``, else in sequence;
* q, k and v in one ``attention.query_key_value`` projection laid out head by head (each head's
  q, k and v rows together): the loader splits it into q_proj / k_proj / v_proj row by head
  (`fused_parts`), so the fused q/k/v GEMM, tensor parallelism and the KV cache see the
  Llama-family layout;
* RoPE on the first ``int(head_dim * rotary_pct)`` dims of each head (default a quarter), the
  rest passed through (`PartialRotaryAttention`);
* ``attention_bias`` (default on) on ``query_key_value`` and ``dense``; an ungated GELU MLP
  (``dense_h_to_4h`` / ``dense_4h_to_h``, always biased); the head ``embed_out`` (no bias).

Checkpoint names map onto the Llama-family tree (`our_name`): ``gpt_neox.embed_in`` ->
``model.embed_tokens``, ``gpt_neox.layers.N.attention`` -> ``model.layers.N.self_attn``,
``gpt_neox.final_layer_norm`` -> ``model.norm``, ``embed_out`` -> ``lm_head``. The layers run
op by op (LayerNorms, partial RoPE: ``decoder_layer`` and ``qk_norm_rope`` fallbacks, reason
``unsupported``), on the fused q/k/v GEMM, the packed GEMMs and the native attention kernels.
"""

from __future__ import annotations

from torch import nn

from shared.model.config import ModelConfig
from shared.model.models.phi import ParallelBlock, PartialRotaryAttention, PartialRotaryForCausalLM
from shared.model.models.starcoder2 import PlainMLP

# checkpoint name prefixes / infixes -> Strata's
_PREFIXES = (
    ("gpt_neox.embed_in.", "model.embed_tokens."),
    ("gpt_neox.final_layer_norm.", "model.norm."),
    ("gpt_neox.layers.", "model.layers."),
    ("embed_out.", "lm_head."),
)
_ATTENTION = ".attention."


class GPTNeoXDecoderLayer(ParallelBlock):
    """GPT-NeoX's layer (see the module doc)."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(
            PartialRotaryAttention(c, c.attention_bias, c.o_proj_bias, o_name="dense"),
            PlainMLP(c, ("dense_h_to_4h", "dense_4h_to_h")),
            nn.LayerNorm(c.hidden_size, c.rms_norm_eps),
            nn.LayerNorm(c.hidden_size, c.rms_norm_eps),
            c.parallel_residual,
            "GPT-NeoX (LayerNorms, parallel residual, partial RoPE) runs op by op",
        )


class GPTNeoXForCausalLM(PartialRotaryForCausalLM):
    """Paged-KV GPT-NeoX; the batch contract of ``shared/model/api.py``."""

    layer_class = GPTNeoXDecoderLayer
    norm_class = nn.LayerNorm

    @staticmethod
    def our_name(name: str) -> str:
        """A checkpoint tensor's name in this model's tree (the loader's hook)."""
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        return name.replace(_ATTENTION, ".self_attn.", 1)

    def fused_parts(self, name: str) -> list[tuple[str, int]] | None:
        """``self_attn.query_key_value``'s weight or bias as ``(parameter, rows)`` pieces in
        checkpoint order: per head, its ``head_dim`` rows of q, of k, then of v (the loader's
        hook; each piece fills the next rows of its parameter)."""
        for kind in ("weight", "bias"):
            fused = f"self_attn.query_key_value.{kind}"
            if name.endswith("." + fused):
                pre, c = name[: -len(fused)] + "self_attn.", self.config
                parts = [f"{pre}{p}_proj.{kind}" for p in "qkv"]
                return [(p, c.head_dim) for _ in range(c.num_heads) for p in parts]
        return None
