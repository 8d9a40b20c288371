"""The one place that names every NATS subject. Everything is prefixed ``strata.``."""

from __future__ import annotations

PREFIX = "strata"

# Public, versioned entry point of the gateway (same semantics as REST).
API_GENERATE = f"{PREFIX}.api.v1.generate"
API_MODELS = f"{PREFIX}.api.v1.models"
API_CANCEL = f"{PREFIX}.api.v1.cancel"  # every gateway: api.ApiCancel for a request it runs
# Per-client subjects: the client's NATS user name is a token, so nats-server's publish
# permission (`services.infra.nats_auth`) authenticates it. The two above are the ``api``
# user's (kept for compatibility).
API_LEGACY_CLIENT = "api"


def api_generate(client: str) -> str:
    """``strata.api.v1.<client>.generate`` (queue group "gateway")."""
    return f"{PREFIX}.api.v1.{client}.generate"


def api_cancel(client: str) -> str:
    """``strata.api.v1.<client>.cancel``: every gateway; ends the client's own request."""
    return f"{PREFIX}.api.v1.{client}.cancel"


def api_client(subject: str) -> str:
    """The client a public API subject belongs to: the ``<client>`` token, or ``api`` for the
    legacy `API_GENERATE` / `API_CANCEL`."""
    parts = subject.split(".")
    return parts[3] if len(parts) == 5 else API_LEGACY_CLIENT


TOK_ENCODE = f"{PREFIX}.tok.encode"  # queue group "tokenizer"
TOK_DECODE = f"{PREFIX}.tok.decode"  # queue group "tokenizer": tok.DetokenizeRequest -> Reply
VISION_ENCODE = f"{PREFIX}.vision.encode"  # queue group "vision"
SCHED_ROUTE = f"{PREFIX}.sched.route"  # queue group "scheduler"
SCHED_STATE = f"{PREFIX}.sched.state"  # scheduler -> everyone: degradation level, down instances
SCHED_INSTANCES = f"{PREFIX}.sched.instances"  # request: the scheduler's view of the registry
TOK_PING = f"{PREFIX}.tok.ping"  # queue group "tokenizer": health.Ping -> health.Pong
VISION_PING = f"{PREFIX}.vision.ping"  # queue group "vision": health.Ping -> health.Pong

LOAD_ALL = f"{PREFIX}.load.>"
KV_EVENTS_ALL = f"{PREFIX}.kv.events.>"
KV_EVENTS_STREAM = "STRATA_KV_EVENTS"
REGISTRY_BUCKET = "strata_registry"

QUEUE_TOKENIZER = "tokenizer"
QUEUE_VISION = "vision"
QUEUE_SCHEDULER = "scheduler"


def sched_route(scheduler_id: str) -> str:
    """One scheduler replica's own route subject (beside the queue group's `SCHED_ROUTE`): the
    gateway sends a route to a replica whose `SchedulerState` it heard lately."""
    return f"{SCHED_ROUTE}.{scheduler_id}"


def prefill_submit(instance: str) -> str:
    return f"{PREFIX}.prefill.{instance}.submit"


def decode_submit(instance: str) -> str:
    return f"{PREFIX}.decode.{instance}.submit"


def req_out(request_id: str) -> str:
    """Token stream of one request, back to the gateway (index-numbered chunks)."""
    return f"{PREFIX}.req.{request_id}.out"


def gw_out(gateway_id: str) -> str:
    """Token streams of every request one gateway owns (`WorkItem.gateway_id`), back to it: a
    decode instance publishes one `TokenChunkBatch` per gateway per engine step here."""
    return f"{PREFIX}.gw.{gateway_id}.out"


def req_cancel(request_id: str) -> str:
    return f"{PREFIX}.req.{request_id}.cancel"


def req_ack(request_id: str) -> str:
    """Reply subject of a submit the scheduler forwarded (`RouteRequest.submit`): the instance's
    `SubmitAck` or error, or the server's no-responders status, straight to the gateway."""
    return f"{PREFIX}.req.{request_id}.ack"


def req_any(request_id: str) -> str:
    """Every subject of one request (out, ack, cancel): the gateway's one subscription."""
    return f"{PREFIX}.req.{request_id}.*"


REQ_CANCEL_ALL = f"{PREFIX}.req.*.cancel"


def work_probe(instance: str) -> str:
    """`HeldQuery` -> `HeldReply`: does this prefill / decode instance still work on a request
    (the gateway asks before it fails a silent stream over)."""
    return f"{PREFIX}.probe.{instance}"


def load_report(role: str, instance: str) -> str:
    return f"{PREFIX}.load.{role}.{instance}"


def role_change(instance: str) -> str:
    """AutoPD: `sched.RoleChange` from the scheduler to one prefill / decode instance."""
    return f"{PREFIX}.autopd.{instance}"


def kv_events(instance: str) -> str:
    return f"{PREFIX}.kv.events.{instance}"


def admin(role: str, instance: str) -> str:
    """Per-instance admin/introspection requests (stats, leak checks)."""
    return f"{PREFIX}.admin.{role}.{instance}"


_ROLE_NAMES = {
    "tok": "tokenizer",
    "vision": "vision encoder",
    "sched": "scheduler",
    "api": "gateway",
}


def describe(subject: str) -> str:
    """The role behind ``subject`` in words, for error messages a client may see (subject names
    are internal): ``strata.tok.encode`` -> "tokenizer", ``strata.decode.d0.submit`` ->
    "decode instance d0"."""
    parts = subject.split(".")
    if len(parts) < 2 or parts[0] != PREFIX:
        return "service"
    if parts[1] in ("prefill", "decode") and len(parts) >= 3:
        return f"{parts[1]} instance {parts[2]}"
    if parts[1] == "admin" and len(parts) >= 4:
        return f"{parts[2]} instance {parts[3]}"
    return _ROLE_NAMES.get(parts[1], f"{parts[1]} service")
