"""Prefill -> decode hand-off between two engines in one thread, through the port's commands
(the code `EnginePort` runs on the engine thread): read the held KV on one engine, reserve,
write and commit it on the other."""

from __future__ import annotations

from shared.engine import commands as cmd
from shared.engine.engine import LLMEngine


def hand_over(a: LLMEngine, b: LLMEngine, rid: str, prompt, first_token: int, params) -> None:
    """Move held request ``rid``'s KV from ``a`` to ``b`` and start decoding it there."""
    got = cmd.ReadKV(rid).run(a)
    cmd.ReserveKV(rid, got.num_tokens).run(b)
    assert cmd.WriteKV(rid, range(got.blocks.shape[0]), 0, got.tokens()).run(b) == got.num_tokens
    cmd.AddPrefilled(rid, list(prompt), first_token, params).run(b)
