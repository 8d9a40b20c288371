"""The response cache's warm and cold tiers: the kvstore's DRAM and its MinIO bucket.

Why the kvstore and not MinIO from the gateway: the kvstore already is a content-addressed
object store with a DRAM LRU, write-behind to MinIO, a byte budget on the bucket, restore into
DRAM on a read and a bucket listing on start-up, and it alone holds the (bucket-limited) MinIO
credentials. A cached response is one more block to it: key = the response key, fingerprint =
``resp-<model fingerprint>`` (its own namespace: no KV block hash can collide with it, and a
new model's responses live apart and age out of the bucket's LRU), dtype ``uint8``, data = the
msgpack `CachedResponse`. Its Query reply names the tier ("dram" = warm, "ssd" = cold); a Pull
of an "ssd" block reads it back from MinIO and promotes it to DRAM.

With several kvstores, each key lives on the one chosen by rendezvous hashing, as KV blocks do
(`shared.kvtransfer.pool.rendezvous_owner`). gRPC TLS comes from the ``STRATA_GRPC_TLS_*``
settings like every KV client (`strata up` gives the gateway its certificate).
"""

from __future__ import annotations

from collections.abc import Sequence

from protos.kv_transfer_pb2 import BlockFrame
from shared.kvtransfer.client import get_client
from shared.kvtransfer.pool import rendezvous_owner

_TIER = {"dram": "warm", "ssd": "cold"}


class KVStoreTier:
    """Response objects in the kvstore instances at ``addrs`` (``host:port`` gRPC)."""

    def __init__(self, addrs: Sequence[str], timeout: float):
        self.addrs = list(addrs)
        self.timeout = timeout

    def _client(self, key: str):
        return get_client(rendezvous_owner(key, self.addrs))

    async def get(self, ns: str, key: str) -> tuple[bytes, str] | None:
        """``(bytes, "warm" | "cold")`` or None when no tier holds ``key``; raises
        `StrataError` when the kvstore cannot be asked."""
        client = self._client(key)
        tiers = await client.query([key], ns, timeout=self.timeout)
        tier = _TIER.get(tiers.get(key, ""))
        if tier is None:
            return None
        async for frame in client.pull([key], ns, timeout=self.timeout):
            if frame.key == key:
                return frame.data, tier
        return None  # gone between the query and the pull (evicted)

    async def put(self, ns: str, key: str, data: bytes) -> None:
        frame = BlockFrame(
            key=key, fingerprint=ns, dtype="uint8", shape=[len(data)], data=data, num_chunks=1
        )
        await self._client(key).push([frame], timeout=self.timeout)
