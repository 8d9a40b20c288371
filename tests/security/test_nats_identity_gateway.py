"""Ownership of NATS API requests at a real gateway (`tests.gateway.harness`: the gateway logs in
as ``gateway``, fake peers on a test-only user) behind a real nats-server with `strata up`'s
users and two clients, alice and bob, issued by `strata creds add`.

A bounded, seeded fuzz pass has alice try everything against bob's live streams: cancel them
(on her subject with bob's ids, on bob's subject, on the legacy and the internal cancel
subjects), read them (subscribe bob's inbox, every inbox, the token subjects), take over their
ids, and point her requests' streams and replies into bob's inbox. Leaks are counted: any of
bob's events alice sees, any event bob sees that is not his, any message on a subscription the
server should have refused, and any of bob's streams ended before bob ends it. The server's
refusals (permission violations) and the gateway's (``strata:nats_api_refused``) are counted
too and must match what alice sent: the refusals come from the mechanisms, not from luck.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from services.gateway import metrics
from services.infra import nats_auth, nats_clients
from services.infra.nats_server import NatsServer
from services.infra.procs import free_port
from shared.nats_auth import NatsAuth
from shared.protocol import subjects
from shared.protocol.api import ApiCancel, GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from tests.gateway.harness import gateway
from tests.security.test_nats_identity import client_login, creds

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
PEERS_PASSWORD = "peers-test-only"
FUZZ_OPS = 150


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("up")
    (d / "logs").mkdir()
    log = open(d / "logs" / "nats.log", "a")
    srv = NatsServer(free_port(), str(d / "nats"), auth=True, die_with_parent=True).start(log)
    for name in ("alice", "bob"):
        assert creds(srv, "add", name)[0] == 0
    # The fake peers play tokenizer, scheduler and decode on one connection: a test-only user
    # without limits, added beside the generated users.
    path = os.path.join(srv.data_dir, nats_clients.AUTH_CONF)
    peers = f'{{"user": "peers", "password": "{nats_auth.hash_password(PEERS_PASSWORD)}"}}'
    text = open(path).read().replace("users: [\n", f"users: [\n    {peers},\n", 1)
    with open(path, "w") as f:
        f.write(text)
    assert nats_clients.reload_server(srv.data_dir)
    yield srv
    srv.stop()
    log.close()


def refused(op: str) -> float:
    return metrics.NATS_API_REFUSED.labels(op=op)._value.get()


async def test_a_client_cannot_touch_another_clients_requests(server):
    peers_auth = NatsAuth(user="peers", password=PEERS_PASSWORD)
    async with gateway(
        server.url,
        auth=server.client_auth("gateway"),
        peers_auth=peers_auth,
        peers_kw={"max_model_len": 8192},
    ) as (_, peers, _s):
        peers.decodes["dec-0"]["gap"] = 0.02
        alice = await client_login(server, "alice")
        bob = await client_login(server, "bob")
        leaks: list[str] = []
        bob_rids = [f"bob-{i}" for i in range(3)]
        bob_events: dict[str, list[GenerateEvent]] = {r: [] for r in bob_rids}

        async def on_bob(msg) -> None:
            ev = decode(msg.data, GenerateEvent)
            if ev.request_id in bob_events:
                bob_events[ev.request_id].append(ev)
            else:
                leaks.append(f"bob got {ev.request_id!r} on {msg.subject}")

        await bob.nc.subscribe("_INBOX.bob.>", cb=on_bob)
        for rid in bob_rids:
            req = GenerateRequest(
                body={**BODY, "max_tokens": 4000},
                request_id=rid,
                stream_subject=f"_INBOX.bob.{rid}",
            )
            await bob.nc.publish(subjects.api_generate("bob"), encode(req))
        while min(len(e) for e in bob_events.values()) < 2:
            await asyncio.sleep(0.02)

        alice_events: list[GenerateEvent] = []

        async def on_alice(msg) -> None:
            ev = decode(msg.data, GenerateEvent)
            alice_events.append(ev)
            if ev.request_id in bob_events and ev.error is None:
                leaks.append(f"alice got bob's {ev.request_id!r}")

        async def forbidden(msg) -> None:
            leaks.append(f"alice read {msg.subject}")

        await alice.nc.subscribe("_INBOX.alice.>", cb=on_alice)
        rng = random.Random(34)
        want = {"violations": 0, "cancel": 0, "stream": 0, "reply": 0, "in_use": 0}
        before = {op: refused(op) for op in ("cancel", "stream", "reply")}
        for i in range(FUZZ_OPS):
            rid = rng.choice(bob_rids)
            key = rng.choice(["", "k", rid])
            op = rng.randrange(9)
            if op == 0:  # her own cancel subject, bob's id: the gateway checks the owner
                await alice.nc.publish(
                    subjects.api_cancel("alice"), encode(ApiCancel(request_id=rid, api_key=key))
                )
                want["cancel"] += 1
            elif op in (1, 2, 3, 4):  # subjects only others may publish: the server refuses
                subject = [
                    subjects.api_cancel("bob"),
                    subjects.API_CANCEL,
                    subjects.req_cancel(rid),
                    subjects.work_probe("dec-0"),
                ][op - 1]
                await alice.nc.publish(subject, encode(ApiCancel(request_id=rid, api_key=key)))
                want["violations"] += 1
            elif op == 5:  # read bob's stream: the server refuses the subscription
                subject = rng.choice(
                    [f"_INBOX.bob.{rid}", "_INBOX.bob.>", "_INBOX.>", "_INBOX.*.*", ">"]
                    + [subjects.req_out(rid), subjects.req_any(rid)]
                )
                await alice.nc.subscribe(subject, cb=forbidden)
                want["violations"] += 1
            elif op == 6:  # take over bob's id
                req = GenerateRequest(body={**BODY, "max_tokens": 4}, request_id=rid)
                await alice.nc.publish(
                    subjects.api_generate("alice"), encode(req), reply=f"_INBOX.alice.r{i}"
                )
                want["in_use"] += 1
            elif op == 7:  # stream her request into bob's inbox
                req = GenerateRequest(
                    body={**BODY, "max_tokens": 4}, stream_subject=f"_INBOX.bob.{rid}"
                )
                await alice.nc.publish(
                    subjects.api_generate("alice"), encode(req), reply=f"_INBOX.alice.r{i}"
                )
                want["stream"] += 1
            else:  # or have the gateway answer into bob's inbox
                req = GenerateRequest(body={**BODY, "max_tokens": 4, "stream": False})
                await alice.nc.publish(
                    subjects.api_generate("alice"), encode(req), reply=f"_INBOX.bob.{rid}"
                )
                want["reply"] += 1
        await alice.refused("pub", "no.such.subject")  # every violation before it has arrived
        violations = [e for e in alice.errors if "permissions violation" in e]
        assert len(violations) == want["violations"] + alice.canaries

        def in_use() -> int:
            return sum(1 for e in alice_events if e.error and "is in use" in e.error.message)

        for _ in range(1000):  # the gateway works through what alice sent
            done = {op: refused(op) - before[op] for op in before}
            if in_use() == want["in_use"] and all(done[op] == want[op] for op in done):
                break
            await asyncio.sleep(0.02)
        leaks += [f"{r} ended before bob ended it" for r in bob_rids if bob_events[r][-1].done]
        assert leaks == [], leaks
        assert {op: refused(op) - before[op] for op in before} == {op: want[op] for op in before}
        assert in_use() == want["in_use"]
        assert sum(1 for e in alice_events if e.status == 400) == want["in_use"] + want["stream"]

        counts = {r: len(e) for r, e in bob_events.items()}
        while any(len(bob_events[r]) < counts[r] + 3 for r in bob_rids):
            await asyncio.sleep(0.02)  # bob's streams run on
        assert not any(e.done for r in bob_rids for e in bob_events[r])
        for rid in bob_rids:  # bob, the owner, may cancel: with the same subject and key
            await bob.nc.publish(subjects.api_cancel("bob"), encode(ApiCancel(request_id=rid)))
        while not all(any(e.done for e in bob_events[r]) for r in bob_rids):
            await asyncio.sleep(0.02)
        for rid in bob_rids:
            finals = [
                e.data["choices"][0]["finish_reason"]
                for e in bob_events[rid]
                if e.data and e.data["choices"]
            ]
            assert finals[-1] == "abort" and len(finals) < 4000, rid
        assert leaks == [], leaks
        print(f"fuzz: {FUZZ_OPS} attempts by alice, {want}, leaks: {len(leaks)}")
        await alice.nc.close()
        await bob.nc.close()
