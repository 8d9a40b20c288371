"""``LLMEngine``: the step loop shared by the prefill and decode services.

One ``step()`` = ``_schedule`` (EPLB between steps, the scheduler's pick, KV that must move:
swap out/in, evicted cached blocks) -> ``_run`` (prepared inputs -> forward -> sample or verify
drafts) -> ``_postprocess`` (``_advance``: the scheduler takes the tokens, drafts are proposed;
``_outputs``: detokenize, build outputs). With ``EngineConfig.async_scheduling`` the same parts
run overlapped by :class:`~shared.engine.overlap.OverlapStepper` (``self.overlap``): the forward
on a forward thread, the next decode step scheduled and prepared while it runs. KV that moves in
and out of the cache (swap, eviction to the pool, disaggregated prefill) is
:class:`~shared.engine.kv_io.EngineKV` (``self.kv``); a
:class:`~shared.engine.port_types.KVConnector` (``self.connector``) is handed each layer's new
K/V. Services reach the engine only through :class:`~shared.engine.port.EnginePort`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.detok import TextTracker
from shared.engine.fair_queue import FairQueue, Tenant
from shared.engine.kv_io import EngineKV
from shared.engine.model_runner import ModelRunner, PreparedBatch, dtype_of
from shared.engine.outputs import EngineStats, RequestOutput
from shared.engine.overlap import OverlapStepper
from shared.engine.params import EngineConfig
from shared.engine.port_types import ExternalKV, KVConnector
from shared.engine.prefault import KVPrefaulter
from shared.engine.sampler import Sampler, SampleRow
from shared.engine.scheduler import FairShare, Scheduler, SchedulerOutput
from shared.engine.sequence import MMInput, Sequence, SequenceStatus
from shared.engine.spec_decode import (
    DraftBackoff,
    DraftModelProposer,
    NgramProposer,
    Proposer,
    check_draft_model,
    eligible,
    propose_all,
    verify_greedy,
)
from shared.engine.structured import (
    Constraint,
    GrammarCache,
    allocate_bitmask,
    apply_bitmask,
    tokenizer_info,
)
from shared.protocol.dtypes import dtype_name
from shared.protocol.hashing import model_salt
from shared.protocol.sampling import SamplingParams


@dataclass
class StepTimes:
    """Where the engine's time goes; sums since start in seconds (``stats()`` reports them).
    Written by the engine thread and, for the forward, by the forward thread; read from any."""

    steps: int = 0  # steps whose tokens were applied
    forward_s: float = 0.0  # forward + sampling
    step_s: float = 0.0  # inside step()
    idle_s: float = 0.0  # the caller's gap: from the end of one step() to the next
    last_forward_s: float = 0.0
    last_step_s: float = 0.0
    device_idle_s: float = 0.0  # the forward thread's wait between two forwards
    ahead_steps: int = 0  # steps scheduled and prepared while the previous forward ran
    # forwards whose batch is mostly prompt chunks (at least PROMPT_SHARE of its tokens): their
    # prompt tokens and seconds, so an instance that prefills beside its decodes can measure
    # its prefill rate from real work (`shared.worker.runtime`)
    prefill_tokens: int = 0
    prefill_forward_s: float = 0.0
    _step_end: float | None = field(default=None, init=False, repr=False)
    _forward_end: float | None = field(default=None, init=False, repr=False)

    def step_started(self) -> float:
        t = time.perf_counter()
        if self._step_end is not None:
            self.idle_s += t - self._step_end
        return t

    def step_ended(self, t0: float) -> float:
        """The step's duration."""
        self._step_end = end = time.perf_counter()
        self.last_step_s = end - t0
        self.step_s += end - t0
        return end - t0

    def forward_started(self) -> float:
        t = time.perf_counter()
        if self._forward_end is not None:
            self.device_idle_s += t - self._forward_end
        return t

    def forward_ended(self, t0: float, sched: SchedulerOutput | None = None) -> None:
        self._forward_end = end = time.perf_counter()
        self.last_forward_s = end - t0
        self.forward_s += end - t0
        if sched is not None:
            prompt, total = prompt_tokens(sched)
            if prompt and prompt >= PROMPT_SHARE * total:
                self.prefill_tokens += prompt
                self.prefill_forward_s += end - t0


