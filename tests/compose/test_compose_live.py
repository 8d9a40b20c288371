"""compose/docker-compose.yml run for real: a private dockerd (Debian's docker.io) with the
images built locally (tests/compose/docker_env.py: a debootstrap base, NATS and MinIO from the
binaries `strata up` runs), the shipped file run unmodified (its secrets from `strata
compose-secrets`, the gateway's host port chosen by STRATA_GATEWAY_PORT): only the gateway is
published, on 127.0.0.1, and it asks for the API key; the kvstore's MinIO user is not root.
A streamed chat through the official openai client equals the native cluster's (`strata up`'s
processes, same default model) token for token; a container whose main process is killed comes
back by its restart policy and serves again; `compose down -v` and the daemon's stop follow even
on failure. A machine that cannot run it fails with one line naming the fix (never a skip):
scripts/setup.sh --compose installs docker.io, debootstrap and Docker Compose and builds the images."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from services.cluster_config import ensure_model
from services.infra import compose_secrets
from services.infra.procs import free_port
from tests.compose.docker_env import (
    COMPOSE_FILE,
    Dockerd,
    DockerEnvError,
    build_images,
    compose_binary,
    container_state,
    image_env,
)
from tests.e2e.conftest import start_cluster

pytestmark = [pytest.mark.compose_live, pytest.mark.timeout(1800)]

N = 16
CHAT = [{"role": "user", "content": "Tell me about the tiers of a KV cache."}]
THREADS = 2  # STRATA_TORCH_THREADS of the compose model services; the native cluster the same


def stream_chat(base_url: str, api_key: str = "unused") -> tuple[str, list[str], int]:
    """Streamed greedy chat: (text, token strings from the log-probabilities, usage tokens)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=CHAT,
        max_tokens=N,
        temperature=0.0,
        stream=True,
        logprobs=True,
        top_logprobs=1,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, tokens, usage = [], [], -1
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs and choice.logprobs.content:
                tokens += [t.token for t in choice.logprobs.content]
    return "".join(text), tokens, usage


def model_digest_script() -> str:
    return (
        "import hashlib, os, sys; d = sys.argv[1]; print(' '.join(f + ':' + "
        "hashlib.sha256(open(os.path.join(d, f), 'rb').read()).hexdigest()[:16] "
        "for f in sorted(os.listdir(d))))"
    )


@pytest.fixture(scope="module")
def model_dir() -> str:
    return ensure_model("")


@pytest.fixture(scope="module")
def native(model_dir) -> tuple[str, list[str], int]:
    """The reference: the same chat through the native cluster, stopped before compose starts."""
    c = start_cluster(model_dir, torch_threads=THREADS)
    try:
        return stream_chat(c.gateway_url)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def dockerd():
    t0 = time.monotonic()
    d = Dockerd()
    error = ""
    try:
        d.start()
        build_images(d)
    except DockerEnvError as exc:
        error = str(exc)
    if error:  # outside the except: one line, no chained traceback
        d.stop()
        pytest.fail(f"compose cluster cannot run here: {error}", pytrace=False)
    print(f"dockerd and images ready in {time.monotonic() - t0:.0f}s")
    yield d
    d.stop()


class Compose:
    def __init__(self, d: Dockerd, tmp) -> None:
        self.d = d
        self.env_file = str(tmp / "compose.env")
        self.secrets = compose_secrets.write_env_file(self.env_file)  # `strata compose-secrets`
        self.api_key = self.secrets["STRATA_API_KEY"]
        self.port = free_port()  # the shipped default is 8000, which this machine may use
        self.bin = compose_binary()

    def __call__(self, *args: str, timeout: float = 300, check: bool = True):
        res = subprocess.run(
            [self.bin, "-f", COMPOSE_FILE, "--env-file", self.env_file, *args],
            env=dict(self.d.env, **image_env(), STRATA_GATEWAY_PORT=str(self.port)),
            capture_output=True,
            text=True,
            timeout=timeout,
        )  # fmt: skip
        if check and res.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed:\n{res.stdout}{res.stderr}")
        return res

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def diagnostics(self) -> str:
        ps = self("ps", "-a", check=False).stdout
        logs = self("logs", "--no-color", "--tail", "30", check=False).stdout
        return f"{ps}\n{logs[-8000:]}"


