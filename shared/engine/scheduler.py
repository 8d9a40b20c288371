"""Continuous batching under a per-step token budget (plain Python, no torch).

Scheduler contract
------------------
``schedule()`` decides one step: which sequences run and how many new tokens each computes.
Every token has one place: the first ``seq.num_computed_tokens`` of ``seq.token_ids`` have K/V
in the cache; a step computes the next ``num_new_tokens`` (plus ``num_draft_tokens``
speculative tokens taken from ``seq.draft_token_ids``). Decodes and prefill chunks share one
budget of ``max_num_batched_tokens``; running sequences go first (so a long prompt never stalls
them), then waiting ones in (priority, start tag, arrival) order, chunked to the budget that
is left. The start tag is the tenant's fair-queuing tag (`shared.engine.fair_queue`, cost = the
tokens to compute): within a priority class, tenants share admissions by weight instead of
first come, first served; with fair queuing off every tag is 0 (FIFO within a class).

Fair queuing also bounds what a light tenant's new request waits behind, which admission order
alone does not (`FairShare`): while two or more tenants are contending (requests of both in the
engine, or one arrived within ``window_s``) a step computes at most ``step_tokens`` prompt tokens
beside its decodes, since the step in flight is the one thing an arrival cannot jump (the maximum
packet size of fair queuing's delay bound); a running prompt chunk is scheduled in tag order beside
the waiting requests, the rest of its prompt tagged past the chunks it had (`_scheduled`), so a new
prompt of another tenant need not wait for every prompt the heavy tenant had started; and when the
running batch is full, a request whose tenant holds less than its weighted share of the
``max_num_seqs`` slots preempts the newest running sequence of the tenant furthest over its share
(same priority class or worse), instead of waiting for one of that tenant's sequences to finish.
A new request of a light tenant (running and waiting requests within its share of the slots,
`_light_arrival`) also gets a step of its own prompt (``lead``), even when the heavy tenant's
next request ranks first: its first token then waits for the step in flight and its own
prefill, not for a forward that also carries every running decode of the heavy tenant (and
the other light new requests waiting then, its tenant's or another light one's, join it whole
up to ``max_num_batched_tokens``: a burst of light arrivals starts together, as on an idle
engine, `_more_light`); never
two such steps in a row, so a stream of light arrivals at most doubles the running decodes'
inter-token time.
With ``slice_tokens`` the prompt chunks and the decodes go in separate steps (`_phase`): prompt
steps of at most ``slice_tokens`` until ``step_tokens`` prompt tokens ran, then a step of the
decodes; the prompts and decodes advance at the capped rate, and the step an arrival waits out
is one slice or one decode step instead of both in one forward.

Priorities: a lower number is more important. Running sequences are served best-first; when KV
runs out the worst running sequence (highest number, latest arrival) is preempted. A waiting
sequence of a strictly better class may preempt worse running ones for KV or a batch slot.
Preemption is "recompute" (free the blocks, re-prefill later: prefix caching usually makes that
cheap) or "swap" (the output lists the blocks to copy out before they are reused, and on resume
the fresh blocks to copy back into).

``schedule_decode_ahead(output)`` is the async-scheduling fast path: while the forward of a
pure-decode step runs, it schedules the same sequences for one more token each (their slot for
the token being sampled now is allocated here), or returns None when anything else could happen
(admissible waiting sequences, new arrivals, drafts, no free block). Blocks of a sequence that finishes
while a forward that writes to it is in flight (``in_flight``) are freed only when that forward
ends (``end_flight``), so no one else can be handed a block it is still writing.

``postprocess(output, sampled)`` takes the tokens chosen for each scheduled sequence (empty for a
prefill chunk that has not reached the end of its prompt; accepted drafts + one bonus token for a
speculative step), advances ``num_computed_tokens``, applies max_tokens / EOS / stop ids,
registers newly full blocks for prefix caching and frees finished sequences (unless
``hold_kv``). It returns the sequences that got tokens or finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.fair_queue import FairQueue
from shared.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # includes num_draft_tokens
    num_draft_tokens: int = 0

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens (a token gets sampled)."""
        real = self.num_new_tokens - self.num_draft_tokens
        return self.seq.num_computed_tokens + real >= self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    # external KV admitted this step: (block ids, their data [L, 2, n, bs, kvh, hd]), written
    # before the forward (`EngineKV.move`)
    load_in: list[tuple[list[int], object]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class Reservation:
    """Blocks admitted for a request whose KV is computed elsewhere and pushed here."""

    block_table: list[int]
    num_tokens: int
    num_cached: int  # leading tokens already in shared cached blocks (not rewritten)


def _rank(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.vstart, seq.arrival)


@dataclass(frozen=True)
class FairShare:
    """How fair queuing bounds a light tenant's wait (see the module doc); off with ``fair``."""

    step_tokens: int = 256
    """Prompt tokens a step computes beside its decodes while tenants contend (0: no cap)."""
    window_s: float = 5.0
    """A tenant whose last request arrived this recently still contends."""
    clock: Callable[[], float] = time.monotonic
    lead: bool = True
    """With the cap on: a new request of a light tenant (its running and waiting requests
    within its share of the slots) gets a step of its own prompt (up to ``step_tokens``; the
    other light new prompts waiting join it whole up to ``max_num_batched_tokens``), never
    two such steps in a row."""
    slice_tokens: int = 0
    """With the cap on: prompt chunks and decodes go in separate steps, a prompt step computing
    at most this many tokens and the decodes running after every ``step_tokens`` prompt tokens
    (0: a step carries the decodes and up to ``step_tokens`` prompt tokens together)."""


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        salt: bytes,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
        eos_token_ids: Seq[int] = (),
        fair: FairQueue | None = None,
        share: FairShare | None = None,
    ):
        self.bm = block_manager
        self.salt = salt
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: list[Sequence] = []  # WAITING and SWAPPED
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._budget = 0
        self.in_flight: set[int] = set()  # id() of sequences the running forward writes to
        self._deferred_free: list[Sequence] = []
        self.fair = fair if fair is not None else FairQueue()
        self.share = share if share is not None else FairShare()
        self._arrived: dict[str, float] = {}  # tenant -> when its last request arrived
        self.contended_steps = 0  # steps whose budget the contention cap lowered
        self.lead_steps = 0  # steps that ran only a light tenant's new prompt (`FairShare.lead`)
        self._led = False  # the last step was one of those
        self.split_steps = 0  # steps of only prompts or only decodes (`FairShare.slice_tokens`)
        self._since_decodes = 0  # prompt tokens of split steps since the decodes last ran
        # blocks of external KV (`Sequence.external`) taken in at admission, and those skipped
        # (held by then, or not continuing the local prefix)
        self.external_blocks = {"used": 0, "skipped": 0}
        self.share_preemptions = 0  # running sequences preempted for another tenant's share
        self.newly_admitted: list[Sequence] = []  # first admissions, drained by the engine
        # Requests whose KV a prefill instance pushes here, admitted at their first frame
        # (`admit_incoming`): their blocks are allocated then and they count toward
        # max_num_seqs (`batch_size`) until their decode starts (`take_incoming`).
        self.incoming: dict[str, Reservation] = {}

    # ----- intake ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.vstart = self.fair.tag(seq.tenant, seq.num_tokens)
        if self.fair.enabled:
            self._arrived[seq.tenant.name] = self.share.clock()
        self.waiting.append(seq)

    @property
    def batch_size(self) -> int:
        """Sequences holding a slot of the batch: running, and admitted with KV on its way."""
        return len(self.running) + len(self.incoming)

    def admit_incoming(
        self, request_id: str, num_tokens: int, hashes: Seq[bytes] = ()
    ) -> Reservation:
        """Admit a request whose prompt KV is pushed here, at its first frame: blocks for
        ``num_tokens`` tokens (the cached prefix of ``hashes`` shared, not rewritten), held
        from now on. It takes a batch slot like a running sequence, but never preempts one: the
        push is refused (MemoryError) when the blocks are not free, and the request is then
        computed here instead."""
        if request_id in self.incoming:
            raise ValueError(f"duplicate request id {request_id!r}")
        bs = self.bm.block_size
        cached = self.bm.find_cached_prefix(list(hashes)[: num_tokens // bs])
        table: list[int] = []
        if not self.bm.allocate_slots(table, num_tokens, cached):
            raise MemoryError(f"no KV blocks for {num_tokens} prefilled tokens")
        r = Reservation(table, num_tokens, len(cached) * bs)
        self.incoming[request_id] = r
        return r

    def take_incoming(self, request_id: str) -> Reservation:
        """The admitted blocks of a request whose pushed KV is complete (it starts running)."""
        r = self.incoming.pop(request_id, None)
        if r is None:
            raise KeyError(f"no KV reservation for {request_id!r}")
        return r

    def cancel_incoming(self, request_id: str) -> bool:
        """A push that failed or was cancelled: its blocks are freed."""
        r = self.incoming.pop(request_id, None)
        if r is not None:
            self.bm.free(r.block_table)
        return r is not None

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose blocks are already allocated and filled (prefilled elsewhere)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks (kept when ``hold_kv``; see :meth:`release`)."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.draft_token_ids = []
        if not seq.hold_kv or reason == "abort":
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        if id(seq) in self.in_flight:
            self._deferred_free.append(seq)  # the running forward still writes its last block
            return
        self.bm.free(seq.block_table)
        seq.block_table = []

    def end_flight(self) -> None:
        """The forward that wrote to ``in_flight`` is done: free what finished meanwhile."""
        self.in_flight.clear()
        for seq in self._deferred_free:
            self.release(seq)
        self._deferred_free.clear()

    # ----- schedule --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        led, self._led = self._led, False
        phase = None  # "prompt" or "decode": a split step (`FairShare.slice_tokens`)
        if self.share.step_tokens and self._contended():
            decodes = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1)
            cap = self.share.step_tokens + decodes  # the cap is on prompt tokens
            if cap < self._budget:
                self._budget = cap
                self.contended_steps += 1
            light = self._light_arrival() if self.share.lead and not led else None
            if light is not None:
                # its prompt alone: not behind the heavy tenant's decodes in the same forward
                budget, self._budget = self._budget, min(self._budget, self.share.step_tokens)
                if self.batch_size >= self.max_num_seqs:
                    self._evict_for_share(light, out)  # `_light_arrival` found the victim
                if self._admit(light, out):
                    self._led = True
                    self.lead_steps += 1
                    self._more_light(out)
                    return out
                self._budget = budget
            if self.share.slice_tokens:
                phase = self._phase()
                if phase == "prompt":
                    left = self.share.step_tokens - self._since_decodes
                    self._budget = min(self._budget, self.share.slice_tokens, left)
        self.running.sort(key=_rank)
        # With fair queuing, running prompt chunks take their turn in rank order beside the
        # waiting requests (the rest of a prompt is tagged past the chunks it had: `_scheduled`),
        # so a light tenant's new prompt goes before a heavy tenant's half-done ones; decodes
        # always go first.
        chunks: list[Sequence] = []
        i = 0
        while i < len(self.running) and self._budget > 0:
            seq = self.running[i]
            i += 1
            if self.fair.enabled and seq.num_tokens - seq.num_computed_tokens > 1:
                chunks.append(seq)
            elif phase == "prompt":
                continue  # the decodes run in a step of their own
            elif not self._continue(seq, out):
                break  # preempted itself: everything after it is gone too
        if phase != "decode":
            self._prompts(chunks, out)
        if phase == "prompt":
            if out.scheduled:
                self._since_decodes += out.num_batched_tokens
            else:  # nothing admissible: the decodes run now
                phase = None
                self._budget = self.max_num_batched_tokens
                i = 0
                while i < len(self.running):  # by index: a preempted victim leaves the list
                    seq = self.running[i]
                    i += 1
                    remaining = seq.num_tokens - seq.num_computed_tokens
                    if remaining == 1 and not self._continue(seq, out):
                        break
        if phase is not None:
            self.split_steps += 1
        if phase != "prompt":
            self._since_decodes = 0  # the decodes ran in this step
        return out

    def _more_light(self, out: SchedulerOutput) -> None:
        """Into a lead step, after its first: the next light new prompts in rank order (of its
        tenant or another light one), each whole, while they fit in ``max_num_batched_tokens``
        and a slot is free; the first that does not fit ends it. A burst of light arrivals
        then starts together, as it would on an idle engine, instead of one per lead step
        with a step of the heavy tenant's between each."""
        self._budget = self.max_num_batched_tokens - out.num_batched_tokens
        while self.batch_size < self.max_num_seqs:
            seq = self._light_arrival()
            if seq is None or seq.num_tokens - seq.num_computed_tokens > self._budget:
                return
            if not self._admit(seq, out):
                return

    def _phase(self) -> str | None:
        """What a step takes while tenants contend with ``share.slice_tokens`` on: "decode"
        (the decodes alone) once ``step_tokens`` prompt tokens ran since they last did,
        "prompt" (prompt chunks alone, at most ``slice_tokens``) before that, or None when
        only one kind of work is there (the capped step as without the split)."""
        decodes = False
        prompts = bool(self.waiting)
        for s in self.running:
            if s.num_tokens - s.num_computed_tokens == 1:
                decodes = True
            else:
                prompts = True
        if not (prompts and decodes):
            return None
        return "decode" if self._since_decodes >= self.share.step_tokens else "prompt"

    def _prompts(self, chunks: list[Sequence], out: SchedulerOutput) -> None:
        """Running prompt chunks and waiting requests in rank order, to the budget left."""
        blocked = {id(s) for s in out.preempted}
        for seq in sorted(chunks + self.waiting, key=_rank):
            if self._budget <= 0 or id(seq) in blocked:
                break
            if seq.status == SequenceStatus.RUNNING:
                if not self._continue(seq, out):
                    break
                continue
            if (
                self.batch_size >= self.max_num_seqs
                and not self._evict_worse(seq, out)
                and not self._evict_for_share(seq, out)
            ):
                break
            if not self._admit(seq, out):
                break  # head of line blocks the rest (tag order within a priority class)

    def _continue(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Schedule running ``seq``'s next tokens (preempting the worst running ones for KV);
        False when ``seq`` itself had to be preempted."""
        n = min(seq.num_tokens - seq.num_computed_tokens, self._budget)
        k = min(len(seq.draft_token_ids), self._budget - n) if n == 1 else 0
        total = seq.num_computed_tokens + n + k
        while not self.bm.allocate_slots(seq.block_table, total):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                break
        if seq.status != SequenceStatus.RUNNING:
            return False
        self._scheduled(out, ScheduledSeq(seq, n + k, k))
        return True

    def _scheduled(self, out: SchedulerOutput, sch: ScheduledSeq) -> None:
        """Add ``sch`` to the step. A prompt chunk that leaves part of its prompt for later is
        fair queuing's unit of service: the rest's start tag moves on by the chunk's cost, so
        another tenant's request arriving meanwhile (tagged with the virtual time) goes first."""
        out.scheduled.append(sch)
        self._budget -= sch.num_new_tokens
        seq = sch.seq
        if self.fair.enabled and sch.num_new_tokens > 1 and not sch.num_draft_tokens:
            self.fair.served(seq.vstart)
            if not sch.samples:
                seq.vstart += sch.num_new_tokens / seq.tenant.weight

    def schedule_decode_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Step i+1 for a pure-decode step i still running: the same sequences, one token each.

        Only when nothing else could change the batch: every sequence of ``prev`` is a plain
        decode that samples, they are exactly the running set, nobody waiting could be admitted
        (the batch is full and no waiting class is better than a running one), the budget and
        ``max_num_seqs`` hold, and each one's slot for the next position can be allocated
        without preempting. ``ScheduledSeq.start`` reads ``num_computed_tokens``, which is right
        once step i's ``postprocess`` has advanced it (the engine checks that before launching).
        """
        if not prev.scheduled or len(prev.scheduled) != len(self.running):
            return None
        if self.waiting:  # they could only run by taking a slot from a worse class
            if self.batch_size < self.max_num_seqs:
                return None
            worst = max(s.priority for s in self.running)
            if any(w.priority < worst for w in self.waiting):
                return None
            if self._share_victim(self.waiting) is not None:
                return None  # a tenant under its share would take a slot
            if self.share.step_tokens and self._contended():
                return None  # the step's budget is capped: schedule() decides it
        if len(prev.scheduled) > min(self.max_num_seqs, self.max_num_batched_tokens):
            return None
        running = {id(s) for s in self.running}
        for sch in prev.scheduled:
            seq = sch.seq
            if id(seq) not in running or sch.num_new_tokens != 1 or sch.num_draft_tokens:
                return None
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.draft_token_ids:
                return None
        out = SchedulerOutput()
        for sch in prev.scheduled:
            seq = sch.seq
            if not self.bm.allocate_slots(seq.block_table, seq.num_tokens + 1):
                return None  # slots taken so far stay with their sequences: harmless
            out.scheduled.append(ScheduledSeq(seq, 1, 0))
        return out

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Try to start a waiting or swapped sequence within the remaining budget."""
        swapped = seq.status == SequenceStatus.SWAPPED
        cached: list[int] = []
        hashes: list[bytes] = []
        ext = None  # (first block, count, data) of external KV taken in with the prefix
        # prompt_logprobs need every prompt token's logits: no prefix reuse until they are out
        # (vLLM skips the prefix cache for such requests too)
        if not swapped and (seq.params.prompt_logprobs is None or seq.prompt_lps_sent):
            hashes = seq.update_block_hashes(self.salt, self.bm.block_size)
            usable = (seq.num_tokens - 1) // self.bm.block_size  # always compute the last token
            cached = self.bm.find_cached_prefix(hashes[:usable])
            ext = self._external(seq, hashes[:usable], len(cached))
        start = seq.num_computed_tokens if swapped else len(cached) * self.bm.block_size
        if ext is not None:
            start += ext[1] * self.bm.block_size
        n = seq.num_tokens - start
        if n > self._budget:
            if self.chunked:
                n = self._budget
            elif n <= self.max_num_batched_tokens:
                return False  # fits a later step whole
            # else: unchunked prompt larger than any budget runs whole, exceeding it
        while not self.bm.allocate_slots(seq.block_table, start + n, cached):
            if not self._evict_worse(seq, out):
                return False
        if swapped:
            out.swap_in.append((seq, seq.block_table[: self.bm.blocks_for(start)]))
        else:
            if ext is not None:  # written before this step's forward, cached from now on
                first, n_ext, data = ext
                out.load_in.append((seq.block_table[first : first + n_ext], data))
                self.bm.cache_full_blocks(
                    seq.block_table, hashes, first, first + n_ext, computed=False
                )
            if seq.external is not None:
                used = ext[1] if ext is not None else 0
                self.external_blocks["used"] += used
                self.external_blocks["skipped"] += len(seq.external.hashes) - used
            seq.external = None
            seq.num_computed_tokens = start
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = start
                self.prefix_query_tokens += seq.num_tokens
                self.prefix_hit_tokens += start
                self.newly_admitted.append(seq)
            seq.num_committed_blocks = len(cached) + (ext[1] if ext is not None else 0)
        self.fair.served(seq.vstart)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._scheduled(out, ScheduledSeq(seq, n, 0))
        return True

    def _external(self, seq: Sequence, hashes: Seq[bytes], local: int):
        """The part of ``seq.external`` that continues the local cached prefix of ``local``
        blocks, as (first block index, block count, data), or None. Blocks it carries that the
        engine already holds, or that do not match the prompt's hashes, are skipped and
        counted; all of it is skipped when it does not start at or before the local prefix's
        end."""
        x = seq.external
        if x is None or not x.hashes:
            return None
        want = [h.hex() for h in hashes]
        try:
            first = want.index(x.hashes[0])
        except ValueError:
            first = len(want)
        m = 0  # blocks of it that match the prompt from ``first`` on
        while m < len(x.hashes) and first + m < len(want) and want[first + m] == x.hashes[m]:
            m += 1
        use = m - (local - first) if first <= local else 0
        if use <= 0:
            return None
        skip = local - first
        return local, use, x.kv[:, :, skip : skip + use]

    def _evict_worse(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt the worst running sequence if its class is strictly worse than ``seq``'s."""
        if not self.running:
            return False
        victim = max(self.running, key=_rank)
        if victim.priority <= seq.priority:
            return False
        self._preempt(victim, out)
        return True

    def _contended(self) -> bool:
        """Two or more tenants have requests here or sent one within ``share.window_s``."""
        if not self.fair.enabled:
            return False
        horizon = self.share.clock() - self.share.window_s
        self._arrived = {t: at for t, at in self._arrived.items() if at >= horizon}
        tenants = set(self._arrived)
        for seq in self.running:
            tenants.add(seq.tenant.name)
            if len(tenants) > 1:
                return True
        for seq in self.waiting:
            tenants.add(seq.tenant.name)
            if len(tenants) > 1:
                return True
        return len(tenants) > 1

    def _light_arrival(self) -> Sequence | None:
        """The request `FairShare.lead` gives a step of its own: the first in rank order, of
        the best waiting class, that is new (never computed) and whose tenant is light: its
        running and waiting requests together stay within its weighted share of the
        ``max_num_seqs`` slots (the shares taken among the running tenants and it), while
        another tenant runs. Its class must be at least as good as every running one, and a
        batch slot must be free or share preemption free one (`_share_victim`).

        Light is judged with the tenant's waiting requests: a heavy tenant's short requests
        finish fast and can leave it holding few slots while its backlog is long, and a lead
        step taken for it made the light tenant's next arrival wait out a step (no two lead
        steps run in a row). And the light request need not be first in rank: a light tenant
        whose previous request was just served has a start tag a request's cost past the
        virtual time, behind the heavy tenant's next one, which would then go first."""
        if not self.waiting:
            return None
        held, weight = self._running_shares()
        queued: dict[str, int] = {}
        for s in self.waiting:
            queued[s.tenant.name] = queued.get(s.tenant.name, 0) + 1
        best = min(s.priority for s in self.waiting)
        seq = None
        light: dict[str, bool] = {}
        for s in self.waiting:
            if s.priority != best or s.status != SequenceStatus.WAITING or s.num_preemptions:
                continue
            if seq is not None and _rank(s) >= _rank(seq):
                continue
            name = s.tenant.name
            if name not in light:
                over = self._overage(held, weight, s)(name)
                others = bool(weight.keys() - {name})  # alone: an ordinary step serves it
                light[name] = others and over + queued[name] <= 0
            if light[name]:
                seq = s
        if seq is None or any(s.priority < seq.priority for s in self.running):
            return None
        if self.batch_size >= self.max_num_seqs and self._share_victim([seq]) is None:
            return None
        return seq

    def _running_shares(self) -> tuple[dict[str, int], dict[str, float]]:
        """Running sequences per tenant, and each running tenant's weight."""
        held: dict[str, int] = {}
        weight: dict[str, float] = {}
        for s in self.running:
            held[s.tenant.name] = held.get(s.tenant.name, 0) + 1
            weight[s.tenant.name] = s.tenant.weight
        return held, weight

    def _overage(
        self, held: dict[str, int], weight: dict[str, float], seq: Sequence
    ) -> Callable[[str], float]:
        """Slots a tenant holds beyond its weighted share of ``max_num_seqs``, the shares
        taken among the running tenants and ``seq``'s."""
        weights = {**weight, seq.tenant.name: seq.tenant.weight}
        total = sum(weights.values())
        return lambda t: held.get(t, 0) - self.max_num_seqs * weights[t] / total

    def _share_victim(self, waiting: Seq[Sequence]) -> Sequence | None:
        """With the running batch full: the running sequence that the first of ``waiting``
        whose tenant is under its weighted share of the slots may preempt (the newest of the
        tenant furthest over its share, in that request's priority class or a worse one)."""
        if not self.fair.enabled or self.batch_size < self.max_num_seqs:
            return None
        held, weight = self._running_shares()
        for seq in waiting:
            name = seq.tenant.name
            over = self._overage(held, weight, seq)
            if over(name) + 1 > 0:
                continue  # taking one more slot would put this tenant over its share
            for t in sorted(held, key=over, reverse=True):
                if over(t) <= 0:
                    break
                mine = [
                    s for s in self.running if s.tenant.name == t and s.priority >= seq.priority
                ]
                if mine:
                    return max(mine, key=_rank)
        return None

    def _evict_for_share(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt a sequence of a tenant over its share of the batch for ``seq``'s tenant."""
        victim = self._share_victim([seq])
        if victim is None:
            return False
        self._preempt(victim, out)
        self.share_preemptions += 1
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take ``seq`` off the running list, refunding any budget it got this step."""
        for j, s in enumerate(out.scheduled):
            if s.seq is seq:
                self._budget += s.num_new_tokens
                del out.scheduled[j]
                break
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        seq.draft_token_ids = []
        out.preempted.append(seq)
        if self.preemption_mode == "swap" and seq.num_computed_tokens > 0:
            keep = self.bm.blocks_for(seq.num_computed_tokens)
            out.swap_out.append((seq, list(seq.block_table[:keep])))
            seq.status = SequenceStatus.SWAPPED
        else:
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = 0
        self.release(seq)
        self.waiting.append(seq)

    # ----- postprocess -----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: Seq[Seq[int]]) -> list[Sequence]:
        touched: list[Sequence] = []
        for sch, tokens in zip(out.scheduled, sampled, strict=True):
            seq = sch.seq
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            real = sch.num_new_tokens - sch.num_draft_tokens
            seq.num_computed_tokens += real + (max(len(tokens) - 1, 0) if tokens else 0)
            seq.draft_token_ids = []
            reason = None
            for t in tokens:
                seq.token_ids.append(t)
                reason = self._stop_reason(seq, t)
                if reason:
                    break
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            # Commit after the tokens are appended (accepted drafts must be in token_ids to be
            # hashed) and before a finish can release the blocks.
            self._commit_blocks(seq)
            if reason:
                self.finish(seq, reason)
            if tokens or seq.is_finished:
                touched.append(seq)
        return touched

    def postprocess_prefilled(self, seq: Sequence, first_token_id: int) -> None:
        """Append the first token of a sequence prefilled elsewhere (KV already written)."""
        seq.token_ids.append(first_token_id)
        self._commit_blocks(seq, computed=False)  # the prompt's KV was computed elsewhere
        reason = self._stop_reason(seq, first_token_id)
        if reason:
            self.finish(seq, reason)

    def _commit_blocks(self, seq: Sequence, computed: bool = True) -> None:
        full = seq.num_computed_tokens // self.bm.block_size
        if full > seq.num_committed_blocks:
            hashes = seq.update_block_hashes(self.salt, self.bm.block_size)
            seq.num_committed_blocks = self.bm.cache_full_blocks(
                seq.block_table, hashes, seq.num_committed_blocks, full, computed
            )

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_output_tokens < p.min_tokens:
            return None
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        return None
