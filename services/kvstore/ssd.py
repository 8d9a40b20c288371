"""The SSD tier in MinIO (S3): big blocks as one object each, ``<fingerprint>/<hash>``; small
blocks batched into chunk objects, ``<fingerprint>/chunk/<id>``, each carrying its manifest in a
header (format: `services.kvstore.chunks`), read back with ranged GETs (a pull's adjacent blocks in
one GET, GETs in parallel: `services.kvstore.reader`).

Blocking minio-SDK calls; the async `KVStore` runs them in worker threads. Calls fail fast
(short timeouts, one quick retry, a 503's Retry-After not honoured) so a MinIO outage degrades
the kvstore to DRAM-only instead of stalling it; failures raise `ObjectStoreError`, a missing
object returns None. With several endpoints (one distributed MinIO), a node that is down or
answers 503 (busy: a node that just lost a peer says ``SlowDownWrite`` with ``Retry-After: 60``
for several seconds while its peers accept the write) sends the call to the next node; only when
some node said busy and none took the call is the round repeated, after 0.5, 1, then 2 s
pauses, up to 19.5 s (`BUSY_WAITS_S`).

Why chunks below ~1 MiB and one object per block above: docs/benchmarks/kvpool.md.
"""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import urllib3
from minio import Minio
from minio.error import S3Error

from services.kvstore.chunks import (
    HEADER_READ_BYTES,
    PREFIX_BYTES,
    SsdLoc,
    header_length,
    pack_chunk,
    parse_index,
)
from services.kvstore.dram import BlockKey

NO_FINGERPRINT = "_"
CHUNK_DIR = "chunk"


BUSY_CODES = frozenset(
    {
        "SlowDown",
        "SlowDownWrite",
        "SlowDownRead",
        "ServiceUnavailable",
        "XMinioServerNotInitialized",
    }
)
"""S3 error codes of a 503 that reached the SDK (a request urllib3 does not retry)."""
BUSY_WAITS_S = (0.5, 1.0, *[2.0] * 9)
"""Pauses before another round over the endpoints when a node answered 503 and none took the
call: a distributed MinIO settling after a node loss (seen: every surviving node busy for up to
~13 s), 19.5 s in all; never the 60 s a 503 asks for."""


class ObjectStoreError(RuntimeError):
    """The object store could not be reached or refused the operation. ``kind``:
    ``unreachable`` (no answer), ``busy`` (503 after the retry), ``refused`` (any other error
    answer)."""

    def __init__(self, message: str, kind: str = "refused"):
        super().__init__(message)
        self.kind = kind


def _s3_error(exc: S3Error) -> ObjectStoreError:
    """The `ObjectStoreError` of an error answer (``busy`` for a 503's codes)."""
    kind = "busy" if exc.code in BUSY_CODES else "refused"
    return ObjectStoreError(f"minio {exc.code}: {exc.message}", kind)


def _transport_error(exc: Exception) -> ObjectStoreError:
    """The `ObjectStoreError` of an exception from urllib3 or the socket layer."""
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and isinstance(
        exc.reason, urllib3.exceptions.ResponseError
    ):  # the status retry ran out: the node answers, but 502/503/504
        return ObjectStoreError(f"minio busy: {exc.reason}", kind="busy")
    return ObjectStoreError(f"minio unreachable: {type(exc).__name__}: {exc}", kind="unreachable")


def object_name(key: BlockKey) -> str:
    fp, h = key
    return f"{fp or NO_FINGERPRINT}/{h}"


def fp_prefix(fingerprint: str) -> str:
    return f"{fingerprint or NO_FINGERPRINT}/"


def new_chunk_name(fingerprint: str) -> str:
    """A fresh chunk object name (time-ordered, unique across instances)."""
    return f"{fp_prefix(fingerprint)}{CHUNK_DIR}/{time.time_ns():016x}-{uuid.uuid4().hex[:12]}"


def parse_name(name: str) -> BlockKey | None:
    """``(fingerprint, hash)`` of a per-block object; None for anything else (chunks too)."""
    fp, sep, h = name.rpartition("/")
    if not sep or not h or fp.endswith(f"/{CHUNK_DIR}") or fp == CHUNK_DIR:
        return None
    return ("" if fp == NO_FINGERPRINT else fp, h)


def chunk_fingerprint(name: str) -> str | None:
    """The fingerprint of a chunk object name; None if ``name`` is not a chunk."""
    fp, sep, _ = name.rpartition(f"/{CHUNK_DIR}/")
    if not sep:
        return None
    return "" if fp == NO_FINGERPRINT else fp


@dataclass
class Listing:
    """What a bucket listing found: per-block objects (with locations), chunk names and when
    each object was last written (seconds since the epoch, 0 if unknown)."""

    blocks: list[tuple[BlockKey, SsdLoc]] = field(default_factory=list)
    chunks: list[tuple[str, str]] = field(default_factory=list)  # (fingerprint, object name)
    modified: dict[str, float] = field(default_factory=dict)