PROMPT_SHARE = 0.75  # a forward counts as prefill work when prompt chunks are this much of it


def prompt_tokens(sched: SchedulerOutput) -> tuple[int, int]:
    """(tokens of the step's prompt chunks, all its tokens): a sequence computing more than
    one known token (beyond its drafts) is prefilling; one token is a decode."""
    prompt = total = 0
    for s in sched.scheduled:
        total += s.num_new_tokens
        if s.num_new_tokens - s.num_draft_tokens > 1:
            prompt += s.num_new_tokens - s.num_draft_tokens
    return prompt, total


class StepResult(NamedTuple):
    """What ``LLMEngine._run`` hands ``_advance``: the step, its inputs (prompt logprobs ride on
    them), and per scheduled sequence its tokens (sampled, or accepted drafts + one) and
    logprobs."""

    sched: SchedulerOutput
    batch: PreparedBatch
    sampled: list[list[int]]
    lps: list[list | None]


class LLMEngine:
    def __init__(
        self,
        loaded_model,
        config: EngineConfig | None = None,
        tokenizer=None,
        proposer: Proposer | None = None,
    ):
        self.config = config = config or EngineConfig()
        self._launch_chances = 0  # step() calls that could launch a forward (EPLB's interval)
        self.loaded = loaded_model
        model = loaded_model.model
        if config.quantization == "int8":
            from shared.engine.quant import quantize_model_

            quantize_model_(model)
        kv_dtype = dtype_of(config.dtype, model.dtype)
        per_block = ModelRunner.bytes_per_block(model, config.block_size, kv_dtype)
        draft = None
        if config.speculative_model and config.num_speculative_tokens > 0 and proposer is None:
            draft = _load_draft(config, loaded_model)
            # the draft's cache holds as many blocks as the target's, inside the same budget
            per_block += ModelRunner.bytes_per_block(draft.model, config.block_size, kv_dtype)
        num_blocks = config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"EngineConfig.kv_cache_bytes: {config.kv_cache_bytes} B holds no block "
                f"({per_block} B each)"
            )
        self.runner = ModelRunner(model, num_blocks, config.block_size, kv_dtype)
        if draft is not None:
            proposer = DraftModelProposer(
                ModelRunner(draft.model, num_blocks, config.block_size, kv_dtype),
                config.num_speculative_tokens,
                loaded_model.config.vocab_size,
                config.max_num_batched_tokens,
            )
        self.runner.announce(config.quantization)  # tensor parallel: the followers' runners
        self.salt = model_salt(loaded_model.fingerprint, dtype_name(kv_dtype), config.block_size)
        self.eos_token_ids = list(loaded_model.config.eos_token_ids or [])
        device_type = torch.device(config.device).type
        self.bm = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            save=config.pool_save,
        )
        self.scheduler = Scheduler(
            self.bm,
            self.salt,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.preemption_mode,
            self.eos_token_ids,
            FairQueue(config.fair_queuing),
            FairShare(
                config.fair_step_tokens,
                config.fair_window_s,
                lead=config.fair_lead,
                # CPU only: on an accelerator the decodes ride in a prompt forward nearly free
                slice_tokens=config.fair_slice_tokens if device_type == "cpu" else 0,
            ),
        )
        # (tenant, seconds queued) of each first admission, oldest first; the worker drains it
        # (`drain_admissions`) into per-tenant metrics. Bounded: a reader that stops loses
        # the oldest entries, never the engine's memory.
        self.admissions: deque[tuple[str, float]] = deque(maxlen=1 << 16)
        # seconds of each step that ran a batch (`drain_step_times`; bounded the same way)
        self.step_times: deque[float] = deque(maxlen=1 << 16)
        self.sampler = Sampler(self.eos_token_ids, torch.Generator().manual_seed(0))
        if proposer is None and config.num_speculative_tokens > 0:
            proposer = NgramProposer(
                config.num_speculative_tokens, config.ngram_min, config.ngram_max
            )
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.seqs: dict[str, Sequence] = {}
        self.trackers: dict[str, TextTracker] = {}
        self.pending: list[RequestOutput] = []  # outputs produced outside step()
        self.current: SchedulerOutput | None = None  # the step being executed
        self.kv = EngineKV(
            self.runner, self.bm, self.salt, config.collect_evicted_kv, self.scheduler
        )
        self.connector: KVConnector | None = None  # layer-wise KV saving
        self.times = StepTimes()
        overlap = config.async_scheduling
        if overlap is None:
            overlap = device_type == "cuda"
        # the overlapped step (forward thread, decode scheduled ahead); None: the plain step
        self.overlap = OverlapStepper(self) if overlap else None
        self._spec = [0, 0]  # drafted, accepted
        self.backoff = DraftBackoff(config.spec_min_acceptance)
        self._grammars: GrammarCache | None = None
        kv = self.runner.kv
        self.prefault = KVPrefaulter(kv.k, kv.v, config.kv_prefault_bytes)

    @property
    def grammars(self) -> GrammarCache:
        """Compiled grammars of structured requests (built on first use; needs the tokenizer)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the engine's tokenizer")
            info = tokenizer_info(self.tokenizer, self.loaded.config.vocab_size, self.eos_token_ids)
            self._grammars = GrammarCache(info)
        return self._grammars

    # ----- intake ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        mm_inputs: Seq[MMInput] = (),
        output_token_ids: Seq[int] = (),
        hold_kv: bool = False,
        tenant: Tenant | None = None,
        external_kv: ExternalKV | None = None,
    ) -> None:
        """Queue a request. ``output_token_ids`` resumes one whose tokens were already emitted
        elsewhere: they become context and are not emitted again. ``tenant`` (default: the
        default tenant, weight 1) orders it among waiting requests of its priority class.
        ``external_kv``: KV of some of its prompt's blocks from the pool, taken in at admission
        (`Scheduler._admit`)."""
        if external_kv is not None:
            self._check_external(external_kv)
        seq = self._new_seq(request_id, prompt_token_ids, params, priority, mm_inputs, hold_kv)
        seq.external = external_kv
        if tenant is not None:
            seq.tenant = tenant
        seq.queued_at = time.perf_counter()
        seq.token_ids += list(output_token_ids)
        seq.num_resumed_outputs = len(output_token_ids)
        seq.prompt_lps_sent = bool(output_token_ids)  # a resume: sent with its first token
        self._track(seq)
        self.scheduler.add(seq)

    def _check_external(self, x: ExternalKV) -> None:
        k = self.runner.kv.k  # [layers, blocks, block_size, kv_heads, head_dim]
        want = (k.shape[0], 2, len(x.hashes), k.shape[2], self.runner.kv_heads, k.shape[4])
        if tuple(x.kv.shape) != want or x.kv.dtype != k.dtype:
            raise ValueError(
                f"external KV of shape {list(x.kv.shape)} {x.kv.dtype}: this engine's "
                f"{len(x.hashes)} blocks are {list(want)} {k.dtype}"
            )

    def _new_seq(self, request_id, prompt, params, priority, mm_inputs, hold_kv) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt:
            raise ValueError("empty prompt")
        vocab = self.loaded.config.vocab_size
        if max(prompt) >= vocab or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params is not None and params.structured is not None:
            self.grammars.get(params.structured)  # GrammarError (a ValueError) when bad
        seq = Sequence(
            request_id,
            list(prompt),
            len(prompt),
            params or SamplingParams(),
            priority=priority,
            mm_inputs=list(mm_inputs),
            hold_kv=hold_kv,
        )
        self.seqs[request_id] = seq
        return seq

    def _track(self, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        from shared.model.tokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(
            self.tokenizer,
            list(seq.token_ids),
            skip_special_tokens=seq.params.skip_special_tokens,
            spaces_between_special_tokens=seq.params.spaces_between_special_tokens,
        )
        tracker = TextTracker(detok, seq.params.stop, seq.params.include_stop_str_in_output)
        tracker.prime(seq.token_ids[seq.num_prompt_tokens :])  # resumed outputs (failover)
        self.trackers[seq.request_id] = tracker

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; an "abort" output follows in the next step."""
        seq = self.seqs.pop(request_id, None)
        self.trackers.pop(request_id, None)
        if seq is None:
            return
        if seq.status == SequenceStatus.FINISHED:
            self.scheduler.release(seq)  # held KV
            return
        self.scheduler.finish(seq, "abort")
        self.pending.append(self._output(seq, [], None, "", True))

    def _save_layer(self, layer: int) -> None:
        self.kv.save_layer(self.connector, self.current, layer)

    # ----- KV computed elsewhere -------------------------------------------------------------
    def commit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        first_token_id: int,
        params: SamplingParams | None = None,
        priority: int = 0,
        mm_inputs: Seq[MMInput] = (),
    ) -> None:
        """Turn a reserved, fully written request (``self.kv.reserve`` / ``write``) into a
        running decode; ``first_token_id`` was emitted elsewhere, outputs start after it."""
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        r = self.kv.take(request_id)
        try:
            seq = self._new_seq(request_id, prompt_token_ids, params, priority, mm_inputs, False)
        except ValueError:
            self.bm.free(r.block_table)
            raise
        seq.block_table = r.block_table
        seq.prompt_lps_sent = True  # prompt logprobs come from where the prompt was computed
        seq.num_computed_tokens = r.num_tokens
        seq.num_cached_tokens = r.num_cached
        self._track(seq)
        self.scheduler.add_running(seq)
        before = seq.num_tokens
        self.scheduler.postprocess_prefilled(seq, first_token_id)
        tracker = self.trackers.get(seq.request_id)
        if tracker is not None:
            tracker.add(first_token_id)  # emitted by the prefill side
        if seq.is_finished:
            self.pending.append(self._emit(seq, before + 1, None))

    def release(self, request_id: str) -> None:
        """Free a finished request's held blocks (``hold_kv=True``)."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.release(seq)

    def has_unfinished_requests(self) -> bool:
        in_flight = self.overlap is not None and self.overlap.flight is not None
        return self.scheduler.has_unfinished() or bool(self.pending) or in_flight

    def close(self) -> None:
        """Stop the forward thread (after the forward in flight, if any)."""
        if self.overlap is not None:
            self.overlap.close()

    # ----- step ------------------------------------------------------------------------------
    def step(self, layer_callback=None) -> list[RequestOutput]:
        """Run one forward and return the outputs it produced (and those of aborts since the
        last call): schedule -> run -> postprocess.

        With ``async_scheduling`` the same parts run overlapped (``OverlapStepper``): the
        forward on the forward thread, the next pure-decode step scheduled and prepared while
        it runs and launched before detokenization. ``stats()`` reports both this thread's
        idle gap and the forward thread's (``device_idle_s``).
        """
        t0 = self.times.step_started()
        if layer_callback is None and self.connector is not None:
            layer_callback = self._save_layer
        outputs, self.pending = self.pending, []
        if self.overlap is not None:
            outputs += self.overlap.step(t0, layer_callback)
        else:
            sched = self._schedule(t0)
            if not sched.is_empty:
                ran = self._run(sched, self.runner.prepare(sched), layer_callback)
                outputs += self._postprocess(ran)
        took = self.times.step_ended(t0)
        if self.current is not None and not self.current.is_empty:
            self.step_times.append(took)
        return outputs

    def _schedule(self, t0: float) -> SchedulerOutput:
        """Between forwards: EPLB, the scheduler's pick (first admissions logged), the KV that
        must move before the forward overwrites it; the step becomes ``current``."""
        self._maybe_rebalance()
        sched = self.scheduler.schedule()
        for seq in self.scheduler.newly_admitted:
            self.admissions.append((seq.tenant.name, t0 - seq.queued_at))
        self.scheduler.newly_admitted.clear()
        self.kv.move(sched)
        self.current = sched  # what a layer callback of this step may look at
        return sched

    def _maybe_rebalance(self) -> None:
        """EPLB between steps (no forward in flight): every ``eplb_interval_steps`` launches."""
        every = self.config.eplb_interval_steps
        self._launch_chances += 1
        if every and self._launch_chances % every == 0:
            self.runner.rebalance_experts()

    def _run(self, sched: SchedulerOutput, batch: PreparedBatch, layer_callback) -> StepResult:
        """Forward + sampling of a prepared step. Under overlap this runs on the forward thread:
        every torch op of a step on one thread, so only one OpenMP team is ever busy (a second
        team on the engine thread measured ~11% slower forwards on 2 cores)."""
        t = self.times.forward_started()
        logits = self.runner.execute(batch, layer_callback)
        if self.connector is not None:
            self.connector.wait_for_save()
        self.times.forward_ended(t, sched)
        return StepResult(sched, batch, *self._sample(sched, batch.logit_rows, logits))

    def _postprocess(self, ran: StepResult) -> list[RequestOutput]:
        """Apply a step's tokens, then build its outputs."""
        return self._outputs(self._advance(ran))

    def _advance(self, ran: StepResult) -> list:
        """The scheduler takes a step's tokens (prompt logprobs filed, drafts proposed for the
        next step); ``(seq, before, logprobs)`` of every sequence that got tokens or finished."""
        if ran.batch.prompt_out is not None:
            _keep_prompt_logprobs(ran.sched, ran.batch)
        touched = self._update(ran.sched, ran.sampled, ran.lps)
        self.times.steps += 1
        return touched

    def _outputs(self, touched: list) -> list[RequestOutput]:
        """Detokenize (stop strings may finish a sequence here) and build the outputs."""
        return [self._emit(seq, before, lp) for seq, before, lp in touched]

    def _sample(self, sched: SchedulerOutput, logit_rows, logits):
        """Tokens per scheduled sequence (sampled, or accepted drafts + bonus) and logprobs."""
        rows: list[SampleRow] = []
        where: list[int] = []
        verify: dict[int, torch.Tensor] = {}  # logits rows of each sequence with drafts
        constrained: list[tuple[int, Sequence]] = []  # (row, seq) of structured requests
        r = 0
        for i, (sch, k) in enumerate(zip(sched.scheduled, logit_rows, strict=True)):
            if k == 1:
                s = sch.seq
                if s.params.structured is not None:
                    constrained.append((len(rows), s))
                rows.append(SampleRow(s.params, s.token_ids, s.num_prompt_tokens))
                where.append(r)
            elif k > 1:
                verify[i] = logits[r : r + k]
            r += k
        bitmask = self._fill_bitmask(constrained)
        res = (
            self.sampler(logits[where], rows, bitmask, [j for j, _ in constrained])
            if rows
            else None
        )
        for j, s in constrained:
            s.constraint.accept(res.token_ids[j])
        sampled: list[list[int]] = []
        lps: list[list | None] = []
        j = 0
        for i, (sch, k) in enumerate(zip(sched.scheduled, logit_rows, strict=True)):
            if k == 1:
                sampled.append([res.token_ids[j]])
                lps.append(None if res.logprobs[j] is None else [res.logprobs[j]])
                j += 1
            elif k > 1:
                toks = self._verify(sch.seq, sch.num_draft_tokens, verify[i])
                self._spec[0] += sch.num_draft_tokens
                self._spec[1] += len(toks) - 1
                self.backoff.observe(sch.seq, sch.num_draft_tokens, len(toks) - 1)
                sampled.append(toks)
                lps.append(None)
            else:
                sampled.append([])
                lps.append(None)
        return sampled, lps

    def _verify(self, s: Sequence, num_drafts: int, logits: torch.Tensor) -> list[int]:
        """The tokens a step with drafts emits for ``s`` (``logits``: its ``num_drafts + 1``
        rows): the greedy prefix rule or rejection sampling, under the grammar's bitmask at
        each position for a structured request (spec_decode's module docstring)."""
        drafts = s.draft_token_ids[:num_drafts]
        if s.constraint is not None:
            logits = logits.float().clone()
            masks = s.constraint.draft_bitmasks(drafts, self.grammars.vocab_size)
            apply_bitmask(logits, masks, list(range(len(drafts) + 1)))
        if s.params.greedy:
            toks = verify_greedy(drafts, logits.argmax(dim=-1).tolist())
        else:
            toks = self.sampler.verify(
                logits, drafts, SampleRow(s.params, s.token_ids, s.num_prompt_tokens)
            )
        if s.constraint is not None:
            for t in toks:
                s.constraint.accept(t)
        return toks

    def _fill_bitmask(self, constrained: list[tuple[int, Sequence]]):
        """The next-token bitmask of each structured row (its matcher built on first use by
        replaying the outputs so far: a prefill hand-off's first token, a resume's tokens)."""
        if not constrained:
            return None
        bitmask = allocate_bitmask(len(constrained), self.grammars.vocab_size)
        for n, (_, s) in enumerate(constrained):
            if s.constraint is None:
                spec = s.params.structured
                s.constraint = Constraint(self.grammars.get(spec))
                s.constraint.replay(s.token_ids[s.num_prompt_tokens - spec.resumed_tokens :])
            s.constraint.fill(bitmask, n)
        return bitmask

    def _update(self, sched: SchedulerOutput, sampled, lps) -> list:
        """Advance the scheduler with a step's tokens; ``(seq, before, logprobs)`` for every
        sequence that got tokens or finished."""
        before = {id(s.seq): s.seq.num_tokens for s in sched.scheduled}
        touched = self.scheduler.postprocess(sched, sampled)
        for seq in touched:  # a grammar that ended on a stop id the scheduler does not know
            if seq.constraint is not None and seq.constraint.terminated and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
        lp_of = {id(s.seq): lp for s, lp in zip(sched.scheduled, lps, strict=True)}
        if self.proposer is not None:
            self._propose()
        return [(seq, before[id(seq)], lp_of[id(seq)]) for seq in touched]

    def _propose(self) -> None:
        """Drafts for every running sequence that decodes next step and may speculate; a
        structured request's drafts are cut where its grammar refuses one (and it gets none
        before its grammar state exists, at its first sampled token)."""
        seqs = [
            s
            for s in self.scheduler.running
            if s.num_computed_tokens == s.num_tokens - 1
            and eligible(s)
            and (s.params.structured is None or s.constraint is not None)
            and self.backoff.allows(s)
        ]
        # called with none too: a draft model frees finished sequences' blocks here
        k = self.config.num_speculative_tokens
        for seq, drafts in zip(seqs, propose_all(self.proposer, seqs), strict=True):
            drafts = drafts[:k]
            if seq.constraint is not None and drafts:
                drafts = drafts[: seq.constraint.valid_prefix(drafts)]
            seq.draft_token_ids = drafts

    def _emit(self, seq: Sequence, before: int, lps) -> RequestOutput:
        new = seq.token_ids[before:]
        text = held = ""
        tracker = self.trackers.get(seq.request_id)
        if tracker is not None:
            for n, t in enumerate(new):
                delta, hit = tracker.add(t)
                text += delta
                if hit:
                    del seq.token_ids[before + n + 1 :]
                    new = new[: n + 1]
                    if seq.is_finished:  # max_tokens (a prefill's 1) ended it on this token
                        seq.finish_reason = "stop"
                    else:
                        self.scheduler.finish(seq, "stop")
                    break
            if seq.is_finished:
                held = tracker.flush()
                text += held
        if lps is not None:
            lps = lps[: len(new)]
        out = self._output(seq, new, lps, text, seq.is_finished, held)
        if seq.params.prompt_logprobs is not None and not seq.prompt_lps_sent and new:
            seq.prompt_lps_sent = True  # with the first output; a recompute does not redo them
            got = [seq.prompt_lps[p] for p in range(1, seq.num_prompt_tokens)]
            out.prompt_logprobs = [d for d, _ in got]
            out.prompt_ranks = [r for _, r in got]
            seq.prompt_lps.clear()
        if seq.is_finished:
            self.trackers.pop(seq.request_id, None)
            if not seq.hold_kv:
                self.seqs.pop(seq.request_id, None)
        return out

    @staticmethod
    def _output(
        seq: Sequence, new, lps, text: str, finished: bool, held: str = ""
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=list(new),
            new_logprobs=lps,
            text_delta=text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            held_text=held,
        )

    # ----- convenience -----------------------------------------------------------------------
    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run prompts to completion; returns the generated token ids of each."""
        plist = params if isinstance(params, list | tuple) else [params] * len(prompts)
        base = f"gen-{id(prompts)}-{time.monotonic_ns()}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, p, sp)
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.seqs for rid in ids) or self.pending:
            for o in self.step():
                if o.request_id in got:
                    got[o.request_id] += o.new_token_ids
        return [got[rid] for rid in ids]

    def drain_step_times(self) -> list[float]:
        """Seconds of each step that ran a batch since the last call; safe from any thread."""
        out = []
        while self.step_times:
            out.append(self.step_times.popleft())
        return out

    def drain_admissions(self) -> list[tuple[str, float]]:
        """(tenant, seconds queued) of the requests first admitted since the last call; safe
        from any thread (``deque.popleft`` is atomic)."""
        out = []
        while self.admissions:
            out.append(self.admissions.popleft())
        return out

    def idle_work(self) -> bool:
        """One chunk of work for the engine thread while no request is unfinished: KV cache
        pages faulted in ahead of the blocks in use (`shared.engine.prefault`). False when
        there is none left."""
        return self.prefault.step(self.bm.high_water) > 0

    def stats(self) -> EngineStats:
        """Counters, readable from another thread while a step runs (the worker's heartbeat):
        the waiting queue is copied in one C call, so no Python iteration sees it change."""
        s, t = self.scheduler, self.times
        waiting = list(s.waiting)
        return EngineStats(
            running=len(s.running),
            waiting=sum(1 for q in waiting if q.status == SequenceStatus.WAITING),
            swapped=sum(1 for q in waiting if q.status == SequenceStatus.SWAPPED),
            kv_blocks_total=self.bm.num_blocks,
            kv_blocks_free=self.bm.num_free_blocks,
            kv_blocks_cached=len(self.bm.cached),
            kv_usage=self.bm.usage,
            kv_pool_bytes=self.runner.kv_bytes,
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            preemptions=s.num_preemptions,
            share_preemptions=s.share_preemptions,
            contended_steps=s.contended_steps,
            lead_steps=s.lead_steps,
            split_steps=s.split_steps,
            steps=t.steps,
            forward_time_s=t.forward_s,
            prefill_tokens=t.prefill_tokens,
            prefill_forward_s=t.prefill_forward_s,
            step_time_s=t.step_s,
            idle_gap_s=t.idle_s,
            last_forward_s=t.last_forward_s,
            device_idle_s=t.device_idle_s,
            ahead_steps=t.ahead_steps,
            last_step_s=t.last_step_s,
            spec_draft_tokens=self._spec[0],
            spec_accepted_tokens=self._spec[1],
            external_blocks=dict(self.scheduler.external_blocks),
            spec_paused_steps=self.backoff.paused_steps,
            kv_prefaulted_bytes=self.prefault.bytes,
            spec_draft_forwards=getattr(getattr(self.proposer, "stats", None), "forwards", 0),
            pool_recorded=dict(self.bm.recorded),
        )


def _keep_prompt_logprobs(sched: SchedulerOutput, batch) -> None:
    """File a step's prompt logprobs (``ModelRunner._prompt_logprobs``) under each sequence's
    prompt positions: ``{prompt token: logprob, then its top-n}`` and the prompt token's rank."""
    for (i, first, count), (lp, ids, ranks) in zip(
        batch.prompt_rows, batch.prompt_out, strict=True
    ):
        seq = sched.scheduled[i].seq
        n = seq.params.prompt_logprobs or 0
        lp, ids, ranks = lp[:, : n + 1].tolist(), ids[:, : n + 1].tolist(), ranks.tolist()
        for j in range(count):
            d: dict[int, float] = {}
            for t, v in zip(ids[j], lp[j], strict=True):
                d.setdefault(t, v)
            seq.prompt_lps[first + j] = (d, ranks[j])


def _load_draft(config: EngineConfig, target):
    """The draft model of ``config.speculative_model`` (in the target's dtype, on its device),
    checked to share the target's vocabulary."""
    from shared.model.errors import CheckpointError
    from shared.model.loader import load_model

    try:
        draft = load_model(config.speculative_model, dtype=target.model.dtype, device=config.device)
    except (CheckpointError, OSError) as exc:  # one line at start, naming the setting
        raise CheckpointError(f"speculative_model {config.speculative_model}: {exc}") from None
    check_draft_model(target.config, draft.config, config.speculative_model)
    return draft
