"""MinIO stopped under load: requests keep succeeding (engine / DRAM / recompute), the failed
SSD writes are counted, and writing behind resumes when MinIO returns on the same port and
data dir. The KV of every request reaches decode by the layer-wise push throughout (transfer
byte counters; nothing falls back to recompute), which the same text alone would not show."""

from __future__ import annotations

import random
import threading

import openai
import pytest

from tests.cluster.conftest import API_KEY
from tests.cluster_kv.conftest import (
    SHARED_PREFIX,
    kv_bytes_per_token,
    metric,
    moved_since,
    start_cluster,
    transfer_counters,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORDS = "tier block hash chunk object spill restore prefix pool cache token layer".split()


def client_of(cluster) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    return client, client.models.list().data[0].id


def ask(client, model, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.0)
    return r.choices[0].text


class Load:
    """Two client threads sending requests with new prompts (new blocks for the pool)."""

    def __init__(self, client, model):
        self.client, self.model = client, model
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(48))
            try:
                ask(self.client, self.model, prompt)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
                self.errors.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_minio_down_under_load_then_back(model_dir):
    secured = {
        "STRATA_LAYERWISE_TRANSFER": "true",
        "STRATA_API_KEYS": API_KEY,
        "STRATA_KV_POOL_SAVE": "all",  # every block to the pool: a steady stream of SSD writes
    }
    c = start_cluster(model_dir, env=secured)  # NATS users, KV mTLS and an API key
    try:
        client, model = client_of(c)
        known = SHARED_PREFIX + "What survives a MinIO outage?"
        t0 = transfer_counters(c)
        r = client.completions.create(model=model, prompt=known, max_tokens=4, temperature=0.0)
        expected = r.choices[0].text
        known_bytes = r.usage.prompt_tokens * kv_bytes_per_token(model_dir)
        assert moved_since(t0, transfer_counters(c)) == {
            "sent:layerwise": known_bytes,
            "received:layerwise": known_bytes,
        }

        def kv(sample: str, **labels) -> float:
            return metric(c, "kvstore-0", sample, **labels)

        wait_until(lambda: kv("strata_kvstore_persists_total") >= 4, 30, "write-behind")
        assert kv("strata_kvstore_ssd_online") == 1
        with Load(client, model) as load:
            wait_until(lambda: load.ok >= 2, 60, "load running")
            c.minio.stop()
            down_at = load.ok
            wait_until(
                lambda: kv("strata_kvstore_errors_total", op="spill") > 0,
                60,
                "failed SSD writes counted",
            )
            assert kv("strata_kvstore_ssd_online") == 0
            t_down = transfer_counters(c)
            assert ask(client, model, known) == expected  # served while MinIO is down
            down = moved_since(t_down, transfer_counters(c))
            assert down.get("received:layerwise", 0) >= known_bytes  # pushed, not recomputed
            wait_until(lambda: load.ok >= down_at + 3, 60, "requests while MinIO is down")
            # new blocks wait in DRAM for their SSD write (the gauge moves at the next report)
            wait_until(
                lambda: kv("strata_kvstore_blocks", tier="write_behind") > 0,
                60,
                "blocks waiting for the SSD tier",
            )
            queued = kv("strata_kvstore_blocks", tier="write_behind")
            persisted = kv("strata_kvstore_persists_total")

            c.minio.start()  # same port, same data dir
            wait_until(lambda: kv("strata_kvstore_ssd_online") == 1, 90, "SSD tier back")
            back_at = load.ok
            wait_until(lambda: load.ok >= back_at + 2, 60, "requests after MinIO is back")
        assert load.errors == []
        wait_until(
            lambda: kv("strata_kvstore_blocks", tier="write_behind") == 0,
            60,
            "write-behind queue drained",
        )
        assert kv("strata_kvstore_persists_total") >= persisted + queued
        assert ask(client, model, known) == expected
        moved = moved_since(t0, transfer_counters(c))
        assert not any(k.startswith("fallback:") for k in moved), moved  # no KV lost all along
        # every byte decode used was pushed by prefill (a push is only cut short, never received,
        # when a request ends at its first token)
        assert 0 < moved["received:layerwise"] <= moved["sent:layerwise"]
        assert set(moved) == {"sent:layerwise", "received:layerwise"}, moved
        c.check()  # no service died
    finally:
        c.stop()
