"""Per-role NATS users and their subject permissions: the server's ``authorization`` block.

One user per role (``gateway``, ``scheduler``, ... and ``api`` for external clients of
``strata.api.v1.>``), each allowed to publish and subscribe exactly the subjects its service
uses (derived from `shared.protocol.subjects` and every ``serve``/``subscribe``/``publish``/
``request`` call in ``services/``). Every user may subscribe only its own reply inboxes
(``_INBOX.<user>.>``, the prefix `shared.nats_auth` gives each client) and may answer a request
it received (``allow_responses``). JetStream API subjects go only to the roles that use them.

Pure: `permissions`, `authorization_block` and `tls_block` build text; `ensure_credentials`
writes or reuses one 0600 password file per user in a directory.
"""

from __future__ import annotations

import json
import os
import secrets

from services.scheduler.snapshots import BUCKET as SNAPSHOT_BUCKET
from shared.nats_auth import inbox_prefix
from shared.protocol import subjects as s

API_USER = "api"
"""The user external NATS API clients log in as (printed in the `strata up` banner)."""

_P = s.PREFIX
_JS_API = "$JS.API.>"  # the whole JetStream API: stream, consumer, KV and object store admin
_REGISTRY = [  # the registry bucket only: look it up or create it, put and delete records
    f"$JS.API.STREAM.INFO.KV_{s.REGISTRY_BUCKET}",
    f"$JS.API.STREAM.CREATE.KV_{s.REGISTRY_BUCKET}",
    f"$KV.{s.REGISTRY_BUCKET}.>",
]
_EVENTS_STREAM = [  # the KV-events stream exists, with its limits (publishing is separate)
    f"$JS.API.STREAM.INFO.{s.KV_EVENTS_STREAM}",
    f"$JS.API.STREAM.CREATE.{s.KV_EVENTS_STREAM}",
    f"$JS.API.STREAM.UPDATE.{s.KV_EVENTS_STREAM}",
]
_REQ_OUT = f"{_P}.req.*.out"
_KV_EVENTS = f"{_P}.kv.events.*"

_MODEL_INSTANCE = (
    [s.load_report("prefill", "*"), s.load_report("decode", "*"), _KV_EVENTS, _REQ_OUT]
    + [s.decode_submit("*"), *_REGISTRY],
    [s.prefill_submit("*"), s.decode_submit("*"), s.REQ_CANCEL_ALL, s.work_probe("*")]
    + [s.role_change("*")],
)

# role -> (publish, subscribe); every user also subscribes `_INBOX.<user>.>`.
_TABLE: dict[str, tuple[list[str], list[str]]] = {
    "gateway": (
        [
            s.TOK_ENCODE,
            s.TOK_DECODE,
            s.TOK_PING,
            s.VISION_ENCODE,
            s.VISION_PING,
            s.SCHED_ROUTE,
            s.SCHED_INSTANCES,
            s.REQ_CANCEL_ALL,
            s.work_probe("*"),
            f"{inbox_prefix(API_USER)}.>",
            f"{_P}.audit.>",  # the audit log (services/gateway/audit.py) and its stream
            "$JS.API.STREAM.INFO.STRATA_AUDIT",
            "$JS.API.STREAM.CREATE.STRATA_AUDIT",
            "$JS.API.STREAM.UPDATE.STRATA_AUDIT",
        ],
        [s.API_GENERATE, s.API_CANCEL, s.SCHED_STATE, f"{_P}.req.*.*"],
    ),
    "tokenizer": ([], [s.TOK_ENCODE, s.TOK_DECODE, s.TOK_PING]),
    "vision": ([], [s.VISION_ENCODE, s.VISION_PING]),
    "scheduler": (
        [
            s.SCHED_STATE,
            s.SCHED_INSTANCES,
            s.prefill_submit("*"),
            s.decode_submit("*"),
            s.role_change("*"),
            _JS_API,
            "$JS.FC.>",
            f"$O.{SNAPSHOT_BUCKET}.>",
        ],
        [s.SCHED_ROUTE, s.SCHED_INSTANCES, s.LOAD_ALL],
    ),
    "kvstore": (
        [s.load_report("kvstore", "*"), _KV_EVENTS, *_EVENTS_STREAM],
        [s.admin("kvstore", "*")],
    ),
    # prefill and decode have the same rights: AutoPD flips an instance's role at run time
    "prefill": _MODEL_INSTANCE,
    "decode": _MODEL_INSTANCE,
    API_USER: ([f"{_P}.api.v1.>"], []),
}

