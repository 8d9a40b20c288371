"""NATS authentication and authorization against a real nats-server started with the config
`strata up` generates (`NatsServer(auth=True)`): anonymous and wrong-password clients are
refused, each role can do its job, and every other role is refused on every subject family.

Permission violations reach nats-py asynchronously (``error_cb``); each connection collects
them, and a refusal is asserted by the server's message naming the subject."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import bcrypt
import nats
import pytest

from services.infra import nats_auth
from services.infra.nats_server import NatsServer
from services.infra.procs import free_port
from shared import bus
from shared.config import ConfigError
from shared.kv_events_stream import StreamLimits, ensure_kv_events_stream
from shared.nats_auth import NatsAuth
from shared.protocol import subjects
from shared.protocol.health import Ping, Pong
from shared.protocol.sched import InstanceRecord
from shared.registry import read_registry, register_instance

ROLES = ("gateway", "tokenizer", "vision", "scheduler", "kvstore", "prefill", "decode", "api")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = NatsServer(
        free_port(), str(tmp_path_factory.mktemp("nats-auth")), auth=True, die_with_parent=True
    ).start()
    yield srv
    srv.stop()


class Client:
    """One connection as ``user`` that records the server's permission errors."""

    def __init__(self, nc, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors
        self.canaries = 0

    async def refused(self, op: str, subject: str) -> bool:
        """Whether the server refused ``op`` ("pub"/"sub") on ``subject``. The server answers
        in order, so once the error for a canary publish nobody may make has arrived, any
        error for ``op`` has too (nats-py lower-cases the messages)."""
        what = f'{"publish" if op == "pub" else "subscription"} to "{subject}"'.lower()
        self.canaries += 1
        canary = f"no.one.may.publish.{self.canaries}"
        await self.nc.publish(canary, b"")
        await self.nc.flush()
        for _ in range(500):
            if any(f'"{canary}"' in e for e in self.errors):
                return any(what in e for e in self.errors)
            await asyncio.sleep(0.01)
        raise AssertionError(f"the server never refused {canary}")


async def login(server: NatsServer, user: str) -> Client:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        server.url,
        name=f"test-{user}",
        error_cb=on_error,
        max_reconnect_attempts=0,
        **server.client_auth(user).connect_kwargs(),
    )
    return Client(nc, errors)


def _users(path: str) -> list[dict]:
    """The user entries of an ``auth.conf`` (`authorization_block` writes one JSON object a
    line)."""
    lines = open(path).read().splitlines()
    return [json.loads(line.strip().rstrip(",")) for line in lines if '"user"' in line]


def test_a_short_password_keeps_bcrypts_full_cost():
    """A password a person may have chosen (shorter than Strata's random ones) is hashed at
    nats-server's `mkpasswd` cost; a long random one at bcrypt's least."""
    short, long_ = "hunter2-horse", "x" * nats_auth.RANDOM_LENGTH
    assert nats_auth.hash_password(short).startswith("$2a$11$")
    assert nats_auth.hash_password(long_).startswith("$2a$04$")
    assert bcrypt.checkpw(short.encode(), nats_auth.hash_password(short).encode())


def test_credentials_are_private_files_and_reused(server):
    conf = os.path.join(server.data_dir, "nats.conf")
    users = os.path.join(server.data_dir, "auth.conf")
    text = open(conf).read() + open(users).read()
    assert "no_auth_user" not in text and "authorization" in text
    for user, password in server.passwords.items():  # bcrypt hashes only, nothing plaintext
        assert password not in text
        (entry,) = [u for u in _users(users) if u["user"] == user]
        assert entry["password"].startswith("$2a$04$")  # 256-bit random: cost adds nothing
        assert bcrypt.checkpw(password.encode(), entry["password"].encode())
    for path in [conf, users, *(nats_auth.password_file(server.cred_dir, u) for u in ROLES)]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert stat.S_IMODE(os.stat(server.cred_dir).st_mode) == 0o700
    assert set(server.passwords) == set(ROLES) and len(set(server.passwords.values())) == 8
    assert nats_auth.ensure_credentials(server.cred_dir) == server.passwords  # kept, not rotated


async def test_anonymous_and_wrong_password_are_refused(server):
    with pytest.raises(ConfigError, match="refused login as anonymous"):
        await bus.connect(server.url, "anon", NatsAuth())
    bad = NatsAuth(user="gateway", password="not-the-password")
    with pytest.raises(ConfigError, match="refused login as 'gateway'"):
        await bus.connect(server.url, "bad", bad)
    with pytest.raises(ConfigError, match="STRATA_NATS_PASSWORD_FILE=/nonexistent"):
        NatsAuth.from_env(
            {"STRATA_NATS_USER": "decode", "STRATA_NATS_PASSWORD_FILE": "/nonexistent"}
        )


