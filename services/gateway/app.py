"""`strata serve gateway --nats-url URL --port N --model DIR`: REST + NATS API."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import ssl
from pathlib import Path

import uvicorn

from services.gateway.audit import AuditLog
from services.gateway.auth import Auth
from services.gateway.config import GatewayConfig
from services.gateway.http import build_app
from services.gateway.nats_api import serve_api
from services.gateway.pipeline import Pipeline
from services.gateway.readiness import Readiness
from services.gateway.service import GatewayService
from services.gateway.tenants import Tenants
from shared import bus, metrics
from shared.logs import setup_logging
from shared.model.validate import takes_images
from shared.nats_auth import NatsAuth
from shared.service import StartupError, announce_ready, run

log = logging.getLogger(__name__)


def served_name(cfg: GatewayConfig) -> str:
    return cfg.model_name or (Path(cfg.model).name if cfg.model else "strata")


def token_speller(model_dir: str):
    """id -> token text for logprobs (the id itself when no tokenizer is available)."""
    if not model_dir:
        return str
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return functools.lru_cache(maxsize=65536)(lambda i: tok.decode([i], skip_special_tokens=False))


def model_text(model_dir: str) -> dict:
    """What the gateway needs of the checkpoint's text side: the tokenizer (token strings) and
    the family's tool-call syntax; empty without a checkpoint. No grammar compiler: that needs
    torch, which the gateway does not import (the tokenizer service validates constraints)."""
    if not model_dir:
        return {}
    from services.gateway.tools import tool_format
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return {"tokenizer": tok, "tool_format": tool_format(tok.chat_template)}


def bind_http(host: str, port: int) -> socket.socket:
    """The listening socket for uvicorn; a `StartupError` naming the port when it is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(
            f"gateway port {port} on {host} cannot be bound "
            f"({exc.strerror or exc}); pass --port (STRATA_PORT) with a free "
            "port, or 0 for any"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_public_bind(cfg: GatewayConfig) -> None:
    """A `StartupError` when the gateway would listen beyond loopback with no API key: anyone
    who reaches the address could use the cluster."""
    if cfg.api_keys or cfg.api_key_file or is_loopback(cfg.host):
        return
    raise StartupError(
        f"gateway bind {cfg.host} is not loopback and no API key is set; set STRATA_API_KEYS "
        "(--api-keys) or STRATA_API_KEY_FILE (--api-key-file), or bind 127.0.0.1"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def needs_vision(cfg: GatewayConfig) -> bool:
    """Readiness waits for a vision encoder only when the model takes images and the gateway
    accepts them (``max_images`` > 0; `strata up --vision 0` sets it to 0)."""
    return bool(cfg.model) and cfg.max_images > 0 and takes_images(cfg.model)


async def build_service(nc, cfg: GatewayConfig) -> GatewayService:
    if cfg.model and cfg.max_images and not takes_images(cfg.model):
        # a text-only checkpoint: an image is a 400 naming the model (`core.build_spec`), not a
        # wait on a vision service that is not there
        cfg = cfg.model_copy(update={"max_images": 0})
    auth = Auth.from_config(cfg.api_keys, cfg.api_key_file)
    try:  # before the pipeline subscribes anything: a bad setting leaves nothing behind
        tenants = Tenants.from_config(cfg.tenant_weights, (p.name for p in auth.keys.values()))
    except ValueError as exc:
        raise StartupError(f"STRATA_TENANT_WEIGHTS: {exc}") from None
    pipeline = Pipeline(nc, cfg)
    await pipeline.start()
    readiness = Readiness(nc, cfg, needs_vision(cfg))
    service = GatewayService(
        pipeline,
        cfg,
        served_name(cfg),
        auth,
        token_speller(cfg.model),
        readiness,
        **model_text(cfg.model),
        tenants=tenants,
    )
    audit = AuditLog(cfg.audit_file, cfg.audit_prompts, cfg.instance_id, cfg.audit_stream)
    audit.start(nc.jetstream(), cfg.instance_id, cfg.audit_max_age, cfg.audit_max_bytes)
    service.audit = audit
    return service


def uvicorn_config(app, cfg: GatewayConfig, host: str, port: int) -> uvicorn.Config:
    """The HTTP server's config: HTTPS with ``tls_cert``/``tls_key`` (and client certificates
    required with ``tls_client_ca``), else plain HTTP."""
    tls = {}
    if cfg.tls_cert:
        tls = dict(ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key)
        if cfg.tls_client_ca:
            tls.update(ssl_ca_certs=cfg.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", **tls)


def main(argv: list[str]) -> None:
    cfg = GatewayConfig.load(argv, role="gateway")
    setup_logging("gateway", cfg.instance_id, cfg.log_level)

    check_public_bind(cfg)
    sock = bind_http(cfg.host, cfg.port)  # a busy port fails before anything else starts

    async def amain(stop: asyncio.Event) -> None:
        services: list[GatewayService] = []  # filled below; the hook fails its open streams
        nc = await bus.connect(
            cfg.nats_url,
            f"gateway-{cfg.instance_id}",
            on_disconnect=lambda: [s.pipeline.nats_lost() for s in services],
        )
        service = await build_service(nc, cfg)
        services.append(service)
        # Under NATS auth the caller's identity is authenticated: hold it to its own inbox.
        await serve_api(nc, service, strict=bool(NatsAuth.from_env().user))
        metrics.serve_metrics(cfg.metrics_port, cfg.metrics_bind)
        server = uvicorn.Server(uvicorn_config(build_app(service), cfg, cfg.host, cfg.port))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if task.done():
            task.result()
        port = server.servers[0].sockets[0].getsockname()[1]
        scheme = "https" if cfg.tls_cert else "http"
        announce_ready("gateway", cfg.instance_id, f"http={scheme}://{cfg.host}:{port}")
        await stop.wait()
        server.should_exit = True
        await task
        service.close_audit()
        if service.response_cache is not None:  # stored answers on their way to the kvstore
            try:
                await asyncio.wait_for(service.response_cache.drain(), cfg.response_cache_timeout)
            except TimeoutError:
                log.warning("response cache: kvstore writes still in flight at shutdown")
        await nc.drain()

    run(amain)
