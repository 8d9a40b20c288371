"""`strata up --ep 2` on the default colocated shape (decode prefills itself, kvstore + MinIO
on) with a random Qwen3-MoE (8 experts, top-2), real processes and gloo: greedy completions
equal transformers', decode's metrics show the expert-parallel path ran (4 expert slots per
rank, all-to-all bytes) and the pool write-through stored the prompt's blocks (rank 0's copy of
the replicated KV); the same with ``--tp 2 --ep 2``; prefill + decode at ``--ep 2`` push KV
layer by layer (exact bytes, broadcast to decode's other rank). ``--ep`` that does not fit the checkpoint
or differs from ``--tp`` fails at start-up with one line.
"""

from __future__ import annotations

import openai
import pytest

from tests.acceptance.checkpoints import build_text, greedy
from tests.cluster_kv.conftest import (
    SHARED_PREFIX,
    kv_bytes_per_token,
    metric,
    moved_since,
    serve_decode_at_once,
    start_cluster,
    transfer_counters,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
N = 8
PROMPT = SHARED_PREFIX + "Which expert answers?"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_text("qwen3_moe", tmp_path_factory.mktemp("ep") / "checkpoint")


@pytest.mark.parametrize("tp", [1, 2], ids=["ep2", "tp2-ep2"])
def test_ep2_colocated_cluster_serves_and_pools(moe, tmp_path, tp):
    """``tp2-ep2``: heads and the dense layer split by TP, experts by EP, over the same 2 ranks
    (the pool write-through then gathers KV heads; every block written through, the policy
    CUDA boxes get by default)."""
    ids = moe.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ref = moe.tokenizer.decode(greedy(moe, ids, N)[0], skip_special_tokens=True)
    blocks = (len(ids) - 1) // 16
    cluster = start_cluster(
        str(moe.path),
        data_dir=str(tmp_path / "cluster"),
        prefill=0,
        ep=2,
        tp=tp,
        env={"STRATA_KV_POOL_SAVE": "all"},
    )
    try:
        client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPT,
            max_tokens=N,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == ref
        assert metric(cluster, "decode-0", "strata_ep_local_experts") == 4
        assert metric(cluster, "decode-0", "strata_ep_alltoall_bytes_total") > 0
        allreduced = metric(cluster, "decode-0", "strata_tp_allreduce_bytes_total")
        assert (allreduced > 0) == (tp == 2)
        wait_until(
            lambda: (
                metric(
                    cluster, "decode-0", "strata_prefix_pool_stored_blocks_total", source="computed"
                )
                >= blocks
            ),
            60,
            "the pool write-through",
        )
    finally:
        cluster.stop()


def test_ep2_prefill_pushes_layer_by_layer_to_ep2_decode(moe):
    """The disaggregated shape at --ep 2: prefill reads each layer's KV out of rank 0's own copy
    while computing (its followers wait after the same layer) and pushes it layer by layer;
    decode broadcasts it to its other rank and decodes the same tokens as transformers."""
    ids = moe.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ref = moe.tokenizer.decode(greedy(moe, ids, N)[0], skip_special_tokens=True)
    cluster = start_cluster(str(moe.path), prefill=1, kvstore=0, ep=2)
    try:
        t0 = transfer_counters(cluster)
        client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPT,
            max_tokens=N,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == ref
        n = len(ids) * kv_bytes_per_token(str(moe.path))
        assert moved_since(t0, transfer_counters(cluster)) == {
            "sent:layerwise": n,
            "received:layerwise": n,
        }
        assert metric(cluster, "decode-0", "strata_ep_kv_bytes_total") == n  # to its 1 other rank
        assert metric(cluster, "prefill-0", "strata_ep_alltoall_bytes_total") > 0
    finally:
        cluster.stop()


BAD_EP = [
    (["--ep", "16"], "--ep 16 is more ranks than the checkpoint's 8 experts"),
    (["--ep", "3"], "--ep 3 must divide the checkpoint's 8 experts"),
    (["--ep", "2", "--tp", "4"], "--tp 4 with --ep 2: together they run over the same ranks"),
]


@pytest.fixture(scope="module")
def bad_ep_runs(moe) -> dict[tuple[str, ...], tuple[int, str]]:
    """``strata serve decode`` with each of `BAD_EP`'s flags, all started at once."""
    return serve_decode_at_once(str(moe.path), [tuple(args) for args, _ in BAD_EP])


@pytest.mark.parametrize("args,want", BAD_EP)
def test_bad_ep_fails_with_one_line(bad_ep_runs, args, want):
    rc, out = bad_ep_runs[tuple(args)]
    assert rc == 1
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("STRATA_FATAL decode:"), lines
    assert want in lines[0]
