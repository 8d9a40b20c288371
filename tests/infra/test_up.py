"""`strata up` and the `Cluster` library end to end, with dummy service apps (no model) but a
real nats-server and MinIO: readiness, /health, prefixed logs, fail-fast, and no process left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from services.infra.procs import free_port, port_open, repo_root
from services.infra.supervisor import ServiceFailed
from services.launcher import Cluster
from tests.infra.fake_apps import (
    pid_alive,
    recorded_pids,
    write_fake_apps,
    write_fake_checkpoint,
)


@pytest.fixture
def fake(tmp_path):
    """Env that makes `strata serve <role>` run the dummy apps; a fake checkpoint dir."""
    root = write_fake_apps(tmp_path / "apps")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    model = write_fake_checkpoint(tmp_path / "model", "LlavaForConditionalGeneration")
    env = {
        "STRATA_APP_PACKAGE": "fakeapps",
        "FAKE_PID_DIR": str(pid_dir),
        "PYTHONPATH": os.pathsep.join([repo_root(), root]),
    }
    return {"env": env, "pid_dir": pid_dir, "model": model, "tmp": tmp_path}


def all_dead(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def up_cmd(fake, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--model",
        fake["model"],
        "--port",
        str(free_port()),
        "--data-dir",
        str(fake["tmp"] / "data"),
        "--no-color",
        *extra,
    ]


def test_strata_up_serves_then_stops_everything_on_sigterm(fake):
    env = dict(os.environ, **fake["env"])
    proc = subprocess.Popen(
        up_cmd(fake, "--prefill", "1", "--decode", "2"),
        env=env,
        cwd=repo_root(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "strata up exited early:\n" + "".join(lines)
            lines.append(line)
            if "Strata is up at" in line:
                banner = line
            if "Ctrl-C stops everything" in line:
                break
        url = banner.split("Strata is up at ")[1].split()[0]
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        text = "".join(lines)
        assert "'fake-model'" in banner  # the banner asked /v1/models
        for name in (
            "scheduler-0",
            "tokenizer-0",
            "vision-0",
            "kvstore-0",
            "prefill-0",
            "decode-0",
            "decode-1",
            "gateway-0",
        ):
            assert f"[{name}] STRATA_READY" in text, name
        assert "[decode-1] decode-1 starting argv=[] threads=1" in text
        assert "[gateway-0] gateway-0 starting argv=[] threads=-" in text
        assert "curl http" in text
        pids = recorded_pids(fake["pid_dir"])
        assert len(pids) == 16 and all(pid_alive(p) for p in pids)  # 8 apps + 8 grandchildren
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # a failed assertion above: still stop everything
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert proc.returncode == 0, rest
    assert "[decode-0] bye from decode-0" in rest
    assert all_dead(pids)
    assert not port_open("127.0.0.1", int(url.rsplit(":", 1)[1]))
    logs = fake["tmp"] / "data" / "logs"
    assert "STRATA_READY" in (logs / "prefill-0.log").read_text()
    assert (logs / "nats.log").exists() and (logs / "minio.log").exists()


def test_strata_up_fails_fast_when_a_service_crashes(fake):
    env = dict(os.environ, **fake["env"], FAKE_CRASH="decode")
    res = subprocess.run(
        up_cmd(fake, "--no-minio"),
        env=env,
        cwd=repo_root(),
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert res.returncode == 1  # at the crash (the message says so), not at a deadline
    err = res.stderr
    assert "start-up failed: decode-0 exited with code 3 before it was ready" in err or (
        "start-up failed: decode-0 exited with code 3" in err
    ), err
    assert "  | boom: fake failure in decode-0" in err
    assert all_dead(recorded_pids(fake["pid_dir"]))


def test_strata_up_refuses_a_busy_port(fake):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = up_cmd(fake, "--no-minio")
        cmd[cmd.index("--port") + 1] = str(port)
        res = subprocess.run(
            cmd,
            env=dict(os.environ, **fake["env"]),
            cwd=repo_root(),
            text=True,
            capture_output=True,
            timeout=60,
        )
    assert res.returncode == 1
    assert f"port {port} is already in use" in res.stderr


def test_cluster_library_kill_restart_scale(fake):
    c = Cluster(
        fake["model"],
        minio=False,
        vision=0,
        kvstore=0,
        prefill=1,
        env=fake["env"],
        role_args={"decode": ["--max-num-seqs", "4"]},
    )
    with c:
        assert c.names() == ["scheduler-0", "tokenizer-0", "prefill-0", "decode-0", "gateway-0"]
        with urllib.request.urlopen(c.gateway_url + "/v1/models", timeout=5) as r:
            assert json.load(r)["data"][0]["id"] == "fake-model"
        assert "decode-0 starting argv=['--max-num-seqs', '4'] threads=1" in c.logs("decode-0")
        # the model processes are forked from the zygote, the others started fresh
        forked = {n for n, p in c.sup.procs.items() if p.forked}
        assert forked == {"prefill-0", "decode-0"}, forked
        old_pid = c.sup.procs["decode-0"].pid
        c.kill("decode-0")
        assert not c.alive("decode-0") and c.alive("prefill-0")
        c.check()  # a kill on purpose is not a failure
        c.restart("decode-0")
        assert c.alive("decode-0") and c.sup.procs["decode-0"].pid != old_pid
        assert c.sup.procs["decode-0"].forked  # a restart too
        assert c.start_service("decode", args=["--x", "1"]) == "decode-1"
        assert "decode-1 starting argv=['--max-num-seqs', '4', '--x', '1'] threads=1" in c.logs(
            "decode-1"
        )
        os.kill(c.sup.procs["tokenizer-0"].pid, signal.SIGKILL)  # a crash nobody asked for
        c.sup.procs["tokenizer-0"].proc.wait(5)
        with pytest.raises(ServiceFailed, match="tokenizer-0 exited with code -9"):
            c.check()
        c.stop_service("decode-1")
        assert not c.alive("decode-1")
        pids = recorded_pids(fake["pid_dir"])
        data_dir = c.data_dir
    assert all_dead(pids)
    assert not os.path.exists(data_dir)  # a temp data dir is removed
    assert c.nats is not None and c.nats.proc is None


def test_cluster_start_failure_stops_everything(fake):
    env = dict(fake["env"], FAKE_CRASH="prefill-0")
    c = Cluster(fake["model"], minio=False, prefill=1, env=env)
    with pytest.raises(ServiceFailed) as err:
        c.start()
    assert err.value.name == "prefill-0"
    assert "boom: fake failure in prefill-0" in err.value.tail
    assert all_dead(recorded_pids(fake["pid_dir"]))
    assert c.nats.proc is None


def test_sigkilled_strata_up_leaves_no_service_or_server(fake):
    """Children die with the launcher (PR_SET_PDEATHSIG), even when it gets no chance to
    clean up. Only the dummy apps' own grandchildren (not in the launcher's hands) remain."""
    env = dict(os.environ, **fake["env"])
    proc = subprocess.Popen(
        up_cmd(fake, "--prefill", "1"),
        env=env,
        cwd=repo_root(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out = []
    for line in proc.stdout:
        out.append(line)
        if "Ctrl-C stops everything" in line:
            break
    nats_pid = _pid_of("nats-server", str(fake["tmp"]))
    minio_pid = _pid_of("minio", str(fake["tmp"]))
    apps = [int(f.read_text().split()[0]) for f in fake["pid_dir"].glob("*.pids")]
    grandchildren = [int(f.read_text().split()[1]) for f in fake["pid_dir"].glob("*.pids")]
    assert len(apps) == 7 and nats_pid and minio_pid, "".join(out)
    proc.kill()
    proc.wait(10)
    try:
        assert all_dead([*apps, nats_pid, minio_pid])
    finally:
        for pid in grandchildren:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pid_of(exe: str, marker: str) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if (
                cmd
                and os.path.basename(cmd[0].decode()) == exe
                and marker.encode() in b" ".join(cmd)
            ):
                return int(entry)
    return 0


def test_strata_up_restarts_a_crash_then_gives_up_on_a_required_role(fake):
    """A crashed service comes back by itself (one line with the count, and the count on the
    launcher's metrics port); one that then keeps failing before it is ready is given up with
    one line, and losing the only decode instance stops `strata up` with exit code 1."""
    env = dict(os.environ, **fake["env"])
    proc = subprocess.Popen(
        # backoff 0.1, 0.2, ... s instead of 0.5, 1, ...: the same rule, a fifth of the wait
        up_cmd(fake, "--no-minio", "--vision", "0", "--kvstore", "0", "--restart-backoff", "0.1"),
        env=env,
        cwd=repo_root(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []

    def read_until(needle: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "strata up exited early:\n" + "".join(lines)
            lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} in:\n" + "".join(lines))

    def decode_pid() -> int:
        return int((fake["pid_dir"] / "decode-0.pids").read_text().split()[-2])

    try:
        metrics = read_until("restart counts: ").split("restart counts: ")[1].strip()
        read_until("Ctrl-C stops everything")
        os.kill(decode_pid(), signal.SIGKILL)
        read_until("decode-0 exited with code -9; restarting (restart 1, backoff 0.1s)")
        read_until("[decode-0] STRATA_READY")
        with urllib.request.urlopen(metrics, timeout=5) as r:
            assert 'strata_launcher_restarts_total{service="decode-0"} 1.0' in r.read().decode()
        (fake["pid_dir"] / "decode-0.crash").write_text("")  # every later start fails
        os.kill(decode_pid(), signal.SIGKILL)
        gave_up = read_until("giving up", timeout=120)
        assert (
            "decode-0 exited with code 3; giving up after 5 failed starts in a row (last: "
            "boom: fake failure in decode-0)" in gave_up
        ), gave_up
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    text = "".join(lines) + rest
    assert proc.returncode == 1, text
    assert text.count("decode-0 exited with code 3; restarting") == 4  # then the 5th: give up
    assert "no decode left: decode-0 cannot start (required role); stopping" in text
    assert all_dead(recorded_pids(fake["pid_dir"]))
