"""The zygote (services/infra/zygote.py): a model process forked from a server that imported
torch once must be the process a fresh ``python -m`` would have been, with its exit status and
its death seen by the supervisor as `subprocess.Popen`'s, and gone when the launcher is.

`tests/infra/zygote_child.py` reports what it is; the same child started the usual way
(``fork=False``) is the control: only the forked one finds torch imported at its start, and its
parent is the zygote."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from services.infra import supervisor as supervisor_mod
from services.infra.procs import repo_root
from services.infra.supervisor import LogSink, ProcSpec, ServiceFailed, Supervisor
from services.infra.zygote import zygote
from tests.infra.fake_apps import pid_alive
from tests.infra.test_supervisor import wait_dead

PY = sys.executable


def spec(name: str, *action: str, fork: bool = True, cwd: str | None = None) -> ProcSpec:
    return ProcSpec(
        name,
        [PY, "-m", "tests.infra.zygote_child", *action],
        env={"ZYGOTE_TEST_MARK": name, "PYTHONPATH": repo_root()},
        cwd=cwd or repo_root(),
        fork=fork,
    )


def facts(sup: Supervisor, name: str) -> dict:
    return json.loads(next(line for line in sup.procs[name].tail if line.startswith("{")))


def test_a_forked_child_is_the_process_a_fresh_interpreter_would_be(tmp_path):
    out = io.StringIO()
    sup = Supervisor(LogSink(out, color=False))
    try:
        for fork in (True, False):
            name = f"c-{int(fork)}"
            sup.start(spec(name, "exit", "75", fork=fork, cwd=str(tmp_path)))
            p = sup.procs[name]
            assert p.proc.wait(60) == 75  # sys.exit(75) is its status
            p.finish()
            assert p.retired  # 75: what the supervisor reads as retired on purpose
            f = facts(sup, name)
            assert p.forked is fork and f["torch_at_start"] is fork
            z = zygote()
            assert z is not None
            assert f["ppid"] == (z.proc.pid if fork else os.getpid())
            assert f["pid"] == p.pid == f["pgid"] == f["sid"]  # its own session and group
            assert f["name"] == "__main__" and f["argv"] == ["exit", "75"]
            assert f["mark"] == name and f["cwd"] == str(tmp_path)
            assert f["stdin"] == "/dev/null"
            assert f["cmdline"] == " ".join(p.spec.argv)  # `ps` names the service
            assert "to stderr" in p.tail  # stderr reaches the log too
            assert f"[{name}] STRATA_READY" in out.getvalue()
    finally:
        sup.stop_all()


def test_a_forked_child_joins_its_threads_and_runs_atexit():
    sup = Supervisor(LogSink(None))
    try:
        sup.start(spec("f-0", "finish"))
        p = sup.procs["f-0"]
        assert p.proc.wait(60) == 0
        p.finish()
        assert p.forked
        tail = list(p.tail)
        assert tail.index("thread finished") < tail.index("atexit ran"), tail
    finally:
        sup.stop_all()


def test_a_killed_forked_child_reports_the_signal():
    sup = Supervisor(LogSink(None))
    try:
        sup.start(spec("k-0", "sleep"))
        sup.start(spec("k-1", "sleep"))
        sup.wait_ready(["k-0", "k-1"], 60)
        assert sup.procs["k-0"].forked and sup.procs["k-1"].forked
        assert sup.procs["k-0"].proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            sup.procs["k-0"].proc.wait(0.1)
        sup.kill("k-0")  # on purpose: not a failure
        assert sup.procs["k-0"].proc.wait(10) == -signal.SIGKILL
        sup.check()
        os.kill(sup.procs["k-1"].pid, signal.SIGKILL)  # a crash
        sup.procs["k-1"].proc.wait(10)
        with pytest.raises(ServiceFailed, match="k-1 exited with code -9"):
            sup.check()
    finally:
        sup.stop_all()


LAUNCHER = """
import sys, time
from services.infra.supervisor import LogSink, ProcSpec, Supervisor
from services.infra.zygote import zygote
sup = Supervisor(LogSink(None))
argv = [sys.executable, "-m", "tests.infra.zygote_child", "sleep"]
for name in ("d-0", "d-1"):
    sup.start(ProcSpec(name, argv, env={"PYTHONPATH": sys.argv[1]}, cwd=sys.argv[1],
                       die_with_parent=True, fork=True))
sup.wait_ready(["d-0", "d-1"], 60)
assert all(p.forked for p in sup.procs.values())
print(zygote().dir, zygote().proc.pid, *(p.pid for p in sup.procs.values()), flush=True)
time.sleep(120)
"""


def test_the_launchers_death_takes_the_zygote_and_its_children():
    launcher = subprocess.Popen(
        [PY, "-c", LAUNCHER, repo_root()],
        cwd=repo_root(),
        env=dict(os.environ, PYTHONPATH=repo_root()),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        where, *rest = launcher.stdout.readline().split()
        pids = [int(x) for x in rest]
        assert len(pids) == 3 and all(pid_alive(p) for p in pids), pids
        assert os.path.exists(where)
        launcher.kill()  # SIGKILL: nothing of the launcher's own code runs
        launcher.wait(10)
        assert wait_dead(pids), [p for p in pids if pid_alive(p)]
        assert not os.path.exists(where)  # the zygote removed its socket's folder
    finally:
        launcher.kill()


def test_without_a_zygote_the_child_starts_the_usual_way(monkeypatch):
    monkeypatch.setattr(supervisor_mod, "zygote", lambda: None)
    monkeypatch.setattr(supervisor_mod, "zygote_failure", lambda: "no fork here")
    out = io.StringIO()
    sup = Supervisor(LogSink(out, color=False))
    try:
        sup.start(spec("u-0", "exit", "0"))
        p = sup.procs["u-0"]
        assert p.proc.wait(60) == 0
        p.finish()
        assert not p.forked and facts(sup, "u-0")["torch_at_start"] is False
        assert "[u-0] started without the zygote: no fork here" in out.getvalue()
    finally:
        sup.stop_all()
