"""The clustered deployment of docs/DEPLOY.md under load, one fault at a time.

One deployment on 13 namespace hosts, secured as deployed (NATS users per role, the KV plane on
mutual TLS, an API key on the gateway): a 3-node NATS cluster with JetStream R3 (hosts 1-3),
distributed MinIO with 4 drives over 2 hosts (two single-drive nodes on each of hosts 2 and 3),
the gateway and tokenizer on host 1, the kvstore on host 4 (a 1 MiB DRAM tier, so pool blocks
live in MinIO), two scheduler replicas, two decode and two prefill instances each on a host of
its own, and spare hosts for replacements. The tiny default model.

Each phase sends 64 greedy streams (staggered over about 1.3 s, so at the fault some are being
routed, some prefilled, some decoded) and injects its fault once 8 streams have two tokens:
kill one NATS node (the one, away from the gateway's, holding most service connections), kill
the MinIO node the kvstore talks to, then kill a decode host, a scheduler replica's host and a
prefill host (its link down first, then its processes: a machine losing power, no FIN or RST).
Per phase, asserted:

- every finished stream is token-identical to the in-process greedy reference, with exactly
  ``MAX_TOKENS`` tokens (the usage chunk agrees: none lost, none duplicated), and at least half
  the streams finished;
- every other stream ended with a clear error (an SSE error event, or before its first token an
  error status with the OpenAI error body), none hung past ``STREAM_TIMEOUT`` or was cut (the
  fault-free phase: every stream finished);
- a new request sent after the fault gets its first token within ``RECOVERY_S`` (retried while
  it errors) and is token-identical too;
- after the MinIO node loss, pool blocks written before it and after it read back from MinIO
  through the kvstore (evicted from its DRAM);
- the killed NATS node had service clients; the streams of a killed decode or prefill host
  failed over (the gateway counted failovers).

Each phase then restarts (NATS, MinIO) or replaces (hosts) what it killed, so the next starts
from a whole deployment (after a scheduler replica's host, once its NATS server dropped the dead
connection, whose queue subscription still took route requests). A fault-free phase runs first
on the same deployment.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch

from services.cluster_config import ensure_model
from services.infra.kv_pki import ensure_pki
from services.infra.minio_server import MinioCredentials
from shared.kvtransfer.client import KVClient
from shared.kvtransfer.frames import frame_to_tensor, tensor_to_frames
from shared.kvtransfer.tls import GrpcTls
from tests.cluster.test_decode_failover import prompts, reference
from tests.multihost.hosts import API_KEY, Deployment, MinioCluster, NatsCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STREAMS = 64
MAX_TOKENS = 16
STAGGER_S = 0.02  # between two streams' starts
TRIGGER = 8  # the fault comes once this many streams have two tokens
STREAM_TIMEOUT = 90.0  # a stream still open after this is a hang
RECOVERY_S = 30.0  # the fault -> the first token of a new request (generous: a loaded 2-core box)
AUTH = {"Authorization": f"Bearer {API_KEY}"}

CLIENT_HOST = 1  # the gateway's: the test's HTTP client and scrapes run there
NATS_HOSTS = (1, 2, 3)
MINIO_NODES = ((2, 9000), (2, 9002), (3, 9000), (3, 9002))  # 4 drives over 2 hosts
KVSTORE_HOST = 4
PLACEMENT = {  # role -> instance -> host
    "scheduler": {"scheduler-0": 5, "scheduler-1": 6},
    "decode": {"decode-0": 7, "decode-1": 8},
    "prefill": {"prefill-0": 9, "prefill-1": 10},
}
SPARE_HOSTS = [11, 12, 13]
KVSTORE_DRAM = 1 << 20
POOL_BLOCK = 16384  # float32s: 64 KiB, 16 blocks fill the kvstore's DRAM
RUNNING = ("strata:engine_num_requests_running", "strata:engine_num_requests_waiting")
FAILOVERS = "strata:stream_failovers_total"
BY_INSTANCE = "strata_gateway_streams_by_instance"  # streams the gateway routed there, not ended
FAULTS = ["none", "nats-node", "minio-node", "decode-host", "scheduler-host", "prefill-host"]


@dataclass
class Outcome:
    """How one stream ended: "complete", "error" (SSE error event), "status" (an error status
    before the first token), "hang" (open past its timeout) or "cut" (closed without [DONE])."""

    kind: str
    tokens: list[str] = field(default_factory=list)
    detail: str = ""
    usage_tokens: int = -1
    id: str = ""  # the completion id (the request id): to find it in the services' output


class FaultedCluster:
    """The deployment, what is live per role, and the faults and their repairs."""

    def __init__(self, net, model_dir: str, tmp_path) -> None:
        self.net = net
        self.nats = NatsCluster(net, tmp_path, NATS_HOSTS)
        self.creds = MinioCredentials.load_or_create(str(tmp_path / "minio-creds.json"))
        self.minio = MinioCluster(net, tmp_path, self.creds, MINIO_NODES)
        env = {"STRATA_JS_REPLICAS": "3", "STRATA_STALL_TIMEOUT": "10"}
        self.d = Deployment(net, model_dir, tmp_path, env=env, nats=self.nats)
        self.live = {role: dict(hosts) for role, hosts in PLACEMENT.items()}
        self.spares = list(SPARE_HOSTS)
        self.kvstore_addr = f"{net.addr(KVSTORE_HOST)}:50051"
        self.client_cert = ensure_pki(self.d.pki_dir, ["client"], [net.addr(CLIENT_HOST)])["client"]

    def start(self) -> None:
        net, d = self.net, self.d
        for name in self.nats.procs:  # JetStream's meta leader elected, before any client
            net.run_in(CLIENT_HOST, lambda n=name: self.nats.wait_healthy(n))
        net.run_in(CLIENT_HOST, self.minio.wait_healthy)
        net.run_in(CLIENT_HOST, self.minio.provision)
        net.run_in(CLIENT_HOST, self.minio.wait_serving)
        d.kvstore_addrs = [self.kvstore_addr]
        kv_env = {
            "STRATA_GRPC_PORT": "50051",
            "STRATA_MINIO_ENDPOINT": self.minio.endpoints,
            "STRATA_MINIO_ACCESS_KEY": self.creds.kv_user,
            "STRATA_MINIO_SECRET_KEY": self.creds.kv_password,
            "STRATA_DRAM_BYTES": str(KVSTORE_DRAM),
            # evicted blocks wait for MinIO here (beyond it the oldest are dropped: a cache)
            "STRATA_SPILL_BUFFER_BYTES": str(16 * KVSTORE_DRAM),
        }
        d.start("kvstore", "kvstore-0", KVSTORE_HOST, env=kv_env)
        d.start("tokenizer", "tokenizer-0", CLIENT_HOST)
        d.start("gateway", "gateway-0", CLIENT_HOST)
        for role, hosts in self.live.items():
            for name, host in hosts.items():
                d.start(role, name, host)
        for svc in d.services.values():
            svc.wait_ready()
        net.run_in(CLIENT_HOST, d.wait_gateway_ready)
        self.wait_whole()

    def metric(self, name: str, metric: str, label: str = "") -> float:
        return self.net.run_in(CLIENT_HOST, lambda: self.d.metric(name, metric, label))

    def held(self, name: str) -> float:
        """Requests in ``name``'s engine (running batch and queue)."""
        return sum(self.metric(name, m) for m in RUNNING)

    def wait_whole(self, timeout: float = 60.0) -> None:
        """Every live scheduler sees two live decode and two live prefill instances."""
        end = time.monotonic() + timeout
        seen: dict[str, float] = {}
        while time.monotonic() < end:
            seen = {
                f"{s}/{role}": self.metric(s, "strata_scheduler_live_instances", f'role="{role}"')
                for s in self.live["scheduler"]
                for role in ("decode", "prefill")
            }
            if all(v >= 2 for v in seen.values()):
                return
            time.sleep(0.2)
        raise AssertionError(f"the deployment did not become whole again: {seen}")

    # ---------------------------------------------------------------- faults

    def inject(self, fault: str) -> dict:
        """Cause ``fault`` now; what was killed and what it held (runs on the client host)."""
        if fault == "nats-node":
            conns = {n: self.nats.client_names(n) for n in self.nats.procs}
            gw = next((n for n, names in conns.items() if "gateway-gateway-0" in names), "")
            victim = max((n for n in conns if n != gw), key=lambda n: len(conns[n]))
            self.nats.kill(victim)
            return {"killed": victim, "clients": conns[victim]}
        if fault == "minio-node":
            self.minio.kill(0)  # the kvstore's MinioTier starts on the first endpoint
            return {"killed": self.minio.endpoint(0)}
        role = fault.removesuffix("-host")
        names = sorted(self.live[role])
        held = {}
        if role == "decode":  # the gateway's count, exact (the engines' gauges lag 0.5 s)
            held = {n: self.metric("gateway-0", BY_INSTANCE, f'instance="{n}"') for n in names}
        elif role == "prefill":  # a prompt stays there briefly: the gauges rarely catch one
            held = {n: self.held(n) for n in names}
        victim = max(names, key=lambda n: held.get(n, 0.0))  # the busier one
        host = self.live[role].pop(victim)
        self.net.kill_host(host)
        return {"killed": victim, "host": host, "held": held.get(victim), "at": time.monotonic()}

    def repair(self, fault: str, info: dict) -> None:
        """Restart (servers) or replace on a spare host (instances) what ``fault`` killed."""
        if fault == "nats-node":
            self.nats.start(info["killed"])
            self.net.run_in(CLIENT_HOST, lambda: self.nats.wait_healthy(info["killed"]))
        elif fault == "minio-node":
            self.minio.start(0)
            self.net.run_in(CLIENT_HOST, lambda: self.minio.wait_healthy(0))
            self.net.run_in(CLIENT_HOST, self.minio.wait_serving)
        elif fault != "none":
            role = fault.removesuffix("-host")
            name, host = f"{role}-r{len(self.spares)}", self.spares.pop(0)
            self.d.start(role, name, host).wait_ready()
            self.live[role][name] = host
            if role == "scheduler":
                info["lingered"] = self.wait_forgotten(f"scheduler:{info['killed']}", info["at"])
        self.wait_whole()

    def wait_forgotten(self, client: str, since: float, timeout: float = 60.0) -> float:
        """Seconds from ``since`` until no NATS node lists ``client`` (a dead host's connection:
        its server keeps its queue subscriptions, and gives them requests, until it drops it),
        so the next phase starts without it; at most ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            names = self.net.run_in(
                CLIENT_HOST, lambda: [c for n in self.nats.procs for c in self.nats.client_names(n)]
            )
            if client not in names:
                break
            time.sleep(0.5)
        return time.monotonic() - since

    # ---------------------------------------------------------------- the pool in MinIO

    async def pool_put(self, kv: KVClient, blocks: dict[str, torch.Tensor]) -> None:
        frames = [f for k, t in blocks.items() for f in tensor_to_frames(t, key=k, fingerprint="f")]
        rep = await kv.push(frames, timeout=30)
        assert sorted(rep.stored) == sorted(blocks)

    async def pool_in_minio(self, kv: KVClient, keys: list[str], timeout: float = 40.0) -> None:
        """Until the kvstore holds ``keys`` only in the SSD tier (evicted from DRAM, written)."""
        end = time.monotonic() + timeout
        tiers: dict[str, str] = {}
        while time.monotonic() < end:
            tiers = await kv.query(keys, "f")
            if all(tiers.get(k) == "ssd" for k in keys):
                return
            await asyncio.sleep(0.3)
        raise AssertionError(f"pool blocks not in MinIO: {sorted(set(tiers.values()))} {tiers}")

    def pool(self, step: str, blocks: dict[str, dict[str, torch.Tensor]]) -> None:
        """``before``: write blocks "a" and push them out of DRAM (into MinIO). ``after``: the
        same for blocks "b", then read "a" and "b" back; through the kvstore's gRPC (mTLS)."""

        async def run() -> None:
            cert = self.client_cert
            kv = KVClient(self.kvstore_addr, tls=GrpcTls.from_files(cert.cert, cert.key, cert.ca))
            try:
                tag = "a" if step == "before" else "b"
                blocks[tag] = random_blocks(16)
                await self.pool_put(kv, blocks[tag])
                await self.pool_put(kv, random_blocks(16))  # evicts them from the 1 MiB DRAM
                await self.pool_in_minio(kv, list(blocks[tag]))
                if step == "after":
                    want = {**blocks["a"], **blocks["b"]}
                    got = {}
                    async for f in kv.pull(list(want), "f", timeout=60):
                        got[f.key] = frame_to_tensor(f)
                    assert sorted(got) == sorted(want), "pool blocks missing after the node loss"
                    assert all(torch.equal(got[k], want[k]) for k in want)
            finally:
                await kv.close()

        self.net.run_in(CLIENT_HOST, lambda: asyncio.run(run()))


