"""Load a Hugging Face checkpoint directory into a Strata model.

Reads ``config.json`` and single or sharded safetensors (``model.safetensors.index.json``).
Every expected tensor must be present with the expected shape, otherwise ``CheckpointError``
names the file and the tensor.

The model's fingerprint (`LoadedModel.fingerprint`) is `shared.model.fingerprint`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.model.config import LLAVA_ARCHITECTURE, ModelConfig, load_config
from shared.model.errors import CheckpointError
from shared.model.fingerprint import fingerprint_of, weights_digest
from shared.model.models import model_class
from shared.model.moe import checkpoint_name, expected_parts, expert_slice
from shared.model.validate import INDEX as _INDEX
from shared.model.validate import checkpoint_files

__all__ = ["CheckpointError", "LoadedModel", "load_model", "weights_digest", "checkpoint_files"]

# Newer on-disk LLaVA layout (transformers 4.52-4.x) -> the layout 5.x writes, which we use.
_LLAVA_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


@dataclass
class LoadedModel:
    """A model ready for ``forward`` plus what identifies it."""

    model: nn.Module
    config: ModelConfig
    fingerprint: str  # hex sha256 over architecture, weights digest and dtype
    path: Path


def _our_name(name: str, config: ModelConfig) -> str:
    if config.num_experts:
        name = checkpoint_name(name)
    if config.architecture == LLAVA_ARCHITECTURE:
        for old, new in _LLAVA_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        # transformers 5.x saves the tower without its ``vision_model.`` level
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that alias an earlier parameter (tied LM head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied


def _fused_parts(name: str, config: ModelConfig) -> list[tuple[str, int]] | None:
    """A fused projection some checkpoints store (Phi-3's ``self_attn.qkv_proj`` and
    ``mlp.gate_up_proj``) as ``(our parameter, rows)`` pieces in order; None for any other."""
    for fused, parts in (
        (
            "self_attn.qkv_proj.weight",
            (
                ("q_proj", config.num_heads * config.head_dim),
                ("k_proj", config.num_kv_heads * config.head_dim),
                ("v_proj", config.num_kv_heads * config.head_dim),
            ),
        ),
        (
            "mlp.gate_up_proj.weight",
            (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)),
        ),
    ):
        if name.endswith("." + fused):
            pre = name[: -len(fused)] + fused.split(".")[0] + "."
            return [(f"{pre}{part}.weight", rows) for part, rows in parts]
    return None


def _copy_split(f, key: str, file: Path, parts, params) -> list[str]:
    """Copy fused tensor ``key`` row block by row block into ``parts``' parameters, each block
    into the next rows of its parameter (a parameter may take several: GPT-NeoX's per-head
    q, k, v)."""
    shape = tuple(f.get_slice(key).get_shape())
    want = (sum(r for _, r in parts), *params[parts[0][0]].shape[1:])
    if shape != want:
        raise CheckpointError(f"{file}: tensor {key!r} has shape {shape}, expected {want}")
    t, row, filled = f.get_tensor(key), 0, {}
    with torch.no_grad():
        for name, rows in parts:
            at = filled.get(name, 0)
            params[name][at : at + rows].copy_(t[row : row + rows])
            filled[name] = at + rows
            row += rows
    return list(filled)


def _expected(params: dict[str, nn.Parameter], tied: set[str], config: ModelConfig) -> set[str]:
    """Tensor names the checkpoint must provide: a stacked expert weight counts as found when
    its own name is there (transformers 5.x fused layout) or every per-expert piece is."""
    out = set()
    for n in params:
        if n not in tied:
            out.update(expected_parts(n, config.num_experts) or [n])
    return out


def _load_weights(model: nn.Module, config: ModelConfig, path: Path) -> list[Path]:
    files, weight_map = checkpoint_files(path)
    tied = _tied_names(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _expected(params, tied, config)
    found: dict[str, Path] = {}
    own_name = getattr(model, "our_name", None)  # a family's checkpoint names -> its modules'
    own_parts = getattr(model, "fused_parts", None)  # a family's fused tensors (`_fused_parts`)
    for file in files:
        if not file.exists():
            raise CheckpointError(f"{file}: shard listed in {_INDEX} is missing")
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
        with handle as f:
            for key in f.keys():
                name = _our_name(key, config)
                if own_name is not None:
                    name = own_name(name)
                split = (own_parts and own_parts(name)) or _fused_parts(name, config)
                if split is not None and all(n in expected for n, _ in split):
                    for n in _copy_split(f, key, file, split, params):
                        found[n] = file
                    continue
                piece = expert_slice(name, config.moe_intermediate_size)
                if piece is not None and name in expected:  # one expert's gate, up or down
                    pname, e, rows, _ = piece
                    target = params[pname][e][rows]
                elif name in params and name not in tied:
                    target = params[name]
                else:
                    continue  # e.g. a SigLIP pooling head or an untied duplicate we do not use
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(target.shape):
                    raise CheckpointError(
                        f"{file}: tensor {key!r} has shape {shape}, expected {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(f.get_tensor(key))
                for part in expected_parts(name, config.num_experts) or [name]:
                    found[part] = file
    missing = sorted(expected - found.keys())
    if missing:
        where = path / _INDEX if weight_map is not None else files[0]
        raise CheckpointError(
            f"{where}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return files


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LoadedModel:
    """Build the model for ``path/config.json`` and load its safetensors weights."""
    path = Path(path)
    config = load_config(path)
    dtype = dtype or config.dtype
    model = meta_model(config).to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    files = _load_weights(model, config, path)
    fold = getattr(model, "fold_constants", None)  # a LLaVA has none: its decoders fold nothing
    if fold is not None:
        fold()
    model.eval().requires_grad_(False)
    fp = fingerprint_of(config.architecture, files, dtype)
    return LoadedModel(model=model, config=config, fingerprint=fp, path=path)


# torch.nn.init's in-place initialisers the model's layers call in their constructors
_INITS = (
    "normal_",
    "uniform_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "constant_",
    "ones_",
    "zeros_",
)


def meta_model(config: ModelConfig) -> nn.Module:
    """The model of ``config`` on the meta device: shapes only, nothing initialised."""
    with torch.device("meta"), skip_init():
        return model_class(config)(config)


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Layers built inside skip their random initialisation (the checkpoint overwrites every
    tensor). On the meta device it computes nothing, but torch runs ``normal_`` on meta through
    a Python decomposition whose first call imports torch._dynamo and torch._inductor: about
    1.6 s of CPU in every worker's start for an `nn.Embedding`."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor
