"""`strata.sched.route`: request -> chosen prefill/decode instances, and scheduler state."""

from __future__ import annotations

from shared.protocol.base import Msg


class RouteRequest(Msg):
    request_id: str
    num_prompt_tokens: int
    block_hashes: list[str] = []
    priority: int = 0
    slo_class: str = "interactive"
    max_tokens: int = 16
    exclude: list[str] = []  # instances to avoid (failover)


class RouteReply(Msg):
    decode_instance: str
    decode_addr: str
    # Empty: the decode instance prefills the prompt itself (conditional disaggregation).
    prefill_instance: str = ""
    prefill_addr: str = ""
    transfer_mode: str = "direct"
    expected_cached_tokens: int = 0
    degrade_level: int = 0


class InstanceInfo(Msg):
    instance_id: str
    role: str
    incarnation: str
    grpc_addr: str
    alive: bool
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_free: int = 0


class InstancesReply(Msg):
    instances: list[InstanceInfo]


class SchedulerState(Msg):
    degrade_level: int = 0
    down: list[str] = []
    ts: float = 0.0
