"""Per-request sampling parameters and the engine configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StructuredKind = Literal["json", "json_schema", "regex", "choice", "grammar", "tool_calls"]


class StructuredSpec(BaseModel):
    """A decoding constraint (compiled by ``shared.engine.structured``); rides the bus as is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: StructuredKind = Field(..., description="What ``spec`` is (see structured.py).")
    spec: str = Field("", description="JSON schema / regex / JSON list of choices / EBNF.")
    resumed_tokens: int = Field(
        0, ge=0, description="Outputs counted into the prompt on a resume; the matcher replays "
        "them too (decode's failover path passes prompt + sent tokens as the prompt)."
    )


class SamplingParams(BaseModel):
    """How to pick tokens for one request. Frozen; reused verbatim in bus messages."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    min_tokens: int = Field(0, ge=0, description="EOS / stop ids are masked until this many.")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style, outputs.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style, outputs.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="HF-style over prompt+output.")
    seed: int | None = Field(None, description="Same tokens whatever else is in the batch.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (trimmed).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop ids.")
    ignore_eos: bool = Field(False, description="Do not stop at the model's EOS ids.")
    logprobs: int | None = Field(None, ge=0, le=20, description="None off, 0 chosen, n top-n.")
    skip_special_tokens: bool = Field(True, description="Detokenizer drops special tokens.")
    speculation: bool = Field(
        True, description="Draft tokens allowed (the scheduler turns this off from level 1)."
    )
    structured: StructuredSpec | None = Field(
        None, description="Grammar the output must follow (token bitmask in the sampler)."
    )
    logit_bias: dict[int, float] | None = Field(
        None, description="OpenAI logit_bias: added to these token ids' logits (-100..100)."
    )

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return self

    def resumed(self, sent: int) -> SamplingParams:
        """These params for a stream resumed after ``sent`` outputs that the engine takes as part
        of the prompt: only the rest of max_tokens / min_tokens is due, and the grammar matcher
        replays the ``sent`` tokens too."""
        if not sent:
            return self
        update: dict = {"max_tokens": max(1, self.max_tokens - sent),
                        "min_tokens": max(0, self.min_tokens - sent)}  # fmt: skip
        if self.structured is not None:
            update["structured"] = self.structured.model_copy(update={"resumed_tokens": sent})
        return self.model_copy(update=update)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, validated at construction (a bad value names the setting)."""

    kv_cache_bytes: int = 256 << 20
    """Byte budget of the paged KV pool; ``num_blocks`` is derived from it and never exceeds it."""
    block_size: int = 16
    """Tokens per KV block (the unit of paging, prefix caching and transfer)."""
    max_num_seqs: int = 64
    """Most sequences in one running batch."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget shared by decodes and prefill chunks."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so running decodes keep their pace."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks whose chained hash is already in the pool."""
    preemption_mode: str = "recompute"
    """When KV runs out: "recompute" (drop and re-prefill) or "swap" (copy blocks out and back)."""
    num_speculative_tokens: int = 0
    """n-gram (prompt-lookup) draft tokens per greedy decode step; 0 disables speculation."""
    ngram_min: int = 1
    """Shortest suffix n-gram the proposer tries to match."""
    ngram_max: int = 4
    """Longest suffix n-gram the proposer tries to match (tried first)."""
    quantization: str | None = None
    """Weight quantization: None or "int8" (weight-only, per-output-channel scales)."""
    device: str = "cpu"
    """Torch device of the model and KV cache."""
    dtype: str | None = None
    """KV cache dtype name (e.g. "float32"); None follows the model dtype."""
    collect_evicted_kv: bool = False
    """Copy evicted cached blocks out for the KV pool (``EnginePort.drain_evicted``)."""
    async_scheduling: bool | None = None
    """Schedule and prepare decode step i+1 while the forward of step i runs (see
    ``LLMEngine.step``); False runs every step strictly in sequence; None: on for CUDA, off on
    CPU, where the thread hand-offs cost about what the overlap hides (docs/ENGINE.md)."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"EngineConfig.{name}: {why} (got {getattr(self, name)!r})")

        if self.block_size < 1:
            bad("block_size", "must be >= 1")
        if self.kv_cache_bytes <= 0:
            bad("kv_cache_bytes", "must be > 0")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            bad("max_num_batched_tokens", "must be >= max_num_seqs")
        if self.preemption_mode not in ("recompute", "swap"):
            bad("preemption_mode", 'must be "recompute" or "swap"')
        if self.num_speculative_tokens < 0:
            bad("num_speculative_tokens", "must be >= 0")
        if not 1 <= self.ngram_min <= self.ngram_max:
            bad("ngram_min", "need 1 <= ngram_min <= ngram_max")
        if self.quantization not in (None, "int8"):
            bad("quantization", 'must be None or "int8"')