def random_blocks(n: int) -> dict[str, torch.Tensor]:
    return {os.urandom(16).hex(): torch.randn(POOL_BLOCK) for _ in range(n)}


# -------------------------------------------------------------------- streams


async def stream(
    cl: httpx.AsyncClient, url: str, body: dict, progress: list[int], i: int, first: list[float]
) -> Outcome:
    """One streamed chat completion; ``first`` gets the time of its first token."""
    toks: list[str] = []
    usage, rid = -1, ""
    try:
        async with asyncio.timeout(STREAM_TIMEOUT):
            async with cl.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    with_msg = json.loads(raw).get("error", {}).get("message", "") if raw else ""
                    return Outcome("status", detail=f"{r.status_code}: {with_msg}")
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        return Outcome("complete", toks, usage_tokens=usage, id=rid)
                    if not line.startswith("data: "):
                        continue
                    obj = json.loads(line[6:])
                    rid = obj.get("id", rid)
                    if "error" in obj:
                        return Outcome("error", toks, obj["error"].get("message", ""), id=rid)
                    if obj.get("usage"):
                        usage = obj["usage"]["completion_tokens"]
                    for ch in obj["choices"]:
                        for t in (ch.get("logprobs") or {}).get("content") or ():
                            toks.append(t["token"])
                            progress[i] += 1
                            if not first:
                                first.append(time.monotonic())
    except TimeoutError:
        return Outcome("hang", toks, f"open after {STREAM_TIMEOUT:.0f}s")
    except httpx.HTTPError as exc:
        return Outcome("cut", toks, repr(exc))
    return Outcome("cut", toks, "the body ended without [DONE]")


