"""`strata.sched.route`: request -> chosen prefill/decode instances, and scheduler state."""

from __future__ import annotations

from shared.protocol import subjects
from shared.protocol.base import Msg
from shared.protocol.work import DecodeWork, PrefillWork, WorkItem


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
    # Route and submit in one hop: the scheduler fills in the route fields (`routed_submit`) and
    # publishes this item to the chosen instance's submit subject with reply subject
    # `strata.req.<id>.ack`, so the instance acks to the gateway directly. The RouteReply still
    # comes back as usual (the gateway needs the chosen instances for failover).
    submit: WorkItem | None = None


class DegradeRules(Msg):
    """What each degradation level trims, owned by the scheduler and published with its state;
    the gateway applies the same rules before it routes (one owner, one set of numbers)."""

    # Level >= 1: max_tokens cap of the batch class (speculation is off for every class).
    batch_max_tokens_cap: int = 256
    # Level 3: only priorities <= this are admitted (lower number = more urgent).
    top_priority: int = 0
    # Retry-After of the 429 that levels 2 and 3 answer.
    retry_after_s: float = 5.0


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
    # Prompt blocks the scheduler's index places in the pool (kvstore DRAM / MinIO) as far as
    # its prefix walk went; 0 tells a decode instance that computes the prompt itself to skip
    # its pool lookup (`DecodeWork.pool_blocks`); -1: not known (an older scheduler).
    pool_blocks: int = -1


class InstanceInfo(Msg):
    instance_id: str
    role: str
    incarnation: str
    grpc_addr: str
    alive: bool
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_free: int = 0
    draining: bool = False  # AutoPD: flipping its role, not routed to


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
    rules: DegradeRules = DegradeRules()


class InstanceRecord(Msg):
    """One entry of the JetStream KV registry bucket ``strata_registry`` (key = instance_id)."""

    instance_id: str
    role: str
    incarnation: str
    grpc_addr: str = ""
    model: str = ""
    capacity: dict[str, float] = {}  # e.g. kv_blocks, max_num_seqs, max_model_len
    ts: float = 0.0


RETIRED = "retired"
"""`RoleChange.to_role` of a retirement (autoscaling): the instance drains its role, then exits
with `RETIRED_EXIT`, which a launcher does not restart."""
RETIRED_EXIT = 75


class RoleChange(Msg):
    """`subjects.role_change(instance)`: scheduler -> one prefill / decode instance (AutoPD,
    `services.scheduler.planner`): stop taking ``from_role`` work, let what runs finish, then
    serve ``to_role`` under a new incarnation. ``to_role`` "retired" (autoscaling,
    `services.scheduler.autoscale`): drain the same way, then exit. An instance whose
    incarnation or role differs (it restarted, or already flipped) ignores it."""

    instance_id: str
    incarnation: str
    from_role: str
    to_role: str
    scheduler_id: str = ""
    ts: float = 0.0


def routed_submit(item: WorkItem, route: RouteReply) -> tuple[str, PrefillWork | DecodeWork]:
    """The submit subject and the message the routed instance gets: a `PrefillWork` (with where
    the KV goes after prefill and the transfer mode) or, when decode prefills the prompt itself,
    a `DecodeWork`; ``max_tokens`` capped and speculation turned off by the degradation level."""
    sampling = item.sampling
    if route.max_tokens_cap and sampling.max_tokens > route.max_tokens_cap:
        sampling = sampling.model_copy(
            update={
                "max_tokens": route.max_tokens_cap,
                "min_tokens": min(sampling.min_tokens, route.max_tokens_cap),
            }
        )
    if not route.speculation and sampling.speculation:
        sampling = sampling.model_copy(update={"speculation": False})
    base = {f: getattr(item, f) for f in WorkItem.model_fields} | {"sampling": sampling}
    if route.prefill_instance:
        mode = "pool" if route.transfer_mode == "pool" else "direct"
        work = PrefillWork(
            **base,
            decode_instance=route.decode_instance,
            decode_addr=route.decode_addr,
            transfer_mode=mode,
        )
        return subjects.prefill_submit(route.prefill_instance), work
    return subjects.decode_submit(route.decode_instance), DecodeWork(
        **base, pool_blocks=route.pool_blocks
    )
