"""The process supervisor with tiny dummy children: prefixes, readiness, fail-fast, stop-all."""

from __future__ import annotations

import io
import os
import sys
import time

import pytest

from services.infra.supervisor import LogSink, ProcSpec, ServiceFailed, Supervisor, stop_all
from tests.infra.fake_apps import pid_alive

PY = sys.executable


def child(name: str, code: str, ready: bool = True) -> ProcSpec:
    return ProcSpec(name, [PY, "-c", code], ready=ready)


def wait_dead(pids: list[int], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sink_prefixes_and_colors_per_name():
    out = io.StringIO()
    sink = LogSink(out, color=True)
    sink.write("decode-0", "hello")
    sink.write("prefill-0", "world")
    sink.write("decode-0", "again")
    assert out.getvalue().splitlines() == [
        "\x1b[36m[decode-0]\x1b[0m hello",
        "\x1b[33m[prefill-0]\x1b[0m world",
        "\x1b[36m[decode-0]\x1b[0m again",
    ]
    plain = io.StringIO()
    LogSink(plain, color=False).write("gateway-0", "x")
    assert plain.getvalue() == "[gateway-0] x\n"


def test_sink_colors_only_ttys(monkeypatch):
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert LogSink(io.StringIO()).color is False
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert LogSink(io.StringIO()).color is True
    monkeypatch.setenv("NO_COLOR", "1")
    assert LogSink(io.StringIO()).color is False


def test_output_is_prefixed_and_ready_line_detected(tmp_path):
    out = io.StringIO()
    sup = Supervisor(LogSink(out, color=False), log_dir=str(tmp_path))
    code = (
        "import sys, time; print('one'); print('two', file=sys.stderr, flush=True); "
        "print('STRATA_READY role=x instance=a-0 grpc=1.2.3.4:5', flush=True); time.sleep(60)"
    )
    p = sup.start(child("a-0", code))
    sup.wait_ready(["a-0"], timeout=20)
    assert p.ready_detail == "role=x instance=a-0 grpc=1.2.3.4:5"
    sup.stop_all(timeout=5)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["[a-0] one", "[a-0] two"]
    assert lines[2].startswith("[a-0] STRATA_READY")
    assert (tmp_path / "a-0.log").read_text().splitlines()[:2] == ["one", "two"]
    assert p.returncode is not None and not pid_alive(p.pid)


def test_crash_before_ready_fails_fast_with_last_lines():
    sup = Supervisor()
    code = "import sys; [print(f'line {i}') for i in range(60)]; print('fatal: bad weights'); sys.exit(3)"
    sup.start(child("decode-0", code))
    with pytest.raises(ServiceFailed) as err:  # at the exit, not at the 60 s deadline:
        sup.wait_ready(["decode-0"], timeout=60)
    e = err.value
    assert e.name == "decode-0"
    assert "exited with code 3" in str(e)
    assert e.tail[-1] == "fatal: bad weights"
    assert e.tail[0] == "line 21" and len(e.tail) == 40  # the last 40 lines, in order
    sup.stop_all()


def test_another_process_dying_fails_the_wait_for_all():
    sup = Supervisor()
    sup.start(child("slow-0", "import time; time.sleep(60)"))
    sup.start(child("bad-0", "import sys; print('nope'); sys.exit(7)"))
    with pytest.raises(ServiceFailed) as err:
        sup.wait_ready(["slow-0", "bad-0"], timeout=60)
    assert err.value.name == "bad-0" and "code 7" in str(err.value)
    slow = sup.procs["slow-0"]
    sup.stop_all(timeout=5)
    assert not pid_alive(slow.pid)


def test_not_ready_in_time_is_a_failure():
    sup = Supervisor()
    sup.start(child("mute-0", "import time; print('loading'); time.sleep(60)"))
    with pytest.raises(ServiceFailed, match="not ready after 1s") as err:
        sup.wait_ready(["mute-0"], timeout=1)
    assert err.value.tail == ["loading"]
    sup.stop_all(timeout=5)


def test_stop_kills_whole_process_group_including_grandchildren(tmp_path):
    pidfile = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "print('STRATA_READY', flush=True)\n"
        "time.sleep(600)\n"
    )
    sup = Supervisor()
    p = sup.start(child("parent-0", code))
    sup.wait_ready(["parent-0"], timeout=20)
    grandchild = int(pidfile.read_text())
    assert pid_alive(grandchild) and pid_alive(p.pid)
    sup.stop_all(timeout=5)
    assert wait_dead([p.pid, grandchild])


def test_sigterm_ignoring_child_is_sigkilled_after_timeout():
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('STRATA_READY', flush=True); time.sleep(600)"
    )
    sup = Supervisor()
    p = sup.start(child("stubborn-0", code))
    sup.wait_ready(["stubborn-0"], timeout=20)
    t0 = time.monotonic()
    sup.stop_all(timeout=0.5)
    assert time.monotonic() - t0 > 0.4  # SIGTERM's grace was given (a lower bound cannot flake)
    assert p.returncode == -9  # then SIGKILL


def test_graceful_child_exits_on_sigterm_before_timeout():
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        "print('STRATA_READY', flush=True); time.sleep(600)"
    )
    sup = Supervisor()
    p = sup.start(child("nice-0", code))
    sup.wait_ready(["nice-0"], timeout=20)
    stop_all([p], timeout=10)
    assert p.returncode == 0  # it exited on SIGTERM (a SIGKILL after the timeout would be -9)


def test_unexpected_exit_reported_once_and_kill_is_expected():
    sup = Supervisor()
    a = sup.start(child("a-0", "import time; time.sleep(60)", ready=False))
    sup.start(child("b-0", "import time; time.sleep(60)", ready=False))
    os.kill(a.pid, 9)
    a.proc.wait(5)
    with pytest.raises(ServiceFailed, match="a-0 exited with code -9"):
        sup.check()
    assert [p.name for p in sup.exited()] == ["a-0"]
    assert sup.exited() == []
    sup.check()  # reported once, no longer a failure
    sup.kill("b-0")
    sup.procs["b-0"].proc.wait(5)
    sup.check()  # killed on purpose: not a failure
    assert sup.exited() == []
    with pytest.raises(ValueError):
        sup.start(child("c-0", "import time; time.sleep(60)", ready=False)) and sup.start(
            child("c-0", "pass")
        )
    sup.stop_all(timeout=5)
