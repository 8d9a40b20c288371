"""`strata.req.<id>.out` (one request's token stream to the gateway), `strata.gw.<id>.out`
(one engine step's chunks of every request a gateway owns, batched) and `strata.req.<id>.cancel`.
"""

from __future__ import annotations

from shared.protocol.base import Msg
from shared.protocol.errors import ErrorInfo


class Usage(Msg):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class TokenChunk(Msg):
    """Tokens ``index .. index+len(token_ids)-1`` of one request's output.

    Index-numbered so a gateway that resumes a stream on another instance drops duplicates.
    """

    request_id: str
    index: int
    token_ids: list[int] = []
    text: str = ""
    # Per token: {token_id: logprob} with the chosen token first, then the top-n alternatives.
    logprobs: list[dict[int, float]] | None = None
    # vLLM prompt_logprobs, on a request's first chunk only: per prompt token from the 2nd on,
    # {token_id: logprob} with the prompt token first, then the top-n; and that token's rank.
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_ranks: list[int] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    usage: Usage | None = None
    error: ErrorInfo | None = None
    instance_id: str = ""
    attempt: int = 0  # the `WorkItem.attempt` (route) this chunk belongs to


class TokenChunkBatch(Msg):
    """`strata.gw.<gateway_id>.out`: one decode step's chunks of the requests that gateway owns,
    one message instead of one per request; each chunk is exactly what ``strata.req.<id>.out``
    would carry (index-numbered, so dedup and failover work the same)."""

    chunks: list[TokenChunk]


class Cancel(Msg):
    request_id: str
    reason: str = "client disconnected"
    # None: stop the request wherever it runs. A number (a failover): stop only that route's
    # work; the request's next route (a higher attempt), maybe on the same instance, runs on.
    attempt: int | None = None
