"""Checkpoint loading: config normalisation, sharding, fingerprints and error messages."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model.config import config_from_dict, load_config
from shared.model.default_model import build_benchmark_model, build_default_model
from shared.model.loader import CheckpointError, load_model, weights_digest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    cfg = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_transformers_4x_config_layout():
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 100,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [1, 2],
        "bos_token_id": 0,
    }
    c = config_from_dict(cfg)
    assert c.dtype == torch.bfloat16 and c.rope_theta == 500000.0
    assert c.rope_scaling["rope_type"] == "llama3" and c.num_kv_heads == 4 and c.head_dim == 16
    assert c.eos_token_ids == (1, 2) and c.bos_token_id == 0 and not c.is_multimodal


def test_transformers_5x_config_layout(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert "rope_parameters" in raw and "dtype" in raw  # what the installed transformers wrote
    c = load_config(ckpt)
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and c.head_dim == 16
    assert c.num_kv_heads == 1 and c.dtype == torch.float32 and c.rope_scaling is None


def test_sharded_checkpoint_loads_identically(ckpt, tmp_path):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(ckpt)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    single, sharded = load_model(ckpt), load_model(tmp_path)
    for (n, a), (_, b) in zip(
        single.model.state_dict().items(), sharded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n


def test_fingerprint_stable_and_sensitive(ckpt, tmp_path):
    a, b = load_model(ckpt), load_model(ckpt)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    assert load_model(ckpt, dtype=torch.bfloat16).fingerprint != a.fingerprint
    other = _copy(ckpt, tmp_path / "other")
    tensors = load_file(other / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    assert load_model(other).fingerprint != a.fingerprint


def test_sampled_digest_for_big_files(ckpt, monkeypatch):
    import shared.model.fingerprint as fingerprint

    files = [ckpt / "model.safetensors"]
    full = weights_digest(files)
    monkeypatch.setattr(fingerprint, "FULL_HASH_LIMIT", 1024)  # force the header + samples rule
    sampled = weights_digest(files)
    assert sampled != full and sampled == weights_digest(files)


def test_missing_tensor_names_file_and_tensor(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.self_attn\.k_norm\.weight"
    ):
        load_model(bad)


def test_wrong_shape_names_file_and_tensor(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors.*model\.layers\.0\.mlp\.up_proj\.weight.*\(47, 32\)",
    ):
        load_model(bad)


def test_unknown_architecture(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*MambaForCausalLM"):
        load_model(bad)
    assert issubclass(CheckpointError, ValueError)


def test_default_models_deterministic_and_cached(tmp_path):
    a = build_default_model(tmp_path / "a")
    b = build_default_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    build_default_model(a)  # complete dir with the same version marker: nothing rewritten
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    bench = load_model(build_benchmark_model(tmp_path / "bench"))
    c = bench.config
    assert (
        c.hidden_size,
        c.intermediate_size,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
    ) == (512, 1408, 8, 8, 4, 64)
    n_params = sum(p.numel() for p in bench.model.parameters())
    assert 20e6 < n_params < 30e6
    default = load_model(a)
    assert default.config.is_multimodal and default.config.num_image_tokens == 16
    assert default.config.image_size == 64 and default.config.qk_norm


def test_fingerprint_spells_the_dtype_as_torch_prints_it(ckpt):
    """A wire name and a torch dtype give one fingerprint, and it is the one earlier releases
    wrote into block hashes and pool keys (``torch.float32`` in the hashed text)."""
    import hashlib

    from shared.model.fingerprint import fingerprint_of

    files = [ckpt / "model.safetensors"]
    text = f"LlamaForCausalLM\0{weights_digest(files)}\0torch.bfloat16"
    want = hashlib.sha256(text.encode()).hexdigest()
    assert fingerprint_of("LlamaForCausalLM", files, torch.bfloat16) == want
    assert fingerprint_of("LlamaForCausalLM", files, "bfloat16") == want
    assert fingerprint_of("LlamaForCausalLM", files, "float32") != want
