"""int8 quantization of a model's ``nn.Linear`` layers (per-output-channel symmetric scales).

`Int8Linear` (`shared.model.int8`) stores the weight as int8; on CPU float32 it runs the native
W8A8 kernel (activations quantised per row at call time), elsewhere the dequantised weight or
``_weight_int8pack_mm`` (CUDA)."""

from __future__ import annotations

from torch import nn

from shared.model.int8 import Int8Linear  # the module and its GEMM live beside the kernels

__all__ = ["Int8Linear", "quantize_model_"]


def quantize_model_(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` (except names containing ``skip``) in place; returns the count.

    The LM head stays in full precision by default: it decides the argmax and, when tied, shares
    its weight with the embedding. So does a MoE router (the ``gate`` beside ``experts``): a
    rounded router logit flips which experts a token reaches; and Qwen2-MoE's one-output
    ``shared_expert_gate``, which scales the whole shared expert. Stacked expert weights are not
    ``nn.Linear`` and stay as they are.
    """
    n = 0
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if child_name in ("gate", "shared_expert_gate") and hasattr(mod, "experts"):
                continue
            if isinstance(child, nn.Linear) and not any(s in full for s in skip):
                setattr(mod, child_name, Int8Linear(child))
                n += 1
    return n
