"""LLaVA (vision tower + projector + decoder) and image preprocessing against transformers."""

import numpy as np
import pytest
import torch
from PIL import Image

from shared.model.image import ImageProcessor, expand_image_placeholders, image_content_hash
from shared.model.loader import load_model
from tests.acceptance.checkpoints import (
    random_llava,
    tiny_decoder_config,
    tiny_vision_config,
)
from tests.model.paged_driver import PagedDriver

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 150
VOCAB = 160


def _image(seed, size=(45, 37)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def _build(path, vision: str):
    if vision == "clip":
        vc = tiny_vision_config("clip", num_hidden_layers=3)
        tc = tiny_decoder_config(
            transformers.Qwen2Config, vocab_size=VOCAB, num_key_value_heads=2, initializer_range=0.5
        )
        extra = dict(vision_feature_layer=-2, vision_feature_select_strategy="default")
    else:
        vc = tiny_vision_config("siglip", num_hidden_layers=2)
        tc = tiny_decoder_config(
            transformers.LlamaConfig,
            vocab_size=VOCAB,
            num_key_value_heads=4,
            initializer_range=0.5,
            tie_word_embeddings=False,
        )
        extra = dict(vision_feature_layer=[-1, 1], vision_feature_select_strategy="full")
    hf = random_llava(vc, tc, image_token_index=IMAGE_TOKEN, **extra)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=["clip", "siglip"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("llava_" + request.param)
    return _build(path, request.param), load_model(path)


def _prompt_with_images(n_images, n_tok, per_image):
    g = torch.Generator().manual_seed(5)
    text = torch.randint(0, IMAGE_TOKEN, (10,), generator=g).tolist()
    ids = text[:3]
    for i in range(n_images):
        ids += [IMAGE_TOKEN] + text[3 + i : 5 + i]
    ids += text[8:]
    return expand_image_placeholders(ids, IMAGE_TOKEN, per_image)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_match_with_images(pair, n_images):
    hf, ours = pair
    model = ours.model
    per_image = ours.config.num_image_tokens
    expanded, spans = _prompt_with_images(n_images, 10, per_image)
    assert [length for _, length in spans] == [per_image] * n_images
    pixels = torch.randn(n_images, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    kwargs = {"pixel_values": pixels} if n_images else {}
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([expanded]), **kwargs).logits[0]
        if n_images:
            hf_feats = hf.get_image_features(pixel_values=pixels).pooler_output
            hf_feats = torch.stack(list(hf_feats))
    feats = model.encode_images(pixels) if n_images else None
    if n_images:
        assert feats.shape == (n_images, per_image, model.hidden_size)
        assert (feats - hf_feats).abs().max().item() < 1e-4
    embeds = model.merge_image_embeds(torch.tensor(expanded), feats)
    drv = PagedDriver(model, block_size=4)
    got = drv.prefill(drv.new_seq(), expanded, chunk=7, embeds=embeds)
    assert (got - ref).abs().max().item() < 5e-4  # chunked fp32: see test_text_models


def test_num_image_tokens(pair):
    _, ours = pair
    c = ours.config
    if c.vision.model_type == "clip_vision_model":  # 16 patches + CLS, CLS dropped
        assert c.num_image_tokens == 16 and c.vision.feature_layer == -2
    else:  # SigLIP "full": 16 patches, features of layers -1 and 1 concatenated
        assert c.num_image_tokens == 16 and c.vision.feature_layer == (-1, 1)


def test_default_model_loads_in_transformers(default_model_dir):
    ours = load_model(default_model_dir)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(default_model_dir).eval()
    proc = ImageProcessor.from_dir(default_model_dir)
    images = [_image(1, (80, 64)), _image(2, (50, 90))]
    pixels = proc.preprocess(images)
    hf_proc = transformers.AutoImageProcessor.from_pretrained(default_model_dir)
    hf_pixels = torch.as_tensor(np.asarray(hf_proc(images, return_tensors="pt")["pixel_values"]))
    assert pixels.shape == (2, 3, 64, 64)
    assert (pixels - hf_pixels).abs().max().item() < 1e-5
    n = ours.config.num_image_tokens
    ids = [5, 9, ours.config.image_token_id, 11, ours.config.image_token_id, 40, 41]
    expanded, _ = expand_image_placeholders(ids, ours.config.image_token_id, n)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([expanded]), pixel_values=pixels).logits[0]
    model = ours.model
    embeds = model.merge_image_embeds(torch.tensor(expanded), model.encode_images(pixels))
    drv = PagedDriver(model, block_size=16)
    got = drv.prefill(drv.new_seq(), expanded, embeds=embeds)
    assert (got - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    # the images change the logits: the vision path is not a no-op
    blank = drv.prefill(drv.new_seq(), expanded)
    assert (blank - got).abs().max().item() > 0.1


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_preprocessing_matches_transformers(tmp_path, kind):
    if kind == "clip":
        hf_proc = transformers.CLIPImageProcessor(
            size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}
        )
    else:
        hf_proc = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    hf_proc.save_pretrained(tmp_path)
    ours = ImageProcessor.from_dir(tmp_path)
    images = [_image(3, (123, 77)), _image(4, (60, 200)), _image(5, (32, 32)).convert("L")]
    hf_pixels = torch.as_tensor(np.asarray(hf_proc(images, return_tensors="pt")["pixel_values"]))
    got = ours.preprocess(images)
    assert got.shape == hf_pixels.shape == (3, 3, 32, 32)
    assert (got - hf_pixels).abs().max().item() < 1e-5


def test_placeholders_and_hash():
    ids, spans = expand_image_placeholders([1, 99, 2, 99], 99, 3)
    assert ids == [1, 99, 99, 99, 2, 99, 99, 99] and spans == [(1, 3), (5, 3)]
    assert image_content_hash(b"abc") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
