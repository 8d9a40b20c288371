"""Gateway, tokenizer, scheduler, prefill, decode and kvstore on different namespace hosts,
reaching each other only by the addresses they advertise (nats-server on its own host):

- isolating a decode host (its link down) under streaming load fails its streams over to the
  decode instance on another host, token-identical to the in-process greedy reference;
- a decode instance started on a new host gets some of the first four requests sent after its
  ready line (the delay to its first submit is printed, not asserted)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from services.cluster_config import ensure_model
from tests.cluster.test_decode_failover import MAX_TOKENS, prompts, reference, stream_one
from tests.multihost.hosts import API_KEY, Deployment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CLIENT_HOST = 2  # the gateway's host
RUNNING = "strata:engine_num_requests_running"
WAITING = "strata:engine_num_requests_waiting"
STREAMS = 12  # each engine runs one at a time, the rest queued there
TOKENS = 1000  # a stream lasts about 0.5 s on the tiny model: the cut host's queue, seconds


@pytest.fixture(scope="module")
def model_dir() -> str:
    return ensure_model("")


def deploy(
    net, model_dir: str, tmp_path, decode_hosts: dict[str, int], decode_env=None
) -> Deployment:
    d = Deployment(net, model_dir, tmp_path, env={"STRATA_STALL_TIMEOUT": "10"})
    d.kvstore_addrs = [f"{net.addr(7)}:50051"]
    d.start("kvstore", "kvstore-0", 7, env={"STRATA_GRPC_PORT": "50051"})
    d.start("scheduler", "scheduler-0", 3)
    d.start("tokenizer", "tokenizer-0", 2)
    d.start("gateway", "gateway-0", 2)
    d.start("prefill", "prefill-0", 4)
    for name, host in decode_hosts.items():
        d.start("decode", name, host, env=decode_env)
    for svc in d.services.values():
        svc.wait_ready()
    net.run_in(CLIENT_HOST, d.wait_gateway_ready)

    def scheduler_sees_every_decode() -> None:  # else the first streams may all go to one
        end = time.monotonic() + 60
        live = 0.0
        while time.monotonic() < end:
            live = d.metric("scheduler-0", "strata_scheduler_live_instances", 'role="decode"')
            if live >= len(decode_hosts):
                return
            time.sleep(0.2)
        raise AssertionError(f"the scheduler sees {live} of {len(decode_hosts)} decode instances")

    net.run_in(3, scheduler_sees_every_decode)
    return d


async def run_streams(d: Deployment, msgs, on_way=None, max_tokens: int = MAX_TOKENS) -> list:
    progress = [0] * len(msgs)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(timeout=180.0, headers=auth) as cl:
        model = (await cl.get(d.gateway_url + "/v1/models")).json()["data"][0]["id"]
        tasks = [
            asyncio.create_task(stream_one(cl, d.gateway_url, model, m, progress, i, max_tokens))
            for i, m in enumerate(msgs)
        ]
        # the fault once a stream is decoding: each engine (one running sequence each) still
        # holds its queued streams then; waiting for every stream let a fast engine finish
        # most of them first, leaving nothing on the cut host to fail over
        while on_way and max(progress) < 2 and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        if on_way:
            await asyncio.to_thread(on_way)
        return await asyncio.gather(*tasks)


def test_isolated_decode_host_fails_over_token_identical(net_factory, model_dir, tmp_path):
    msgs = prompts()[:STREAMS]
    expected = reference(model_dir, msgs, TOKENS)
    net = net_factory(7)
    hosts = {"decode-0": 5, "decode-1": 6}
    # one stream at a time per decode engine, the rest queued there, load reported every 0.1 s:
    # an instance's streams outlast the report that says it holds some
    one = {"STRATA_MAX_NUM_SEQS": "1", "STRATA_LOAD_INTERVAL": "0.1"}
    d = deploy(net, model_dir, tmp_path, hosts, one)
    held: dict[str, float] = {}

    def cut() -> None:
        """Isolate the first decode host found holding streams: the precondition is that its
        engine's running batch and queue, reported every load interval, are not empty (a count
        of the submits it took would also count streams that already finished). Its link goes
        down right after that one reading, before the other host is read: the two readings took
        long enough for a fast engine to finish the streams the first one saw."""
        end = time.monotonic() + 30
        while time.monotonic() < end:
            for name, host in hosts.items():
                held[name] = net.run_in(
                    host, lambda n=name: d.metric(n, RUNNING) + d.metric(n, WAITING)
                )
                if held[name] >= 1:
                    held["cut"] = host
                    net.link_down(host)
                    return
            time.sleep(0.02)
        raise AssertionError(f"no decode instance held a stream: {held}")

    got = net.run_in(
        CLIENT_HOST, lambda: asyncio.run(run_streams(d, msgs, on_way=cut, max_tokens=TOKENS))
    )
    victim = next(n for n, h in hosts.items() if h == held["cut"])
    for i in range(STREAMS):
        assert [t for t, _ in got[i]] == [t for t, _ in expected[i]], f"stream {i}"
    failovers = net.run_in(
        CLIENT_HOST, lambda: d.metric("gateway-0", "strata:stream_failovers_total")
    )
    print(f"gateway failovers {failovers} (cut {victim}, held {held})")
    assert failovers >= 1  # its streams, cut off with its host, moved to the other one
    assert d.services[victim].proc.poll() is None  # isolated, not killed


def test_new_decode_host_is_routed_to_after_its_ready_line(net_factory, model_dir, tmp_path):
    """The first requests sent after the new instance's ready line reach it (four at once: the
    scheduler counts each one routed against its instance, so the idle newcomer gets some). The
    delay from the ready line to its first handled submit is watched while they run, and
    printed (speed is reported, not asserted)."""
    net = net_factory(8)
    d = deploy(net, model_dir, tmp_path, {"decode-0": 5})
    new = d.start("decode", "decode-1", 8)
    ready = new.wait_ready()
    subject = "strata.decode.*.submit"  # the family label; the counter is decode-1's own

    def handled() -> float:
        return net.run_in(
            8, lambda: d.metric("decode-1", "strata_handler_requests_total", f'subject="{subject}"')
        )

    base = handled()
    first: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # the moment decode-1 answered its first submit, polled every 20 ms
        while not stop.is_set() and not first:
            if handled() > base:
                first.append(time.monotonic())
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        net.run_in(CLIENT_HOST, lambda: asyncio.run(run_streams(d, prompts()[:4])))
        watcher.join(5)
    finally:
        stop.set()
    assert first, "the first four requests after decode-1's ready line did not reach it"
    print(f"decode-1 on a new host handled its first submit {first[0] - ready:.2f}s after ready")
