"""Instance membership from load reports (the heartbeat) and registry records. Pure Python.

An instance is live from its first load report until ``down_after`` report intervals pass without
one; then it is declared down (once). A report with a new incarnation means the process restarted:
it is a new member and the old member's state is dropped (the caller drops its cache blocks).
A report that says the instance's main bus connection is down (``LoadReport.connected``) keeps it
a member (not down) but takes it out of `live` (routing) until a report says it reconnected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.table import RoleTable
from services.scheduler.types import InstanceView
from shared.protocol.load import LoadReport
from shared.protocol.sched import InstanceRecord

TRACKED_ROLES = ("prefill", "decode", "kvstore")


@dataclass
class Member:
    view: InstanceView
    incarnation: str
    last_seen: float
    alive: bool = True
    connected: bool = True  # its main bus connection, as its last report said
    record: InstanceRecord | None = None
    draining: bool = False  # AutoPD: flipping its role; not routable (`mark_draining`)
    drain_until: float = 0.0  # the scheduler's own mark holds until then (report in flight)


@dataclass
class Observed:
    """What one load report changed: ``restarted`` = new incarnation of a known instance."""

    instance_id: str
    new: bool = False
    restarted: bool = False
    revived: bool = False
    connection_changed: bool = False  # ``connected`` differs from the previous report's


@dataclass
class Membership:
    interval_s: float = 0.5
    down_after: int = 3
    long_instances: frozenset[str] = frozenset()
    members: dict[str, Member] = field(default_factory=dict)
    records: dict[str, InstanceRecord] = field(default_factory=dict)
    _live: dict[str, list[InstanceView]] = field(default_factory=dict)  # cache, by role
    _tables: dict[str, RoleTable] = field(default_factory=dict)  # numpy columns of _live

    @property
    def timeout_s(self) -> float:
        return self.interval_s * self.down_after

    def observe(self, r: LoadReport, now: float) -> Observed | None:
        """Apply a load report; None for roles the scheduler does not track."""
        if r.role not in TRACKED_ROLES:
            return None
        m = self.members.get(r.instance_id)
        out = Observed(r.instance_id)
        if m is None or m.incarnation != r.incarnation:
            out.new = m is None
            out.restarted = m is not None
            view = InstanceView(
                instance_id=r.instance_id,
                role=r.role,
                reserved_long=r.instance_id in self.long_instances,
            )
            m = Member(
                view=view,
                incarnation=r.incarnation,
                last_seen=now,
                record=self.records.get(r.instance_id),
            )
            self.members[r.instance_id] = m
            self._live.clear()
        elif not m.alive:
            out.revived = True
            self._live.clear()
        m.alive = True
        m.last_seen = now
        if m.connected != r.connected:
            m.connected = r.connected
            out.connection_changed = True
            self._live.clear()
        draining = r.draining or now < m.drain_until
        if draining != m.draining:
            m.draining = draining
            self._live.clear()
        v = m.view
        rec = self.records.get(r.instance_id)
        v.grpc_addr = r.grpc_addr or (rec.grpc_addr if rec else "")
        v.num_running, v.num_waiting = r.num_running, r.num_waiting
        v.waiting_tokens = r.waiting_tokens
        v.kv_blocks_free, v.kv_blocks_total = r.kv_blocks_free, r.kv_blocks_total
        v.prefill_tokens_per_s = r.prefill_tokens_per_s
        v.decode_tokens_per_s = r.decode_tokens_per_s
        v.step_s = r.step_s
        v.block_size = r.block_size
        v.pending_tokens = v.pending_requests = 0  # the report now covers what we routed
        self.touch(v)
        return out

    def tick(self, now: float) -> list[str]:
        """Declare down every live member silent for longer than the timeout; returns them."""
        down = []
        for iid, m in self.members.items():
            if m.alive and now - m.last_seen > self.timeout_s:
                m.alive = False
                down.append(iid)
        if down:
            self._live.clear()
        return sorted(down)

    def put_record(self, rec: InstanceRecord) -> None:
        self.records[rec.instance_id] = rec
        m = self.members.get(rec.instance_id)
        if m is not None and m.incarnation == rec.incarnation:
            m.record = rec
            m.view.grpc_addr = m.view.grpc_addr or rec.grpc_addr

    def mark_draining(self, instance_id: str, until: float) -> None:
        """AutoPD chose ``instance_id`` to flip: route nothing more to it from now on (until its
        own reports say it drains, or ``until`` passes: then its reports decide)."""
        m = self.members[instance_id]
        m.draining, m.drain_until = True, until
        self._live.clear()

    def remove(self, instance_id: str) -> bool:
        """A clean shutdown (registry record deleted): forget the member now."""
        self.records.pop(instance_id, None)
        self._live.clear()
        return self.members.pop(instance_id, None) is not None

    def touch(self, view: InstanceView) -> None:
        """Bring the role table's row of ``view`` in step after the view changed."""
        t = self._tables.get(view.role)
        if t is not None:
            t.refresh(view)

    def table(self, role: str) -> RoleTable:
        """Numpy columns over `live(role)` (same order), kept current by `touch`."""
        views = self.live(role)
        t = self._tables.get(role)
        if t is None or t.views is not views:
            t = self._tables[role] = RoleTable(views)
        return t

    def live(self, role: str) -> list[InstanceView]:
        """Routable instances of ``role`` (alive, connected, not draining) sorted by id (cached until
        membership changes; callers must not mutate the list)."""
        cached = self._live.get(role)
        if cached is None:
            cached = [
                m.view
                for _, m in sorted(self.members.items())
                if m.alive and m.connected and not m.draining and m.view.role == role
            ]
            self._live[role] = cached
        return cached

    def down(self) -> list[str]:
        return sorted(i for i, m in self.members.items() if not m.alive)
