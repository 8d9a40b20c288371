"""int8 KV through the services (``STRATA_KV_INT8``): prefill pushes int8 frames (layer-wise and
after the prefill), decode dequantizes them into its float32 cache, and pool mode stores and
loads int8 blocks through a real kvstore on MinIO.

Tolerance: int8 KV is lossy (per-row scale, error <= scale / 2). Over a short generation (8
tokens, the built-in model) greedy tokens equal a float32 run's and each chosen token's
log-probability is within `LOGPROB_TOL` of float32's (measured: <= 0.15). The random-weight
model has near-ties on many prompts, where int8 KV may rightly pick the other token (logits
move by up to ~0.4 in the tail), so the prompts are ones whose float32 top-1 / top-2 gap
exceeds `MIN_GAP` at every step, checked first. The byte counters show int8-sized transfers:
1 byte per element plus a float32 scale per head_dim row, (head_dim + 4) / (4 * head_dim) of
float32 (0.27 at head_dim 64).
"""

from __future__ import annotations

import pytest

from shared.protocol import subjects
from shared.protocol.sampling import SamplingParams
from shared.protocol.work import PrefillWork
from tests.worker.conftest import kv_workers
from tests.worker.kv_counters import Transfers, assert_moved, kv_bytes
from tests.worker.test_pd import _run

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
LOGPROB_TOL = 0.25  # on the chosen token's logprob
MIN_GAP = 0.5  # float32 top-1 minus top-2 logprob, at every step of the prompts below
# Distinct prompts per test: the kvstore's MinIO bucket outlives a test, and a prompt whose
# blocks are already there would be served to prefill from the pool (another path).
PROMPTS = {
    "layerwise": [(i * 61 + 5) % 2000 + 10 for i in range(75)],  # 4 full blocks + 11 tokens
    "after_prefill": [(i * 71 + 5) % 2000 + 10 for i in range(75)],
    "pool": [(i * 43 + 5) % 2000 + 10 for i in range(90)],  # 5 full blocks + 10 tokens
}


@pytest.fixture(scope="module")
def fp32_run(model_dir) -> dict[str, list[dict[int, float]]]:
    """Per prompt, each generated token's logprobs (chosen first, then the top 2) from a single
    in-process engine with float32 KV."""
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model

    eng = LLMEngine(load_model(model_dir), EngineConfig(kv_cache_bytes=8 << 20))
    out: dict[str, list[dict[int, float]]] = {k: [] for k in PROMPTS}
    for name, prompt in PROMPTS.items():
        eng.add_request(name, prompt, PARAMS)
    while any(len(v) < PARAMS.max_tokens for v in out.values()):
        for o in eng.step():
            out[o.request_id] += o.new_logprobs
    return out


def _check_close(chunks, ref: list[dict[int, float]]) -> None:
    lps = [lp for c in sorted(chunks, key=lambda c: c.index) for lp in c.logprobs or []]
    assert len(lps) == len(ref) == PARAMS.max_tokens
    for step, (got, want) in enumerate(zip(lps, ref, strict=True)):
        first, second = sorted(want.values(), reverse=True)[:2]
        assert first - second > MIN_GAP, f"step {step}: float32 near-tie, pick another prompt"
        token = next(iter(want))
        assert next(iter(got)) == token, f"step {step}: greedy token differs: {got} vs {want}"
        assert abs(got[token] - want[token]) <= LOGPROB_TOL, f"step {step}: {got} vs {want}"


@pytest.fixture
async def int8_cluster(nats_url, nc, model_dir, kvstore):
    _, addr = kvstore
    specs = [
        ("prefill", "p8-lw", {"layerwise_transfer": True}),
        ("prefill", "p8-ap", {"layerwise_transfer": False}),
        ("decode", "d8", {"layerwise_transfer": True}),
    ]
    async with kv_workers(
        nc, nats_url, model_dir, addr, specs, kv_int8=True, transfer_timeout=5.0
    ) as workers:
        yield workers


@pytest.mark.parametrize("prefill,mode", [("p8-lw", "layerwise"), ("p8-ap", "after_prefill")])
async def test_int8_push_matches_fp32(int8_cluster, nc, fp32_run, prefill, mode):
    *_, d = int8_cluster
    prompt = PROMPTS[mode]
    t = Transfers()
    item = PrefillWork(
        request_id=f"r-int8-{mode}",
        prompt_token_ids=prompt,
        sampling=PARAMS,
        decode_instance="d8",
        decode_addr=d.addr,
    )
    chunks = await _run(nc, subjects.prefill_submit(prefill), item)
    _check_close(chunks, fp32_run[mode])
    int8 = kv_bytes(d.rt, len(prompt), int8=True)
    assert 3 * int8 < kv_bytes(d.rt, len(prompt))  # int8-sized: 3.8x fewer than fp32
    assert_moved(t.moved(), mode, int8)


async def test_int8_pool_store_and_load_matches_fp32(int8_cluster, nc, fp32_run, kvstore):
    p, _, d = int8_cluster
    store, _ = kvstore
    t = Transfers()
    item = PrefillWork(
        request_id="r-int8-pool",
        prompt_token_ids=PROMPTS["pool"],
        sampling=PARAMS,
        decode_instance="d8",
        decode_addr=d.addr,
        transfer_mode="pool",
    )
    chunks = await _run(nc, subjects.prefill_submit("p8-lw"), item)
    _check_close(chunks, fp32_run["pool"])
    # prefill stored the 5 full blocks as int8, decode loaded them from the DRAM tier
    assert_moved(t.moved(), "pool", kv_bytes(d.rt, 5 * 16, int8=True), kvstore_hits_dram=5)
    hashes = (await p.rt.port.match_prefix(PROMPTS["pool"])).hashes
    frames = [await store.acquire((p.rt.fingerprint, h)) for h in hashes]
    assert all(f is not None and f[0].dtype == "int8" for f in frames)
    for h, (_, leased) in zip(hashes, frames, strict=True):
        if leased:
            store.release((p.rt.fingerprint, h))
