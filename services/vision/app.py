"""`strata serve vision --model DIR`: `VisionCore` on `strata.vision.encode` + gRPC embeddings."""

from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from pydantic import Field

from services.vision.core import VisionCore
from services.vision.grpc import EmbeddingHandler
from shared import bus, metrics
from shared.config import ModelServiceConfig
from shared.kvtransfer.server import start_kv_server
from shared.logs import setup_logging
from shared.model.validate import text_only_reason
from shared.omp import in_fresh_thread, serial_torch_here
from shared.protocol import subjects
from shared.protocol.vision import VisionEncodeReply, VisionEncodeRequest
from shared.service import announce_ready, run

log = logging.getLogger(__name__)


class VisionServiceConfig(ModelServiceConfig):
    """Vision service settings (model, device, dtype, torch threads, gRPC address inherited)."""

    cache_bytes: int = Field(256 << 20, ge=1, description="Embedding cache budget in bytes")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="Largest image (pixels)")


async def serve_vision(nc, core: VisionCore, instance_id: str, source_addr: str):
    """Subscribe the core on `strata.vision.encode` (queue group "vision"); returns the sub.
    Encodes run one at a time on one thread, the process's only OpenMP team leader
    (shared/omp.py): concurrent encodes would each lead a team on the same cores."""
    encoder = ThreadPoolExecutor(1, thread_name_prefix="strata-vision")

    async def handle(req: VisionEncodeRequest) -> VisionEncodeReply:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(encoder, core.encode, req, instance_id, source_addr)

    return await bus.serve(
        nc, subjects.VISION_ENCODE, VisionEncodeRequest, handle, queue=subjects.QUEUE_VISION
    )


def main(argv: list[str]) -> None:
    cfg = VisionServiceConfig.load(argv, role="vision")
    if why := text_only_reason(cfg.model):
        sys.exit(f"strata serve vision: {why}; it needs no vision service")
    setup_logging("vision", cfg.instance_id, cfg.log_level)
    torch.set_num_threads(cfg.torch_threads)

    async def amain(stop: asyncio.Event) -> None:
        serial_torch_here()  # the loop only converts embeddings; the encoder thread computes
        core = await asyncio.to_thread(
            in_fresh_thread,
            lambda: VisionCore(
                cfg.model, cfg.device, cfg.dtype, cfg.cache_bytes, cfg.max_image_pixels
            ),
        )
        server, addr = await start_kv_server(EmbeddingHandler(core), cfg.grpc_host, cfg.grpc_port)
        metrics.serve_metrics(cfg.metrics_port, cfg.metrics_bind)
        metrics.SERVICE_INFO.labels("vision", cfg.instance_id).set(1)
        nc = await bus.connect(cfg.nats_url, f"vision-{cfg.instance_id}")
        await serve_vision(nc, core, cfg.instance_id, addr)
        await bus.serve_ping(
            nc, subjects.VISION_PING, "vision", cfg.instance_id, queue=subjects.QUEUE_VISION
        )
        announce_ready("vision", cfg.instance_id, f"grpc={addr}")
        await stop.wait()
        await nc.drain()
        await server.stop(1.0)

    run(amain)
