"""`strata.prefill.<id>.submit` and `strata.decode.<id>.submit`: a request sent in full, once."""

from __future__ import annotations

from typing import Literal

from shared.engine.params import SamplingParams
from shared.protocol.base import Msg

TransferMode = Literal["direct", "pool"]


class ImageRef(Msg):
    offset: int  # first placeholder token in the prompt
    length: int
    hash: str
    source_addr: str  # gRPC address holding the embeddings


class WorkItem(Msg):
    """Everything a prefill or decode instance needs to run one request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    slo_class: str = "interactive"
    images: list[ImageRef] = []
    # Failover: tokens already streamed to the client; generation resumes after them.
    output_token_ids: list[int] = []
    # Where the KV goes after prefill (prefill.submit only).
    decode_instance: str = ""
    decode_addr: str = ""
    transfer_mode: TransferMode = "direct"
    # Decode.submit from a prefill instance: the first token sampled there, and whether KV was pushed.
    first_token_id: int | None = None
    first_logprobs: dict[int, float] | None = None
    kv_pushed: bool = False
    kv_num_tokens: int = 0
    kv_layerwise: bool = False  # the pushed KV left layer by layer (labels decode's byte counter)
    kv_block_hashes: list[str] = []  # pool mode: decode pulls these from the kvstore
    num_cached_tokens: int = 0


class SubmitAck(Msg):
    instance_id: str
    accepted: bool = True
