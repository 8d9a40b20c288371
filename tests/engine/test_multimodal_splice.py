"""Image embeddings spliced into ``inputs_embeds`` by the model runner (default LLaVA model).

The prompt is chunked so that chunk boundaries fall inside image spans; every chunk's embeddings
must equal the matching rows of ``model.merge_image_embeds``, and the engine's greedy tokens must
equal transformers' ``generate`` with ``pixel_values``.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.sequence import MMInput
from shared.model.image import ImageProcessor, expand_image_placeholders, image_content_hash
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from shared.model.default_model import build_default_model

    path = build_default_model(tmp_path_factory.mktemp("default_llava"))
    lm = load_model(path)
    images = [_image(1, (80, 64)), _image(2, (50, 90))]
    pixels = ImageProcessor.from_dir(path).preprocess(images)
    n = lm.config.num_image_tokens
    img = lm.config.image_token_id
    ids = [5, 9, 17, img, 11, 12, 13, img, 40, 41, 42]
    expanded, spans = expand_image_placeholders(ids, img, n)
    feats = lm.model.encode_images(pixels)  # [2, n, hidden]
    mm = [
        MMInput(off, feats[i], image_content_hash(f"img{i}".encode()))
        for i, (off, _) in enumerate(spans)
    ]
    return path, lm, pixels, expanded, feats, mm


def _engine(lm, budget: int) -> LLMEngine:
    cfg = EngineConfig(
        block_size=4, kv_cache_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=budget
    )
    return LLMEngine(lm, cfg)


def test_chunk_embeds_equal_merge(llava):
    _, lm, _, expanded, feats, mm = llava
    merged = lm.model.merge_image_embeds(torch.tensor(expanded), feats)
    eng = _engine(lm, budget=7)  # 7 does not divide the 16-token image spans
    eng.add_request("r", expanded, SamplingParams(temperature=0, max_tokens=1), mm_inputs=mm)
    covered, image_chunks = 0, 0
    while covered < len(expanded):
        sched = eng.scheduler.schedule()
        [sch] = sched.scheduled
        batch = eng.runner.prepare(sched)
        lo, hi = sch.start, sch.start + sch.num_new_tokens
        in_image = any(m.offset < hi and lo < m.offset + m.length for m in mm)
        if in_image:
            image_chunks += 1
            assert batch.inputs_embeds is not None
            assert torch.equal(batch.inputs_embeds, merged[lo:hi])
        else:  # text-only chunks take the plain embedding path
            assert batch.inputs_embeds is None
        logits = eng.runner.execute(batch)
        eng._update(sched, *eng._sample(sched, batch.logit_rows, logits))
        covered = hi
    assert image_chunks >= 5  # two 16-token images over 7-token chunks


def test_greedy_matches_transformers_with_images(llava):
    path, lm, pixels, expanded, _, mm = llava
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
    ids = torch.tensor([expanded])
    with torch.no_grad():
        ref = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )[0, len(expanded) :].tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for budget in (7, 64):  # chunked across image spans, and whole
        eng = _engine(lm, budget)
        eng.add_request("r", expanded, sp, mm_inputs=mm)
        got: list[int] = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                got += o.new_token_ids
        assert got == ref, budget
    # without the images the same token ids give different logits (the splice is not a no-op)
    eng = _engine(lm, 64)
    hidden_img = eng.runner.model.merge_image_embeds(torch.tensor(expanded), llava[4])
    hidden_txt = eng.runner.model.embed_tokens(torch.tensor(expanded))
    assert (hidden_img - hidden_txt).abs().max().item() > 0.1
