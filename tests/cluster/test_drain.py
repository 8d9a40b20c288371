"""`strata drain` (the Kubernetes preStop hook of compose/k8s/prefill.yaml and decode.yaml) on a
real cluster: real nats-server with per-role users, two decode processes each with its drain
socket, the tiny default model, streams through the REST gateway.

While streams run on both instances, `strata drain` (a subprocess, with the instance's
``STRATA_DRAIN_SOCKET`` in its environment as in the pod) retires the busier one: it reports the
requests it holds, a stream started during the drain is served by the other instance, every
stream ends with all its tokens and none failed over (the drained instance finished its own),
the command exits 0 once the drain is over, and the instance then exits with the retired code,
which the launcher does not restart. A drain that did not wait would cut the streams: they would
fail over (counted by the gateway) and the command would report them still open (exit 1).

Then SIGTERM alone, what Kubernetes sends after the hook (or without one), on an instance
holding streams: it does not drain. It stops at once and hands its streams off (an
``unavailable`` error naming it); they fail over to the other instance and end with all their
tokens, counted as failovers by the gateway.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from services.infra.procs import repo_root
from shared.protocol.sched import RETIRED_EXIT
from tests.cluster.conftest import API_KEY, AUTH, scrape, start_cluster
from tests.cluster.test_autoscale import _stream, _wait

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STREAMS = 6
# outlasts the drain command's start (a Python process: 3-4 s on a loaded 2-core box) and the late
# stream after it more than 2x over (checked: the drain is still going when the late stream ends)
MAX_TOKENS = 1200
KILL_TOKENS = 400  # outlasts the SIGTERM, sent as soon as every stream runs (checked: held >= 1)


def _running(c, name: str) -> float:
    return sum(scrape(c, name, "strata:engine_num_requests_running").values())


def test_strata_drain_finishes_the_streams_then_retires(default_model_dir, tmp_path):
    socks = {n: str(tmp_path / f"{n}.sock") for n in ("decode-0", "decode-1")}
    c = start_cluster(
        default_model_dir,
        prefill=0,
        decode=1,
        vision=0,
        kvstore=0,
        torch_threads=1,
        minio=False,
        env={"STRATA_API_KEYS": API_KEY, "STRATA_DRAIN_SOCKET": socks["decode-0"]},
    )
    try:
        c.start_service("decode", env={"STRATA_DRAIN_SOCKET": socks["decode-1"]})
        live = "strata_scheduler_live_instances"
        _wait("2 live decodes", lambda: scrape(c, "scheduler-0", live)['{role="decode"}'] == 2, 60)

        async def main():
            async with httpx.AsyncClient(headers=AUTH, timeout=240) as client:
                url = c.gateway_url
                model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
                streams = [
                    asyncio.create_task(_stream(client, url, model, i, MAX_TOKENS))
                    for i in range(STREAMS)
                ]
                every = lambda: sum(_running(c, n) for n in socks) == STREAMS  # noqa: E731
                await asyncio.to_thread(_wait, "every stream running", every, 60)
                name = max(socks, key=lambda n: _running(c, n))
                other = next(n for n in socks if n != name)
                # as the preStop hook runs it: `strata drain` with the pod's environment
                drain = subprocess.Popen(
                    [sys.executable, "-m", "services.cli", "drain"],
                    env={**os.environ, "STRATA_DRAIN_SOCKET": socks[name]},
                    cwd=repo_root(),
                    stderr=subprocess.PIPE,
                    text=True,
                )
                assert drain.stderr is not None
                first = await asyncio.to_thread(drain.stderr.readline)
                # the scheduler has the instance's draining load report: it routes nothing there
                one = lambda: scrape(c, "scheduler-0", live)['{role="decode"}'] == 1  # noqa: E731
                await asyncio.to_thread(_wait, "the scheduler to stop routing there", one, 30)
                late = await _stream(client, url, model, 100, 16)
                assert drain.poll() is None, "the drain was over before the late stream ended"
                rest = await asyncio.to_thread(drain.stderr.read)
                rc = await asyncio.to_thread(drain.wait, 60)
                return name, other, first, rest, rc, await asyncio.gather(*streams), late

        name, other, first, rest, rc, done, late = asyncio.run(main())
        assert f"drain: {name} (decode) draining: " in first, first
        assert int(first.split("draining: ")[1].split()[0]) >= 1  # it held live streams
        assert rc == 0 and "drain: drained in " in rest, (rc, rest)
        assert done == [(MAX_TOKENS, "length")] * STREAMS
        assert late == (16, "length")
        failovers = scrape(c, "gateway-0", "strata:stream_failovers_total")
        assert sum(failovers.values()) == 0, failovers  # the drained instance finished its own
        deadline = time.monotonic() + 60
        while c.sup.procs[name].returncode is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.sup.procs[name].returncode == RETIRED_EXIT
        assert not c.sup.wanted(name) and c.alive(other)

        # SIGTERM alone (what the kubelet sends after the hook, or without one) does not drain:
        # the instance stops at once and hands its streams off; they fail over, token-identical
        c.start_service("decode", env={"STRATA_DRAIN_SOCKET": ""})
        _wait("2 live decodes", lambda: scrape(c, "scheduler-0", live)['{role="decode"}'] == 2, 60)
        pair = [other, c.names("decode")[-1]]

        async def terminate():
            async with httpx.AsyncClient(headers=AUTH, timeout=240) as client:
                url = c.gateway_url
                model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
                streams = [
                    asyncio.create_task(_stream(client, url, model, 200 + i, KILL_TOKENS))
                    for i in range(STREAMS)
                ]
                every = lambda: sum(_running(c, n) for n in pair) == STREAMS  # noqa: E731
                await asyncio.to_thread(_wait, "every stream running", every, 60)
                victim = max(pair, key=lambda n: _running(c, n))
                held = _running(c, victim)
                await asyncio.to_thread(c.kill, victim, signal.SIGTERM)
                return victim, held, await asyncio.gather(*streams)

        victim, held, done = asyncio.run(terminate())
        assert held >= 1 and c.sup.procs[victim].returncode == 0  # a plain stop, not retired
        assert done == [(KILL_TOKENS, "length")] * STREAMS  # nothing lost ...
        failovers = sum(scrape(c, "gateway-0", "strata:stream_failovers_total").values())
        assert failovers >= 1  # ... but handed off, not drained: the preStop hook is needed
    finally:
        c.stop()