@pytest.fixture(scope="module")
def cluster(native, dockerd, tmp_path_factory):
    c = Compose(dockerd, tmp_path_factory.mktemp("compose"))
    c("down", "-v", "--remove-orphans", check=False)  # anything a killed run left
    try:
        t0 = time.monotonic()
        res = c(
            "up", "-d", "--no-build", "--pull", "never", "--wait", "--wait-timeout", "300",
            timeout=420, check=False,
        )  # fmt: skip
        if res.returncode != 0:
            pytest.fail(
                f"compose up failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}\n"
                + c.diagnostics(),
                pytrace=False,
            )
        print(f"compose cluster healthy in {time.monotonic() - t0:.0f}s")
        yield c
    finally:
        c("down", "-v", "--remove-orphans", "--timeout", "20", check=False, timeout=300)


def gateway_url(c: Compose) -> str:
    addr = c("port", "gateway", "8000").stdout.strip()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", addr), addr
    return f"http://{addr}"


def test_only_the_gateway_is_published_and_only_on_loopback(cluster, dockerd):
    published = {}
    for service in cluster("config", "--services").stdout.split():
        cid = cluster.container(service)
        if not cid:
            continue  # profile services (monitoring) are not started
        res = dockerd.docker(
            "inspect", "--format",
            '{{range $p, $b := .NetworkSettings.Ports}}{{range $b}}{{$p}}={{.HostIp}} {{end}}{{end}}',
            cid,
        )  # fmt: skip
        if res.stdout.split():
            published[service] = res.stdout.split()
    assert list(published) == ["gateway"], published
    assert all(b.startswith("8000/tcp=127.0.0.1") for b in published["gateway"]), published
    assert gateway_url(cluster) == f"http://127.0.0.1:{cluster.port}"


def test_the_gateway_asks_for_the_key(cluster):
    with pytest.raises(openai.AuthenticationError):
        stream_chat(gateway_url(cluster), api_key="not-the-key")


def test_the_kvstore_is_not_minio_root(cluster):
    show = "import os; print(os.environ['{}'])"
    kv = cluster("exec", "-T", "kvstore", "python", "-c", show.format("STRATA_MINIO_ACCESS_KEY"))
    root = cluster("exec", "-T", "minio-1", "sh", "-c", "echo $MINIO_ROOT_USER")
    assert kv.stdout.strip() == "strata-kvstore" and root.stdout.strip() == "strata-root"
    setup = cluster("ps", "-a", "--format", "{{.Service}} {{.State}} {{.ExitCode}}", "minio-setup")
    assert setup.stdout.split() == ["minio-setup", "exited", "0"], setup.stdout


def test_the_image_serves_the_same_default_model(cluster, model_dir):
    res = cluster("exec", "-T", "decode", "python", "-c", model_digest_script(), "/models/default")
    host = subprocess.run(
        [sys.executable, "-c", model_digest_script(), model_dir], capture_output=True, text=True
    )
    assert res.stdout.strip() == host.stdout.strip() != "", (res.stdout, host.stdout)


def test_streamed_chat_equals_the_native_cluster(cluster, native):
    text, tokens, usage = stream_chat(gateway_url(cluster), cluster.api_key)
    assert usage == N and len(tokens) == N, (usage, tokens)
    assert (text, tokens) == native[:2]
    assert native[2] == N


def test_a_crashed_container_is_restarted_and_serves_again(cluster, dockerd, native):
    """SIGKILL to the decode container's main process (a crash: `docker kill` would count as a
    manual stop, which `restart: unless-stopped` honours); the daemon restarts it, the new
    process announces itself ready, and the next chat is the native cluster's again."""
    cid = cluster.container("decode")
    before = container_state(dockerd, cid)
    assert before["Running"] and before["Pid"] > 0
    os.kill(before["Pid"], signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:
        state = container_state(dockerd, cid)
        res = dockerd.docker("logs", cid)
        logs = res.stdout + res.stderr
        if (
            state["RestartCount"] > before["RestartCount"]
            and state["Running"]
            and logs.count("STRATA_READY role=decode") >= 2
        ):
            break
        assert time.monotonic() < deadline, f"decode not back: {state}\n{cluster.diagnostics()}"
        time.sleep(1)
    assert state["Pid"] != before["Pid"]
    deadline = time.monotonic() + 60
    while True:  # the scheduler routes to the restarted instance once its registration lands
        try:
            got = stream_chat(gateway_url(cluster), cluster.api_key)
            break
        except openai.APIError as exc:
            assert time.monotonic() < deadline, f"no answer after the restart: {exc}"
            time.sleep(1)
    assert got == native
