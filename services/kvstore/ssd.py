"""The SSD tier: one MinIO (S3) object per block, named ``<fingerprint>/<hash>``.

Blocking minio-SDK calls; the async `KVStore` runs them in worker threads. Calls fail fast
(short timeouts, one retry) so a MinIO outage degrades the kvstore to DRAM-only instead of
stalling it; failures raise `ObjectStoreError`, a missing object returns None.

Why one object per block and no chunk objects: see docs/benchmarks/kvpool.md. In short, at KV
block sizes (tens of KiB to MiBs) the per-object cost is amortized by issuing the writes
concurrently, and a chunk object would couple the lifetimes of unrelated blocks.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import urllib3
from minio import Minio
from minio.error import S3Error

from services.kvstore.dram import BlockKey

NO_FINGERPRINT = "_"


class ObjectStoreError(RuntimeError):
    """The object store could not be reached or refused the operation."""


def object_name(key: BlockKey) -> str:
    fp, h = key
    return f"{fp or NO_FINGERPRINT}/{h}"


def parse_name(name: str) -> BlockKey | None:
    fp, sep, h = name.rpartition("/")
    if not sep or not h:
        return None
    return ("" if fp == NO_FINGERPRINT else fp, h)


class MinioTier:
    """Blocks as objects in ``bucket`` (created if missing)."""

    def __init__(
        self,
        endpoint: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        *,
        secure: bool = False,
        timeout: float = 5.0,
        max_connections: int = 16,
    ):
        self.bucket = bucket
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=min(timeout, 2.0), read=timeout),
            maxsize=max_connections,
            retries=urllib3.Retry(total=1, backoff_factor=0.05, status_forcelist=[502, 503, 504]),
        )
        self.client = Minio(
            endpoint,
            access_key=access_key,
            secret_key=secret_key,
            secure=secure,
            region="us-east-1",
            http_client=http,
        )
        self._bucket_ready = False

    def _call(self, fn, *args, **kwargs):
        try:
            if not self._bucket_ready:
                self.ensure_bucket()
            return fn(*args, **kwargs)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                return None
            raise ObjectStoreError(f"minio {exc.code}: {exc.message}") from exc
        except ObjectStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - urllib3/socket errors: store unreachable
            raise ObjectStoreError(f"minio unreachable: {type(exc).__name__}: {exc}") from exc

    def ensure_bucket(self) -> None:
        try:
            if not self.client.bucket_exists(self.bucket):
                try:
                    self.client.make_bucket(self.bucket)
                except S3Error as exc:  # another instance created it first
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
        except S3Error as exc:
            raise ObjectStoreError(f"minio {exc.code}: {exc.message}") from exc
        except Exception as exc:  # noqa: BLE001
            raise ObjectStoreError(f"minio unreachable: {type(exc).__name__}: {exc}") from exc
        self._bucket_ready = True

    def put(self, key: BlockKey, data: bytes) -> None:
        self._call(
            self.client.put_object,
            self.bucket,
            object_name(key),
            io.BytesIO(data),
            len(data),
            content_type="application/octet-stream",
        )

    def get(self, key: BlockKey) -> bytes | None:
        def read() -> bytes:
            resp = self.client.get_object(self.bucket, object_name(key))
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        return self._call(read)

    def delete(self, key: BlockKey) -> None:
        self._call(self.client.remove_object, self.bucket, object_name(key))

    def list(self, fingerprint: str | None = None) -> Iterator[tuple[BlockKey, int]]:
        """Every block object (optionally of one fingerprint) with its size."""

        def listing() -> list[tuple[BlockKey, int]]:
            prefix = None if fingerprint is None else f"{fingerprint or NO_FINGERPRINT}/"
            out = []
            for obj in self.client.list_objects(self.bucket, prefix=prefix, recursive=True):
                key = parse_name(obj.object_name or "")
                if key is not None:
                    out.append((key, obj.size or 0))
            return out

        return iter(self._call(listing) or [])
