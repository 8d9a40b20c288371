"""scripts/setup.sh installs only what the first run runs: without ``--compose`` (scripts/up.sh)
pip installs the project without the test extras and nothing of Docker, Compose or helm is
touched; with ``--compose`` (scripts/test.sh) the extras and helm come too. Run in a sandbox
copy: a fake venv whose python records pip calls (and runs everything else with this
interpreter), the real MinIO, helm and built kernels linked into a scratch cache; the shared venv
is untouched."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.infra.minio_server import minio_binary
from services.infra.procs import cache_dir

ROOT = Path(__file__).resolve().parents[1]
HELM_VERSION = "v3.22.0"  # scripts/setup.sh builds this one
MINIO_VERSION_LINE = 'MINIO_VERSION="'

pytestmark = pytest.mark.timeout(120)


def sandbox(tmp: Path, stamp: str | None) -> tuple[Path, Path, dict[str, str]]:
    root = tmp / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    pip_log = tmp / "pip.log"
    fake = venv_bin / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2" = "-m pip" ]; then echo "$@" >> {pip_log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    if stamp is not None:
        digest = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()
        (root / ".venv" / ".strata-installed").write_text(stamp.format(hash=digest) + "\n")
    cache = tmp / "cache"
    (cache / "bin").mkdir(parents=True)
    helm = Path(cache_dir()) / "bin" / "helm"
    if not os.access(helm, os.X_OK):
        pytest.fail(f"helm not in {helm}: run scripts/setup.sh --compose", pytrace=False)
    (cache / "bin" / "helm").symlink_to(helm)
    # kustomize and the KEDA validators, built and installed by a real --compose run
    kustomize, keda = Path(cache_dir()) / "bin" / "kustomize", Path(cache_dir()) / "node" / "keda"
    if not os.access(kustomize, os.X_OK) or not keda.is_dir():
        pytest.fail(f"kustomize or {keda} missing: run scripts/setup.sh --compose", pytrace=False)
    (cache / "bin" / "kustomize").symlink_to(kustomize)
    (cache / "node").mkdir()
    (cache / "node" / "keda").symlink_to(keda)
    # the native kernels and torch ops the real set-up built (each build is keyed by its
    # sources' digest, so the sandbox's run finds them and does not compile them again)
    (cache / "kernels").symlink_to(Path(cache_dir()) / "kernels", target_is_directory=True)
    setup = (root / "scripts" / "setup.sh").read_text()
    minio_version = setup.split(MINIO_VERSION_LINE, 1)[1].split('"', 1)[0]
    chart = cache / "go" / "mod" / "github.com" / "minio" / f"minio@{minio_version}"
    (chart / "helm" / "minio").mkdir(parents=True)
    (chart / "helm" / "minio" / "Chart.yaml").write_text("name: minio\n")
    env = dict(
        os.environ,
        STRATA_CACHE=str(cache),
        STRATA_MINIO_BIN=minio_binary(),
        STRATA_SKIP_MODEL="1",
        STRATA_SKIP_COMPOSE="1",  # the Docker part is covered by the live compose test
        PYTHONPATH=str(ROOT),  # `import services` in the fake venv's check
    )
    return root, pip_log, env


def run_setup(root: Path, env: dict[str, str], *args: str) -> str:
    res = subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def test_first_run_installs_the_project_only(tmp_path):
    root, pip_log, env = sandbox(tmp_path, stamp=None)
    out = run_setup(root, env)
    assert pip_log.read_text().split() == [
        "-m",
        "pip",
        "install",
        "--progress-bar",
        "on",
        "-e",
        ".",
    ]
    assert "no Docker, Compose images or helm" in out
    assert "helm:" not in out and "docker compose:" not in out and "kustomize:" not in out
    assert "[setup] ready" in out
    # the next first run: nothing to install
    pip_log.unlink()
    run_setup(root, env)
    assert not pip_log.exists()


def test_compose_adds_the_test_extras_and_helm(tmp_path):
    root, pip_log, env = sandbox(tmp_path, stamp="{hash} .")  # after a first run
    out = run_setup(root, env, "--compose")
    assert pip_log.read_text().split()[-2:] == ["-e", ".[test,bench]"]
    assert f"helm: {tmp_path}/cache/bin/helm ({HELM_VERSION})" in out
    assert f"kustomize: {tmp_path}/cache/bin/kustomize (v5.6.0)" in out
    assert "STRATA_SKIP_COMPOSE=1: no Docker set-up" in out
    pip_log.unlink()
    run_setup(root, env)  # a full install satisfies the first run too
    assert not pip_log.exists()


def test_an_older_full_install_stamp_needs_no_pip(tmp_path):
    root, pip_log, env = sandbox(tmp_path, stamp="{hash}")
    run_setup(root, env, "--compose")
    assert not pip_log.exists()


def test_unknown_argument_is_one_line(tmp_path):
    root, _, env = sandbox(tmp_path, stamp="{hash}")
    res = subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh"), "--composee"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "[setup] unknown argument --composee (usage: scripts/setup.sh [--compose])"
    )
