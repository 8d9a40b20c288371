"""`strata.load.<role>.<instance>`: periodic load report; doubles as the heartbeat."""

from __future__ import annotations

from shared.protocol.base import Msg


class LoadReport(Msg):
    instance_id: str
    role: str  # "prefill" | "decode" | "kvstore" | "vision" | "tokenizer"
    incarnation: str  # new on every process start
    grpc_addr: str = ""
    model: str = ""
    ts: float
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    max_model_len: int = 0
    block_size: int = 16
    # Prompt tokens queued and not yet prefilled (the scheduler's queue-time estimate).
    waiting_tokens: int = 0
    # Whether the instance's main NATS connection (submits, token streams) is up. The report
    # itself travels on a connection of its own, so a reconnecting instance still reports; the
    # scheduler keeps it a member but does not route to it. Default True: older senders parse.
    connected: bool = True
    # Tensor-parallel ranks serving this instance (`--tp`); one instance, one report either way.
    tp_size: int = 1
    # AutoPD: the instance is draining its current role before a role change (the scheduler
    # routes nothing more to it); the report after the change carries the new role.
    draining: bool = False
    # Mean engine step seconds over the last report interval (0: no step ran): one token of
    # every running stream, the autoscaler's TPOT signal (`services.scheduler.autoscale`).
    step_s: float = 0.0
