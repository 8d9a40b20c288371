"""The drain socket of a model instance (`shared.worker.drain`, `strata drain`), in-process on a
real engine and real NATS: a drain asked while a stream runs reports the open request, waits
for the stream to end with all its tokens, replies before the stop, then stops the instance as a
retirement; ``drain_timeout_s`` bounds it; stale and foreign socket files are told apart.
tests/cluster/test_drain.py runs the same through `strata drain` against a real process."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from shared.protocol import subjects
from shared.protocol.work import DecodeWork
from shared.service import StartupError
from shared.worker.app import start_worker
from shared.worker.autopd import RETIREMENTS
from shared.worker.config import WorkerConfig
from shared.worker.drain import DrainEndpoint, ask_drain
from tests.worker.test_autopd import LONG, long_reference, prompt_ids, sampling, submit

__all__ = ["long_reference", "prompt_ids"]  # fixtures, shared with test_autopd

LONGER = 1500  # outlasts what it must (a warm engine decodes the toy model fast)


async def _worker(nats_url, nc, model_dir, sock, iid: str, **fields):
    cfg = WorkerConfig.load(
        [],
        role="decode",
        instance_id=iid,
        nats_url=nats_url,
        model=model_dir,
        kv_cache_bytes=8 << 20,
        load_interval=0.05,
        drain_socket=str(sock),
        **fields,
    )
    stop = asyncio.Event()
    return await start_worker(cfg, "decode", nc=nc, stop=stop), stop


async def test_a_drain_waits_for_the_stream_then_retires(
    nats_url, nc, model_dir, prompt_ids, long_reference, tmp_path
):
    sock = tmp_path / "d.sock"
    w, stop = await _worker(nats_url, nc, model_dir, sock, "dr-d0")
    retired0 = RETIREMENTS._value.get()
    try:
        assert os.stat(sock).st_mode & 0o777 == 0o600  # only the instance's user
        work = DecodeWork(
            request_id="dr-r1", prompt_token_ids=prompt_ids, sampling=sampling(LONGER)
        )
        stream = await submit(nc, subjects.decode_submit("dr-d0"), work)
        await asyncio.wait_for(stream.first.wait(), 60)
        replies = await asyncio.to_thread(lambda: list(ask_drain(str(sock), 120)))
        # the reply came once the stream had ended, with every token, and before the stop
        assert stream.done.is_set()
        tokens = stream.tokens()
        assert len(tokens) == LONGER and tokens[:LONG] == long_reference  # greedy: a prefix
        first, last = replies
        assert (first["state"], first["instance"], first["role"]) == ("draining", "dr-d0", "decode")
        assert first["open"] == 1  # the premise: it held a live stream when asked
        assert (last["state"], last["open"]) == ("drained", 0)
        await asyncio.wait_for(stop.wait(), 5)  # then it stops, as a retirement
        assert w.roles.retired and w.rt.draining
        assert RETIREMENTS._value.get() == retired0 + 1
    finally:
        await w.stop()
    assert not sock.exists()


async def test_the_drain_is_bounded_by_drain_timeout(nats_url, nc, model_dir, prompt_ids, tmp_path):
    sock = tmp_path / "d.sock"
    w, stop = await _worker(nats_url, nc, model_dir, sock, "dr-d1", drain_timeout_s=0.2)
    try:
        work = DecodeWork(
            request_id="dr-r2", prompt_token_ids=prompt_ids, sampling=sampling(LONGER)
        )
        stream = await submit(nc, subjects.decode_submit("dr-d1"), work)
        await asyncio.wait_for(stream.first.wait(), 60)
        *_, last = await asyncio.to_thread(lambda: list(ask_drain(str(sock), 60)))
        assert (last["state"], last["open"]) == ("timed_out", 1)
        assert 0.2 <= last["seconds"] < 5
        assert not stream.done.is_set()
        await asyncio.wait_for(stop.wait(), 5)  # the stop that cancels it follows
    finally:
        await w.stop()


async def test_stale_and_foreign_socket_files(tmp_path):
    gone = tmp_path / "gone.sock"
    with socket.socket(socket.AF_UNIX) as s:  # bound, then closed: its instance is gone
        s.bind(str(gone))
    assert gone.exists()
    ep = await DrainEndpoint(None, str(gone), "x").start()  # cleared and bound again
    try:
        with pytest.raises(StartupError, match="another running instance's"):
            await DrainEndpoint(None, str(gone), "y").start()
    finally:
        await ep.close()
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(StartupError, match="is not a socket"):
        await DrainEndpoint(None, str(plain), "z").start()


async def test_a_stop_alone_hands_the_stream_off_without_draining(
    nats_url, nc, model_dir, prompt_ids, long_reference, tmp_path
):
    """What SIGTERM does (it sets the stop event; the worker stops): no drain, the running
    stream ends at once with an ``unavailable`` error naming the instance, which the gateway
    fails over to another instance (tests/cluster/test_drain.py), never an "abort"."""
    w, _ = await _worker(nats_url, nc, model_dir, tmp_path / "d.sock", "dr-d2")
    work = DecodeWork(request_id="dr-r3", prompt_token_ids=prompt_ids, sampling=sampling(LONGER))
    stream = await submit(nc, subjects.decode_submit("dr-d2"), work)
    await asyncio.wait_for(stream.first.wait(), 60)
    await w.stop()
    await asyncio.wait_for(stream.done.wait(), 10)
    last = max(stream.chunks, key=lambda c: (c.error is not None, c.index))
    assert last.error is not None and last.error.code == "unavailable", last
    assert last.instance_id == "dr-d2"
    sent = [t for c in sorted(stream.chunks, key=lambda c: c.index) for t in c.token_ids]
    assert 0 < len(sent) < LONGER and sent[:LONG] == long_reference[: len(sent)]
