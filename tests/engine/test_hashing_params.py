import subprocess
import sys

import pytest
from pydantic import ValidationError

from shared.engine.params import EngineConfig
from shared.protocol.hashing import from_hex, hash_blocks, mm_extra_keys, model_salt, to_hex
from shared.protocol.sampling import SamplingParams


def test_hash_chain_full_blocks_only_and_parent_continuation():
    salt = model_salt("fp", "float32", 4)
    toks = list(range(10))
    hs = hash_blocks(toks, 4, salt)
    assert len(hs) == 2 and all(len(h) == 16 for h in hs)
    assert hash_blocks(toks[4:8], 4, salt, parent=hs[0]) == hs[1:]
    assert hash_blocks([0, 1, 2, 9], 4, salt)[0] != hs[0]
    assert hash_blocks(toks, 4, model_salt("fp2", "float32", 4)) != hs
    assert from_hex(to_hex(hs)) == hs


def test_hash_stable_across_processes():
    code = (
        "from shared.protocol.hashing import *;"
        "print(hash_blocks(list(range(8)),4,model_salt('fp','float32',4))[1].hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == hash_blocks(list(range(8)), 4, model_salt("fp", "float32", 4))[1].hex()


def test_image_hash_changes_only_overlapping_blocks():
    salt = model_salt("fp", "float32", 4)
    toks = [7] * 12
    a = hash_blocks(toks, 4, salt, mm_extra_keys([(5, 2, "imgA")], 4))
    b = hash_blocks(toks, 4, salt, mm_extra_keys([(5, 2, "imgB")], 4))
    plain = hash_blocks(toks, 4, salt)
    assert a[0] == b[0] == plain[0]
    assert a[1] != b[1] and a[1] != plain[1]
    assert a[2] != b[2]  # chained
    assert mm_extra_keys([], 4) is None


def test_sampling_params_validation_and_frozen():
    p = SamplingParams(temperature=0.0, max_tokens=3)
    assert p.greedy and p.stop == [] and p.top_k == 0
    with pytest.raises(ValidationError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValidationError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValidationError):
        p.max_tokens = 4  # frozen
    assert SamplingParams.model_validate(p.model_dump()) == p


def test_engine_config_validation_names_setting():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    assert EngineConfig().block_size == 16
