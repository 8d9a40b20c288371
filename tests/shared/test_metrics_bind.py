"""Prometheus /metrics binds the service's own address, never every interface by default."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from services.gateway.config import GatewayConfig
from services.infra.procs import free_port
from services.kvstore.config import KVStoreConfig
from services.scheduler.config import SchedulerConfig
from shared.metrics import serve_metrics


def test_metrics_bind_follows_the_service_host():
    assert GatewayConfig.load([], role="gateway").metrics_bind == "127.0.0.1"
    assert GatewayConfig.load([], role="gateway", host="127.0.0.3").metrics_bind == "127.0.0.3"
    assert KVStoreConfig.load([], role="kvstore", grpc_host="10.1.2.3").metrics_bind == "10.1.2.3"
    assert SchedulerConfig.load([], role="scheduler").metrics_bind == "127.0.0.1"  # no host
    over = SchedulerConfig.load([], role="scheduler", metrics_host="0.0.0.0")
    assert over.metrics_bind == "0.0.0.0"


def test_serve_metrics_listens_on_the_given_address_only():
    port = free_port()
    serve_metrics(port, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
    # bound to 0.0.0.0 this would answer on every loopback address too
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
