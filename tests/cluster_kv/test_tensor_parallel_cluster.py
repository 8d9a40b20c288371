"""`strata up --tp 2` on the default colocated shape (decode prefills itself, kvstore + MinIO on)
with a random Qwen3 (6 heads / 2 KV heads), real processes and gloo:

* greedy completions equal transformers', and decode's metrics show the sharded path ran
  (all-reduced bytes, world size 2, KV heads gathered for the pool write-through);
* a killed follower rank stops its instance with one line naming the rank; the restart
  supervisor brings it back, and the fresh instance loads the prompt's blocks back from the
  pool, scattered by KV head over its two ranks, and answers the same;
* a follower rank killed under 8 streams: its instance stops as a whole, the streams fail over
  to the other decode instance and finish with transformers' tokens, the group restarts;
* ``--tp 3`` (2 KV heads), ``--tp 0`` and more ranks than GPUs fail at start-up with one line,
  before any rank starts;
* the disaggregated shape pushes whole-head KV layer by layer between prefill and decode at
  any pair of TP degrees (2/2, 1/2, 2/1): re-sharded by KV head on the receiving side.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import time

import httpx
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

# loads the checkpoint on each call: once per test module is enough
kv_bytes = functools.cache(kv_bytes_per_token)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

N = 8
PROMPT = SHARED_PREFIX + "Which tier survives a restart?"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_text("qwen3", tmp_path_factory.mktemp("tp") / "checkpoint")


def _complete(cluster, retry_s: float = 0.0):
    client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="x", max_retries=0)
    deadline = time.monotonic() + retry_s
    while True:
        try:
            model = client.models.list().data[0].id
            return client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=N,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _ranks(pid: int) -> list[int]:
    """The rank processes ``pid`` spawned (not multiprocessing's resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid and b"spawn_main" in cmd:
                out.append(int(d))
    return out


def test_tp2_colocated_cluster_serves_pools_and_restarts_after_a_rank_kill(qwen3, tmp_path):
    ids = qwen3.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ref = qwen3.tokenizer.decode(greedy(qwen3, ids, N)[0], skip_special_tokens=True)
    blocks = (len(ids) - 1) // 16
    assert blocks >= 2
    cluster = start_cluster(
        str(qwen3.path),
        data_dir=str(tmp_path / "cluster"),
        prefill=0,
        tp=2,
        restart=True,
        # pool loads forced on: the tiny model may recompute faster than it loads; every block
        # written through (a crash leaves no time for the stop's flush)
        env={"STRATA_KV_POOL_LOAD": "always", "STRATA_KV_POOL_SAVE": "all"},
    )
    try:
        first = _complete(cluster)
        assert first.choices[0].text == ref
        assert metric(cluster, "decode-0", "strata_tp_world_size") == 2
        assert metric(cluster, "decode-0", "strata_tp_allreduce_bytes_total") > 0
        wait_until(
            lambda: (
                metric(
                    cluster, "decode-0", "strata_prefix_pool_stored_blocks_total", source="computed"
                )
                >= blocks
            ),
            30,
            "decode's write-through to the pool",
        )
        assert metric(cluster, "decode-0", "strata_tp_kv_bytes_total", op="gather") > 0
        assert metric(cluster, "kvstore-0", "strata_kvstore_puts_total", outcome="stored") >= blocks

        # a follower rank dies: the instance stops as a whole, the restart supervisor starts
        # it again, and the fresh instance (empty engine memory) loads the prompt's blocks
        # from the pool, scattered by KV head over its ranks
        rank0 = cluster.sup.procs["decode-0"].proc.pid
        (follower,) = _ranks(rank0)
        os.kill(follower, signal.SIGKILL)
        wait_until(lambda: cluster.sup.procs["decode-0"].proc.pid != rank0, 60, "a restart")
        with open(os.path.join(cluster.log_dir, "decode-0.log")) as f:
            log = f.read()
        line = f"tensor parallel rank 1 of 2 (pid {follower}) exited with code -9: stopping"
        assert log.count(line) == 1, log[-3000:]
        cluster.sup.wait_ready(["decode-0"], 240)
        t0 = transfer_counters(cluster)
        again = _complete(cluster, retry_s=120)
        assert again.choices[0].text == ref
        assert again.usage.prompt_tokens_details.cached_tokens == blocks * 16
        n = blocks * 16 * kv_bytes(str(qwen3.path))  # whole blocks: both KV heads
        assert moved_since(t0, transfer_counters(cluster)) == {"received:pool": n}
        assert metric(cluster, "decode-0", "strata_tp_kv_bytes_total", op="scatter") == n
    finally:
        cluster.stop()


STREAMS = 8
STREAM_TOKENS = 48  # the kill comes after 4: most of each stream is still to come


async def _stream_ids(cl, url: str, model: str, ids: list[int], progress: list[int], i: int):
    """One greedy streamed completion of token-id prompt ``ids``: its token ids, or the error."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    got: list[int] = []
    async with cl.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return obj["error"]["message"]
            for ch in obj["choices"]:
                got += ch.get("token_ids") or []
                progress[i] = len(got)
    return got


def test_a_rank_killed_under_8_streams_fails_them_over_and_the_group_restarts(qwen3, tmp_path):
    """``--tp 2`` with two decode instances: a follower rank of decode-0 is killed while 8
    greedy streams run on both instances; decode-0 stops as a whole, its streams fail over to
    decode-1 and finish with transformers' tokens (none lost or repeated), and the restart
    supervisor brings decode-0's group back, which then serves again."""
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 400) for _ in range(24 + 3 * i)] for i in range(STREAMS)]
    refs = [greedy(qwen3, p, STREAM_TOKENS)[0] for p in prompts]
    cluster = start_cluster(
        str(qwen3.path),
        data_dir=str(tmp_path / "cluster"),
        prefill=0,
        decode=2,
        kvstore=0,
        tp=2,
        restart=True,
        env={"STRATA_STALL_TIMEOUT": "10"},
    )
    try:
        url = cluster.gateway_url
        rank0 = cluster.sup.procs["decode-0"].proc.pid
        (follower,) = _ranks(rank0)

        async def run():
            progress = [0] * STREAMS
            async with httpx.AsyncClient(timeout=240) as cl:
                model = (await cl.get(url + "/v1/models")).json()["data"][0]["id"]
                tasks = [
                    asyncio.create_task(_stream_ids(cl, url, model, p, progress, i))
                    for i, p in enumerate(prompts)
                ]
                while min(progress) < 4 and not any(t.done() for t in tasks):
                    await asyncio.sleep(0.02)
                live = sum(not t.done() for t in tasks)
                os.kill(follower, signal.SIGKILL)
                return live, await asyncio.gather(*tasks)

        live, got = asyncio.run(run())
        assert live == STREAMS, f"only {live} streams were live at the kill"
        assert got == refs  # every stream complete, token for token
        assert metric(cluster, "gateway-0", "strata:stream_failovers_total") >= 1
        wait_until(lambda: cluster.sup.procs["decode-0"].proc.pid != rank0, 60, "a restart")
        cluster.sup.wait_ready(["decode-0"], 240)
        assert metric(cluster, "decode-0", "strata_tp_world_size") == 2
        assert _complete(cluster, retry_s=120).choices[0].text  # served again
    finally:
        cluster.stop()


