"""The gateway's audit log: one structured line per API request, REST and NATS alike.

Every request that reaches `GatewayService.open` leaves exactly one entry, whether it was
refused there (401, 400, 429, 503: ``outcome`` is the error code) or ran (``outcome`` is the
finish reason of its choices, ``aborted`` when the client went away or cancelled, or the error
code a stream ended with). An entry holds who (the API key's *name*, never the key; and the
NATS client identity, the subject token nats-server authenticated, where it came over NATS), which model and route, the request id, prompt and
completion token counts, the outcome, the HTTP status, the latency and the time to first
token (``ttft_ms``: arrival to the first token at this gateway). The prompt is never in
it unless the operator opts in (``STRATA_AUDIT_PROMPTS=true``).

Entries go to two sinks, each optional:

- a JSON-lines file (``STRATA_AUDIT_FILE``; mode 0600, appended; `strata up` writes
  ``<data-dir>/logs/audit.jsonl``);
- the JetStream stream ``STRATA_AUDIT`` (subjects ``strata.audit.>``; each gateway publishes on
  ``strata.audit.<instance>``) with bounded retention (``STRATA_AUDIT_MAX_AGE`` seconds and
  ``STRATA_AUDIT_MAX_BYTES``, oldest discarded), so every gateway's entries land in one place
  that survives the gateways. Publishing is off the request path: entries wait in a bounded
  queue; what does not fit is counted (``strata_audit_dropped_total``), never blocks a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig
from nats.js.errors import NotFoundError
from prometheus_client import Counter

log = logging.getLogger(__name__)

STREAM = "STRATA_AUDIT"
SUBJECTS = "strata.audit.>"
QUEUE_MAX = 10_000

ENTRIES = Counter("strata_audit_entries_total", "Audit entries recorded", ["sink"])
DROPPED = Counter("strata_audit_dropped_total", "Audit entries the JetStream queue could not hold")


def subject(instance: str) -> str:
    return f"strata.audit.{instance or 'gateway'}"


@dataclass
class AuditEntry:
    """One request's audit record (the JSON line and the JetStream message body)."""

    ts: float
    request_id: str
    identity: str
    transport: str  # "http" or "nats"
    kind: str  # chat, completion, responses, messages, ...
    model: str
    outcome: str
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None  # arrival to the first token here; None when none came
    gateway: str = ""
    client: str = ""  # the NATS API client identity (its subject token); "" over REST
    prompt: Any = field(default=None)  # only with STRATA_AUDIT_PROMPTS

    def to_json(self) -> str:
        d = asdict(self)
        if d["prompt"] is None:
            del d["prompt"]
        return json.dumps(d, separators=(",", ":"), ensure_ascii=False)


class AuditLog:
    """Records `AuditEntry` lines to the file and queues them for the JetStream stream."""

    def __init__(
        self, path: str = "", include_prompts: bool = False, gateway: str = "", stream: bool = True
    ):
        self.include_prompts = include_prompts
        self.gateway = gateway
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.chmod(path, 0o600)
            self._file = os.fdopen(fd, "a", buffering=1, encoding="utf-8")  # line-buffered
        self._queue: asyncio.Queue[str] | None = asyncio.Queue(QUEUE_MAX) if stream else None
        self._task: asyncio.Task | None = None

    def start(self, js, instance: str, max_age: float, max_bytes: int) -> None:
        """Publish the queued entries to the stream from a task of this loop (`publish`)."""
        self._task = asyncio.create_task(self.publish(js, instance, max_age, max_bytes))

    def refused(self, kind: str, body: Any, request_id: str, exc, who: dict, arrival: float):
        """Record a request refused before it ran (``exc``: its `StrataError`)."""
        self.record(
            AuditEntry(
                ts=time.time(),
                request_id=request_id,
                kind=kind,
                model=str(body.get("model") or "") if isinstance(body, dict) else "",
                outcome=exc.code,
                status=exc.http_status,
                latency_ms=_ms_since(arrival),
                prompt=prompt_of(body),
                **who,
            )
        )

    def finished(self, run, who: dict) -> None:
        """Record a run at its close: its finish reasons, else the error a stream ended with,
        else ``aborted`` (the client went away or cancelled)."""
        reasons = sorted({c.finish_reason for c in run.choices if c.finish_reason})
        if run.error is not None:
            outcome, status = run.error.code, run.error.http_status
        elif all(c.finish_reason for c in run.choices):
            outcome, status = ",".join(reasons), 200
        else:
            outcome, status = "aborted", 499
        self.record(
            AuditEntry(
                ts=time.time(),
                request_id=run.request_id,
                kind=run.fmt.kind,
                model=run.fmt.model,
                outcome=outcome,
                status=status,
                prompt_tokens=sum(len(p.prompt_token_ids) for p in run.prepared),
                completion_tokens=sum(len(c.token_ids) for c in run.choices),
                latency_ms=_ms_since(run.arrival),
                ttft_ms=(
                    round((run.first_token_at - run.arrival) * 1000, 3)
                    if run.first_token_at is not None
                    else None
                ),
                prompt=prompt_of(run.spec.request.model_dump(include={"messages", "prompt"})),
                **who,
            )
        )

    def record(self, entry: AuditEntry) -> None:
        """Write one entry now (file) and queue it for the stream; never raises."""
        entry.gateway = entry.gateway or self.gateway
        if not self.include_prompts:
            entry.prompt = None
        line = entry.to_json()
        if self._file is not None:
            try:
                self._file.write(line + "\n")
                ENTRIES.labels("file").inc()
            except OSError as exc:
                log.warning("audit file write failed: %s", exc)
        if self._queue is not None:
            try:
                self._queue.put_nowait(line)
            except asyncio.QueueFull:
                DROPPED.inc()

    async def publish(self, js, instance: str, max_age: float, max_bytes: int) -> None:
        """Create (or update) the stream, then publish queued entries until cancelled."""
        if self._queue is None:
            return
        try:
            await ensure_stream(js, max_age, max_bytes)
        except Exception as exc:  # noqa: BLE001 - no JetStream, or not permitted: file only
            log.warning(
                "audit stream %s unavailable (%s): audit entries go to the file only", STREAM, exc
            )
            self._queue = None
            return
        subj = subject(instance)
        while True:
            line = await self._queue.get()
            try:
                await js.publish(subj, line.encode(), timeout=5)
                ENTRIES.labels("jetstream").inc()
            except Exception as exc:  # noqa: BLE001 - NATS down: keep the entry's file copy
                DROPPED.inc()
                log.warning("audit entry not published: %s", exc)

    def close(self) -> None:
        """Stop publishing and close the file (shutdown)."""
        if self._task is not None:
            self._task.cancel()
        if self._file is not None:
            self._file.close()
            self._file = None


async def ensure_stream(js, max_age: float, max_bytes: int) -> None:
    """The ``STRATA_AUDIT`` stream with limits retention (oldest discarded past the bounds)."""
    cfg = StreamConfig(
        name=STREAM,
        subjects=[SUBJECTS],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=max_age,
        max_bytes=max_bytes or -1,
    )
    try:
        await js.stream_info(STREAM)
        await js.update_stream(cfg)
    except NotFoundError:
        try:
            await js.add_stream(cfg)
        except Exception as exc:  # noqa: BLE001 - another gateway created it first
            log.debug("audit stream create: %s", exc)


def prompt_of(body: Any) -> Any:
    """What an entry keeps of the prompt when the operator opts in (messages, prompt, input)."""
    if not isinstance(body, dict):
        return None
    got = {k: body[k] for k in ("messages", "prompt", "input") if body.get(k) is not None}
    return got or None


def _ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)
