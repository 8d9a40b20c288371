"""Pure parts of the response cache: the key, the hot tier, the stored object, the opt-in."""

from __future__ import annotations

import hashlib

import pytest

from services.gateway.core import ApiError
from services.gateway.pipeline import Prepared
from services.gateway.response_cache import (
    CachedResponse,
    HotTier,
    cache_key,
    deterministic,
    namespace,
    wanted,
)
from services.gateway.schemas import CompletionRequest
from shared.protocol.codec import decode, encode
from shared.protocol.sampling import SamplingParams
from shared.protocol.stream import TokenChunk, Usage
from shared.protocol.work import ImageRef


def prep(ids=(1, 2, 3), fp="fp", kv_dtype="float32", images=(), **sampling) -> Prepared:
    s = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **sampling})
    refs = [ImageRef(offset=o, length=n, hash=h, source_addr="x:1") for o, n, h in images]
    return Prepared(list(ids), s, refs, fingerprint=fp, kv_dtype=kv_dtype)


def test_key_is_sha256_of_canonical_json_and_stable():
    k = cache_key(1, [prep()])
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == cache_key(1, [prep()])  # same inputs, same key (no per-process salt)
    # the source address of an image is where to fetch it, not what it is: not in the key
    a = prep(images=[(0, 4, "h1")])
    moved = [a.images[0].model_copy(update={"source_addr": "y:2"})]
    b = Prepared(a.prompt_token_ids, a.sampling, moved, fingerprint="fp", kv_dtype="float32")
    assert cache_key(1, [a]) == cache_key(1, [b])
    assert k != hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 9},
        {"stop": ["x"]},
        {"seed": 7},
        {"temperature": 0.5},
        {"top_k": 3},
        {"logprobs": 2},
        {"min_tokens": 2},
        {"stop_token_ids": [5]},
        {"logit_bias": {3: 1.0}},
        {"ids": (1, 2, 4)},
        {"fp": "fp2"},
        {"kv_dtype": "int8"},
        {"images": [(0, 4, "h2")]},
    ],
    ids=lambda c: next(iter(c)),
)
def test_every_output_deciding_input_changes_the_key(change):
    assert cache_key(1, [prep(**change)]) != cache_key(1, [prep()])


def test_n_and_prompt_list_change_the_key():
    one = cache_key(1, [prep()])
    assert cache_key(2, [prep()]) != one
    assert cache_key(1, [prep(), prep(ids=(9,))]) != one
    assert namespace([prep(fp="abc")]) == "resp-abc"


def test_deterministic_means_greedy_or_seeded_for_every_prompt():
    assert deterministic([prep()])
    assert deterministic([prep(temperature=1.0, seed=3)])
    assert not deterministic([prep(temperature=0.7)])
    assert not deterministic([prep(), prep(temperature=0.7)])


def test_hot_tier_is_an_lru_by_bytes():
    hot = HotTier(10)
    assert hot.put("a", b"1234") == [] and hot.put("b", b"1234") == []
    assert hot.get("a") == b"1234"  # a is now the most recent
    assert hot.put("c", b"1234") == ["b"]
    assert list(hot._items) == ["a", "c"] and hot.used == 8
    assert hot.put("big", b"x" * 11) == [] and "big" not in hot  # larger than the budget
    assert hot.put("a", b"12") == [] and hot.used == 6  # a replaced, counted once
    hot.clear()
    assert len(hot) == 0 and hot.used == 0 and hot.get("a") is None


def test_cached_response_round_trips():
    chunk = TokenChunk(
        request_id="r",
        index=0,
        token_ids=[100, 101],
        text="t0 t1 ",
        logprobs=[{100: -0.5, 7: -1.5}, {101: -0.1}],
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=0),
    )
    resp = CachedResponse(key="k" * 64, fingerprint="fp", choices=[[chunk], [chunk]])
    assert decode(encode(resp), CachedResponse) == resp


def test_opt_in_field_header_and_bad_values():
    req = CompletionRequest(model="m", prompt="x")
    assert not wanted(req, {})
    assert wanted(req, {"X-Strata-Cache": "use"})
    assert not wanted(req, {"x-strata-cache": "off"})
    assert wanted(CompletionRequest(model="m", prompt="x", cache=True), {"x-strata-cache": "off"})
    assert not wanted(CompletionRequest(model="m", prompt="x", cache=False), {})
    with pytest.raises(ApiError) as err:
        wanted(req, {"x-strata-cache": "yes please"})
    assert err.value.param == "cache" and "X-Strata-Cache" in err.value.message


async def test_an_unreadable_or_misplaced_object_is_a_miss():
    from services.gateway.config import GatewayConfig
    from services.gateway.response_cache import ResponseCache

    cache = ResponseCache(GatewayConfig(response_cache=True))
    chunk = TokenChunk(request_id="r", index=0, text="x", finish_reason="stop")
    good = CachedResponse(key="a" * 64, fingerprint="fp", choices=[[chunk]])
    cache.store("resp-fp", good)
    got = await cache.get("resp-fp", "a" * 64)
    assert got is not None and got[0] == good and got[1] == "hot"
    assert await cache.get("resp-other", "a" * 64) is None  # another model's namespace
    cache.hot.put("b" * 64, encode(good))  # stored under another key
    cache.hot.put("c" * 64, b"\xc1 not msgpack")
    assert await cache.get("resp-fp", "b" * 64) is None
    assert await cache.get("resp-fp", "c" * 64) is None
