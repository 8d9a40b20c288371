"""Turns a scheduled step into model inputs, runs the model and owns the paged KV tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.engine import tp_kv
from shared.engine.kv_access import RawKV
from shared.engine.scheduler import SchedulerOutput
from shared.model.api import AttentionMetadata, KVCache, LayerCallback
from shared.model.ep import REBALANCE, rebalance_all


def dtype_of(name: str | None, default: torch.dtype) -> torch.dtype:
    if name is None:
        return default
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"EngineConfig.dtype: unknown torch dtype {name!r}")
    return dt


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    inputs_embeds: torch.Tensor | None
    logits_indices: torch.Tensor  # flat-batch rows whose logits are needed
    logit_rows: list[int]  # per scheduled seq: how many of those rows are its (0 = none)
    # prompt_logprobs: (scheduled index, first position, count) of prompt rows whose next
    # prompt token's logprob is wanted; their flat rows and target ids below.
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_index: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_top: int = 0  # the largest top-n among those sequences
    # per prompt_rows entry, after execute: (logprobs [count, 1 + top], ids, ranks [count])
    prompt_out: list | None = None
    # tensor parallel: rank 0 runs a layer callback whose KV reads every rank joins (tp_kv)
    layer_sync: bool = False


_PROMPT_SLICE = 256  # prompt rows per logits matrix when prompt logprobs are computed
_PY_SLOTS = 64  # new tokens of a sequence up to which positions and slots are worked out in Python


class ModelRunner(RawKV):
    """Holds the model and the KV cache; everything here is torch."""

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        self.model = model
        self.device = torch.device(model.device)
        self.block_size = block_size
        self.kv = KVCache.allocate(
            model.num_layers,
            num_blocks,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            kv_dtype,
            self.device,
            shared=getattr(model, "kv_shared", False),  # K and V one tensor (DeepSeek's latent)
        )

    @classmethod
    def follower(cls, model) -> ModelRunner:
        """A rank > 0's runner, sized by rank 0's engine (`announce`); then run `follow`."""
        num_blocks, block_size, kv_dtype, quantization = model.tp.broadcast(None)
        if quantization == "int8":
            from shared.engine.quant import quantize_model_

            quantize_model_(model)
        return cls(model, num_blocks, block_size, kv_dtype)

    def announce(self, quantization: str | None) -> None:
        """Rank 0 of a tensor-parallel model: tell the followers how to build their runners."""
        tp = getattr(self.model, "tp", None)
        if tp is not None and tp.rank == 0 and tp.world_size > 1:
            with tp.lock:
                tp.broadcast((self.kv.k.shape[1], self.block_size, self.kv.k.dtype, quantization))

    @staticmethod
    def bytes_per_block(model, block_size: int, kv_dtype: torch.dtype) -> int:
        return KVCache.bytes_per_block(
            model.num_layers,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            kv_dtype,
            shared=getattr(model, "kv_shared", False),
        )

    @property
    def kv_bytes(self) -> int:
        tensors = 1 if self.kv.v is self.kv.k else 2
        return tensors * self.kv.k.numel() * self.kv.k.element_size()

    # ----- inputs --------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        """The flat batch of a step. Positions and slots are plain ints, one ``torch.tensor``
        each at the end: a decode step of 16 sequences built them as 4-5 small torch ops per
        sequence (~1 ms per step on the benchmark CPU, docs/benchmarks/engine.md)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        qlens: list[int] = []
        logits_idx: list[int] = []
        logit_rows: list[int] = []
        splices: list[tuple[int, torch.Tensor]] = []
        prompt_rows: list[tuple[int, int, int]] = []
        p_idx: list[int] = []
        p_tgt: list[int] = []
        top = 0
        for i, sch in enumerate(out.scheduled):
            seq, start, n = sch.seq, sch.start, sch.num_new_tokens
            toks = seq.token_ids[start:] + seq.draft_token_ids[: sch.num_draft_tokens]
            toks = toks[:n]
            base = len(ids)
            ids += toks
            table = seq.block_table
            if n <= _PY_SLOTS:
                pos += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            else:  # a prompt chunk: vectorised
                p = torch.arange(start, start + n)
                pos += p.tolist()
                slots += (torch.tensor(table, dtype=torch.long)[p // bs] * bs + p % bs).tolist()
            qsl.append(qsl[-1] + n)
            ctx.append(start + n)
            qlens.append(n)
            k = sch.num_draft_tokens + 1 if sch.samples else 0
            logits_idx += range(base + n - k, base + n)
            logit_rows.append(k)
            want = seq.params.prompt_logprobs
            last = min(start + n, seq.num_prompt_tokens - 1)  # rows that predict a prompt token
            if want is not None and not seq.prompt_lps_sent and last > start:
                prompt_rows.append((i, start + 1, last - start))
                p_idx += range(base, base + last - start)
                p_tgt += seq.token_ids[start + 1 : last + 1]
                top = max(top, want)
            for m in seq.mm_inputs:
                lo, hi = max(start, m.offset), min(start + n, m.offset + m.length)
                if lo < hi:
                    splices.append((base + lo - start, m.embeds[lo - m.offset : hi - m.offset]))
        tables = _block_tables(out)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=qlens,
            context_lens_list=ctx,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        embeds = None
        if splices:
            embeds = self.model.embed_tokens(input_ids).clone()
            for at, e in splices:
                embeds[at : at + e.shape[0]] = e.to(embeds.device, embeds.dtype)
        batch = PreparedBatch(
            input_ids,
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            embeds,
            torch.tensor(logits_idx, dtype=torch.long, device=dev),
            logit_rows,
        )
        if prompt_rows:
            batch.prompt_rows, batch.prompt_top = prompt_rows, top
            batch.prompt_index = torch.tensor(p_idx, dtype=torch.long, device=dev)
            batch.prompt_targets = torch.tensor(p_tgt, dtype=torch.long, device=dev)
        return batch

    def prepare_decode_ahead(self, out: SchedulerOutput) -> PreparedBatch:
        """Inputs of a pure-decode step scheduled before the previous step's tokens exist: each
        sequence computes position ``num_tokens`` (the token being sampled now, filled into
        ``input_ids`` later by :meth:`fill_ahead_tokens`)."""
        bs, dev = self.block_size, self.device
        pos = [s.seq.num_tokens for s in out.scheduled]
        tables = _block_tables(out)
        slots = [
            s.seq.block_table[p // bs] * bs + p % bs
            for s, p in zip(out.scheduled, pos, strict=True)
        ]
        n = len(pos)
        ctx = [p + 1 for p in pos]
        meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=[1] * n,
            context_lens_list=ctx,
        )
        return PreparedBatch(
            torch.zeros(n, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            None,
            torch.arange(n, device=dev),
            [1] * n,
        )

    @staticmethod
    def fill_ahead_tokens(batch: PreparedBatch, out: SchedulerOutput) -> None:
        """Put each sequence's newest token (sampled after the batch was prepared) in place."""
        last = [s.seq.token_ids[-1] for s in out.scheduled]
        batch.input_ids.copy_(torch.tensor(last, dtype=torch.long))

    @torch.inference_mode()
    def execute(
        self, batch: PreparedBatch, layer_callback: LayerCallback | None = None
    ) -> torch.Tensor:
        """Forward the flat batch; float32 logits for ``batch.logits_indices`` rows.

        Under tensor parallelism (a model cut by `shared.model.parallel.shard_model`) rank 0
        first hands the batch to the other ranks, which run it in `follow`."""
        tp = getattr(self.model, "tp", None)
        if tp is None or tp.rank != 0:
            return self._forward(batch, layer_callback, prompt=True)
        with tp.lock:
            # on the host: a CUDA tensor would be unpickled onto rank 0's GPU on every rank
            sent = tp_kv.on_device(batch, torch.device("cpu"))
            sent.layer_sync = layer_callback is not None
            tp.broadcast(sent)
            if layer_callback is not None:  # its KV reads (layer-wise push) run on every rank
                layer_callback = tp_kv.layer_sync(tp, layer_callback)
            tp_kv.forward_scope(True)
            try:
                return self._forward(batch, layer_callback, prompt=True)
            finally:
                tp_kv.forward_scope(False)

    def rebalance_experts(self) -> list[tuple[float, float]]:
        """Expert parallelism: move every MoE layer's experts to the placement that balances the
        rows routed since the last call (`shared.model.ep.rebalance_all`), on every rank; call
        between steps. Per layer the expected (before, after) max/mean rank load; [] without
        expert parallelism."""
        tp = getattr(self.model, "tp", None)
        if tp is None or tp.shards_kv:
            return []
        with tp.lock:
            tp.broadcast(REBALANCE)
            return rebalance_all(self.model)

    def follow(self) -> int:
        """A rank > 0's loop: run each batch (or KV operation, `shared.engine.tp_kv`) rank 0
        broadcasts until it sends ``None``; returns how many batches ran."""
        tp, n = self.model.tp, 0
        while (msg := tp.broadcast(None)) is not None:
            if isinstance(msg, tp_kv.KVOp):
                tp_kv.follow(self, tp, msg)
                continue
            if msg == REBALANCE:
                rebalance_all(self.model)
                continue
            sync = (lambda _: tp_kv.follow_layer(self, tp)) if msg.layer_sync else None
            self._forward(tp_kv.on_device(msg, self.device), sync)
            n += 1
        return n

    def _forward(
        self,
        batch: PreparedBatch,
        layer_callback: LayerCallback | None = None,
        prompt: bool = False,
    ):
        hidden = self.model.forward(
            batch.input_ids,
            batch.positions,
            batch.meta,
            self.kv,
            inputs_embeds=batch.inputs_embeds,
            layer_callback=layer_callback,
        )
        if prompt and batch.prompt_rows:
            batch.prompt_out = self._prompt_logprobs(hidden, batch)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: PreparedBatch) -> list:
        """Per ``batch.prompt_rows`` entry: the log-softmax of each row's logits at the next
        prompt token (column 0) and at the top-n (columns 1..), their ids, and the prompt
        token's rank (1 = most likely). Logits are made ``_PROMPT_SLICE`` rows at a time, so a
        long prompt chunk never holds a whole ``[tokens, vocab]`` matrix."""
        lps, ids, ranks = [], [], []
        for a in range(0, batch.prompt_index.numel(), _PROMPT_SLICE):
            rows = batch.prompt_index[a : a + _PROMPT_SLICE]
            tgt = batch.prompt_targets[a : a + _PROMPT_SLICE, None]
            logp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
            chosen = logp.gather(1, tgt)
            top_v, top_i = logp.topk(batch.prompt_top, dim=-1)
            lps.append(torch.cat([chosen, top_v], dim=1))
            ids.append(torch.cat([tgt, top_i], dim=1))
            ranks.append((logp > chosen).sum(dim=1) + 1)
        lp, tid, rk = (torch.cat(x).cpu() for x in (lps, ids, ranks))
        out, at = [], 0
        for _, _, count in batch.prompt_rows:
            out.append((lp[at : at + count], tid[at : at + count], rk[at : at + count]))
            at += count
        return out


def _block_tables(out: SchedulerOutput) -> torch.Tensor:
    """``[num_seqs, max_blocks]`` block ids of the scheduled sequences, zero-padded."""
    width = max(len(s.seq.block_table) for s in out.scheduled)
    return torch.tensor(
        [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in out.scheduled],
        dtype=torch.long,
    )
