"""Every HF processor layout a LLaVA checkpoint comes in, against transformers as the oracle.

transformers 5 ``LlavaProcessor.save_pretrained`` writes ``processor_config.json`` with the
image processor nested under ``"image_processor"``, the chat template to
``chat_template.jinja`` and no ``preprocessor_config.json``; older versions wrote
``preprocessor_config.json``. Strata's preprocessing, image token, chat template and
placeholder count must match transformers' processor on both.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from services.tokenizer.core import TokenizerCore
from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.sequence import MMInput
from shared.model.default_model import CHAT_TEMPLATE, train_tokenizer
from shared.model.errors import CheckpointError
from shared.model.image import ImageProcessor, image_content_hash
from shared.model.loader import load_model
from shared.model.tokenizer import Tokenizer
from shared.protocol.sampling import SamplingParams
from shared.protocol.tok import TokenizeRequest
from tests.acceptance.checkpoints import (
    random_llava,
    tiny_decoder_config,
    tiny_vision_config,
)

transformers = pytest.importorskip("transformers")


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


IMAGES = [_image(1, (123, 77)), _image(2, (60, 200)), _image(3, (32, 32)).convert("L")]


def _clip_processor():
    return transformers.CLIPImageProcessor(
        size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}
    )


def _hf_pixels(proc, images) -> torch.Tensor:
    return torch.as_tensor(np.asarray(proc(images, return_tensors="pt")["pixel_values"]))


@pytest.fixture(scope="module")
def llava5(tmp_path_factory):
    """A tiny random LLaVA and its processor, saved by this transformers' ``save_pretrained``."""
    out = tmp_path_factory.mktemp("llava_tf5")
    tok = train_tokenizer()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<image>"},
    )
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    tc = tiny_decoder_config(
        transformers.Qwen2Config,
        vocab_size=vocab,
        num_key_value_heads=2,
        initializer_range=0.2,
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    hf = random_llava(
        tiny_vision_config("clip"),
        tc,
        image_token_index=tok.token_to_id("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    proc = transformers.LlavaProcessor(
        image_processor=_clip_processor(),
        tokenizer=fast,
        chat_template=CHAT_TEMPLATE,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    hf.save_pretrained(out)
    proc.save_pretrained(out)
    return out, hf


def test_transformers_5_layout_is_what_this_test_covers(llava5):
    path, _ = llava5
    assert not (path / "preprocessor_config.json").exists()
    nested = json.loads((path / "processor_config.json").read_text())["image_processor"]
    assert nested["size"] == {"shortest_edge": 40} and nested["do_center_crop"] is True
    assert (path / "chat_template.jinja").exists()


def test_nested_processor_config_matches_transformers(llava5):
    path, _ = llava5
    hf_proc = transformers.AutoProcessor.from_pretrained(path).image_processor
    got = ImageProcessor.from_dir(path).preprocess(IMAGES)
    want = _hf_pixels(hf_proc, IMAGES)
    assert got.shape == want.shape == (3, 3, 32, 32)
    assert (got - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_legacy_preprocessor_config_matches_transformers(tmp_path, kind):
    if kind == "clip":
        hf_proc = _clip_processor()
    else:
        hf_proc = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    hf_proc.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preprocessor_config.json"]
    got = ImageProcessor.from_dir(tmp_path).preprocess(IMAGES)
    want = _hf_pixels(transformers.AutoImageProcessor.from_pretrained(tmp_path), IMAGES)
    assert got.shape == want.shape == (3, 3, 32, 32)
    assert (got - want).abs().max().item() < 1e-6


def test_both_files_nested_wins_as_in_transformers(llava5, tmp_path):
    path, _ = llava5
    shutil.copy(path / "processor_config.json", tmp_path)
    transformers.SiglipImageProcessor(size={"height": 48, "width": 48}).save_pretrained(tmp_path)
    want = _hf_pixels(transformers.AutoImageProcessor.from_pretrained(tmp_path), IMAGES)
    got = ImageProcessor.from_dir(tmp_path).preprocess(IMAGES)
    assert got.shape == want.shape == (3, 3, 32, 32)  # the nested CLIP settings, not 48x48
    assert (got - want).abs().max().item() < 1e-6


def test_no_image_processor_names_both_files(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(CheckpointError, match="processor_config.json .*preprocessor_config.json"):
        ImageProcessor.from_dir(tmp_path)


CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "What is in it?"},
        ],
    }
]


def _hf_inputs(path, image):
    proc = transformers.AutoProcessor.from_pretrained(path)
    hf_chat = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}
    ]
    text = proc.apply_chat_template(hf_chat, add_generation_prompt=True)
    return proc(text=text, images=[image], return_tensors="pt")


@pytest.mark.parametrize("token_in", ["tokenizer_config", "processor_config_only"])
def test_tokenizer_ids_match_the_processor(llava5, tmp_path, token_in):
    """Chat template (chat_template.jinja), image token and placeholder count as transformers."""
    path, _ = llava5
    if token_in == "processor_config_only":  # the image token named by processor_config.json
        shutil.copytree(path, tmp_path, dirs_exist_ok=True)
        tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
        del tc["image_token"]
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
        path = tmp_path
    assert Tokenizer.from_dir(path).image_token == "<image>"
    core = TokenizerCore(path)
    rep = core.encode(TokenizeRequest(request_id="r", messages=CHAT))
    hf = _hf_inputs(path, IMAGES[0])
    assert rep.token_ids == hf["input_ids"][0].tolist()
    [span] = rep.image_spans
    assert span.length == core.config.num_image_tokens == 16  # (32/8)^2 + CLS - CLS


def test_greedy_matches_transformers_generate(llava5):
    """Strata's tokenizer + image preprocessing + engine against transformers ``generate`` on
    the same image and chat prompt."""
    path, hf = llava5
    lm = load_model(path)
    rep = TokenizerCore(path).encode(TokenizeRequest(request_id="r", messages=CHAT))
    pixels = ImageProcessor.from_dir(path).preprocess([IMAGES[1]])
    feats = lm.model.encode_images(pixels)
    mm = [MMInput(rep.image_spans[0].offset, feats[0], image_content_hash(b"img"))]
    eng = LLMEngine(
        lm,
        EngineConfig(
            block_size=4, kv_cache_bytes=8 << 20, max_num_seqs=2, max_num_batched_tokens=256
        ),
    )
    eng.add_request(
        "r",
        rep.token_ids,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        mm_inputs=mm,
    )
    got = []
    while eng.has_unfinished_requests():
        got += sum((o.new_token_ids for o in eng.step()), [])
    hf_in = _hf_inputs(path, IMAGES[1])
    with torch.no_grad():
        want = hf.generate(**hf_in, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert got == want[0, hf_in["input_ids"].shape[1] :].tolist()
    with torch.no_grad():  # the image changes the output: the vision path is not a no-op
        blank = hf.generate(
            **{**hf_in, "pixel_values": torch.zeros_like(hf_in["pixel_values"])},
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
        )
    assert blank[0].tolist() != want[0].tolist()
