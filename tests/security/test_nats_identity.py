"""One NATS identity per API client, against a real nats-server run with the config `strata up`
writes: clients issued and revoked with `strata creds` while the server runs (a SIGHUP reload,
same pid), each reaching only its own subjects and inboxes, ``auth.conf`` holding bcrypt hashes
only. The gateway side (ownership of a request) is in ``test_nats_identity_gateway.py``."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from services.infra import nats_clients
from services.infra.nats_server import NatsServer
from services.infra.procs import free_port
from shared import bus
from shared.config import ConfigError
from shared.nats_auth import NatsAuth
from shared.protocol import subjects
from tests.security.test_nats_auth import Client, login


def creds(server: NatsServer, *argv: str) -> tuple[int, list[str]]:
    """Run `strata creds ...` (its in-process entry point) on ``server``'s data dir."""
    said: list[str] = []
    data_dir = os.path.dirname(server.data_dir)  # strata up: <data-dir>/nats
    rc = nats_clients.cli([*argv, "--data-dir", data_dir], "", say=said.append)
    return rc, said


def client_auth(server: NatsServer, name: str) -> NatsAuth:
    with open(os.path.join(server.cred_dir, f"{name}.password")) as f:
        return NatsAuth(user=name, password=f.read().strip())


async def client_login(server: NatsServer, name: str) -> Client:
    server.passwords[name] = client_auth(server, name).password
    return await login(server, name)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("up")
    (d / "logs").mkdir()
    log = open(d / "logs" / "nats.log", "a")  # where strata up keeps it: creds waits on it
    srv = NatsServer(free_port(), str(d / "nats"), auth=True, die_with_parent=True).start(log)
    for name in ("alice", "bob"):
        rc, said = creds(srv, "add", name)
        assert rc == 0 and "reloaded nats-server" in said[0], said
    yield srv
    srv.stop()
    log.close()


def test_issued_credentials_are_private_and_hashed(server, capsys):
    capsys.readouterr()
    assert creds(server, "list")[0] == 0
    assert capsys.readouterr().out.split() == ["api", "alice", "bob"]
    for name in ("alice", "bob"):
        path = os.path.join(server.cred_dir, f"{name}.password")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    conf = open(os.path.join(server.data_dir, "auth.conf")).read()
    assert stat.S_IMODE(os.stat(os.path.join(server.data_dir, "auth.conf")).st_mode) == 0o600
    for name in ("alice", "bob", "api", "gateway"):
        secret = open(os.path.join(server.cred_dir, f"{name}.password")).read().strip()
        assert secret not in conf and f'"user": "{name}"' in conf
    assert conf.count('"password": "$2a$04$') == conf.count('"user": ')  # random: least cost
    # a bad, reserved or taken name is refused with a message naming the problem
    rc, said = creds(server, "add", "a.b")
    assert rc == 1 and "[A-Za-z0-9_-]" in said[0]
    assert "reserved" in creds(server, "add", "gateway")[1][0]
    assert "exists already" in creds(server, "add", "alice")[1][0]
    assert "no client 'carol'" in creds(server, "revoke", "carol")[1][0]


# (operation, subject, allowed for alice): bob's, api's, the services' and the wildcards are not.
ALICE = [
    ("pub", subjects.api_generate("alice"), True),
    ("pub", subjects.api_cancel("alice"), True),
    ("pub", subjects.api_generate("bob"), False),
    ("pub", subjects.api_cancel("bob"), False),
    ("pub", subjects.API_GENERATE, False),  # the legacy subjects are api's identity
    ("pub", subjects.API_CANCEL, False),
    ("pub", "strata.req.r1.cancel", False),
    ("pub", subjects.work_probe("dec-0"), False),
    ("pub", subjects.TOK_ENCODE, False),
    ("pub", subjects.SCHED_ROUTE, False),
    ("pub", "_INBOX.bob.x", False),
    ("sub", "_INBOX.alice.x", True),
    ("sub", "_INBOX.bob.>", False),
    ("sub", "_INBOX.bob.x", False),
    ("sub", "_INBOX.api.>", False),
    ("sub", "_INBOX.gateway.>", False),
    ("sub", "_INBOX.>", False),
    ("sub", "_INBOX.*.x", False),
    ("sub", "strata.req.*.out", False),
    ("sub", subjects.api_generate("bob"), False),
    ("sub", ">", False),
]


async def test_a_client_reaches_only_its_own_subjects(server):
    c = await client_login(server, "alice")
    try:
        wrong = []
        for op, subject, allowed in ALICE:
            if op == "pub":
                await c.nc.publish(subject, b"x")
            else:
                await c.nc.subscribe(subject)
            if await c.refused(op, subject) == allowed:
                wrong.append(f"{op} {subject}: {'refused' if allowed else 'allowed'}")
        assert not wrong, wrong
        assert c.nc.is_connected  # refused operations, not a dropped login
    finally:
        await c.nc.close()


async def test_the_shared_api_user_is_one_identity_too(server):
    """``api`` keeps the legacy subjects but reads no other client's inbox."""
    c = await login(server, "api")
    try:
        checks = [
            ("pub", subjects.API_GENERATE, True),
            ("pub", subjects.api_cancel("api"), True),
            ("pub", subjects.api_cancel("alice"), False),
            ("sub", "_INBOX.alice.>", False),
            ("sub", "_INBOX.>", False),
        ]
        for op, subject, allowed in checks:
            if op == "pub":
                await c.nc.publish(subject, b"x")
            else:
                await c.nc.subscribe(subject)
            assert await c.refused(op, subject) != allowed, (op, subject)
    finally:
        await c.nc.close()


async def test_revoked_client_is_refused_without_a_restart(server):
    pid = server.proc.pid
    rc, said = creds(server, "add", "carol")
    assert rc == 0, said
    carol = await client_login(server, "carol")
    bob = await client_login(server, "bob")
    try:
        auth = client_auth(server, "carol")
        rc, said = creds(server, "revoke", "carol")
        assert rc == 0 and f"pid {pid}" in said[0], said
        assert "carol" not in nats_clients.client_names(server.data_dir)
        for _ in range(500):  # the reload closes the revoked user's open connection
            if not carol.nc.is_connected:
                break
            await asyncio.sleep(0.01)
        assert not carol.nc.is_connected
        with pytest.raises(ConfigError, match="refused login as 'carol'"):
            await bus.connect(server.url, "carol-again", auth)
        assert server.proc.pid == pid and server.proc.poll() is None  # same server, no restart
        await bob.nc.flush()  # the other clients stay connected
        assert bob.nc.is_connected and not bob.errors
    finally:
        await carol.nc.close()
        await bob.nc.close()


def test_the_identity_is_the_subjects_client_token():
    assert subjects.api_client(subjects.api_generate("alice")) == "alice"
    assert subjects.api_client(subjects.api_cancel("b-2_x")) == "b-2_x"
    assert subjects.api_client(subjects.API_GENERATE) == "api"
    assert subjects.api_client(subjects.API_CANCEL) == "api"
