"""The engine configuration (sampling parameters live in `shared.protocol.sampling`)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.block_manager import SAVE_POLICIES


class EngineConfigError(ValueError):
    """A bad `EngineConfig` value: ``setting`` names the field, ``why`` says what is wrong."""

    def __init__(self, setting: str, why: str, value: object):
        super().__init__(f"EngineConfig.{setting}: {why} (got {value!r})")
        self.setting, self.why, self.value = setting, why, value


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
    """Draft tokens per decode step (n-gram prompt lookup, or ``speculative_model``'s); 0
    disables speculation."""
    spec_min_acceptance: float = 0.1
    """Speculation pauses for a sequence whose moving share of accepted drafts falls under this
    (2 steps, doubled per further miss up to 64, then it probes again: `spec_decode.DraftBackoff`);
    0: never pauses. A verify step costs about 1 + 0.1 k plain steps on CPU, so with free
    drafts (n-gram) speculation pays from about 10% acceptance; a draft model needs more."""
    speculative_model: str | None = None
    """Checkpoint directory of a small draft model with the target's vocabulary: it proposes
    the drafts (run greedily, its own KV cache inside ``kv_cache_bytes``) instead of n-gram
    lookup. None: n-gram."""
    ngram_min: int = 1
    """Shortest suffix n-gram the proposer tries to match."""
    ngram_max: int = 4
    """Longest suffix n-gram the proposer tries to match (tried first)."""
    quantization: str | None = None
    """Weight quantization: None or "int8" (int8 weights, per-output-channel scales; on CPU the
    activations are quantised per row at call time and the GEMM runs in int8: W8A8)."""
    device: str = "cpu"
    """Torch device of the model and KV cache."""
    dtype: str | None = None
    """KV cache dtype name (e.g. "float32"); None follows the model dtype."""
    collect_evicted_kv: bool = False
    """Copy evicted cached blocks out for the KV pool (``EnginePort.drain_evicted``)."""
    pool_save: str = "off"
    """Which full blocks this engine computes are recorded to be copied out for the KV pool
    (``EnginePort.drain_computed``, so a restart or another instance finds them): "all" (every
    one: write-through), "reused" (those a second request uses, or computed again after leaving
    memory unsaved), "off" (see `shared.engine.block_manager`)."""
    async_scheduling: bool | None = None
    """Schedule and prepare decode step i+1 while the forward of step i runs (see
    ``LLMEngine.step``); False runs every step strictly in sequence; None: on for CUDA, off on
    CPU, where the thread hand-offs cost about what the overlap hides (docs/ENGINE.md)."""
    fair_queuing: bool = True
    """Order waiting requests of one priority class by their tenant's fair-queuing start tag
    (weighted shares, `shared.engine.fair_queue`); False: first come, first served."""
    fair_step_tokens: int = 256
    """With fair queuing, while two or more tenants contend (requests of both here, or one
    arrived within ``fair_window_s``), a step computes at most this many prompt tokens beside
    its running decodes: a light tenant's new request waits behind one short step, not a
    full ``max_num_batched_tokens`` chunk of a heavy tenant's prompts. 0: no cap."""
    fair_window_s: float = 5.0
    """How long after its last request a tenant still counts as contending (``fair_step_tokens``)."""
    fair_lead: bool = True
    """With the step cap on, a new request of a tenant under its weighted share of the running
    slots gets a step of its own prompt (up to ``fair_step_tokens``) instead of sharing one with
    every running decode; never two such steps in a row (the decodes wait one step at most)."""
    fair_slice_tokens: int = 128
    """With the step cap on, while tenants contend: prompt chunks and running decodes go in
    separate steps, a prompt step computing at most this many tokens and the decodes running
    after every ``fair_step_tokens`` prompt tokens. The step in flight, which a light tenant's
    arrival waits out, is then the longer of one slice and one decode step, not their sum,
    while the heavy tenant's prompts and decodes advance at the same rate. 0: off (a step
    carries the decodes and up to ``fair_step_tokens`` prompt tokens together). CPU engines
    only: on an accelerator the decodes add little to a prompt forward (they are bound by
    reading the weights, which the prompt reads anyway), so a step of their own would cost one."""
    kv_prefault_bytes: int = 1 << 30
    """While no request is unfinished, the engine thread faults in the pages of this many bytes
    of KV cache past the blocks ever used (CPU; `shared.engine.prefault`), so the steps that
    first use them do not (0.65 s per GiB zeroed inside steps otherwise, on a 2-core EPYC).
    Memory stays the blocks used plus this window; 0: off."""
    eplb_interval_steps: int = 0
    """Expert parallelism (``--ep``): move experts to the placement that balances the rows routed
    so far every N engine steps, between steps (EPLB, `shared.model.ep`); 0: never."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise EngineConfigError(name, why, getattr(self, name))

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
        if self.pool_save not in SAVE_POLICIES:
            bad("pool_save", f"must be one of {', '.join(SAVE_POLICIES)}")
        if self.preemption_mode not in ("recompute", "swap"):
            bad("preemption_mode", 'must be "recompute" or "swap"')
        if self.fair_step_tokens < 0:
            bad("fair_step_tokens", "must be >= 0 (0: no cap)")
        if self.fair_slice_tokens < 0:
            bad("fair_slice_tokens", "must be >= 0 (0: off)")
        if self.fair_window_s < 0:
            bad("fair_window_s", "must be >= 0")
        if self.kv_prefault_bytes < 0:
            bad("kv_prefault_bytes", "must be >= 0 (0: off)")
        if self.eplb_interval_steps < 0:
            bad("eplb_interval_steps", "must be >= 0")
        if self.num_speculative_tokens < 0:
            bad("num_speculative_tokens", "must be >= 0")
        if not 0.0 <= self.spec_min_acceptance <= 1.0:
            bad("spec_min_acceptance", "must be between 0 and 1")
        if self.speculative_model and self.num_speculative_tokens < 1:
            bad("speculative_model", "needs num_speculative_tokens >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            bad("ngram_min", "need 1 <= ngram_min <= ngram_max")
        if self.quantization not in (None, "int8"):
            bad("quantization", 'must be None or "int8"')
