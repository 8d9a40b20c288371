"""OLMo-3 over the paged KV cache: OLMo-2's model (`models/olmo2.py`: post-norms, q/k norm over
all heads) with sliding-window layers.

* the layers ``layer_types`` marks ``sliding_attention`` (default: all but every 4th) attend
  within ``sliding_window`` (default 4096) and rotate by their own RoPE (5.x ``rope_parameters``
  keyed by layer type; 4.x: ``rope_theta`` without ``rope_scaling``, which only the full layers
  take): `ModelConfig.rope_local` on `ModelConfig.sliding_layers`, as Gemma-3's
  (`LlamaForCausalLM.layer_ropes`);
* a checkpoint with sliding layers is served with its context capped at the window
  (`ModelConfig.max_model_len`), where full attention is exact.

Like OLMo-2 it runs op by op (the one-call native layer has pre-norms and per-head q/k norms)
and refuses tensor parallelism (`shared.model.parallel.check_shardable`). transformers keeps
OLMo-3's cos/sin in float32 (OLMo-2's are cast to the model dtype): the same numbers in a
float32 model.
"""

from __future__ import annotations

from shared.model.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """Paged-KV OLMo-3; the batch contract of ``shared/model/api.py``."""
