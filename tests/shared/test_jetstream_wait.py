"""A process starting while JetStream does not answer (a cluster electing its leaders, a server
restarting or too busy for its API timeout, one without JetStream) waits for it instead of dying: the KV-event stream's
state is retried with backoff (`shared.jetstream.while_electing`) and, past the window, the
process ends in one line (`JetStreamUnavailable`). Real nats-servers: one killed and started
again on its port while the call waits, one without JetStream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess

import pytest

from services.infra.nats_server import nats_binary, start_nats
from services.infra.procs import free_port, signal_group, stop_process, wait_until
from shared import bus
from shared.jetstream import JetStreamUnavailable
from shared.kv_events_stream import kv_events_stream_state

pytestmark = pytest.mark.timeout(120)


async def test_the_stream_state_waits_for_a_server_that_comes_back(tmp_path, caplog):
    server = start_nats(data_dir=str(tmp_path / "nats"))
    port, data_dir = server.port, server.data_dir
    nc = await bus.connect(server.url, "js-wait-test")
    try:
        signal_group(server.proc.pid, signal.SIGKILL)
        server.proc.wait(5)
        caplog.set_level(logging.INFO, logger="shared.jetstream")
        js = nc.jetstream(timeout=1.0)  # each API request gives up after 1 s (default 5)
        asking = asyncio.create_task(kv_events_stream_state(js, retry_s=60))
        await asyncio.sleep(1.5)  # past one API request's timeout: one try failed
        assert not asking.done()
        server = start_nats(port=port, data_dir=data_dir)
        state = await asyncio.wait_for(asking, 60)
        assert state.messages == 0
        waits = [r for r in caplog.records if "waits for JetStream" in r.getMessage()]
        assert waits, "the state came without a retry: the server was never missed"
    finally:
        await nc.close()
        server.stop()


async def test_no_answer_for_the_whole_window_ends_in_one_line(tmp_path):
    server = start_nats(data_dir=str(tmp_path / "nats"))
    nc = await bus.connect(server.url, "js-wait-test")
    try:
        signal_group(server.proc.pid, signal.SIGKILL)
        server.proc.wait(5)
        with pytest.raises(JetStreamUnavailable) as err:
            await kv_events_stream_state(nc.jetstream(timeout=0.5), retry_s=1)
        text = str(err.value)
        assert "\n" not in text and "STRATA_KV_EVENTS" in text
        assert "for 1s" in text and "TimeoutError" in text
    finally:
        with contextlib.suppress(ConnectionError):  # closing a client whose server is dead
            await nc.close()
        server.stop()


async def test_a_server_without_jetstream_ends_in_one_line():
    port = free_port()
    proc = subprocess.Popen(
        [nats_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(lambda: _listening(port), 20, "nats-server", proc)
        nc = await bus.connect(f"nats://127.0.0.1:{port}", "js-wait-test")
        try:
            # it answers like a cluster electing its meta leader, so it is waited for too
            with pytest.raises(JetStreamUnavailable, match="ServiceUnavailableError"):
                await kv_events_stream_state(nc.jetstream(), retry_s=1)
        finally:
            await nc.close()
    finally:
        stop_process(proc)


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
