"""Check a checkpoint directory without loading it (torch-free, well under a second).

`validate_checkpoint` is what `strata up` runs before it starts any process, and what a model
service runs before it connects to NATS: ``config.json`` parses, its architecture is one Strata
serves, the safetensors weights (every shard an index lists) and ``tokenizer.json`` are there.
Each failure is a `CheckpointError` whose one-line message names the file, the problem and the
fix. Tensor names and shapes are checked later, by the loader.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from shared.model.archs import (
    LLAVA_ARCHITECTURE,
    LLAVA_TEXT_TYPES,
    MIN_WINDOW_LEN,
    SUPPORTED,
    architecture_of,
    decoder_config,
    sliding_window_of,
)
from shared.model.config_dense import check_dense
from shared.model.config_fields import check_phi_rotary
from shared.model.config_gpt_oss import check_gpt_oss
from shared.model.config_moe import check_moe_families
from shared.model.config_more import check_more
from shared.model.config_neox import check_neox
from shared.model.deepseek_config import DEEPSEEK_TYPES, check_deepseek
from shared.model.errors import CheckpointError

INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is a corrupt length field
_WHAT = "a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"


@dataclass(frozen=True)
class CheckpointInfo:
    """What the light check learned about a checkpoint."""

    path: Path
    architecture: str
    multimodal: bool  # takes images (LLaVA): the cluster needs a vision encoder for them
    weight_files: tuple[Path, ...]
    context_note: str | None = None  # one line when the served context is capped (see below)


def declared_dtype(cfg: dict) -> object:
    """The dtype a parsed config.json declares: ``dtype`` (transformers 5) or ``torch_dtype`` at
    the top level, then in a LLaVA's ``text_config``; None when it names none."""
    text = cfg.get("text_config") or {}
    return (
        cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    )


def read_config_json(file: Path) -> dict:
    """``config.json`` parsed; `CheckpointError` when it is missing, unreadable or not a JSON
    object."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{file.parent}: no config.json there; pass {_WHAT}") from e
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CheckpointError(f"{file}: cannot be read ({why}); check the file") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file}: invalid JSON ({e}); re-save the checkpoint with save_pretrained"
        ) from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def check_architecture(cfg: dict, file: Path) -> str:
    """The declared architecture, or `CheckpointError` when Strata does not serve it."""
    arch = architecture_of(cfg)
    if arch not in SUPPORTED:
        raise CheckpointError(
            f"{file}: unsupported architecture {arch!r} (Strata serves {', '.join(SUPPORTED)})"
        )
    if arch == LLAVA_ARCHITECTURE:
        text = cfg.get("text_config") or {}
        mt = text.get("model_type", "llama") if isinstance(text, dict) else None
        if mt not in LLAVA_TEXT_TYPES:
            raise CheckpointError(
                f"{file}: unsupported LLaVA text model_type {mt!r} "
                f"(Strata serves {', '.join(LLAVA_TEXT_TYPES)})"
            )
    return arch


def check_decoder(cfg: dict, file: Path | str) -> str | None:
    """Settings of the decoder config ``cfg`` Strata cannot serve raise `CheckpointError`: a
    router top-k above the expert count, a sliding window under `MIN_WINDOW_LEN`, Phi's RoPE on
    an odd or empty part of the head (`check_phi_rotary`). Returns one line when the served
    context is capped at the sliding window, else None."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.get("num_experts_per_tok")
    moe = cfg.get("model_type") in ("qwen3_moe", "qwen2_moe", "mixtral")
    if moe and experts is not None and top_k:
        if int(top_k) > int(experts):
            raise CheckpointError(
                f"{file}: num_experts_per_tok {top_k} exceeds the {experts} experts per layer; "
                "fix config.json"
            )
    if cfg.get("model_type") == "phi":
        check_phi_rotary(cfg, str(file))
    if cfg.get("model_type") in DEEPSEEK_TYPES:  # router groups, top-k, RoPE dims, YaRN
        check_deepseek(cfg, str(file))
    check_dense(cfg, str(file))  # GLM's rotary part, Helium's heads (`shared.model.config_dense`)
    check_neox(cfg, str(file))  # GPT-NeoX / StableLM / Cohere heads, rotary part, logit_scale
    check_more(cfg, str(file))  # EXAONE-4's layer types, Nemotron's rotary part, heads
    check_gpt_oss(cfg, str(file))  # gpt-oss: MXFP4 / quantized, top-k, RoPE, head dim
    check_moe_families(cfg, str(file))  # OLMoE / GraniteMoE / PhiMoE / ERNIE-MoE top-k etc.
    window = sliding_window_of(cfg)
    if window is None:
        return None
    limit = int(cfg.get("max_position_embeddings") or window)
    if window < MIN_WINDOW_LEN:
        raise CheckpointError(
            f"{file}: sliding_window {window} is under {MIN_WINDOW_LEN} tokens; Strata attends "
            "to the full context and caps it at the window, which leaves no usable length"
        )
    if window >= limit:
        return None
    return (
        f"{file}: sliding_window {window} < max_position_embeddings {limit}: serving a context "
        f"of {window} tokens (full attention over at most the window equals windowed attention)"
    )


def checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, when sharded, the tensor -> file map."""
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index}: malformed index ({type(e).__name__}: {e}); "
                "re-save the checkpoint with save_pretrained"
            ) from e
        return files, weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{path}: no model.safetensors or {INDEX} (Strata loads "
            "safetensors weights; save with safe_serialization=True)"
        )
    return files, None


def check_safetensors_header(file: Path) -> None:
    """The file exists and starts with a well-formed safetensors header (8-byte length + JSON)."""
    if not file.exists():
        raise CheckpointError(
            f"{file}: weights shard listed in {INDEX} is missing; copy the complete checkpoint"
        )
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            ok = 0 < n <= min(size - 8, _MAX_HEADER)
            ok = ok and isinstance(json.loads(f.read(n)), dict)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e}); check the file") from e
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise CheckpointError(
            f"{file}: not a valid safetensors file (truncated or corrupt "
            "header); copy or re-save the weights"
        )


def validate_checkpoint(path: str | Path) -> CheckpointInfo:
    """The whole light check (see the module doc); returns what it learned."""
    p = Path(path)
    if not p.is_dir():
        what = "does not exist" if not p.exists() else "is not a directory"
        raise CheckpointError(f"{p}: {what}; pass {_WHAT}")
    file = p / "config.json"
    cfg = read_config_json(file)
    arch = check_architecture(cfg, file)
    note = check_decoder(decoder_config(cfg), file)
    files, _ = checkpoint_files(p)
    for f in files:
        check_safetensors_header(f)
    if not (p / TOKENIZER_FILE).is_file():
        raise CheckpointError(
            f"{p}: no {TOKENIZER_FILE} (Strata needs the fast tokenizer file; "
            "save it with tokenizer.save_pretrained(dir))"
        )
    return CheckpointInfo(p, arch, arch == LLAVA_ARCHITECTURE, tuple(files), note)


def takes_images(path: str | Path) -> bool:
    """True when the checkpoint at ``path`` is multimodal (False when unreadable: the model
    services report that themselves)."""
    try:
        cfg = read_config_json(Path(path) / "config.json")
    except CheckpointError:
        return False
    return architecture_of(cfg) == LLAVA_ARCHITECTURE


def text_only_reason(path: str | Path) -> str | None:
    """One line saying why the checkpoint at ``path`` takes no images (its architecture has no
    vision tower), or None when it takes images or config.json cannot be read (the checks above
    report that)."""
    try:
        arch = architecture_of(read_config_json(Path(path) / "config.json"))
    except CheckpointError:
        return None
    if arch == LLAVA_ARCHITECTURE:
        return None
    return f"{path} is a text-only checkpoint ({arch}, no vision tower)"
