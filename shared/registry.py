"""Instance registry in the JetStream KV bucket ``strata_registry`` (the role etcd plays elsewhere).

Each prefill / decode / kvstore instance writes ``<instance_id> -> InstanceRecord`` (role, gRPC
address, incarnation, capacity) when it starts and deletes it when it stops cleanly. Liveness is
NOT decided here: the scheduler declares an instance down after missed load reports, so a crashed
instance whose record is still in the bucket is still detected.

    js = nc.jetstream()
    await register_instance(js, InstanceRecord(instance_id="decode-0", role="decode", ...))
    ...
    await deregister_instance(js, "decode-0")
"""

from __future__ import annotations

import time

from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from shared.jetstream import while_electing
from shared.protocol.codec import decode, encode
from shared.protocol.sched import InstanceRecord
from shared.protocol.subjects import REGISTRY_BUCKET

__all__ = [
    "InstanceRecord",
    "deregister_instance",
    "read_registry",
    "register_instance",
    "registry_bucket",
]


async def registry_bucket(
    js: JetStreamContext, bucket: str = REGISTRY_BUCKET, replicas: int = 1
) -> KeyValue:
    """The registry bucket, created (history 1, file storage, ``replicas`` copies) if it does
    not exist yet."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(
                bucket=bucket,
                history=1,
                description="Strata instance registry",
                replicas=replicas,
            )
        except Exception:  # noqa: BLE001 - another process created it first
            return await js.key_value(bucket)


async def register_instance(
    js: JetStreamContext,
    info: InstanceRecord,
    bucket: str = REGISTRY_BUCKET,
    replicas: int = 1,
    retry_s: float = 15.0,
) -> int:
    """Write (or overwrite) ``info`` under its instance id; returns the KV revision. While the
    bucket's stream has no leader the write is retried (`shared.jetstream.while_electing`) for
    up to ``retry_s``, then the last error is raised."""
    if not info.ts:
        info = info.model_copy(update={"ts": time.time()})

    async def put() -> int:
        kv = await registry_bucket(js, bucket, replicas)
        return await kv.put(info.instance_id, encode(info))

    return await while_electing(put, f"registry write of {info.instance_id}", retry_s)


async def deregister_instance(
    js: JetStreamContext, instance_id: str, bucket: str = REGISTRY_BUCKET
) -> None:
    """Remove the instance's record (a clean shutdown); a missing record is not an error."""
    kv = await registry_bucket(js, bucket)
    try:
        await kv.delete(instance_id)
    except KeyNotFoundError:
        pass


async def read_registry(
    js: JetStreamContext, bucket: str = REGISTRY_BUCKET
) -> dict[str, InstanceRecord]:
    """Every record currently in the bucket, by instance id. Right after a NATS node holding
    the bucket's stream dies, nats-py can answer "no keys" for a moment (read here as {}) while
    the new stream leader catches up: a caller that needs a record retries until it shows
    (the scheduler follows the bucket with `services.scheduler.app.watch_registry` instead)."""
    kv = await registry_bucket(js, bucket)
    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    out: dict[str, InstanceRecord] = {}
    for key in keys:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue
        if entry.value:
            out[key] = decode(entry.value, InstanceRecord)
    return out
