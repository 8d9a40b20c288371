"""Chaos and bus fuzz on one real supervised cluster (`Cluster(restart=True)`: every role, the
tiny default model, one prefill and one decode instance, kvstore + MinIO) in the secured
deployment: NATS users per role, the KV plane on mutual TLS, the gateway behind an API key. The
fuzzer publishes each subject as the NATS user allowed to (a compromised service of that role).

`test_bus_fuzz` sends random, truncated, wrong-shape and oversized payloads on every subject
family: every request subject answers a typed ``bad_request`` error, the consumers count what
they drop, and no process exits (no restart happened).

`test_chaos` kills one role with SIGKILL (or nats-server) under a light streaming load (a few
greedy streams): each in-flight stream completes token-identical to the in-process reference or
ends cleanly the way that role's loss allows (an SSE error event naming the cause; the client's
connection closed for the gateway itself), never a hang; the launcher restarts the process by
itself, and a new request succeeds before a generous deadline. The recovery time (kill to the
first new request answered) is printed with the load average: docs/OPERATIONS.md lists it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import msgpack
import pytest
import torch

from services.infra import nats_auth
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sampling import SamplingParams
from shared.protocol.sched import InstancesRequest, RouteRequest, SchedulerState
from shared.protocol.stream import Cancel
from shared.protocol.tok import TokenizeRequest
from shared.protocol.vision import VisionEncodeRequest
from shared.protocol.work import WorkItem
from tests.cluster.conftest import scrape, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STREAMS = 4
MAX_TOKENS = 200
RECOVERY_DEADLINE = 150.0  # seconds from the kill to a served request (generous: a loaded box)
CLIENT_TIMEOUT = 90.0  # a stream still open after this is a hang
API_KEY = "sk-chaos-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MEASURED: dict[str, tuple[float, float]] = {}  # victim -> (served again, restarted), s

# What an in-flight stream may do when this process dies: "complete" (token-identical to the
# reference), "error" (an SSE error event naming the cause), "cut" (the connection closes:
# the process holding it is gone). Each stream must end in one of its role's outcomes.
OUTCOMES = {
    "decode-0": {"error"},  # the only decode instance held the streams' KV
    "prefill-0": {"complete"},  # the streams live on decode once they have tokens
    "kvstore-0": {"complete"},
    "scheduler-0": {"complete"},
    "tokenizer-0": {"complete"},
    "vision-0": {"complete"},  # text streams never reach it
    "gateway-0": {"cut"},
    "nats": {"error"},  # the gateway fails its open streams when its connection drops
}


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    c = start_cluster(
        default_model_dir,
        prefill=1,
        decode=1,
        kvstore=1,
        vision=1,
        minio=True,
        torch_threads=1,
        restart=True,
        env={"STRATA_STALL_TIMEOUT": "10", "STRATA_API_KEYS": API_KEY},
    )
    assert c.certs and c.cfg.nats_auth, "the chaos test runs the secured deployment"
    try:
        yield c
    finally:
        c.stop()
        if MEASURED:
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(
                f"\nrecovery in s (kill -> first new request served, kill -> the process is "
                f"back and ready), load average {load}:"
            )
            for name, (served, back) in MEASURED.items():
                print(f"  {name:12s} {served:6.1f} {back:6.1f}")


def model_name(c) -> str:
    r = httpx.get(c.gateway_url + "/v1/models", timeout=10, headers=AUTH)
    return r.json()["data"][0]["id"]


def prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Chaos story {i} about queues."}] for i in range(STREAMS)]


@pytest.fixture(scope="module")
def expected(default_model_dir) -> list[list[str]]:
    """Greedy token texts per prompt from the engine in-process (no services involved)."""
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    engine = LLMEngine(load_model(default_model_dir), EngineConfig(kv_cache_bytes=64 << 20))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, list[str]] = {f"r{i}": [] for i in range(STREAMS)}
    with torch.inference_mode():
        for i, m in enumerate(prompts()):
            ids = tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))
            engine.add_request(f"r{i}", ids, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += [
                    tok.decode([t], skip_special_tokens=False) for t in o.new_token_ids
                ]
    return [out[f"r{i}"] for i in range(STREAMS)]


# ---------------------------------------------------------------- bus fuzz


def garbage(valid: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Random, truncated, wrong-shape and oversized versions of one subject's message."""
    return [
        ("empty", b""),
        ("random", rng.randbytes(64)),
        ("random-4k", rng.randbytes(4096)),
        ("truncated", valid[: len(valid) // 2]),
        ("truncated-1", valid[:-1]),
        ("list", msgpack.packb([1, 2, 3])),
        ("int", msgpack.packb(42)),
        ("wrong-types", msgpack.packb({"request_id": 7, "prompt_token_ids": "x", "role": [1]})),
        ("error-map", msgpack.packb({"__error__": {"code": 5}})),
        ("deep", b"\x91" * 100_000 + b"\xc0"),
        ("oversized", msgpack.packb({"junk": b"\0" * (6 << 20)})),
    ]


def valid_messages() -> dict[str, bytes]:
    item = WorkItem(request_id="fz", prompt_token_ids=[1, 2, 3], sampling=SamplingParams())
    return {
        subjects.TOK_ENCODE: encode(TokenizeRequest(request_id="fz", prompt="hi")),
        subjects.VISION_ENCODE: encode(VisionEncodeRequest(request_id="fz", images=[b"x"])),
        subjects.SCHED_ROUTE: encode(RouteRequest(request_id="fz", num_prompt_tokens=3)),
        subjects.SCHED_INSTANCES: encode(InstancesRequest(role="decode")),
        subjects.prefill_submit("prefill-0"): encode(item),
        subjects.decode_submit("decode-0"): encode(item),
        subjects.req_cancel("fz"): encode(Cancel(request_id="fz")),
        subjects.API_GENERATE: encode(GenerateRequest(body={"prompt": "hi"})),
    }


PUBLISHED = {  # subjects nobody replies on: the consumer counts and drops what is bad
    subjects.kv_events("decode-0"): encode(
        KVEvent(
            instance_id="decode-0",
            incarnation="x",
            seq=1,
            tier="engine",
            kind="stored",
            hashes=["0" * 32],
        )
    ),
    subjects.load_report("decode", "decode-0"): encode(
        LoadReport(instance_id="decode-0", role="decode", incarnation="x", ts=time.time())
    ),
    subjects.SCHED_STATE: encode(SchedulerState()),
}


PUBLISHER = {  # subject family -> the NATS user allowed to publish it
    "strata.tok.": "gateway",
    "strata.vision.": "gateway",
    "strata.sched.route": "gateway",
    "strata.sched.instances": "gateway",
    "strata.req.": "gateway",
    "strata.prefill.": "scheduler",
    "strata.decode.": "scheduler",
    "strata.sched.state": "scheduler",
    "strata.api.": "api",
    "strata.kv.events.": "decode",
    "strata.load.": "decode",
}


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` the rest."""
    p, t = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or (tok != "*" and tok != t[i]):
            return False
    return len(p) == len(t)


def publisher(subject: str) -> str:
    """The user that publishes ``subject``, checked against the server's permission table."""
    user = next(u for p, u in PUBLISHER.items() if subject.startswith(p))
    allowed = nats_auth.permissions(user)["publish"]["allow"]
    assert any(_matches(a, subject) for a in allowed), (user, subject)
    return user


def test_bus_fuzz(cluster, default_model_dir):
    from shared.bus import connect

    rng = random.Random(7)
    sched_bad = "strata_scheduler_bad_messages_total"

    async def run() -> dict[str, list[str]]:
        users = {
            u: await connect(cluster.nats_url, f"fuzzer-{u}", cluster.nats_credentials(u))
            for u in set(PUBLISHER.values())
        }
        answers: dict[str, list[str]] = {}
        try:
            for subject, valid in valid_messages().items():
                nc = users[publisher(subject)]
                for what, data in garbage(valid, rng):
                    reply = await nc.request(subject, data, timeout=30)
                    if subject == subjects.API_GENERATE:
                        ev = decode(reply.data, GenerateEvent)
                        assert ev.done and ev.error is not None, (subject, what, ev)
                        code = ev.error.code
                        assert ev.status == 400, (subject, what, ev)
                    else:
                        with pytest.raises(StrataError) as err:
                            decode(reply.data, InstancesRequest)
                        code = err.value.code
                    answers.setdefault(subject, []).append(f"{what}:{code}")
            for subject, valid in PUBLISHED.items():
                nc = users[publisher(subject)]
                for _, data in garbage(valid, rng):
                    await nc.publish(subject, data)
                await nc.flush()
        finally:
            for nc in users.values():
                await nc.drain()
        return answers

    before = sum(scrape(cluster, "scheduler-0", sched_bad).values())
    answers = asyncio.run(run())
    for subject, got in answers.items():  # a typed bad_request for every payload
        assert all(a.endswith(":bad_request") for a in got), (subject, got)
        assert len(got) == 11, subject
    time.sleep(1.0)  # the published garbage reached the scheduler
    after = scrape(cluster, "scheduler-0", sched_bad)
    assert sum(after.values()) - before >= 2 * 11 - 2, after  # kv events + load reports
    assert all(cluster.alive(n) for n in cluster.names()), "a service exited"
    assert not any(cluster.watchdog.restarts().values()), cluster.watchdog.restarts()
    r = httpx.post(
        cluster.gateway_url + "/v1/completions",
        timeout=30,
        headers=AUTH,
        json={"model": model_name(cluster), "prompt": "ok", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text  # still serving


# ---------------------------------------------------------------- chaos


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, msgs: list[dict], progress: list[int], i: int
) -> tuple[str, object]:
    """("complete", token texts), ("error", message), ("status", code) or ("cut", exception)."""
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 0,
    }
    toks: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return "status", (r.status_code, (await r.aread())[:300])
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or done:
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    return "error", obj["error"]["message"]
                for ch in obj["choices"]:
                    for t in (ch.get("logprobs") or {}).get("content") or ():
                        toks.append(t["token"])
                        progress[i] += 1
            assert done, "stream ended without [DONE]"
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        return "cut", repr(exc)
    return "complete", toks


async def until_served(url: str, model: str, deadline: float) -> float:
    """Poll with small requests until one is answered 200; returns the time it was."""
    async with httpx.AsyncClient(timeout=10.0, headers=AUTH) as cl:
        while time.monotonic() < deadline:
            try:
                r = await cl.post(
                    url + "/v1/completions",
                    json={"model": model, "prompt": "ping", "max_tokens": 4},
                )
                if r.status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    pytest.fail(f"not serving {RECOVERY_DEADLINE:.0f}s after the kill")


def back_up(c, name: str, before: int, deadline: float) -> float:
    """The watchdog restarted ``name`` and it is ready again: the time it was seen so."""
    while time.monotonic() < deadline:
        if c.watchdog.restarts()[name] > before:
            if name in ("nats", "minio"):
                server = c.nats if name == "nats" else c.minio
                if server.proc.poll() is None:
                    return time.monotonic()
            elif c.alive(name) and c.sup.procs[name].ready.is_set():
                return time.monotonic()
        time.sleep(0.05)
    pytest.fail(f"{name} was not restarted: {c.watchdog.restarts()}")


@pytest.mark.parametrize("victim", list(OUTCOMES))
def test_chaos(cluster, expected, victim):
    c = cluster
    c.wait_healthy(120)
    model = model_name(c)
    restarts_before = c.watchdog.restarts()[victim]

    async def run() -> tuple[list[tuple[str, object]], float, int]:
        progress = [0] * STREAMS
        limits = httpx.Limits(max_connections=STREAMS + 2)
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=limits, headers=AUTH) as cl:
            tasks = [
                asyncio.create_task(stream_one(cl, c.gateway_url, model, m, progress, i))
                for i, m in enumerate(prompts())
            ]
            while min(progress) < 2 and not any(t.done() for t in tasks):
                await asyncio.sleep(0.02)
            live = sum(not t.done() for t in tasks)
            t_kill = time.monotonic()
            await asyncio.to_thread(c.crash, victim)
            got = await asyncio.gather(*tasks)
        served = await until_served(c.gateway_url, model, t_kill + RECOVERY_DEADLINE)
        back = await asyncio.to_thread(
            back_up, c, victim, restarts_before, t_kill + RECOVERY_DEADLINE
        )
        return got, served - t_kill, live, back - t_kill

    got, recovery, live, restarted = asyncio.run(run())
    MEASURED[victim] = (recovery, restarted)
    print(f"{victim}: outcomes {[k for k, _ in got]}, served again after {recovery:.1f}s")
    assert live >= STREAMS // 2, f"only {live} streams were in flight at the kill"
    allowed = OUTCOMES[victim]
    for i, (kind, detail) in enumerate(got):
        assert kind in allowed, (victim, i, kind, detail)
        if kind == "complete":
            assert detail == expected[i], f"stream {i} differs from the reference"
        if kind == "error":
            assert detail, "an error event without a message"
    assert c.watchdog.restarts()[victim] == restarts_before + 1