async def test_password_file_env_logs_in(server):
    env = server.client_auth("tokenizer").env(nats_auth.password_file(server.cred_dir, "tokenizer"))
    assert "STRATA_NATS_PASSWORD" not in env  # the secret stays in its file
    nc = await bus.connect(server.url, "tok", NatsAuth.from_env(env))
    assert nc.is_connected
    await nc.close()


# (operation, subject, users allowed). Everything else must be refused by the server.
MATRIX = [
    ("pub", "strata.decode.d0.submit", {"scheduler", "prefill", "decode"}),
    ("pub", "strata.prefill.p0.submit", {"scheduler"}),
    ("pub", subjects.SCHED_ROUTE, {"gateway"}),
    ("pub", subjects.sched_route("scheduler-1"), {"gateway"}),
    ("pub", subjects.SCHED_INSTANCES, {"gateway", "scheduler"}),
    ("pub", subjects.TOK_ENCODE, {"gateway"}),
    ("pub", subjects.TOK_DECODE, {"gateway"}),
    ("pub", subjects.VISION_ENCODE, {"gateway"}),
    ("pub", subjects.TOK_PING, {"gateway"}),
    ("pub", "strata.req.r1.cancel", {"gateway"}),
    ("pub", "strata.req.r1.out", {"prefill", "decode"}),
    ("pub", "strata.gw.gateway-0.out", {"prefill", "decode"}),
    ("pub", "strata.kv.events.x", {"prefill", "decode", "kvstore"}),
    ("pub", "strata.load.decode.d0", {"decode", "prefill"}),  # AutoPD flips roles
    ("pub", "strata.load.prefill.p0", {"prefill", "decode"}),
    ("pub", "strata.autopd.d0", {"scheduler"}),
    ("sub", "strata.autopd.d0", {"prefill", "decode"}),
    ("pub", "strata.load.kvstore.k0", {"kvstore"}),
    ("pub", subjects.SCHED_STATE, {"scheduler"}),
    ("pub", subjects.API_GENERATE, {"api"}),
    ("pub", "$JS.API.STREAM.DELETE.STRATA_KV_EVENTS", {"scheduler"}),
    ("pub", "$JS.API.STREAM.PURGE.KV_strata_registry", {"scheduler"}),
    ("pub", "$KV.strata_registry.decode-0", {"prefill", "decode"}),
    ("pub", "$JS.API.STREAM.INFO.STRATA_KV_EVENTS", {"scheduler", "kvstore"}),
    ("pub", "_INBOX.api.x", {"gateway"}),
    ("sub", "strata.req.*.out", {"gateway"}),
    ("sub", "strata.req.r1.*", {"gateway"}),
    ("sub", "strata.gw.gateway-0.out", {"gateway"}),
    ("sub", subjects.REQ_CANCEL_ALL, {"gateway", "prefill", "decode"}),
    ("sub", "strata.decode.d0.submit", {"decode", "prefill"}),
    ("sub", "strata.prefill.p0.submit", {"prefill", "decode"}),
    ("sub", subjects.SCHED_ROUTE, {"scheduler"}),
    ("sub", subjects.sched_route("scheduler-1"), {"scheduler"}),
    ("sub", subjects.TOK_ENCODE, {"tokenizer"}),
    ("sub", subjects.TOK_DECODE, {"tokenizer"}),
    ("sub", subjects.VISION_ENCODE, {"vision"}),
    ("sub", subjects.LOAD_ALL, {"scheduler"}),
    ("sub", subjects.KV_EVENTS_ALL, set()),
    ("sub", subjects.SCHED_STATE, {"gateway"}),
    ("sub", subjects.API_GENERATE, {"gateway"}),
    ("sub", subjects.API_CANCEL, {"gateway"}),
    ("pub", subjects.API_CANCEL, {"api"}),
    ("sub", "strata.admin.kvstore.k0", {"kvstore"}),
    ("sub", "_INBOX.>", set()),
    ("sub", "_INBOX.gateway.>", {"gateway"}),
    ("sub", ">", set()),
]


