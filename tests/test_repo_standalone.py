"""The repository stands alone: no tracked file refers to a folder beside the clone, to a path
of one machine or to a package registry's host, and the tests that read vendored data pass in a copy with nothing beside it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Built from parts so that this file does not match its own patterns.
_OUTSIDE = [
    re.escape(".." + "/shared"),  # the team folder beside a developer's clone
    re.escape('"..", "' + 'shared"'),
    "/" + r"(?:work|home|root|Users)/[A-Za-z0-9_.-]+",  # absolute paths of one machine
]
OUTSIDE = re.compile("|".join(_OUTSIDE))

# Package registries' and mirrors' hosts: the mirror comes from the builder's environment (pip's
# index settings, apt's sources, GOPROXY, build arguments), never from a tracked file.
_D = "."  # joined below, so that this file names no host either
REGISTRY_HOSTS = [
    _D.join(parts)
    for parts in (
        ("pypi", "org"),
        ("files", "pythonhosted", "org"),
        ("download", "pytorch", "org"),
        ("deb", "debian", "org"),
        ("security", "debian", "org"),
        ("archive", "ubuntu", "com"),
        ("registry", "npmjs", "org"),
        ("proxy", "golang", "org"),
        ("sum", "golang", "org"),
        ("crates", "io"),
        ("static", "crates", "io"),
        ("repo", "maven", "apache", "org"),
        ("repo1", "maven", "org"),
        ("registry-1", "docker", "io"),
        ("index", "docker", "io"),
        ("ghcr", "io"),
        ("quay", "io"),
        ("dl", "min", "io"),
        ("charts", "min", "io"),
        ("conda", "anaconda", "org"),
    )
]
# docker.io is also Debian's package name for Docker (`apt-get install docker.io`): only a host
# use counts, as in an image reference (the host, a slash, the image) or a URL.
_DOCKER_IO = _D.join(("docker", "io"))
REGISTRY = re.compile(
    r"(?<![\w.-])(?:"
    + "|".join(re.escape(h) for h in REGISTRY_HOSTS)
    + r")(?![\w-])"
    + r"|://"
    + re.escape(_DOCKER_IO)
    + r"|(?<![\w.-])"
    + re.escape(_DOCKER_IO)
    + r"/"
)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


@pytest.fixture(scope="module")
def files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return tracked_files()


def test_no_tracked_file_names_a_path_outside_the_repo(files):
    hits = []
    for rel in files:
        path = ROOT / rel
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "tracked lines refer to a folder outside the repo:\n" + "\n".join(hits)


def test_no_tracked_file_names_a_package_registry_host(files):
    hits = []
    for rel in files:
        path = ROOT / rel
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if REGISTRY.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "tracked lines name a package registry's host:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    ("line", "hit"),
    [
        ("ARG TORCH_INDEX=https://" + REGISTRY_HOSTS[2] + "/whl/cpu", True),
        ("pip install --index-url https://" + REGISTRY_HOSTS[0] + "/simple torch", True),
        ("DEBIAN_MIRROR = 'http://" + REGISTRY_HOSTS[3] + "/debian'", True),
        ("image: " + _DOCKER_IO + "/library/nats:2.10", True),
        ("helm repo add minio https://" + REGISTRY_HOSTS[-2] + "/", True),
        ("apt-get install " + _DOCKER_IO + " debootstrap", False),  # Debian's package name
        ('missing="$missing ' + _DOCKER_IO + '"', False),
        ("see the " + REGISTRY_HOSTS[0].split(".")[0] + " docs", False),
    ],
)
def test_the_registry_pattern(line, hit):
    """The pattern catches a host wherever it names one and spares Debian's docker.io package."""
    assert bool(REGISTRY.search(line)) is hit, line


def test_vendored_trace_ships_with_its_license(files):
    base = "loadtests/data/mooncake/"
    assert {base + "conversation_trace.jsonl", base + "LICENSE", base + "README.md"} <= set(files)
    assert "Apache License" in (ROOT / base / "LICENSE").read_text()


@pytest.mark.timeout(240)
def test_data_reading_tests_pass_in_a_copy_with_nothing_beside_it(files, tmp_path):
    """What `git clone` gives a user (the tracked files), alone in a fresh folder."""
    clone = tmp_path / "alone" / "strata"
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            dst = clone / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    assert sorted(os.listdir(clone.parent)) == ["strata"]
    env = dict(os.environ, PYTHONPATH=str(clone), STRATA_CACHE=str(tmp_path / "cache"))
    probe = subprocess.run(
        [sys.executable, "-c", "import loadtests, services; print(loadtests.__file__)"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip().startswith(str(clone)), probe.stdout  # the copy's code runs
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/scheduler/test_simulator.py",
            "tests/loadgen/test_pure.py",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-2000:]