USERS: tuple[str, ...] = tuple(_TABLE)
"""Every user `strata up` creates: the service roles, then ``api``."""


def permissions(user: str) -> dict[str, object]:
    """The nats-server ``permissions`` map of ``user`` (KeyError for an unknown user)."""
    pub, sub = _TABLE[user]
    return {
        "publish": {"allow": list(pub)},
        "subscribe": {"allow": [*sub, f"{inbox_prefix(user)}.>"]},
        "allow_responses": True,
    }


def authorization_block(passwords: dict[str, str]) -> str:
    """nats-server config text: one user per entry of ``passwords`` with its permissions. No
    ``no_auth_user``: a client without credentials is refused."""
    users = [
        {"user": u, "password": p, "permissions": permissions(u)} for u, p in passwords.items()
    ]
    # The config format accepts JSON values; json.dumps quotes `$`, `>` and `*` safely.
    lines = ",\n    ".join(json.dumps(u) for u in users)
    return "authorization {\n  users: [\n    " + lines + "\n  ]\n}\n"


def tls_block(cert: str, key: str, ca: str = "") -> str:
    """nats-server ``tls`` block: serve ``cert``/``key``; with ``ca``, clients must present a
    certificate signed by it (mutual TLS)."""
    conf = {"cert_file": cert, "key_file": key}
    if ca:
        conf.update(ca_file=ca, verify=True)
    return "tls " + json.dumps(conf) + "\n"


def password_file(cred_dir: str, user: str) -> str:
    return os.path.join(cred_dir, f"{user}.password")


def ensure_credentials(cred_dir: str, users: tuple[str, ...] = USERS) -> dict[str, str]:
    """Each user's password: read from ``<cred_dir>/<user>.password`` when present (so a kept
    data dir keeps its credentials), else a new random one written there with mode 0600.
    Delete a file (or the directory) and restart to rotate."""
    os.makedirs(cred_dir, mode=0o700, exist_ok=True)
    os.chmod(cred_dir, 0o700)
    out = {}
    for user in users:
        path = password_file(cred_dir, user)
        if os.path.exists(path):
            with open(path) as f:
                out[user] = f.read().strip()
        if not out.get(user):
            out[user] = secrets.token_urlsafe(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(out[user] + "\n")
        os.chmod(path, 0o600)
    return out


# ---- docker compose: the same users, passwords from compose/.env ----

COMPOSE_MISSING = "run: strata compose-secrets compose/.env"


def compose_password_var(user: str) -> str:
    """The compose variable holding ``user``'s password (``STRATA_NATS_PASSWORD_GATEWAY``)."""
    return f"STRATA_NATS_PASSWORD_{user.upper()}"


def compose_authorization_block() -> str:
    """`authorization_block` for compose/docker-compose.yml: passwords are ``${VAR:?...}``
    interpolations and every other ``$`` (``$JS.API.>``) is escaped as ``$$``."""
    marks = {u: f"@{compose_password_var(u)}@" for u in USERS}
    text = authorization_block(marks).replace("$", "$$")
    for u, mark in marks.items():
        text = text.replace(mark, "${" + compose_password_var(u) + ":?" + COMPOSE_MISSING + "}")
    return text


def write_env_file(path: str, users: tuple[str, ...] = USERS) -> dict[str, str]:
    """Write (mode 0600) ``STRATA_NATS_PASSWORD_<USER>=...`` lines for compose, keeping the
    passwords already in ``path``; returns them by user."""
    old: dict[str, str] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep:
                    old[key] = value
    out = {u: old.get(compose_password_var(u)) or secrets.token_urlsafe(32) for u in users}
    keep = {k: v for k, v in old.items() if k not in {compose_password_var(u) for u in users}}
    lines = [f"{k}={v}" for k, v in keep.items()]
    lines += [f"{compose_password_var(u)}={p}" for u, p in out.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    return out
