"""`strata.prefill.<id>.submit` and `strata.decode.<id>.submit`: a request sent in full, once."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pydantic import Field

from shared.protocol.base import Msg
from shared.protocol.sampling import SamplingParams

TransferMode = Literal["direct", "pool"]


class ImageRef(Msg):
    offset: int  # first placeholder token in the prompt
    length: int
    hash: str
    source_addr: str  # gRPC address holding the embeddings


class WorkItem(Msg):
    """A request sent in full, once: what the gateway hands the scheduler inside
    `RouteRequest.submit`, and what every instance's submit message extends."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    images: list[ImageRef] = []
    # Failover: tokens already streamed to the client; generation resumes after them.
    output_token_ids: list[int] = []
    # Which route of the request this is (0, then +1 per failover). Chunks carry it back, and a
    # failover's cancel names it: a straggler of an abandoned route cannot end the new one.
    attempt: int = 0
    # Fair queuing: whose request this is (the gateway's name for the caller's API key, never
    # the key) and its weight; an engine admits the waiting requests of one priority class by
    # their tenants' weighted shares (`shared/engine/fair_queue.py`).
    tenant: str = "default"
    tenant_weight: float = Field(1.0, gt=0)
    # The instance id of the gateway that owns the stream: decode sends its chunks batched on
    # ``strata.gw.<gateway_id>.out`` (`subjects.gw_out`); "" (an older gateway): one message
    # per chunk on ``strata.req.<request_id>.out``.
    gateway_id: str = Field("", pattern=r"^[A-Za-z0-9_-]{0,128}$")

    @property
    def engine_id(self) -> str:
        """The id this route's work has inside an instance (engine, KV transfer, task table):
        the request id, plus ``#<attempt>`` after a failover, so a cancelled earlier route on
        the same instance can never touch this one's sequence or KV."""
        return engine_id(self.request_id, self.attempt)


def engine_id(request_id: str, attempt: int) -> str:
    """See `WorkItem.engine_id`."""
    return request_id if attempt == 0 else f"{request_id}#{attempt}"


def engine_ids_of(request_id: str, attempt: int | None, among: Collection[str]) -> set[str]:
    """The engine ids in ``among`` of ``request_id``'s work: of every attempt, or of
    ``attempt`` only."""
    if attempt is not None:
        eid = engine_id(request_id, attempt)
        return {eid} if eid in among else set()
    return {k for k in among if k == request_id or k.startswith(request_id + "#")}


class HeldQuery(Msg):
    """`subjects.work_probe`: is route ``attempt`` of ``request_id`` still worked on here?"""

    request_id: str
    attempt: int = 0


class HeldReply(Msg):
    """``held``: its task runs here (queued, prefilling, preempted, handing off or decoding);
    ``engine_steps``: the engine's step count, which a working engine keeps raising."""

    held: bool
    engine_steps: int = 0


class PrefillWork(WorkItem):
    """`strata.prefill.<id>.submit` (from the scheduler): the request and where its KV goes."""

    decode_instance: str
    decode_addr: str
    transfer_mode: TransferMode = "direct"


class DecodeWork(WorkItem):
    """`strata.decode.<id>.submit`: from the scheduler (decode prefills the prompt itself: the
    defaults) or from a prefill instance (its first token and how the KV was handed over)."""

    first_token_id: int | None = None
    kv_pushed: bool = False
    kv_num_tokens: int = 0
    kv_layerwise: bool = False  # the pushed KV left layer by layer (labels decode's byte counter)
    kv_block_hashes: list[str] = []  # pool mode: decode pulls these from the kvstore
    num_cached_tokens: int = 0
    # From the route (`RouteReply.pool_blocks`): the prompt blocks the scheduler's index places
    # in the pool; 0 and no emitted tokens: decode skips its pool lookup (a stale 0 costs a
    # recompute, never a wrong token); -1: not known, decode looks the prompt up.
    pool_blocks: int = -1


class SubmitAck(Msg):
    instance_id: str
    accepted: bool = True
