"""MinIO credentials: per-install root secrets kept beside the data dir (0600), the documented
defaults refused, and a kvstore user that reaches the KV bucket only (real MinIO)."""

from __future__ import annotations

import io
import os
import stat

import pytest
from minio import Minio
from minio.error import S3Error

from services.infra.minio_server import KV_BUCKET, start_minio
from services.kvstore.config import KVStoreConfig
from shared.config import ConfigError


def denied(fn) -> str:
    with pytest.raises(S3Error) as ei:
        fn()
    return ei.value.code


def test_kvstore_user_is_limited_to_the_kv_bucket_and_defaults_are_refused(tmp_path):
    data = str(tmp_path / "minio")
    server = start_minio(data_dir=data)
    try:
        path = server.credentials_file
        assert path == data + ".credentials.json"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert server.access_key.startswith("strata-root-") and len(server.secret_key) >= 32
        root = Minio(server.endpoint, server.access_key, server.secret_key, secure=False)
        root.make_bucket("other-bucket")
        root.put_object("other-bucket", "secret", io.BytesIO(b"s"), 1)

        kv = Minio(server.endpoint, server.kv_access_key, server.kv_secret_key, secure=False)
        assert kv.bucket_exists(KV_BUCKET)
        kv.put_object(KV_BUCKET, "fp/block", io.BytesIO(b"kv"), 2)
        assert kv.get_object(KV_BUCKET, "fp/block").read() == b"kv"
        assert [o.object_name for o in kv.list_objects(KV_BUCKET, recursive=True)] == ["fp/block"]
        kv.remove_object(KV_BUCKET, "fp/block")
        # nothing outside its bucket: other buckets are invisible and closed, none can be made
        assert [b.name for b in kv.list_buckets()] == [KV_BUCKET]
        assert denied(lambda: list(kv.list_objects("other-bucket"))) == "AccessDenied"
        assert denied(lambda: kv.get_object("other-bucket", "secret")) == "AccessDenied"
        assert denied(lambda: kv.make_bucket("new-bucket")) == "AccessDenied"
        assert sorted(b.name for b in root.list_buckets()) == ["other-bucket", KV_BUCKET]

        for user, password in (("strata", "strata-secret-key"), (server.kv_access_key, "x" * 40)):
            old = Minio(server.endpoint, user, password, secure=False)
            assert denied(old.list_buckets) in ("InvalidAccessKeyId", "SignatureDoesNotMatch")
        root_user, kv_password = server.access_key, server.kv_secret_key
    finally:
        server.stop()
    # a restart on the same data dir keeps its secrets, and the kvstore user still works
    again = start_minio(data_dir=data)
    try:
        assert (again.access_key, again.kv_secret_key) == (root_user, kv_password)
        kv = Minio(again.endpoint, again.kv_access_key, again.kv_secret_key, secure=False)
        assert kv.bucket_exists(KV_BUCKET)
    finally:
        again.stop()


def test_kvstore_config_has_no_default_credentials():
    assert KVStoreConfig.model_fields["minio_bucket"].default == KV_BUCKET
    with pytest.raises(ConfigError, match="STRATA_MINIO_ACCESS_KEY"):
        KVStoreConfig.load([], role="kvstore", minio_endpoint="127.0.0.1:9000")
    cfg = KVStoreConfig.load([], role="kvstore")  # DRAM only: no credentials needed
    assert (cfg.minio_access_key, cfg.minio_secret_key) == ("", "")
