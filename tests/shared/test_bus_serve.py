"""`bus.serve` returns once the server has the subscription: a request sent right after it
from another connection is answered, never "no responders" (a real nats-server; 200 fresh
subjects, each asked the moment `serve` returns)."""

from __future__ import annotations

from shared import bus
from shared.protocol.health import Ping, Pong


async def test_a_request_from_another_connection_right_after_serve_is_answered(nats_url):
    server_nc = await bus.connect(nats_url, "serve-side")
    client_nc = await bus.connect(nats_url, "ask-side")

    async def pong(_: Ping) -> Pong:
        return Pong(role="test", instance_id="i-0")

    try:
        for i in range(200):
            sub = await bus.serve(server_nc, f"test.serve.race.{i}", Ping, pong)
            rep = await bus.request(client_nc, f"test.serve.race.{i}", Ping(), Pong, 5.0)
            assert rep.instance_id == "i-0"
            await sub.unsubscribe()
    finally:
        await server_nc.close()
        await client_nc.close()