def chat(model: str, msgs: list[dict]) -> dict:
    return {
        "model": model,
        "messages": msgs,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 0,
        "stream_options": {"include_usage": True},
    }


async def recovery(cl, url: str, model: str, msgs: list[dict], t_fault: float) -> tuple:
    """(seconds from the fault to the first token of a new request that completed, its outcome,
    tries): new requests, one after another, until one completes (at most ``RECOVERY_S``)."""
    tries = 0
    while time.monotonic() < t_fault + RECOVERY_S:
        tries += 1
        first: list[float] = []
        out = await stream(cl, url, chat(model, msgs), [0], 0, first)
        if out.kind == "complete":
            return first[0] - t_fault, out, tries
        await asyncio.sleep(0.2)
    return float("inf"), None, tries


async def phase(c: FaultedCluster, fault: str, model: str, msgs: list) -> dict:
    """The 64 streams with ``fault`` injected under them, and a new request after it."""
    progress = [0] * STREAMS
    url = c.d.gateway_url
    limits = httpx.Limits(max_connections=STREAMS + 4)
    async with httpx.AsyncClient(timeout=STREAM_TIMEOUT, limits=limits, headers=AUTH) as cl:

        async def one(i: int) -> Outcome:
            await asyncio.sleep(i * STAGGER_S)
            return await stream(cl, url, chat(model, msgs[i]), progress, i, [])

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        end = time.monotonic() + 60
        while sum(p >= 2 for p in progress) < TRIGGER and time.monotonic() < end:
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        live = sum(not t.done() for t in tasks)
        t_fault = time.monotonic()
        info = await asyncio.to_thread(c.inject, fault) if fault != "none" else {}
        probe = asyncio.create_task(recovery(cl, url, model, msgs[0], t_fault))
        got = await asyncio.gather(*tasks)
        info.update(live=live, outcomes=got, recovery=await probe)
        return info


