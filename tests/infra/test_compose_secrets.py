"""compose's secrets and its kvstore MinIO user, against the real MinIO scripts/setup.sh builds.

`strata compose-secrets` writes every secret once (0600) and keeps them on a rerun;
`strata compose-minio-setup` (compose's minio-setup container) makes the kvstore's user with the
root account: that user reads and writes its bucket and is refused on another bucket and on
admin calls."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from minio import Minio, MinioAdmin
from minio.credentials import StaticProvider
from minio.error import MinioAdminException, S3Error

from services.infra import compose_secrets, nats_auth
from services.infra.minio_server import start_minio
from services.infra.procs import repo_root
from shared.service import FATAL_LINE

pytestmark = pytest.mark.timeout(180)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=dict(os.environ if env is None else env, PYTHONPATH=repo_root()),
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_compose_secrets_are_generated_once_with_mode_0600(tmp_path):
    path = tmp_path / ".env"
    res = cli("compose-secrets", str(path))
    assert res.returncode == 0, res.stderr
    first = compose_secrets.read_env(str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    for var in compose_secrets.SECRET_VARS:
        assert len(first[var]) >= 40, var  # 32 random bytes, url-safe
    for user in nats_auth.USERS:
        assert first[nats_auth.compose_password_var(user)]
    values = [v for k, v in first.items()]
    assert len(set(values)) == len(values)  # no secret reused for another
    assert cli("compose-secrets", str(path)).returncode == 0  # a rerun: nothing changes
    assert compose_secrets.read_env(str(path)) == first
    nats_only = tmp_path / "nats.env"  # the k8s Secret strata-nats: NATS passwords alone
    assert cli("nats-credentials", str(nats_only)).returncode == 0
    assert set(compose_secrets.read_env(str(nats_only))) == {
        nats_auth.compose_password_var(u) for u in nats_auth.USERS
    }


@pytest.fixture(scope="module")
def minio(tmp_path_factory):
    server = start_minio(data_dir=str(tmp_path_factory.mktemp("compose-minio")))
    yield server
    server.stop()


def test_minio_setup_makes_a_bucket_limited_kvstore_user(minio):
    env = dict(
        os.environ,
        STRATA_MINIO_ENDPOINT=f"{minio.endpoint},unused:9000",
        MINIO_ROOT_USER=minio.access_key,
        MINIO_ROOT_PASSWORD=minio.secret_key,
        STRATA_MINIO_ACCESS_KEY="compose-kvstore",
        STRATA_MINIO_SECRET_KEY="compose-kvstore-secret-0123456789",
        STRATA_MINIO_BUCKET="compose-kv",
    )
    res = cli("compose-minio-setup", env=env)
    assert res.returncode == 0, res.stderr
    assert "MinIO user compose-kvstore limited to the KV bucket" in res.stderr
    root = Minio(minio.endpoint, minio.access_key, minio.secret_key, secure=False)
    root.make_bucket("compose-other")
    kv = Minio(minio.endpoint, "compose-kvstore", env["STRATA_MINIO_SECRET_KEY"], secure=False)
    kv.put_object("compose-kv", "m/block", io.BytesIO(b"kv-bytes"), 8)
    assert kv.get_object("compose-kv", "m/block").read() == b"kv-bytes"
    assert [o.object_name for o in kv.list_objects("compose-kv", prefix="m/")] == ["m/block"]
    with pytest.raises(S3Error) as exc:
        kv.put_object("compose-other", "x", io.BytesIO(b"x"), 1)
    assert exc.value.code == "AccessDenied"
    with pytest.raises(S3Error) as exc:
        kv.make_bucket("compose-new")
    assert exc.value.code == "AccessDenied"
    with pytest.raises(S3Error) as exc:
        kv.get_object("compose-other", "x")
    assert exc.value.code == "AccessDenied"
    admin = MinioAdmin(
        endpoint=minio.endpoint,
        credentials=StaticProvider("compose-kvstore", env["STRATA_MINIO_SECRET_KEY"]),
        secure=False,
    )
    with pytest.raises(MinioAdminException) as aexc:
        admin.user_list()
    assert aexc.value._code == "403", aexc.value
    # a rerun (compose restarts minio-setup on every `up`) is idempotent
    assert cli("compose-minio-setup", env=env).returncode == 0
    assert kv.get_object("compose-kv", "m/block").read() == b"kv-bytes"


def test_minio_setup_refuses_root_as_the_kvstore_user_and_missing_settings(minio):
    env = dict(
        os.environ,
        STRATA_MINIO_ENDPOINT=minio.endpoint,
        MINIO_ROOT_USER=minio.access_key,
        MINIO_ROOT_PASSWORD=minio.secret_key,
        STRATA_MINIO_ACCESS_KEY=minio.access_key,
        STRATA_MINIO_SECRET_KEY=minio.secret_key,
    )
    res = cli("compose-minio-setup", env=env)
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f"{FATAL_LINE} minio-setup: the kvstore's MinIO user must not be the root user"
    )
    env.pop("MINIO_ROOT_PASSWORD")
    res = cli("compose-minio-setup", env={k: v for k, v in env.items()})
    assert res.stderr.strip() == f"{FATAL_LINE} minio-setup: minio-setup needs MINIO_ROOT_PASSWORD"
