"""Per-role NATS users and their subject permissions: the server's ``authorization`` block.

One user per role (``gateway``, ``scheduler``, ...), each allowed to publish and subscribe
exactly the subjects its service uses (derived from `shared.protocol.subjects` and every
``serve``/``subscribe``/``publish``/``request`` call in ``services/``), and one user per NATS API
client (``api``, built in, and those `strata creds add` makes). Every user may subscribe only its
own reply inboxes (``_INBOX.<user>.>``, the prefix `shared.nats_auth` gives each client); roles
may answer a request they received (``allow_responses``). JetStream API subjects go only to the
roles that use them.

A client NAME may publish only ``strata.api.v1.NAME.>`` (``api`` also the legacy
``strata.api.v1.generate`` / ``.cancel``): the server enforces that, so the gateway takes the
subject's NAME token as the caller's authenticated identity (`services.gateway.nats_api`). The
gateway may publish into each client's inbox (streamed events), so its permissions list the
clients.

Pure: `permissions`, `authorization_block` and `tls_block` build text; `ensure_credentials`
writes or reuses one 0600 password file per user in a directory; `hash_password` makes the
bcrypt hash nats-server checks a password against.
"""

from __future__ import annotations

import json
import os
import re
import secrets

import bcrypt

from services.scheduler.snapshots import BUCKET as SNAPSHOT_BUCKET
from shared.nats_auth import inbox_prefix
from shared.protocol import subjects as s

API_USER = s.API_LEGACY_CLIENT
"""The built-in NATS API client (printed in the `strata up` banner); `strata creds add` makes
more, one identity each."""
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
BCRYPT_COST = 11
"""bcrypt's cost for a password a person may have chosen (nats-server's `mkpasswd` default)."""
BCRYPT_COST_RANDOM = 4
"""bcrypt's cost for a password of `RANDOM_LENGTH` characters or more, such as the 256-bit random
ones Strata makes: the cost factor slows guessing of a low-entropy password, and no cost makes a
256-bit secret guessable, so a higher one only costs CPU: the launcher's at every start (about
60 ms a hash) and nats-server's at every client connection."""
RANDOM_LENGTH = 32

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
_GW_OUT = s.gw_out("*")  # one decode step's chunks for one gateway (`TokenChunkBatch`)
_KV_EVENTS = f"{_P}.kv.events.*"

_MODEL_INSTANCE = (
    [s.load_report("prefill", "*"), s.load_report("decode", "*"), _KV_EVENTS, _REQ_OUT, _GW_OUT]
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
            s.sched_route("*"),
            s.SCHED_INSTANCES,
            s.REQ_CANCEL_ALL,
            s.work_probe("*"),
            f"{_P}.audit.>",  # the audit log (services/gateway/audit.py) and its stream
            "$JS.API.STREAM.INFO.STRATA_AUDIT",
            "$JS.API.STREAM.CREATE.STRATA_AUDIT",
            "$JS.API.STREAM.UPDATE.STRATA_AUDIT",
        ],  # + each API client's inbox (`permissions`)
        [
            s.api_generate("*"),
            s.api_cancel("*"),
            s.API_GENERATE,
            s.API_CANCEL,
            s.SCHED_STATE,
            f"{_P}.req.*.*",
            _GW_OUT,  # one user for every gateway instance: each subscribes only its own id
        ],
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
        [s.SCHED_ROUTE, s.sched_route("*"), s.SCHED_INSTANCES, s.LOAD_ALL],
    ),
    "kvstore": (
        [s.load_report("kvstore", "*"), _KV_EVENTS, *_EVENTS_STREAM],
        [s.admin("kvstore", "*")],
    ),
    # prefill and decode have the same rights: AutoPD flips an instance's role at run time
    "prefill": _MODEL_INSTANCE,
    "decode": _MODEL_INSTANCE,
}

ROLES: tuple[str, ...] = tuple(_TABLE)
"""The service roles' users."""
USERS: tuple[str, ...] = (*ROLES, API_USER)
"""Every user `strata up` creates: the service roles, then ``api``."""


def check_client_name(name: str) -> str:
    """``name`` if it can be a NATS API client (one subject token, not a role's or ``api``'s
    user), else ValueError saying why."""
    if not CLIENT_NAME.fullmatch(name):
        raise ValueError(
            f"client name {name[:80]!r}: use 1-64 characters from [A-Za-z0-9_-], starting "
            "with a letter or digit (it becomes a NATS subject token)"
        )
    if name in USERS:
        raise ValueError(f"client name {name!r} is reserved (a service role or the built-in api)")
    return name


def client_permissions(name: str) -> dict[str, object]:
    """An API client: its own generate/cancel subjects and its own reply inboxes, nothing else
    (no ``allow_responses``: nobody sends it requests)."""
    pub = [f"{_P}.api.v1.{name}.>"]
    if name == API_USER:
        pub += [s.API_GENERATE, s.API_CANCEL]
    return {"publish": {"allow": pub}, "subscribe": {"allow": [f"{inbox_prefix(name)}.>"]}}


def permissions(user: str, clients: tuple[str, ...] = (API_USER,)) -> dict[str, object]:
    """The nats-server ``permissions`` map of ``user`` when the API clients are ``clients``
    (KeyError for a user that is neither a role nor one of them)."""
    if user not in _TABLE:
        if user not in clients:
            raise KeyError(user)
        return client_permissions(user)
    pub, sub = _TABLE[user]
    if user == "gateway":  # streamed events go to a subject in the client's own inbox
        pub = [*pub, *(f"{inbox_prefix(c)}.>" for c in clients)]
    return {
        "publish": {"allow": list(pub)},
        "subscribe": {"allow": [*sub, f"{inbox_prefix(user)}.>"]},
        "allow_responses": True,
    }


def hash_password(password: str) -> str:
    """The bcrypt hash (``$2a$``) nats-server accepts in place of a password: cost
    `BCRYPT_COST_RANDOM` for a password of `RANDOM_LENGTH` characters or more (Strata's own are
    43), else `BCRYPT_COST`."""
    cost = BCRYPT_COST_RANDOM if len(password) >= RANDOM_LENGTH else BCRYPT_COST
    salt = bcrypt.gensalt(cost, prefix=b"2a")
    return bcrypt.hashpw(password.encode(), salt).decode()


def authorization_block(passwords: dict[str, str]) -> str:
    """nats-server config text: one user per entry of ``passwords`` (a password or its
    `hash_password`) with its permissions; every entry that is not a role is an API client. No
    ``no_auth_user``: a client without credentials is refused."""
    clients = tuple(u for u in passwords if u not in _TABLE)
    users = [
        {"user": u, "password": p, "permissions": permissions(u, clients)}
        for u, p in passwords.items()
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
