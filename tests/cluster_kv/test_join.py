"""`strata up --nats-url ... --minio-endpoint ...`: a second cluster joins the first one's NATS
and MinIO instead of starting its own (as on a second host), its instances register with the
first cluster's scheduler under prefixed ids, and its kvstore writes the shared SSD tier."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from minio import Minio

from services.launcher import Cluster
from shared import bus
from shared.protocol import subjects
from shared.protocol.sched import InstancesReply, InstancesRequest
from tests.cluster_kv.conftest import SHARED_PREFIX, metric, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def decode_ids(c: Cluster) -> set[str]:
    """Decode instances the scheduler on ``c``'s NATS knows alive."""

    async def ask() -> set[str]:
        nc = await bus.connect(c.nats_url, "test-join", auth=c.nats_credentials("gateway"))
        try:
            rep = await bus.request(
                nc, subjects.SCHED_INSTANCES, InstancesRequest(role="decode"), InstancesReply, 5
            )
        finally:
            await nc.drain()
        return {i.instance_id for i in rep.instances if i.alive}

    return asyncio.run(ask())


def chat(c: Cluster, text: str) -> httpx.Response:
    model = httpx.get(c.gateway_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return httpx.post(c.gateway_url + "/v1/chat/completions", json=body, timeout=60)


def test_a_second_cluster_joins_the_first_ones_nats_and_minio(model_dir):
    a = start_cluster(model_dir, prefill=0)
    try:
        b = start_cluster(
            model_dir,
            nats_url=a.nats_url,
            nats_credentials=os.path.join(a.data_dir, "nats", "credentials"),
            minio_endpoint=a.minio.endpoint,
            minio_credentials=a.minio.credentials_file,
        )
        try:
            # nothing of its own: no nats-server, no MinIO process, ids that cannot collide
            assert b.nats.proc is None and b.minio.proc is None
            assert b.nats_url == a.nats_url and b.instance_prefix
            joined = f"{b.instance_prefix}decode-0"
            assert b.specs["decode-0"].env["STRATA_INSTANCE_ID"] == joined
            assert {"decode-0", joined} <= decode_ids(a)

            # with A's only decode gone, every request is served by B's instances (while both
            # live, the schedulers may route B's requests to A's decode, whose kvstore is A's).
            a.kill("decode-0")
            # A's and B's schedulers answer SCHED_INSTANCES as one queue group, each from its own
            # view of liveness, and they see the death at slightly different times: wait until
            # ten answers in a row (from either) agree that only B's decode is left.
            deadline, streak, ids = time.monotonic() + 90, 0, set()
            while time.monotonic() < deadline and streak < 10:
                ids = decode_ids(a)
                streak = streak + 1 if ids == {joined} else 0
                time.sleep(0.2)
            assert streak == 10, ids

            # B's kvstore writes blocks into A's MinIO (B has no MinIO of its own): a prefix
            # two requests share reaches the pool
            for tail in ("Which tier served this?", "Which tier is shared?"):
                r = chat(b, SHARED_PREFIX + tail)
                assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                written = metric(b, "kvstore-0", "strata_kvstore_ssd_objects_written_total")
                if written > 0:
                    break
                time.sleep(0.5)
            assert written > 0, "the joined kvstore wrote nothing to the shared SSD tier"
            root = Minio(
                a.minio.endpoint,
                access_key=a.minio.access_key,
                secret_key=a.minio.secret_key,
                secure=False,
            )
            objects = list(root.list_objects(a.minio.kv_bucket, recursive=True))
            assert len(objects) >= written

            # A's gateway is served by B's instances
            r = chat(a, "Served by the joined cluster?")
            assert r.status_code == 200, r.text
            assert not a.alive("decode-0")
        finally:
            b.stop()
    finally:
        a.stop()


def test_joining_fails_in_one_line_without_a_server_or_credentials(model_dir, tmp_path):
    with pytest.raises(RuntimeError, match=r"--nats-url nats://127\.0\.0\.1:1: no NATS server"):
        Cluster(model_dir, nats_url="nats://127.0.0.1:1", nats_auth=False).start()
    with pytest.raises(RuntimeError, match="needs --nats-credentials"):
        Cluster(model_dir, nats_url="nats://127.0.0.1:1").start()
    with pytest.raises(RuntimeError, match="empty entry"):
        Cluster(model_dir, nats_url="nats://127.0.0.1:1,", nats_auth=False).start()
    with pytest.raises(RuntimeError, match="--minio-credentials .*: no such file"):
        Cluster(
            model_dir,
            minio_endpoint="127.0.0.1:1",
            minio_credentials=str(tmp_path / "missing.json"),
        ).start()
