"""Vision core + service: cache hits, gRPC embeddings equal to `encode_images`, EPD overlap."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

from services.vision.core import CACHE_EVENTS, EmbeddingCache, VisionCore, decode_image
from shared.protocol.errors import StrataError
from shared.protocol.vision import VisionEncodeReply, VisionEncodeRequest


def png(seed: int, size: tuple[int, int] = (80, 64)) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from shared.model.default_model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("vismodel"))


@pytest.fixture(scope="module")
def core(model_dir):
    return VisionCore(model_dir)


def _hits() -> float:
    return CACHE_EVENTS.labels("hit")._value.get()


def test_cache_lru_by_bytes():
    c = EmbeddingCache(max_bytes=3 * 16)  # three float32 [2, 2] tensors
    for k in "abcd":
        c.put(k, torch.zeros(2, 2))
    assert len(c) == 3 and c.get("a") is None and c.bytes == 48
    c.get("b")  # b becomes most recent; e evicts c
    c.put("e", torch.zeros(2, 2))
    assert c.get("c") is None and c.get("b") is not None


def test_decode_refuses_bombs_and_garbage():
    with pytest.raises(StrataError, match="at most 100 pixels"):
        decode_image(png(0), max_pixels=100)
    with pytest.raises(StrataError, match="cannot decode image"):
        decode_image(b"not an image", max_pixels=10**6)


def test_same_image_twice_is_a_cache_hit(core):
    from shared.model.image import ImageProcessor, image_content_hash

    raw = png(1)
    before = _hits()
    first = core.encode(VisionEncodeRequest(request_id="a", images=[raw]))
    assert first.cache_hits == 0 and _hits() == before
    second = core.encode(VisionEncodeRequest(request_id="b", images=[raw]))
    assert second.cache_hits == 1 and _hits() == before + 1
    info = second.images[0]
    assert info.hash == image_content_hash(raw) and info.num_tokens == 16
    assert (info.width, info.height) == (80, 64)
    want = core.loaded.model.encode_images(
        ImageProcessor.from_dir(core.loaded.path).preprocess([Image.open(io.BytesIO(raw))])
    )[0]
    torch.testing.assert_close(core.get(info.hash), want, rtol=0, atol=0)


async def test_service_grpc_pull_and_overlap(nc, core, model_dir):
    from services.tokenizer.app import serve_tokenizer
    from services.tokenizer.core import TokenizerCore
    from services.vision.app import serve_vision
    from services.vision.grpc import EmbeddingHandler
    from shared import bus
    from shared.kvtransfer.client import KVClient
    from shared.kvtransfer.server import start_kv_server
    from shared.protocol import subjects
    from shared.protocol.tok import TokenizeReply, TokenizeRequest

    server, addr = await start_kv_server(EmbeddingHandler(core))
    subs = [
        await serve_vision(nc, core, "vis-0", addr),
        await serve_tokenizer(nc, TokenizerCore(model_dir)),
    ]
    client = KVClient(addr)
    try:
        images = [png(10 + i, (64, 64)) for i in range(3)]
        parts = [{"type": "text", "text": "describe " * 20000}]
        parts += [{"type": "image_url", "image_url": {"url": "x"}} for _ in images]
        tok_req = TokenizeRequest(request_id="r", messages=[{"role": "user", "content": parts}])
        tok, vis = await asyncio.gather(
            bus.request(nc, subjects.TOK_ENCODE, tok_req, TokenizeReply),
            bus.request(
                nc,
                subjects.VISION_ENCODE,
                VisionEncodeRequest(request_id="r", images=images),
                VisionEncodeReply,
            ),
        )
        # EPD: the two services worked at the same time (their busy intervals intersect)
        assert tok.started_at < vis.finished_at and vis.started_at < tok.finished_at
        assert len(tok.image_spans) == len(vis.images) == 3
        assert vis.source_addr == addr and vis.instance_id == "vis-0"
        keys = [i.hash for i in vis.images]
        got = await client.pull_tensors(keys + ["missing"], core.fingerprint)
        assert sorted(got) == sorted(keys)
        for k in keys:
            torch.testing.assert_close(got[k], core.get(k), rtol=0, atol=0)
            assert got[k].shape == (16, core.loaded.config.hidden_size)
        assert await client.pull_tensors(keys, "other-model") == {}
        assert await client.query(keys + ["missing"]) == {k: "engine" for k in keys}
        with pytest.raises(StrataError) as ei:
            await bus.request(
                nc,
                subjects.VISION_ENCODE,
                VisionEncodeRequest(request_id="x", images=[b"junk"]),
                VisionEncodeReply,
            )
        assert ei.value.code == "bad_request"
    finally:
        await client.close()
        for s in subs:
            await s.unsubscribe()
        await server.stop(0)