@pytest.mark.parametrize("user", ROLES)
async def test_each_user_reaches_only_its_subjects(server, user):
    c = await login(server, user)
    try:
        wrong = []
        for op, subject, allowed in MATRIX:
            if op == "pub":
                await c.nc.publish(subject, b"x")
            else:
                sub = await c.nc.subscribe(subject)
            if await c.refused(op, subject) != (user not in allowed):
                wrong.append(f"{op} {subject}: {'refused' if user in allowed else 'allowed'}")
            if op == "sub" and user in allowed:
                await sub.unsubscribe()
        assert not wrong, f"{user}: {wrong}"
        assert c.nc.is_connected  # violations are refused operations, not a dropped login
    finally:
        await c.nc.close()


async def test_request_reply_flows_between_roles(server):
    """The paths a request takes work under auth: gateway -> tokenizer reply (responses are
    allowed to the asker's inbox), scheduler -> decode submit with the ack to the gateway's
    `strata.req.<id>.ack`, decode -> `.out` to the gateway, api -> gateway and back."""
    gw, tok, sched, dec, api = [
        await login(server, u) for u in ("gateway", "tokenizer", "scheduler", "decode", "api")
    ]
    try:
        await bus.serve_ping(tok.nc, subjects.TOK_PING, "tokenizer", "tok-0", queue="tokenizer")

        async def on_submit(m):
            await m.respond(b"ack")
            await dec.nc.publish(subjects.req_out("r1"), b"tok")

        await dec.nc.subscribe(subjects.decode_submit("d0"), cb=on_submit)

        async def on_generate(m):
            await gw.nc.publish(m.reply, b"event-1")

        await gw.nc.subscribe(subjects.API_GENERATE, queue="gateway", cb=on_generate)
        got: asyncio.Queue = asyncio.Queue()

        async def on_req(m):
            got.put_nowait((m.subject, m.data))

        await gw.nc.subscribe(subjects.req_any("r1"), cb=on_req)
        for c in (tok, dec, gw):
            await c.nc.flush()
        pong = await bus.request(gw.nc, subjects.TOK_PING, Ping(sender="gateway"), Pong)
        assert pong.instance_id == "tok-0"
        await sched.nc.publish(subjects.decode_submit("d0"), b"item", reply=subjects.req_ack("r1"))
        seen = {await asyncio.wait_for(got.get(), 5) for _ in range(2)}
        assert seen == {(subjects.req_ack("r1"), b"ack"), (subjects.req_out("r1"), b"tok")}
        rep = await api.nc.request(subjects.API_GENERATE, b"{}", timeout=5)
        assert rep.data == b"event-1" and rep.subject.startswith("_INBOX.api.")
        assert not any(c.errors for c in (gw, tok, sched, dec, api))
    finally:
        for c in (gw, tok, sched, dec, api):
            await c.nc.close()


async def test_jetstream_for_the_roles_that_use_it(server):
    """kvstore creates the KV-events stream and publishes into it; a decode instance registers
    in the registry bucket; the scheduler reads the registry and the stream; decode may not
    touch the stream's API."""
    kv, dec, sched = [await login(server, u) for u in ("kvstore", "decode", "scheduler")]
    try:
        await ensure_kv_events_stream(kv.nc.jetstream())
        await ensure_kv_events_stream(kv.nc.jetstream(), limits=StreamLimits(max_bytes=1 << 20))
        ack = await kv.nc.jetstream().publish(subjects.kv_events("kv-0"), b"ev", timeout=5)
        assert ack.stream == subjects.KV_EVENTS_STREAM
        await register_instance(
            dec.nc.jetstream(),
            InstanceRecord(
                instance_id="decode-0", role="decode", grpc_addr="127.0.0.1:1", incarnation="i"
            ),
        )
        for _ in range(100):  # a just-written record can take a moment to list
            if await read_registry(sched.nc.jetstream()):
                break
            await asyncio.sleep(0.02)
        assert set(await read_registry(sched.nc.jetstream())) == {"decode-0"}
        info = await sched.nc.jetstream().stream_info(subjects.KV_EVENTS_STREAM)
        assert info.state.messages == 1
        assert info.config.max_bytes == 1 << 20  # kvstore may set the stream's limits
        assert not any(c.errors for c in (kv, dec, sched))  # flows above were awaited replies
        with pytest.raises(nats.errors.TimeoutError):  # refused, so no reply comes
            await dec.nc.jetstream(timeout=0.5).stream_info(subjects.KV_EVENTS_STREAM)
        assert await dec.refused("pub", f"$JS.API.STREAM.INFO.{subjects.KV_EVENTS_STREAM}")
    finally:
        for c in (kv, dec, sched):
            await c.nc.close()