BAD_TP = [
    (["--tp", "3"], "num_kv_heads (2)"),
    (["--tp", "0"], "STRATA_TP (--tp)"),
    (["--tp", "2", "--device", "cuda:64"], "needs CUDA devices up to cuda:65"),
]


@pytest.fixture(scope="module")
def bad_tp_runs(qwen3) -> dict[tuple[str, ...], tuple[int, str]]:
    """``strata serve decode`` with each of `BAD_TP`'s flags, all started at once."""
    return serve_decode_at_once(str(qwen3.path), [tuple(args) for args, _ in BAD_TP])


@pytest.mark.parametrize("args,want", BAD_TP)
def test_bad_tp_fails_with_one_line(bad_tp_runs, args, want):
    rc, out = bad_tp_runs[tuple(args)]
    assert rc == 1
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("STRATA_FATAL decode:"), lines
    assert want in lines[0]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 2), (1, 2), (2, 1)])
def test_prefill_pushes_whole_blocks_to_decode_at_any_tp_layout(
    qwen3, tmp_path, prefill_tp, decode_tp
):
    """The disaggregated shape with TP on either side (PD with different layouts): prefill
    reads each layer's KV out while computing (gathered from its ranks inside the forward when
    sharded) and pushes whole-head blocks layer by layer; decode writes them in (scattered by KV
    head over its ranks when sharded) and decodes the same tokens as transformers."""
    ids = qwen3.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ref = qwen3.tokenizer.decode(greedy(qwen3, ids, N)[0], skip_special_tokens=True)
    cluster = start_cluster(
        str(qwen3.path),
        prefill=1,
        kvstore=0,
        role_args={"prefill": ["--tp", str(prefill_tp)], "decode": ["--tp", str(decode_tp)]},
    )
    try:
        t0 = transfer_counters(cluster)
        r = _complete(cluster)
        assert r.choices[0].text == ref
        n = len(ids) * kv_bytes(str(qwen3.path))
        assert moved_since(t0, transfer_counters(cluster)) == {
            "sent:layerwise": n,
            "received:layerwise": n,
        }
        assert metric(cluster, "prefill-0", "strata_tp_world_size") == prefill_tp
        assert metric(cluster, "decode-0", "strata_tp_world_size") == decode_tp
        gathered = metric(cluster, "prefill-0", "strata_tp_kv_bytes_total", op="gather")
        scattered = metric(cluster, "decode-0", "strata_tp_kv_bytes_total", op="scatter")
        assert gathered >= n if prefill_tp > 1 else gathered == 0
        assert scattered == (n if decode_tp > 1 else 0)
    finally:
        cluster.stop()
