"""Narrow result types the engine hands to services."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta, not the running total)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None  # per new token: chosen first, then top-n
    text_delta: str = ""  # only with a tokenizer; stop strings applied and trimmed
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # The tail of text_delta released only because the request ended (bytes of an incomplete
    # character, a possible stop-string prefix). A stage that hands the request on (prefill)
    # publishes `handoff_text`: whoever continues emits this text once it is complete.
    held_text: str = ""
    # prompt_logprobs (on the first output only): per prompt token from the 2nd on,
    # {token_id: logprob} with the prompt token first, then the top-n; and that token's rank.
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_ranks: list[int] | None = None

    @property
    def handoff_text(self) -> str:
        """``text_delta`` without `held_text`: what a stream that continues elsewhere has shown
        (the next stage's detokenizer, fed the same ids, holds back the same text)."""
        return self.text_delta[: len(self.text_delta) - len(self.held_text)]


@dataclass
class EngineStats:
    """Load and efficiency counters; times are seconds (cumulative unless marked last_)."""

    running: int
    waiting: int
    swapped: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage: float
    kv_pool_bytes: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    forward_time_s: float
    step_time_s: float
    idle_gap_s: float  # time between the end of one step and the start of the next
    last_forward_s: float = 0.0
    last_step_s: float = 0.0
    device_idle_s: float = 0.0  # time the forward thread waited between two forwards
    ahead_steps: int = 0  # steps scheduled and prepared while the previous forward ran
    # prompt tokens and forward seconds of the forwards that were mostly prefill (StepTimes)
    prefill_tokens: int = 0
    prefill_forward_s: float = 0.0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_forwards: int = 0  # forwards of the draft model (draft-model speculation)
    spec_paused_steps: int = 0  # sequence-steps without drafts: acceptance too low (DraftBackoff)
    kv_prefaulted_bytes: int = 0  # KV cache bytes faulted in ahead of use while idle (prefault)
    # blocks of external KV (the pool) taken in at admission ("used") or not ("skipped")
    external_blocks: dict[str, int] = field(default_factory=dict)
    share_preemptions: int = 0  # preempted so a tenant under its share got a batch slot
    contended_steps: int = 0  # steps whose token budget the tenant-contention cap lowered
    lead_steps: int = 0  # steps that ran only a light tenant's new prompt (FairShare.lead)
    split_steps: int = 0  # steps of only prompts or only decodes (FairShare.slice_tokens)
    # blocks recorded for the KV pool by the save policy, by reason (block_manager.RECORD_REASONS)
    pool_recorded: dict[str, int] = field(default_factory=dict)
    kv_blocks_cached: int = 0  # blocks holding a prefix-cached (hashed) block, in use or not
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0
