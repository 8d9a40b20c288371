"""The scheduler core: membership + prefix index + policy + admission/degradation. No NATS.

Feed it load reports, KV events and registry records; call `tick()` periodically (down detection,
degradation level, the `SchedulerState` to publish); call `route()` per request.
"""

from __future__ import annotations

import logging
import time

from services.scheduler import metrics
from services.scheduler.autoscale import RETIRED, Autoscaler
from services.scheduler.config import SchedulerConfig
from services.scheduler.degrade import Degrader, cluster_load
from services.scheduler.membership import Membership
from services.scheduler.planner import ROLES, RoleLoad, RolePlanner
from services.scheduler.policies import Policy, make_policy
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.rules import apply_kv_event, expect_routed, request_view
from services.scheduler.types import ClusterState, RequestView
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sched import (
    DegradeRules,
    InstanceInfo,
    InstanceRecord,
    InstancesReply,
    RoleChange,
    RouteReply,
    RouteRequest,
    SchedulerState,
)

log = logging.getLogger(__name__)


class SchedulerCore:
    def __init__(self, cfg: SchedulerConfig, policy: Policy | None = None) -> None:
        self.cfg = cfg
        self.cost = cfg.cost_model()
        self.policy = policy or make_policy(cfg.policy, self.cost, **cfg.policy_options())
        self.members = Membership(
            interval_s=cfg.load_interval,
            down_after=cfg.down_after,
            long_instances=cfg.long_instance_set(),
        )
        self.index = PrefixIndex()
        self.kv_seq = 0  # last KV-event stream sequence applied to the index
        self.degrader = Degrader(cfg.thresholds())
        self.load = 0.0
        self.block_size = cfg.block_size
        self.planner = (
            RolePlanner(cfg.planner_config(), cfg.prefill_tokens_per_s) if cfg.autopd else None
        )
        self.autoscaler = Autoscaler(cfg.scale_config()) if cfg.autoscale else None

    # --- inputs ---------------------------------------------------------------------------------
    def on_load(self, report: LoadReport, now: float | None = None) -> None:
        obs = self.members.observe(report, time.monotonic() if now is None else now)
        if obs is None:
            return
        if obs.restarted:
            # A new incarnation: the old process's cache is gone.
            self.index.new_incarnation(report.instance_id, report.incarnation)
        if obs.connection_changed:
            log.warning(
                "instance %s %s",
                report.instance_id,
                "reconnected to the bus: routable again"
                if report.connected
                else "lost its main bus connection: not routable until it reconnects",
            )
        if obs.new or obs.restarted:
            view = self.members.members[report.instance_id].view
            view.cached_blocks = self.index.blocks_of(report.instance_id)
            self.members.touch(view)
        if report.role in ("prefill", "decode") and report.block_size:
            self.block_size = report.block_size

    def on_kv_event(self, ev: KVEvent) -> bool:
        m = self.members.members.get(ev.instance_id)
        ok = apply_kv_event(self.index, ev, m.view if m is not None else None)
        metrics.KV_EVENTS.labels(status="applied" if ok else "stale").inc()
        if ok and m is not None:
            self.members.touch(m.view)
        return ok

    def on_record(self, rec: InstanceRecord) -> None:
        self.members.put_record(rec)

    def on_deregister(self, instance_id: str) -> None:
        if self.members.remove(instance_id):
            self.index.drop_instance(instance_id)

    def tick(self, now: float | None = None) -> tuple[SchedulerState, list[str]]:
        """Down detection and degradation; returns the state to publish and the newly down."""
        now = time.monotonic() if now is None else now
        newly_down = self.members.tick(now)
        if newly_down:
            metrics.DECLARED_DOWN.inc(len(newly_down))
        pre = self.members.live("prefill")
        dec = self.members.live("decode")
        self.load = cluster_load(
            [self.cost.queue_s(p) for p in pre],
            [d.kv_used_frac for d in dec],
            [min(1.0, d.batch / self.cfg.batch_norm) for d in dec],
            self.cfg.queue_target_s,
        )
        level = self.degrader.update(self.load, now)
        live = sorted(i for i, m in self.members.members.items() if m.alive)
        metrics.DEGRADE_LEVEL.set(level)
        metrics.CLUSTER_LOAD.set(self.load)
        metrics.DOWN_INSTANCES.set(len(self.members.down()))
        for role in ("prefill", "decode", "kvstore"):
            metrics.LIVE_INSTANCES.labels(role=role).set(len(self.members.live(role)))
        metrics.PREFIX_INDEX_BLOCKS.set(len(self.index))
        state = SchedulerState(
            degrade_level=level,
            down=self.members.down(),
            ts=time.time(),
            live=live,
            cluster_load=round(self.load, 4),
            scheduler_id=self.cfg.instance_id,
            rules=self.rules,
        )
        return state, newly_down

    def plan_roles(self, now: float | None = None) -> list[RoleChange]:
        """AutoPD (one call per state tick): the role changes to order now. The chosen instance
        is marked draining at once, so nothing more is routed to it."""
        if self.planner is None:
            return []
        now = time.monotonic() if now is None else now
        out = []
        for f in self.planner.tick(self.role_loads()):
            self.members.mark_draining(f.instance_id, now + 4 * self.members.timeout_s)
            metrics.AUTOPD_DECISIONS.labels(f.from_role, f.to_role).inc()
            log.info("AutoPD: %s %s -> %s", f.instance_id, f.from_role, f.to_role)
            out.append(
                RoleChange(
                    instance_id=f.instance_id,
                    incarnation=self.members.members[f.instance_id].incarnation,
                    from_role=f.from_role,
                    to_role=f.to_role,
                    scheduler_id=self.cfg.instance_id,
                    ts=time.time(),
                )
            )
        return out

    def role_loads(self) -> list[RoleLoad]:
        """The prefill and decode members the planners see: alive and connected."""
        return [
            RoleLoad(
                iid,
                m.view.role,
                queued_tokens=m.view.queued_tokens,
                num_running=m.view.num_running,
                num_waiting=m.view.num_waiting,
                prefill_tokens_per_s=m.view.prefill_tokens_per_s,
                draining=m.draining,
                step_s=m.view.step_s,
            )
            for iid, m in sorted(self.members.members.items())
            if m.alive and m.connected and m.view.role in ROLES
        ]

    def plan_scale(self, now: float | None = None) -> list[RoleChange]:
        """Autoscaling (one call per state tick): exports each role's need
        (`strata_scheduler_desired_instances`, what a launcher or HPA starts instances up to)
        and returns the retirements to order now: a `RoleChange` to ``RETIRED``, after which
        the instance drains and exits. It is marked draining at once, so nothing more is routed
        to it. An "add" is the raised need alone: this scheduler starts no process; so is a
        "retire" with ``autoscale_retire`` off (Kubernetes removes a pod, which drains)."""
        if self.autoscaler is None:
            return []
        now = time.monotonic() if now is None else now
        actions = self.autoscaler.tick(self.role_loads())
        for role, need in self.autoscaler.need.items():
            metrics.DESIRED_INSTANCES.labels(role=role).set(need)
        out = []
        for a in actions:
            metrics.SCALE_DECISIONS.labels(a.role, a.action).inc()
            log.info("autoscale: %s %s (need %d) %s", a.action, a.role, a.need, a.instance_id)
            if a.action != "retire" or not self.cfg.autoscale_retire:
                continue  # an add, or a retirement left to Kubernetes: the lower need alone
            self.members.mark_draining(a.instance_id, now + 3600.0)
            out.append(
                RoleChange(
                    instance_id=a.instance_id,
                    incarnation=self.members.members[a.instance_id].incarnation,
                    from_role=a.role,
                    to_role=RETIRED,
                    scheduler_id=self.cfg.instance_id,
                    ts=time.time(),
                )
            )
        return out

    @property
    def rules(self) -> DegradeRules:
        """The degradation rules this scheduler enforces and publishes for the gateways."""
        return DegradeRules(
            batch_max_tokens_cap=self.cfg.batch_max_tokens_cap,
            top_priority=self.cfg.top_priority,
            retry_after_s=self.cfg.retry_after_s,
        )

    # --- decisions ------------------------------------------------------------------------------
    def route(self, req: RouteRequest, now: float | None = None) -> RouteReply:
        """Route one request (``now``: monotonic seconds, for expectations; the clock if None)."""
        start = time.perf_counter()
        outcome = "error"
        try:
            reply = self._route(req, time.monotonic() if now is None else now)
            outcome = "self_prefill" if not reply.prefill_instance else "disaggregated"
            return reply
        except StrataError as exc:
            outcome = exc.code
            raise
        finally:
            name = self.policy.name
            metrics.DECISIONS.labels(policy=name, outcome=outcome).inc()
            metrics.DECISION_LATENCY.labels(policy=name).observe(time.perf_counter() - start)

    def _route(self, req: RouteRequest, now: float) -> RouteReply:
        level = self.degrader.level
        self._admit(req, level)
        excl = frozenset(req.exclude)
        decode = self.members.live("decode")
        prefill = self.members.live("prefill")
        if excl:  # failover: rare, so filtered lists (the policy builds its own tables)
            decode = [d for d in decode if d.instance_id not in excl]
            prefill = [p for p in prefill if p.instance_id not in excl]
            state = ClusterState(prefill=prefill, decode=decode)
        else:
            state = ClusterState(
                prefill=prefill,
                decode=decode,
                prefill_table=self.members.table("prefill"),
                decode_table=self.members.table("decode"),
            )
        if not decode:
            raise StrataError("unavailable", "no decode instance is available")
        view = self.request_view(req, now)
        d = self.policy.choose(view, state)
        if d.path:
            metrics.PREFILL_PATHS.labels(policy=self.policy.name, path=d.path).inc()
        if d.reject:
            raise StrataError(
                "overloaded",
                f"request would miss its TTFT SLO: {d.reason}",
                retry_after=round(d.retry_after_s, 3),
            )
        dec = self.members.members[d.decode_instance].view
        target = self.members.members[d.prefill_instance].view if d.prefill_instance else dec
        target.pending_tokens += max(0, req.num_prompt_tokens - d.cached_tokens)
        target.pending_requests += 1
        if target is not dec:
            dec.pending_requests += 1
            self.members.touch(dec)
        self.members.touch(target)
        expect_routed(self.index, target.instance_id, req.block_hashes, now, self.cfg.expect_ttl_s)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s: prefill=%s decode=%s cached=%d ttft=%.3fs (%s)",
                req.request_id,
                d.prefill_instance or "-",
                d.decode_instance,
                d.cached_tokens,
                d.predicted_ttft_s,
                d.reason,
            )
        trim = level >= 1 and req.slo_class == "batch"
        return RouteReply(
            decode_instance=dec.instance_id,
            decode_addr=dec.grpc_addr,
            prefill_instance=target.instance_id if d.prefill_instance else "",
            prefill_addr=target.grpc_addr if d.prefill_instance else "",
            transfer_mode=self.cfg.transfer_mode,
            expected_cached_tokens=d.cached_tokens,
            degrade_level=level,
            max_tokens_cap=self.cfg.batch_max_tokens_cap if trim else 0,
            speculation=level == 0,
            predicted_ttft_ms=round(d.predicted_ttft_s * 1000, 3),
            policy=self.policy.name,
            pool_blocks=sum(1 for t in view.pool_tiers if t is not None),
        )

    def _admit(self, req: RouteRequest, level: int) -> None:
        if level >= 3 and req.priority > self.cfg.top_priority:
            raise StrataError(
                "overloaded",
                f"degradation level {level}: only priority <= {self.cfg.top_priority} admitted",
                retry_after=self.cfg.retry_after_s,
            )
        if level >= 2 and req.slo_class == "batch":
            raise StrataError(
                "overloaded",
                f"degradation level {level}: batch class refused",
                retry_after=self.cfg.retry_after_s,
            )

    def request_view(self, req: RouteRequest, now: float | None = None) -> RequestView:
        now = time.monotonic() if now is None else now
        m = self.index.lookup(req.block_hashes, now) if req.block_hashes else None
        slo_ms = req.ttft_slo_ms or (
            self.cfg.slo_batch_ms if req.slo_class == "batch" else self.cfg.slo_interactive_ms
        )
        return request_view(
            req.request_id,
            req.num_prompt_tokens,
            m,
            self.block_size,
            slo_ms / 1000.0,
            priority=req.priority,
            slo_class=req.slo_class,
            max_tokens=req.max_tokens,
            exclude=frozenset(req.exclude),
        )

    def instances(self, role: str = "") -> InstancesReply:
        out = []
        for iid in sorted(self.members.members):
            m = self.members.members[iid]
            v = m.view
            if role and v.role != role:
                continue
            out.append(
                InstanceInfo(
                    instance_id=iid,
                    role=v.role,
                    incarnation=m.incarnation,
                    grpc_addr=v.grpc_addr,
                    alive=m.alive,
                    num_running=v.num_running,
                    num_waiting=v.num_waiting,
                    kv_blocks_free=v.kv_blocks_free,
                    draining=m.draining,
                )
            )
        return InstancesReply(instances=out)
