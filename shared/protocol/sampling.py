"""Per-request sampling parameters and structured-output specs: they ride the bus inside the
submit messages, so they are part of the protocol; the engine imports them from here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StructuredKind = Literal["json", "json_schema", "regex", "choice", "grammar", "tool_calls"]


class StructuredSpec(BaseModel):
    """A decoding constraint (compiled by ``shared.engine.structured``); rides the bus as is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: StructuredKind = Field(..., description="What ``spec`` is (see structured.py).")
    spec: str = Field("", description="JSON schema / regex / JSON list of choices / EBNF.")
    think: Literal["", "optional", "open"] = Field(
        "",
        description="A thinking block before the constrained answer (the gateway's reasoning "
        "parser): 'optional' (the answer may start with <think>...</think>), 'open' (the "
        "template opened the block: the answer starts inside it), '' (none).",
    )
    resumed_tokens: int = Field(
        0,
        ge=0,
        description="Outputs counted into the prompt on a resume; the matcher replays "
        "them too (decode's failover path passes prompt + sent tokens as the prompt).",
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
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="vLLM prompt_logprobs: None off; n: each prompt token's logprob (and rank) "
        "and the top-n alternatives, from the prefill logits (the prefix cache is skipped).",
    )
    skip_special_tokens: bool = Field(True, description="Detokenizer drops special tokens.")
    spaces_between_special_tokens: bool = Field(
        True,
        description="vLLM: False makes an added token right after another its bare content "
        "(no space a decoder puts between them); only with skip_special_tokens False.",
    )
    speculation: bool = Field(
        True, description="Draft tokens allowed (the scheduler turns this off from level 1)."
    )
    structured: StructuredSpec | None = Field(
        None, description="Grammar the output must follow (token bitmask in the sampler)."
    )
    logit_bias: dict[int, float] | None = Field(
        None, description="OpenAI logit_bias: added to these token ids' logits (-100..100)."
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="vLLM: only these ids may be sampled (every other logit is -inf)."
    )
    bad_words_ids: list[list[int]] = Field(
        default_factory=list,
        description="vLLM bad_words as token sequences: a sequence's last id is banned when "
        "the outputs end with the ids before it (a one-id sequence is always banned).",
    )
    include_stop_str_in_output: bool = Field(
        False, description="A stop string that ends the output stays in its text."
    )
    cache_salt: str = Field(
        "",
        max_length=4096,
        description="vLLM cache_salt: part of the root of the prompt's block-hash chain, so "
        "cached KV (engine prefix cache, pool, the scheduler's index) is shared only between "
        "requests with the same salt; '' none. Not a sampling control: it rides here because "
        "every path that hashes a prompt carries these params.",
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
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if any(not w for w in self.bad_words_ids):
            raise ValueError("bad_words_ids entries must be non-empty")
        return self

    @property
    def masked(self) -> bool:
        """Logits are changed before picking (bias, allowed ids, bad words): a greedy draft
        checked against the raw argmax would not honour it."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_ids)

    def resumed(self, sent: int) -> SamplingParams:
        """These params for a stream resumed after ``sent`` outputs that the engine takes as part
        of the prompt: only the rest of max_tokens / min_tokens is due, and the grammar matcher
        replays the ``sent`` tokens too."""
        if not sent:
            return self
        update: dict = {
            "max_tokens": max(1, self.max_tokens - sent),
            "min_tokens": max(0, self.min_tokens - sent),
        }
        if self.structured is not None:
            update["structured"] = self.structured.model_copy(update={"resumed_tokens": sent})
        return self.model_copy(update=update)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