# -------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def cluster(module_net_factory, tmp_path_factory):
    model_dir = ensure_model("")
    msgs = prompts(STREAMS)
    expected = [[t for t, _ in r] for r in reference(model_dir, msgs, MAX_TOKENS)]
    net = module_net_factory(max(SPARE_HOSTS))
    tmp = tmp_path_factory.mktemp("faults")
    c = FaultedCluster(net, model_dir, tmp)
    try:
        t0 = time.monotonic()
        c.start()
        print(f"\ndeployed in {time.monotonic() - t0:.1f}s")
        auth = {"headers": AUTH, "timeout": 10}
        models = net.run_in(CLIENT_HOST, lambda: httpx.get(c.d.gateway_url + "/v1/models", **auth))
        yield c, models.json()["data"][0]["id"], msgs, expected
    finally:
        for name, svc in c.d.services.items():  # each service's output, for a failed phase
            (tmp / f"{name}.out").write_text("\n".join(svc.lines))
        print(f"service output in {tmp}")


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_under_64_streams(cluster, fault):
    c, model, msgs, expected = cluster
    t0 = time.monotonic()
    pool: dict[str, dict[str, torch.Tensor]] = {}
    if fault == "minio-node":
        c.pool("before", pool)
    failovers = c.metric("gateway-0", FAILOVERS)
    out = c.net.run_in(CLIENT_HOST, lambda: asyncio.run(phase(c, fault, model, msgs)))
    failovers = c.metric("gateway-0", FAILOVERS) - failovers
    kinds = [o.kind for o in out["outcomes"]]
    seconds, probe, tries = out["recovery"]
    summary = {k: kinds.count(k) for k in sorted(set(kinds))}
    errors = sorted({o.detail for o in out["outcomes"] if o.kind != "complete"})
    print(
        f"\n{fault}: {out.get('killed', '-')} at {out['live']} live streams; outcomes {summary}; "
        f"failovers {failovers:.0f}; first token of a new request {seconds:.2f}s after the "
        f"fault ({tries} tries); held {out.get('held', '-')}; NATS clients {out.get('clients')}; "
        f"errors {errors}"
    )
    assert out["live"] >= STREAMS // 2, f"only {out['live']} streams were live at the fault"
    assert kinds.count("complete") >= STREAMS // 2, summary  # the identity check is not empty
    for i, o in enumerate(out["outcomes"]):
        assert o.kind in ("complete", "error", "status"), (fault, i, o)
        if o.kind == "complete":  # none lost, none duplicated, each where the reference has it
            assert o.tokens == expected[i], (fault, i, o.tokens, expected[i])
            assert o.usage_tokens == MAX_TOKENS, (fault, i, o)
        else:
            assert o.detail.split(":", 1)[-1].strip(), (fault, i, "an error without a message")
    assert seconds <= RECOVERY_S, f"{fault}: no new request served {RECOVERY_S:.0f}s after it"
    assert probe.tokens == expected[0]
    if fault == "none":
        assert kinds == ["complete"] * STREAMS
    if fault == "nats-node":
        assert any(n.startswith(("decode", "prefill", "scheduler")) for n in out["clients"])
    if fault in ("decode-host", "prefill-host"):  # it held requests, which moved elsewhere
        assert failovers >= 1, f"no stream failed over from {out['killed']}'s dead host"
    if fault == "minio-node":
        c.pool("after", pool)  # written before and after the node loss, read back from MinIO
    c.repair(fault, out)
    lingered = (
        f", the dead replica's NATS connection {out['lingered']:.1f}s" if "lingered" in out else ""
    )
    print(f"{fault}: phase and repair {time.monotonic() - t0:.1f}s{lingered}")
