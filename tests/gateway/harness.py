"""Start a real gateway (uvicorn + NATS API) in the test's event loop against fake peers."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

from services.gateway.app import build_service, uvicorn_config
from services.gateway.config import GatewayConfig
from services.gateway.http import build_app
from services.gateway.nats_api import serve_api
from shared import bus
from tests.gateway.peers import ROLES, Peers


@contextlib.asynccontextmanager
async def gateway(
    nats_url: str, decodes=("dec-0",), peers_kw=None, roles=ROLES, auth=None, peers_auth=None, **cfg
):
    """Yields (base URL, peers, service); ``roles``: the fake peers serving from the start.
    ``auth``: the gateway logs in with it (a `NatsAuth`; then its NATS API is strict about
    inboxes) and the peers with ``peers_auth`` on a connection of their own."""
    nc = await bus.connect(nats_url, "gw-test", auth)
    pnc = await bus.connect(nats_url, "peers-test", peers_auth) if peers_auth else nc
    peers = await Peers(pnc, **(peers_kw or {})).start(roles)
    for d in decodes:
        await peers.add_decode(d)
    defaults = dict(
        nats_url=nats_url,
        port=0,
        model_name="tiny",
        bus_timeout=2.0,
        health_timeout=0.5,
        first_token_timeout=5.0,
        stall_timeout=5.0,
    )
    conf = GatewayConfig.load([], role="gateway", **{**defaults, **cfg})
    service = await build_service(nc, conf)
    api_subs = await serve_api(nc, service, strict=auth is not None)
    server = uvicorn.Server(uvicorn_config(build_app(service), conf, "127.0.0.1", 0))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        scheme = "https" if conf.tls_cert else "http"
        yield f"{scheme}://127.0.0.1:{port}", peers, service
    finally:
        server.should_exit = True
        await task
        for sub in api_subs:
            await sub.unsubscribe()
        await peers.stop()
        service.close_audit()
        await service.pipeline.stop()
        await nc.drain()
        if pnc is not nc:
            await pnc.drain()
