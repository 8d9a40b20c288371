"""nats-server and MinIO launchers: start on free ports, become healthy, stop leaving nothing."""

from __future__ import annotations

import io

import nats
from minio import Minio

from services.infra.minio_server import MINIO_VERSION, start_minio
from services.infra.nats_server import MAX_PAYLOAD, start_nats
from services.infra.procs import port_open
from tests.infra.fake_apps import pid_alive


async def test_nats_starts_with_jetstream_and_stops(tmp_path):
    server = start_nats(data_dir=str(tmp_path / "nats"))
    pid = server.proc.pid
    try:
        nc = await nats.connect(server.url)
        assert nc.max_payload == MAX_PAYLOAD
        info = await nc.jetstream().account_info()  # fails unless JetStream is on
        assert info.limits is not None
        await nc.close()
    finally:
        server.stop()
    assert server.proc is None
    assert not pid_alive(pid)
    assert not port_open("127.0.0.1", server.port)


async def test_nats_monitoring_endpoint_is_off_unless_a_port_is_given(tmp_path):
    import httpx

    from services.infra.nats_server import NatsServer
    from services.infra.procs import free_port

    quiet = start_nats(data_dir=str(tmp_path / "quiet"))
    try:
        assert "http:" not in open(tmp_path / "quiet" / "nats.conf").read()
    finally:
        quiet.stop()
    monitor = free_port()
    server = NatsServer(free_port(), str(tmp_path / "nats"), monitor_port=monitor).start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="SEEN", subjects=["seen.>"])
        await js.publish("seen.a", b"x" * 100)
        base = f"http://127.0.0.1:{monitor}"
        varz = httpx.get(f"{base}/varz").json()
        assert varz["mem"] > 0 and varz["port"] == server.port
        jsz = httpx.get(f"{base}/jsz", params={"streams": "true"}).json()
        streams = {
            s["name"]: s["state"] for d in jsz["account_details"] for s in d["stream_detail"]
        }
        assert streams["SEEN"]["messages"] == 1
        await nc.close()
    finally:
        server.stop()


def test_minio_starts_healthy_serves_objects_and_stops(tmp_path):
    server = start_minio(data_dir=str(tmp_path / "minio"))
    pid = server.proc.pid
    try:
        assert server.healthy()
        client = Minio(server.endpoint, server.access_key, server.secret_key, secure=False)
        client.make_bucket("strata-test")
        client.put_object("strata-test", "k", io.BytesIO(b"hello"), 5)
        assert client.get_object("strata-test", "k").read() == b"hello"
    finally:
        server.stop()
    assert not pid_alive(pid)
    assert not server.healthy()
    assert not port_open("127.0.0.1", server.port)


def test_minio_is_built_at_the_version_setup_pins():
    """The launcher's fallback build and scripts/setup.sh pin the same MinIO (never @latest)."""
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[2] / "scripts" / "setup.sh").read_text()
    assert f'MINIO_VERSION="{MINIO_VERSION}"' in setup
    src = (Path(__file__).resolve().parents[2] / "services/infra/minio_server.py").read_text()
    assert "@latest" not in src.replace("never @latest", "")


def test_nats_start_is_not_fooled_by_another_server_on_its_port(tmp_path):
    """Ready means this nats-server (its INFO names it), not any listener on the port: a
    server that cannot bind because another one holds the port fails its start."""
    import socket
    import threading

    import pytest

    from services.infra.nats_server import NatsServer, _serves

    decoy = socket.socket()
    decoy.bind(("127.0.0.1", 0))
    decoy.listen()
    port = decoy.getsockname()[1]

    def answer() -> None:
        while True:
            try:
                conn, _ = decoy.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b'INFO {"server_name":"someone-else"}\r\n')

    threading.Thread(target=answer, daemon=True).start()
    try:
        assert not _serves("127.0.0.1", port, "strata-mine")
        with pytest.raises(RuntimeError, match="exited with code"):
            NatsServer(port, str(tmp_path / "nats")).start(timeout=20)
    finally:
        decoy.close()
    srv = start_nats(data_dir=str(tmp_path / "ok"))
    try:
        assert port_open("127.0.0.1", srv.port)
    finally:
        srv.stop()
