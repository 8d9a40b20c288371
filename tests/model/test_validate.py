"""`validate_checkpoint`: the torch-free check `strata up` runs before starting any process.
Every bad checkpoint is a `CheckpointError` whose one line names the file, problem and fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shared.model.errors import CheckpointError
from shared.model.validate import takes_images, validate_checkpoint
from tests.infra.fake_apps import write_fake_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return tmp_path / "m", write_fake_checkpoint(tmp_path / "m")


def test_a_complete_checkpoint_passes(ckpt):
    d, _ = ckpt
    info = validate_checkpoint(d)
    assert (info.architecture, info.multimodal) == ("LlamaForCausalLM", False)
    assert [f.name for f in info.weight_files] == ["model.safetensors"]
    assert not takes_images(d)


def test_the_default_model_passes_and_takes_images(default_model_dir):
    info = validate_checkpoint(default_model_dir)
    assert info.multimodal and takes_images(default_model_dir)


def _break(d, how: str) -> None:
    if how == "missing dir":
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    elif how == "no config.json":
        (d / "config.json").unlink()
    elif how == "bad json":
        (d / "config.json").write_text("{not json")
    elif how == "binary config":
        (d / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    elif how == "json list":
        (d / "config.json").write_text("[1, 2]")
    elif how == "architecture":
        (d / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    elif how == "llava text model":
        (d / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlavaForConditionalGeneration"],
                    "text_config": {"model_type": "gpt2"},
                }
            )
        )
    elif how == "no weights":
        (d / "model.safetensors").unlink()
    elif how == "corrupt weights":
        (d / "model.safetensors").write_bytes(b"\x00" * 3)
    elif how == "missing shard":
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
        )
    elif how == "bad index":
        (d / "model.safetensors.index.json").write_text("{}")
    elif how == "no tokenizer":
        (d / "tokenizer.json").unlink()


CASES = [
    ("missing dir", r"m: does not exist; pass a Hugging Face checkpoint directory"),
    ("no config.json", r"m: no config.json there; pass a Hugging Face checkpoint directory"),
    ("bad json", r"config.json: invalid JSON \(.*\); re-save the checkpoint"),
    ("binary config", r"config.json: cannot be read \(.*\); check the file"),
    ("json list", r"config.json: expected a JSON object, got list"),
    (
        "architecture",
        r"config.json: unsupported architecture 'MambaForCausalLM' \(Strata serves "
        r"LlamaForCausalLM, .*LlavaForConditionalGeneration\)",
    ),
    ("llava text model", r"config.json: unsupported LLaVA text model_type 'gpt2'"),
    (
        "no weights",
        r"m: no model.safetensors or model.safetensors.index.json \(Strata loads "
        r"safetensors weights",
    ),
    ("corrupt weights", r"model.safetensors: not a valid safetensors file \(truncated or corrupt"),
    (
        "missing shard",
        r"model-00001-of-00002.safetensors: weights shard listed in "
        r"model.safetensors.index.json is missing",
    ),
    ("bad index", r"model.safetensors.index.json: malformed index \(KeyError"),
    ("no tokenizer", r"m: no tokenizer.json \(.*save it with tokenizer.save_pretrained"),
]


@pytest.mark.parametrize("how,needle", CASES, ids=[c[0] for c in CASES])
def test_each_bad_checkpoint_is_one_clear_line(ckpt, how, needle):
    d, _ = ckpt
    _break(d, how)
    with pytest.raises(CheckpointError, match=needle) as err:
        validate_checkpoint(d)
    assert "\n" not in str(err.value)


def test_the_check_does_not_import_torch(ckpt):
    code = (
        "import sys; from shared.model.validate import validate_checkpoint; "
        f"validate_checkpoint({str(ckpt[0])!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_load_config_wraps_bad_values(tmp_path):
    from shared.model.config import load_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    with pytest.raises(CheckpointError, match=r"config.json: bad value \(ValueError"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "int3"}))
    with pytest.raises(CheckpointError, match="unsupported dtype 'int3'"):
        load_config(tmp_path)


def test_tokenizer_files_missing_or_bad_are_checkpoint_errors(ckpt):
    from shared.model.tokenizer import Tokenizer

    d, _ = ckpt
    with pytest.raises(CheckpointError, match=r"tokenizer.json: cannot be loaded \(.*re-save"):
        Tokenizer.from_dir(d)  # the fake's tokenizer.json is "{}"
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"m: no tokenizer.json"):
        Tokenizer.from_dir(d)
