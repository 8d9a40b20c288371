"""The gateway rides out a nats-server restart: open streams end with an ``unavailable`` error
naming the lost connection (never a hang), readiness says so while it reconnects, and once the
server is back on the same port the same connection (resubscribed) streams a new request.

Its own nats-server (killed with SIGKILL and started again), the real `Pipeline` and
`Readiness`, and the fake scheduler / decode instance of test_failover_blame."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.pipeline import NATS_LOST, Pipeline, Prepared
from services.gateway.readiness import Readiness
from services.infra.nats_server import start_nats
from services.infra.procs import signal_group
from shared import bus
from shared.protocol.errors import StrataError
from shared.protocol.sampling import SamplingParams
from tests.gateway.test_failover_blame import Fleet

pytestmark = pytest.mark.timeout(120)


async def _until(cond, what: str, timeout: float = 30.0, task=None) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        if task is not None and task.done():  # ended early: its error, not a 30 s wait
            task.result()
            pytest.fail(f"the stream ended before {what}")
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


async def test_open_stream_fails_cleanly_on_nats_loss_and_serving_resumes(tmp_path):
    server = start_nats(data_dir=str(tmp_path / "nats"))
    port, data_dir = server.port, server.data_dir
    pipes: list[Pipeline] = []
    nc = await bus.connect(
        server.url, "gateway-test", on_disconnect=lambda: [p.nats_lost() for p in pipes]
    )
    peers_nc = await bus.connect(server.url, "fleet-test")
    fleet = await Fleet(peers_nc).start()
    await fleet.add_decode("dec-a", gap=0.02)
    cfg = GatewayConfig.load(
        [],
        role="gateway",
        nats_url=server.url,
        bus_timeout=5.0,
        first_token_timeout=60.0,
        stall_timeout=60.0,
    )
    pipe = Pipeline(nc, cfg)
    pipes.append(pipe)
    await pipe.start()
    readiness = Readiness(nc, cfg, need_vision=False)
    spec = SimpleNamespace(
        priority=0, slo_class="interactive", ttft_slo_ms=0.0, tenant="default", tenant_weight=1.0
    )
    got: list[int] = []

    async def consume(rid: str, max_tokens: int) -> None:
        prep = Prepared(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens))
        async for chunk in pipe.stream(rid, prep, spec):
            got.extend(chunk.token_ids)

    try:
        task = asyncio.create_task(consume("rid-1", 5000))
        await _until(lambda: len(got) >= 5, "the first tokens", task=task)
        signal_group(server.proc.pid, signal.SIGKILL)
        with pytest.raises(StrataError) as err:  # well before the 60 s stall timeout
            await asyncio.wait_for(task, 20)
        assert err.value.code == "unavailable" and err.value.message == NATS_LOST
        assert got == list(range(100, 100 + len(got)))  # what came before is intact
        st = await readiness.state()
        assert not st.ready and st.checks == {"nats": "down"}
        assert "lost its NATS connection" in st.message
        server.proc.wait(5)
        server = start_nats(port=port, data_dir=data_dir)  # same port and data, as strata up
        await _until(lambda: nc.is_connected and peers_nc.is_connected, "the reconnect")
        got.clear()
        await asyncio.wait_for(consume("rid-2", 6), 30)  # resubscribed on both sides
        assert got == [100, 101, 102, 103, 104, 105]
    finally:
        await pipe.stop()
        await fleet.stop()
        for c in (nc, peers_nc):
            await c.close()
        server.stop()
