"""Can the cluster serve a request? The gateway's readiness, for `/health` and the request path.

A request needs a tokenizer, a scheduler that answers, a live decode instance and, when the model
takes images and the gateway accepts them, a vision encoder. `Readiness` probes them all at once
(`strata.tok.ping`, `strata.vision.ping`, `strata.sched.instances`) and keeps the answer for
``ready_cache_s``, so a busy load balancer or a burst of requests costs at most one probe round
per period (concurrent callers share the round in flight). `summarize` is the pure core: probe
results plus which checks were ever ok -> a `ReadyState` with a message naming what is missing.

A probe that times out is told apart from one nobody answers: a role that was ok and is only slow
to answer (the scheduler under a burst of 500 streams on 2 cores) is ``busy``, which does not
refuse requests; the request path has its own timeouts and failover. No responders means the
role is gone, and requests get 503 at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from nats.aio.client import Client as NATS

from services.gateway.config import GatewayConfig
from shared import bus
from shared.protocol import subjects
from shared.protocol.errors import StrataError
from shared.protocol.health import Ping, Pong
from shared.protocol.sched import InstancesReply, InstancesRequest

CHECKS = ("tokenizer", "vision", "scheduler", "decode")
"""Every check, in the order a request meets them (and the message lists them)."""

# check -> (never ok since this gateway started, was ok and is not now)
_PHRASES = {
    "tokenizer": ("tokenizer not ready", "tokenizer not available"),
    "vision": ("vision encoder not ready", "vision encoder not available"),
    "scheduler": ("scheduler not ready", "scheduler not available"),
    "decode": ("no decode instance is ready", "no decode instance is available"),
}

BUSY = "busy"
"""A probe result: the role did not answer in time (it has responders, so it is there)."""
Probe = bool | None | Literal["busy"]


@dataclass(frozen=True)
class ReadyState:
    """One readiness verdict.

    ``status``: "ready" (every check ok), "starting" (each failing check has never been ok since
    the gateway started), or "degraded" (a check that was ok fails now). ``checks`` maps each
    check to "ok", "busy" (was ok, answered too slowly now: still ready), "starting", "down", or
    "unknown" (decode while the scheduler is not answering: nobody to ask). ``message`` names
    what is missing ("" when ready)."""

    status: str
    checks: dict[str, str]
    message: str

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def body(self) -> dict:
        """The `/health` JSON body."""
        return {"status": self.status, "checks": dict(self.checks)}


def summarize(results: dict[str, Probe], seen: set[str]) -> ReadyState:
    """Probe ``results`` (check -> ok; None = could not be asked; ``BUSY`` = timed out) and the
    checks ``seen`` ok before (updated in place with the ok ones) -> the verdict. A busy check
    that was ok before counts as up; one never seen ok is still starting."""
    checks: dict[str, str] = {}
    phrases: list[str] = []
    for name in CHECKS:
        if name not in results:
            continue
        ok = results[name]
        if ok == BUSY and name in seen:
            checks[name] = "busy"
        elif ok is True:
            seen.add(name)
            checks[name] = "ok"
        elif ok is None:
            checks[name] = "unknown"
        else:
            was = name in seen
            checks[name] = "down" if was else "starting"
            phrases.append(_PHRASES[name][int(was)])
    if not phrases and "unknown" not in checks.values():
        return ReadyState("ready", checks, "")
    status = "degraded" if "down" in checks.values() else "starting"
    prefix = "starting: " if status == "starting" else ""
    return ReadyState(status, checks, prefix + "; ".join(phrases))


class Readiness:
    """Probes the roles a request needs and caches the verdict (see the module doc)."""

    def __init__(
        self,
        nc: NATS,
        cfg: GatewayConfig,
        need_vision: bool,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.nc = nc
        self.cfg = cfg
        self.need_vision = need_vision
        self.clock = clock
        self.probes = 0  # probe rounds sent (each is 2-3 bus requests)
        self._seen: set[str] = set()
        self.was_ready = False  # some probe round found every check ok
        self._state: ReadyState | None = None
        self._at = 0.0
        self._task: asyncio.Future | None = None

    async def state(self, wait: bool = True) -> ReadyState:
        """The cached verdict while it is fresh, else a new probe round (shared with concurrent
        callers). With ``wait=False`` a stale *ready* verdict is returned at once and refreshed
        in the background, so the request path of a healthy cluster never waits on a probe."""
        if not self.nc.is_connected:  # probes would only time out while it reconnects
            return ReadyState(
                "degraded", {"nats": "down"}, "gateway lost its NATS connection (reconnecting)"
            )
        st = self._state
        if st is not None and self.clock() - self._at < self.cfg.ready_cache_s:
            return st
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._refresh())
        if st is not None and st.ready and not wait:
            return st
        return await asyncio.shield(self._task)  # a cancelled caller leaves the round running

    async def require(self) -> None:
        """Raise ``unavailable`` (503, Retry-After) naming what is missing unless ready."""
        st = await self.state(wait=False)
        if not st.ready:
            raise StrataError("unavailable", st.message, retry_after=self.cfg.unready_retry_after)

    async def require_started(self) -> None:
        """Raise ``unavailable`` (503, Retry-After) while the cluster has never been ready since
        this gateway started; once it was, never (a later outage is the request path's to
        report). For ``/v1/models``: vLLM answers it only once it can serve, so clients and
        scripts poll it as a readiness check and send their first request after its 200."""
        if self.was_ready:
            return
        st = await self.state()
        if st.status == "starting":
            raise StrataError("unavailable", st.message, retry_after=self.cfg.unready_retry_after)

    async def _refresh(self) -> ReadyState:
        self.probes += 1
        names = ["tokenizer", "scheduler"] + (["vision"] if self.need_vision else [])
        calls = [self._ping(subjects.TOK_PING), self._instances()]
        if self.need_vision:
            calls.append(self._ping(subjects.VISION_PING))
        got = await asyncio.gather(*calls)
        results: dict[str, Probe] = {}
        for name, res in zip(names, got, strict=True):
            if name != "scheduler":
                results[name] = res
            elif isinstance(res, InstancesReply):
                results["scheduler"] = True
                results["decode"] = any(i.alive and i.role == "decode" for i in res.instances)
            else:  # busy: decode as last seen (nobody else to ask); gone: unknown
                results["scheduler"] = res
                last = self._state.checks.get("decode") if self._state is not None else None
                known = res == BUSY and last in ("ok", "down", "starting")
                results["decode"] = last == "ok" if known else None
        st = summarize(results, self._seen)
        self.was_ready = self.was_ready or st.ready
        self._state, self._at = st, self.clock()
        return st

    async def _ping(self, subject: str) -> Probe:
        try:
            await bus.request(
                self.nc, subject, Ping(sender="gateway"), Pong, self.cfg.health_timeout
            )
        except StrataError as exc:
            return BUSY if exc.code == "timeout" else False
        return True

    async def _instances(self) -> InstancesReply | bool | str:
        """The scheduler's decode instances, or ``BUSY`` (timed out) / False (nobody answers)."""
        try:
            return await bus.request(
                self.nc,
                subjects.SCHED_INSTANCES,
                InstancesRequest(role="decode"),
                InstancesReply,
                self.cfg.health_timeout,
            )
        except StrataError as exc:
            return BUSY if exc.code == "timeout" else False
