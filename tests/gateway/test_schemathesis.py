"""Schemathesis against the gateway's own OpenAPI schema (`/openapi.json`), fake bus peers.

Hypothesis generates bodies for every operation, valid ones from the schema and invalid ones
(negative mode); every response must be a non-5xx with an OpenAI error body when it is a 4xx,
and the gateway must keep serving afterwards. Examples are bounded and derandomized so the test
stays fast and repeatable. (It found ints past 64 bits in ``top_k`` / ``stop_token_ids`` turning
into a plain-text 500 when the WorkItem was msgpack-encoded; the schema now bounds them.)
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from tests.gateway.harness import gateway

MAX_EXAMPLES = 40  # per operation and mode


class _Gateway:
    """A gateway (+ fake peers) on its own event loop in a thread, for sync hypothesis tests."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with gateway(
                self.nats_url, peers_kw={"max_model_len": 256}, max_tokens_limit=512
            ) as (url, _, _):
                self.url = url
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test thread
            self._error = exc
            self._ready.set()

    def __enter__(self) -> _Gateway:
        self._thread.start()
        assert self._ready.wait(30), "gateway did not start"
        if self._error:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture(scope="module")
def live(nats_server):
    with _Gateway(nats_server.url) as g:
        yield g


def _operations(url: str):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    return {f"{op.method.upper()} {op.path}": op for op in ops}


def test_schema_lists_the_openai_routes(live):
    assert {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /health",
    } <= set(_operations(live.url))


CASES = [
    (name, mode)
    for name in ("POST /v1/chat/completions", "POST /v1/completions")
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
] + [("GET /v1/models", GenerationMode.POSITIVE), ("GET /health", GenerationMode.POSITIVE)]
# (GET routes take no parameters, so there is nothing negative to generate for them)


@pytest.mark.parametrize(("name", "mode"), CASES, ids=lambda x: str(getattr(x, "value", x)))
def test_no_server_errors(live, name, mode):
    op = _operations(live.url)[name]
    seen: dict[int, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:
        if isinstance(case.body, dict):  # negative bodies too: the other fields stay broken
            case.body["model"] = "tiny"  # reach past the model check (a 404) into the pipeline
        resp = case.call(base_url=live.url, timeout=10)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (resp.status_code, resp.text[:500], case.body)
        if resp.status_code >= 400:
            err = resp.json()["error"]
            assert err["message"] and err["type"].endswith("_error"), err

    check()
    print(name, mode.value, dict(sorted(seen.items())))
    assert sum(seen.values()) >= 1
    assert not seen.get(404), seen  # bodies were exercised, not turned away at the model name
    if mode == GenerationMode.POSITIVE and name.startswith("POST"):
        assert seen.get(200), seen  # some generated bodies went all the way through
    if mode == GenerationMode.NEGATIVE and name.startswith("POST"):
        assert any(400 <= s < 500 for s in seen), seen  # invalid bodies were rejected
    # still serving after the fuzzing
    r = httpx.post(
        live.url + "/v1/completions",
        timeout=10,
        json={"model": "tiny", "prompt": "ok", "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
