"""`strata serve tokenizer --model DIR`: `TokenizerCore` on `strata.tok.encode` (queue group)."""

from __future__ import annotations

import asyncio
import logging

from pydantic import Field

from services.tokenizer.core import TokenizerCore
from shared import bus, metrics
from shared.config import ServiceConfig
from shared.logs import setup_logging
from shared.model.validate import validate_checkpoint
from shared.protocol import subjects
from shared.protocol.tok import DetokenizeReply, DetokenizeRequest, TokenizeReply, TokenizeRequest
from shared.service import announce_ready, run

log = logging.getLogger(__name__)


class TokenizerConfig(ServiceConfig):
    """Tokenizer service settings."""

    model: str = Field(..., min_length=1, description="Checkpoint directory (tokenizer + config)")
    dtype: str = Field("", description="KV dtype the engines run (default: checkpoint dtype)")
    block_size: int = Field(16, ge=1, description="KV block size the engines use (for hashes)")
    grammar_timeout: float = Field(
        5.0,
        gt=0,
        description="Longest a structured-output constraint may take to compile (a 400 after); "
        "keep it under the gateway's bus_timeout",
    )


async def serve_tokenizer(nc, core: TokenizerCore):
    """Subscribe the core on `strata.tok.encode` and `strata.tok.decode` in queue group
    "tokenizer"; returns the encode subscription."""

    async def handle(req: TokenizeRequest) -> TokenizeReply:
        # Tokenizing is CPU work; a thread keeps the loop free for other requests.
        return await asyncio.to_thread(core.encode, req)

    async def handle_decode(req: DetokenizeRequest) -> DetokenizeReply:
        return await asyncio.to_thread(core.decode, req)

    await bus.serve(
        nc, subjects.TOK_DECODE, DetokenizeRequest, handle_decode, queue=subjects.QUEUE_TOKENIZER
    )
    return await bus.serve(
        nc, subjects.TOK_ENCODE, TokenizeRequest, handle, queue=subjects.QUEUE_TOKENIZER
    )


def main(argv: list[str]) -> None:
    cfg = TokenizerConfig.load(argv, role="tokenizer")
    info = validate_checkpoint(cfg.model)  # a bad checkpoint: one line (CheckpointError)
    setup_logging("tokenizer", cfg.instance_id, cfg.log_level)
    if info.context_note:  # the gateway refuses longer requests with this length
        log.warning(info.context_note)

    async def amain(stop: asyncio.Event) -> None:
        core = TokenizerCore(cfg.model, cfg.dtype, cfg.block_size, cfg.grammar_timeout)
        metrics.serve_metrics(cfg.metrics_port, cfg.metrics_bind)
        metrics.SERVICE_INFO.labels("tokenizer", cfg.instance_id).set(1)
        nc = await bus.connect(cfg.nats_url, f"tokenizer-{cfg.instance_id}")
        await serve_tokenizer(nc, core)
        await bus.serve_ping(
            nc, subjects.TOK_PING, "tokenizer", cfg.instance_id, queue=subjects.QUEUE_TOKENIZER
        )
        announce_ready("tokenizer", cfg.instance_id)
        await stop.wait()
        await nc.drain()

    run(amain)