class MinioTier:
    """Blocks as objects in ``bucket`` (created if missing). ``endpoint`` may be a list (or a
    comma-separated string) of one distributed MinIO's nodes: a call that cannot reach the
    current node is tried once on each of the others, and the first that answers becomes
    current."""

    def __init__(
        self,
        endpoint: str | Sequence[str],
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
            retries=urllib3.Retry(
                total=1,
                backoff_factor=0.05,
                status_forcelist=[502, 503, 504],
                respect_retry_after_header=False,
            ),
        )
        given = endpoint.split(",") if isinstance(endpoint, str) else endpoint
        self.endpoints = [e.strip() for e in given if e.strip()]
        if not self.endpoints:
            raise ValueError(f"no MinIO endpoint in {endpoint!r}")
        self.clients = [
            Minio(
                e,
                access_key=access_key,
                secret_key=secret_key,
                secure=secure,
                region="us-east-1",
                http_client=http,
            )
            for e in self.endpoints
        ]
        self.current = 0
        self.failovers = 0  # times a call moved to another endpoint
        self._bucket_ready = False

    @property
    def client(self) -> Minio:
        """The client of the endpoint calls go to now."""
        return self.clients[self.current]

    def _call(self, fn, *args, **kwargs):
        """``fn(client, *args, **kwargs)`` on the current endpoint, then on each other one while
        the endpoint is unreachable or busy; another round after a `BUSY_WAITS_S` pause while
        some node said busy."""
        for wait in (*BUSY_WAITS_S, None):
            errors: list[ObjectStoreError] = []
            for attempt in range(len(self.clients)):
                if attempt:
                    self.current = (self.current + 1) % len(self.clients)
                    self.failovers += 1
                try:
                    return self._call_one(fn, *args, **kwargs)
                except ObjectStoreError as exc:
                    if exc.kind == "refused":
                        raise
                    errors.append(exc)
            if wait is None or all(e.kind != "busy" for e in errors):
                raise errors[-1]
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _call_one(self, fn, *args, **kwargs):
        try:
            if not self._bucket_ready:
                self.ensure_bucket()
            return fn(self.client, *args, **kwargs)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                return None
            raise _s3_error(exc) from exc
        except ObjectStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - urllib3/socket errors: unreachable or busy
            raise _transport_error(exc) from exc

    def ensure_bucket(self) -> None:
        try:
            if not self.client.bucket_exists(self.bucket):
                try:
                    self.client.make_bucket(self.bucket)
                except S3Error as exc:  # another instance created it first
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
        except S3Error as exc:
            raise _s3_error(exc) from exc
        except Exception as exc:  # noqa: BLE001
            raise _transport_error(exc) from exc
        self._bucket_ready = True

    def put(self, key: BlockKey, data: bytes) -> SsdLoc:
        """Write one block as its own object."""
        name = object_name(key)
        self._call(
            lambda c: c.put_object(
                self.bucket,
                name,
                io.BytesIO(data),
                len(data),
                content_type="application/octet-stream",
            )
        )
        return SsdLoc(name, 0, len(data))

    def put_chunk(self, fingerprint: str, blocks: list[tuple[str, bytes]]) -> dict[str, SsdLoc]:
        """Write ``blocks`` (hash, bytes) as one chunk object; their locations (hash -> loc)."""
        name = new_chunk_name(fingerprint)
        data, locs = pack_chunk(name, blocks)
        self._call(
            lambda c: c.put_object(
                self.bucket,
                name,
                io.BytesIO(data),
                len(data),
                content_type="application/octet-stream",
            )
        )
        return locs

    def _read(self, name: str, offset: int = 0, length: int = 0) -> bytes | None:
        def read(client: Minio) -> bytes:
            resp = client.get_object(self.bucket, name, offset=offset, length=length)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        return self._call(read)

    def get(self, loc: SsdLoc) -> bytes | None:
        """The block at ``loc`` (a ranged read for a chunk member); None if the object is gone."""
        if loc.ranged:
            data = self._read(loc.obj, loc.offset, loc.length)
            if data is not None and len(data) != loc.length:
                raise ObjectStoreError(f"short read of {loc.obj}@{loc.offset}: {len(data)} bytes")
            return data
        return self._read(loc.obj)

    def get_key(self, key: BlockKey) -> bytes | None:
        """A per-block object by key (None if absent)."""
        return self._read(object_name(key))

    def read_chunk_index(self, name: str) -> dict[str, SsdLoc] | None:
        """Block locations in chunk ``name`` from its header; None if the chunk is gone.
        Raises `ChunkFormatError` for an object that is not a chunk."""
        head = self._read(name, 0, HEADER_READ_BYTES)
        if head is None:
            return None
        need = header_length(head[:PREFIX_BYTES])
        if len(head) < need:
            head = self._read(name, 0, need)
            if head is None:
                return None
        return parse_index(name, head)

    def delete(self, key: BlockKey) -> None:
        self.delete_object(object_name(key))

    def delete_object(self, name: str) -> None:
        """Delete object ``name`` (a per-block or chunk object); deleting a missing one is fine."""
        self._call(lambda c: c.remove_object(self.bucket, name))

    def list(self, fingerprint: str | None = None) -> Listing:
        """Every per-block object and chunk object (optionally of one fingerprint)."""

        def listing(client: Minio) -> Listing:
            prefix = None if fingerprint is None else fp_prefix(fingerprint)
            out = Listing()
            for obj in client.list_objects(self.bucket, prefix=prefix, recursive=True):
                name = obj.object_name or ""
                if obj.last_modified is not None:
                    out.modified[name] = obj.last_modified.timestamp()
                fp = chunk_fingerprint(name)
                if fp is not None:
                    out.chunks.append((fp, name))
                    continue
                key = parse_name(name)
                if key is not None:
                    out.blocks.append((key, SsdLoc(name, 0, obj.size or 0)))
            return out

        return self._call(listing) or Listing()
