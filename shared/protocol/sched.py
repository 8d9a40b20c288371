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
    # Time-to-first-token target in ms; 0 = the scheduler's default for ``slo_class``.
    ttft_slo_ms: float = 0.0


class RouteReply(Msg):
    decode_instance: str
    decode_addr: str
    # Empty: the decode instance prefills the prompt itself (conditional disaggregation).
    prefill_instance: str = ""
    prefill_addr: str = ""
    transfer_mode: str = "direct"
    expected_cached_tokens: int = 0
    degrade_level: int = 0
    # Degradation level >= 1 trims optional work: cap on max_tokens (0 = no cap) and speculation.
    max_tokens_cap: int = 0
    speculation: bool = True
    predicted_ttft_ms: float = 0.0
    policy: str = ""


class InstanceInfo(Msg):
    instance_id: str
    role: str
    incarnation: str
    grpc_addr: str
    alive: bool
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_free: int = 0


class InstancesRequest(Msg):
    """`strata.sched.instances` request; ``role`` filters (empty = every role)."""

    role: str = ""


class InstancesReply(Msg):
    instances: list[InstanceInfo]


class SchedulerState(Msg):
    degrade_level: int = 0
    down: list[str] = []
    ts: float = 0.0
    live: list[str] = []
    cluster_load: float = 0.0
    scheduler_id: str = ""


class InstanceRecord(Msg):
    """One entry of the JetStream KV registry bucket ``strata_registry`` (key = instance_id)."""

    instance_id: str
    role: str
    incarnation: str
    grpc_addr: str = ""
    model: str = ""
    capacity: dict[str, float] = {}  # e.g. kv_blocks, max_num_seqs, max_model_len
    ts: float = 0.0
