"""The HTTP side: stream one job through the gateway and time it; run a set of jobs open-loop
(arrival times) or closed-loop (fixed concurrency) with a tqdm bar.

Only loopback URLs are accepted. Every request is bounded by ``request_timeout`` and a run by
``deadline`` seconds (requests still open then are cancelled and counted as transport errors).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
from tqdm import tqdm

from loadtests.loadgen.stats import RequestResult
from loadtests.loadgen.workload import Job


def check_loopback(url: str) -> None:
    """Raise ValueError unless ``url``'s host resolves only to loopback addresses."""
    host = urlparse(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc}") from None
    addrs = {i[4][0] for i in infos}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"--url must be a loopback address (got {host!r} -> {sorted(addrs)})")


@dataclass
class RunConfig:
    """How requests are sent."""

    url: str  # gateway base URL, e.g. http://127.0.0.1:8000
    model: str = ""  # served model name ('' = first of /v1/models)
    request_timeout: float = 120.0  # seconds per request
    deadline: float = 600.0  # seconds per run (open requests are then cancelled)
    temperature: float = 0.0
    ignore_eos: bool = True
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request
    progress: bool = True


def body_of(job: Job, cfg: RunConfig) -> dict:
    body = {
        "model": cfg.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": job.max_tokens,
        "temperature": cfg.temperature,
        "ignore_eos": cfg.ignore_eos,
    }
    if job.prompt is not None:
        body["prompt"] = job.prompt
    else:
        body["messages"] = job.messages
    return body


async def send(client: httpx.AsyncClient, job: Job, cfg: RunConfig, t0: float) -> RequestResult:
    """Stream ``job``; TTFT/TBT are measured on content-carrying SSE chunks."""
    start = time.perf_counter()
    res = RequestResult(job.index, start - t0, tenant=job.tenant, image=job.image)
    last = None
    try:
        async with client.stream(
            "POST",
            cfg.url + job.endpoint,
            json=body_of(job, cfg),
            headers={**cfg.headers, **job.headers},
            timeout=cfg.request_timeout,
        ) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = await resp.aread()
                res.error = body.decode(errors="replace")[:300]
                return res
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))[:300]
                    continue
                if obj.get("usage"):
                    u = obj["usage"]
                    res.prompt_tokens = u.get("prompt_tokens", 0)
                    res.completion_tokens = u.get("completion_tokens", 0)
                    details = u.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                if any(_content(c) for c in obj.get("choices", ())):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
            if not done and not res.error:
                res.error = "stream ended without [DONE]"
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    except asyncio.CancelledError:
        res.error = "cancelled at the run deadline"
    res.e2e = time.perf_counter() - start
    return res


def _content(choice: dict) -> bool:
    delta = choice.get("delta")
    if delta is not None:
        return bool(delta.get("content"))
    return bool(choice.get("text"))


def new_client(max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    return httpx.AsyncClient(limits=limits, timeout=None)


async def served_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=10.0) as c:
        r = await c.get(url + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def run_jobs(
    jobs: list[Job], cfg: RunConfig, concurrency: int = 0, desc: str = "requests"
) -> tuple[list[RequestResult], float]:
    """Send ``jobs``: open loop at their ``arrival`` offsets when ``concurrency`` is 0, else
    closed loop with at most ``concurrency`` in flight. Returns (results, wall seconds)."""
    limit = concurrency or len(jobs) or 1
    sem = asyncio.Semaphore(limit)
    bar = tqdm(total=len(jobs), desc=desc, disable=not cfg.progress, leave=False)
    results: list[RequestResult] = []
    async with new_client(limit) as client:
        t0 = time.perf_counter()

        async def one(job: Job) -> None:
            if not concurrency:
                await asyncio.sleep(max(0.0, job.arrival - (time.perf_counter() - t0)))
            async with sem:
                r = await send(client, job, cfg, t0)
            r.concurrency = concurrency
            results.append(r)
            bar.update(1)

        tasks = [asyncio.create_task(one(j)) for j in jobs]
        _, pending = await asyncio.wait(tasks, timeout=cfg.deadline) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    bar.close()
    got = {r.index for r in results}
    for j in jobs:  # never started before the deadline
        if j.index not in got:
            results.append(RequestResult(j.index, wall, error="not sent before the deadline"))
    results.sort(key=lambda r: r.index)
    return results, wall
