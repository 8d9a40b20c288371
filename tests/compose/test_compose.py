"""Static checks of compose/ (tests/compose/test_compose_live.py runs it): every role is a
service of the one image, commands are valid `strata serve` roles, env names are real settings,
ports and depends_on hold, NATS is a 3-node JetStream cluster and MinIO is distributed
(erasure-coded, 4 drives)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from services.cluster_config import ROLES
from services.infra import nats_auth
from services.infra.nats_server import MAX_PAYLOAD, nats_binary
from services.infra.procs import repo_root
from shared.config import ModelServiceConfig

COMPOSE = os.path.join(repo_root(), "compose")

# Settings the services read beyond the shared ServiceConfig/ModelServiceConfig fields
# (gateway host/port, kvstore MinIO, worker kvstore addresses); documented in OPERATIONS.md.
SERVICE_SETTINGS = {
    "HOST",
    "PORT",
    "MINIO_ENDPOINT",
    "MINIO_ACCESS_KEY",
    "MINIO_SECRET_KEY",
    "API_KEYS",
    "KVSTORE_ADDRS",
    "NATS_USER",
    "NATS_PASSWORD",
    "HOST_ENGINES",  # prefill / decode: WorkerConfig.host_engines (the auto KV budget's split)
}
KNOWN = {f.upper() for f in ModelServiceConfig.model_fields} | SERVICE_SETTINGS


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(os.path.join(COMPOSE, "docker-compose.yml")) as f:
        return yaml.safe_load(f)


def default_image(svc: dict) -> str:
    """The image a user gets: ``${STRATA_X_IMAGE:-nats:2.10-alpine}`` -> ``nats:2.10-alpine``."""
    image = svc.get("image", "")
    m = re.fullmatch(r"\$\{STRATA_[A-Z]+_IMAGE:-([^}]+)\}", image)
    return m.group(1) if m else image


def nats_nodes(compose: dict) -> list[str]:
    return sorted(n for n, s in compose["services"].items() if default_image(s).startswith("nats:"))


def minio_nodes(compose: dict) -> list[str]:
    return sorted(
        n for n, s in compose["services"].items() if default_image(s).startswith("minio/minio")
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def role_of(svc: dict) -> str | None:
    cmd = svc.get("command")
    if cmd is None:
        return None
    argv = cmd.split() if isinstance(cmd, str) else list(cmd)
    if argv[:2] != ["strata", "serve"]:
        return None
    return argv[2]


def test_every_role_is_a_service_running_strata_serve(compose):
    services = compose["services"]
    roles = {name: role_of(svc) for name, svc in services.items() if role_of(svc)}
    assert sorted(roles.values()) == sorted(ROLES)
    for name, role in roles.items():
        svc = services[name]
        assert role in ROLES
        assert name == role  # one service per role, named after it
        assert svc["image"] == "strata:latest"
        assert svc["build"]["dockerfile"] == "compose/Dockerfile"
        assert os.path.isfile(
            os.path.join(COMPOSE, svc["build"]["context"], svc["build"]["dockerfile"])
        )
        assert svc["volumes"] == ["models:/models"]
        assert "healthcheck" in svc and svc["healthcheck"]["test"][0] == "CMD"


def test_every_service_has_an_image_or_build(compose):
    for name, svc in compose["services"].items():
        assert svc.get("image") or svc.get("build"), name


def test_env_names_real_settings_and_unique_instances(compose):
    ids = []
    for name, svc in compose["services"].items():
        if not role_of(svc):
            continue
        env = svc["environment"]
        seeds = [f"nats://{n}:4222" for n in nats_nodes(compose)]
        assert env["STRATA_NATS_URL"].split(",") == seeds  # every node of the cluster
        assert env["STRATA_JS_REPLICAS"] == str(len(seeds)) == "3"
        assert env["STRATA_MODEL"] == "/models/default"
        assert env["STRATA_METRICS_PORT"] == "9100"
        for key, value in env.items():
            assert key.startswith("STRATA_"), key
            assert key[len("STRATA_") :] in KNOWN, f"{name}: unknown setting {key}"
            assert isinstance(value, str), f"{name}: {key} must be a string in YAML"
        ids.append(env["STRATA_INSTANCE_ID"])
    assert len(ids) == len(set(ids)) == len(ROLES)


def secret_var(value: str) -> str:
    """``${STRATA_X:?run: ...}`` -> ``STRATA_X``; anything else is a value in the file."""
    m = re.fullmatch(
        r"\$\{(STRATA_[A-Z_]+):\?" + re.escape(nats_auth.COMPOSE_MISSING) + r"\}", value
    )
    assert m, f"not a secret from compose/.env: {value!r}"
    return m.group(1)


def test_model_processes_get_threads_and_grpc(compose):
    s = compose["services"]
    for role in ("vision", "prefill", "decode"):
        env = s[role]["environment"]
        assert int(env["STRATA_TORCH_THREADS"]) >= 1
        assert env["STRATA_GRPC_HOST"] == role and env["STRATA_GRPC_PORT"] == "50051"
    for role in ("prefill", "decode"):
        assert s[role]["environment"]["STRATA_KVSTORE_ADDRS"] == "kvstore:50051"
    kv = s["kvstore"]["environment"]
    assert kv["STRATA_MINIO_ENDPOINT"].split(",") == [f"{n}:9000" for n in minio_nodes(compose)]
    setup = s["minio-setup"]["environment"]
    for node in minio_nodes(compose):
        minio = s[node]["environment"]
        assert secret_var(minio["MINIO_ROOT_PASSWORD"]) == "STRATA_MINIO_ROOT_PASSWORD"
        # the kvstore is not root: its own user, which minio-setup makes with the root account
        assert kv["STRATA_MINIO_ACCESS_KEY"] != minio["MINIO_ROOT_USER"]
        assert (setup["MINIO_ROOT_USER"], setup["MINIO_ROOT_PASSWORD"]) == (
            minio["MINIO_ROOT_USER"],
            minio["MINIO_ROOT_PASSWORD"],
        )
    assert secret_var(kv["STRATA_MINIO_SECRET_KEY"]) == "STRATA_MINIO_KV_PASSWORD"
    assert (setup["STRATA_MINIO_ACCESS_KEY"], setup["STRATA_MINIO_SECRET_KEY"]) == (
        kv["STRATA_MINIO_ACCESS_KEY"],
        kv["STRATA_MINIO_SECRET_KEY"],
    )
    assert setup["STRATA_MINIO_ENDPOINT"] == kv["STRATA_MINIO_ENDPOINT"]
    assert s["minio-setup"]["command"] == ["strata", "compose-minio-setup"]
    assert s["kvstore"]["depends_on"]["minio-setup"] == {
        "condition": "service_completed_successfully"
    }


def test_only_the_gateway_is_published_on_loopback_and_asks_for_a_key(compose):
    """By default nothing but the gateway is published, on 127.0.0.1; a public bind is the
    operator's STRATA_GATEWAY_BIND and the API key is required either way (the gateway refuses
    a non-loopback bind without one). Grafana (monitoring profile) is on loopback too."""
    s = compose["services"]
    published = {n: svc["ports"] for n, svc in s.items() if svc.get("ports")}
    assert set(published) == {"gateway", "grafana"}, published
    assert s["grafana"]["profiles"] == ["monitoring"]
    assert published["grafana"] == ["127.0.0.1:3000:3000"]
    gw = s["gateway"]
    assert gw["ports"] == ["${STRATA_GATEWAY_BIND:-127.0.0.1}:${STRATA_GATEWAY_PORT:-8000}:8000"]
    assert gw["environment"]["STRATA_PORT"] == "8000"
    assert gw["environment"]["STRATA_HOST"] == "0.0.0.0"  # inside its container
    assert secret_var(gw["environment"]["STRATA_API_KEYS"]) == "STRATA_API_KEY"
    assert "/health" in " ".join(gw["healthcheck"]["test"])
    prom = yaml.safe_load(compose["configs"]["prometheus"]["content"])
    (http_job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "strata-gateway-http"]
    assert secret_var(http_job["authorization"]["credentials"]) == "STRATA_API_KEY"


def test_no_fixed_credentials_in_the_file(compose):
    """Every password-like value is a ``${STRATA_...:?}`` reference to compose/.env."""
    secretish = re.compile(r"PASSWORD|SECRET|API_KEYS?$|_KEY$")
    for svc in compose["services"].values():
        for key, value in svc.get("environment", {}).items():
            if secretish.search(key) and key != "STRATA_MINIO_ACCESS_KEY":
                secret_var(value)  # asserts
    with open(os.path.join(COMPOSE, "docker-compose.yml")) as f:
        text = f.read()
    assert "strata-secret-key" not in text


def test_grafana_has_no_anonymous_admin(compose):
    env = compose["services"]["grafana"]["environment"]
    assert env.get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") == "Viewer"
    assert env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and env["GF_AUTH_BASIC_ENABLED"] == "false"
    assert not any("ADMIN" in k for k in env)


def test_depends_on_points_at_existing_services(compose):
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        for dep, cond in deps.items():
            assert dep in services, f"{name} depends on missing {dep}"
            assert dep != name
            assert cond["condition"] in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            )
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
        if role_of(svc):
            for node in nats_nodes(compose):
                assert deps[node]["condition"] == "service_healthy", (name, node)
    for node in minio_nodes(compose):
        assert services["minio-setup"]["depends_on"][node]["condition"] == "service_healthy"


def test_infra_and_optional_monitoring(compose):
    s = compose["services"]
    assert all("-js" in s[n]["command"] for n in nats_nodes(compose))
    assert s["prometheus"]["profiles"] == ["monitoring"]
    assert s["grafana"]["profiles"] == ["monitoring"]
    prom = yaml.safe_load(compose["configs"]["prometheus"]["content"])
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert sorted(targets) == sorted(f"{r}:9100" for r in ROLES)
    for name, svc in s.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            assert src.startswith("./") or src in compose["volumes"], f"{name}: {vol}"
        for c in svc.get("configs", []):
            assert c["source"] in compose["configs"]


def test_every_role_and_the_infra_restart_unless_stopped(compose):
    """A crashed container comes back (as `strata up` restarts a crashed process); NATS keeps
    its volume, so JetStream state survives the restart."""
    s = compose["services"]
    for name in (*ROLES, *nats_nodes(compose), *minio_nodes(compose)):
        assert s[name].get("restart") == "unless-stopped", name
    for node in nats_nodes(compose):
        (vol,) = [v for v in s[node]["volumes"] if v.endswith(":/data")]
        assert vol.split(":")[0] in compose["volumes"]
    data = [v for n in nats_nodes(compose) for v in s[n]["volumes"]]
    assert len(set(data)) == 3  # a volume of its own per node


def test_nats_is_a_three_node_jetstream_cluster(compose):
    """Three nodes of one cluster, each with JetStream on its own store, a unique server name
    (JetStream needs one) and routes to every node (a node drops the route to itself)."""
    s = compose["services"]
    nodes = nats_nodes(compose)
    assert nodes == ["nats-0", "nats-1", "nats-2"]
    names, clusters = set(), set()
    for node in nodes:
        argv = s[node]["command"]
        assert "-js" in argv and flag(argv, "-sd") == "/data"
        names.add(flag(argv, "--server_name"))
        clusters.add(flag(argv, "--cluster_name"))
        route_auth = f"route:${{STRATA_NATS_ROUTE_PASSWORD:?{nats_auth.COMPOSE_MISSING}}}@"
        assert flag(argv, "--cluster") == f"nats://{route_auth}0.0.0.0:6222"
        routes = flag(argv, "--routes").split(",")
        assert sorted(routes) == [f"nats://{route_auth}{n}:6222" for n in nodes]
        assert s[node]["healthcheck"]["test"][0] == "CMD"
    assert names == set(nodes) and len(clusters) == 1


ROUTE_VAR = f"${{STRATA_NATS_ROUTE_PASSWORD:?{nats_auth.COMPOSE_MISSING}}}"


def node_argv(compose: dict, node: str, tmp, ports: dict[str, tuple[int, int, int]], pw: str):
    """A node's compose command line on loopback: client, cluster and monitoring ports from
    ``ports`` (by node name), the route password ``pw``, its store and config under ``tmp``."""
    argv = [a.replace(ROUTE_VAR, pw) for a in compose["services"][node]["command"]]
    for name, (_, cluster, _) in ports.items():
        argv = [a.replace(f"@{name}:6222", f"@127.0.0.1:{cluster}") for a in argv]
    client, cluster, mon = ports[node]
    argv = [a.replace("0.0.0.0:6222", f"127.0.0.1:{cluster}") for a in argv]
    argv[argv.index("-m") + 1] = str(mon)
    argv[argv.index("-sd") + 1] = str(tmp / node)
    conf = tmp / "plain.conf"
    conf.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    argv[argv.index("-c") + 1] = str(conf)
    return [nats_binary(), *argv, "-a", "127.0.0.1", "-p", str(client)]


def test_nats_routes_need_the_route_password(compose, tmp_path):
    """Two nodes started from the file's own command lines: with the route password they form
    a cluster; a node that dials with another password is refused (no route either way)."""
    import json
    import time
    import urllib.request

    from services.infra.procs import free_port

    def stop(p: subprocess.Popen) -> None:
        p.kill()  # no lame-duck wait: nothing here outlives the test
        p.wait(10)

    ports = {n: (free_port(), free_port(), free_port()) for n in nats_nodes(compose)}

    def routes(node: str) -> int:
        url = f"http://127.0.0.1:{ports[node][2]}/routez"
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.load(r)["num_routes"]

    def settle(node: str, done, secs: float) -> int:
        """Route connections of ``node`` once ``done(n)``, else the last count after ``secs``
        (a route is a pool of connections: nats-server opens several per peer)."""
        deadline, n = time.monotonic() + secs, -1
        while time.monotonic() < deadline:
            try:
                n = routes(node)
            except OSError:
                n = -1
            if done(n):
                return n
            time.sleep(0.2)
        return n

    procs = []
    try:
        for node, pw in (("nats-0", "right-pw"), ("nats-1", "wrong-pw")):
            argv = node_argv(compose, node, tmp_path, ports, pw)
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        assert settle("nats-0", lambda n: n == 0, 1.0) == 0
        assert settle("nats-0", lambda n: n > 0, 4.0) == 0, "a wrong route password was accepted"
        stop(procs.pop())
        argv = node_argv(compose, "nats-1", tmp_path, ports, "right-pw")
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        assert settle("nats-0", lambda n: n > 0, 15.0) > 0, "the right password formed no route"
    finally:
        for p in procs:
            stop(p)


def test_minio_is_distributed_over_four_drives(compose):
    """Every MinIO container serves the same erasure set: 4 drives, 2 per container, each drive
    a volume of the container that owns it; the kvstore knows every container's endpoint."""
    s = compose["services"]
    nodes = minio_nodes(compose)
    assert nodes == ["minio-1", "minio-2"]
    drive_sets = []
    for node in nodes:
        argv = s[node]["command"]
        assert argv[0] == "server"
        drives = [a for a in argv if a.startswith("http://")]
        drive_sets.append(drives)
        mounts = {v.split(":")[1]: v.split(":")[0] for v in s[node]["volumes"]}
        own = [d for d in drives if d.startswith(f"http://{node}:9000/")]
        assert len(own) == 2
        for d in own:
            path = "/" + d.split("/", 3)[3]
            assert mounts[path] in compose["volumes"], (node, d)
        assert s[node]["healthcheck"]["test"][0] == "CMD-SHELL"  # mc, else wget
    assert drive_sets[0] == drive_sets[1] and len(set(drive_sets[0])) == 4
    hosts = {d.split("/")[2].split(":")[0] for d in drive_sets[0]}
    assert hosts == set(nodes)


def dockerfile_lines(name: str) -> list[str]:
    with open(os.path.join(COMPOSE, name)) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


def test_dockerfile_installs_the_project_and_builds_nothing_at_runtime():
    lines = dockerfile_lines("Dockerfile")
    # users get the public base; the live test passes its debootstrap one
    assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim"
    assert lines[1] == "FROM ${BASE_IMAGE} AS base"
    runs = " ".join(ln for ln in lines if ln.startswith("RUN") or ln.startswith("&&"))
    assert "pip install --no-deps --no-build-isolation ." in runs
    assert "strata model build-default /models/default" in runs
    cmd = [ln for ln in lines if ln.startswith(("CMD", "ENTRYPOINT"))]
    assert cmd == ['CMD ["strata", "serve", "gateway"]']
    copied = {src for ln in lines if ln.startswith("COPY ") for src in ln.split()[1:-1]}
    assert {"pyproject.toml", "README.md", "services", "shared", "protos"} <= copied
    assert any(ln.startswith("USER ") and "root" not in ln for ln in lines)
    assert not any("--mount" in ln or "<<" in ln for ln in lines)  # the legacy builder builds it


def test_the_build_context_holds_what_the_dockerfile_copies():
    """compose/Dockerfile's context is the repository root: .dockerignore admits exactly the
    paths it copies (no .venv, .cache or .git sent to the daemon)."""
    with open(os.path.join(repo_root(), ".dockerignore")) as f:
        rules = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert rules[0] == "*"
    admitted = {r[1:] for r in rules if r.startswith("!")}
    copied = {
        src
        for ln in dockerfile_lines("Dockerfile")
        if ln.startswith("COPY ") and "--from" not in ln
        for src in ln.split()[1:-1]
    }
    assert copied == admitted
    for path in admitted:
        assert os.path.exists(os.path.join(repo_root(), path)), path


def test_local_nats_and_minio_images_are_opt_in():
    """Users pull the public NATS and MinIO images; STRATA_NATS_IMAGE / STRATA_MINIO_IMAGE pick
    the ones compose/nats.Dockerfile and compose/minio.Dockerfile build (the live test's)."""
    with open(os.path.join(COMPOSE, "docker-compose.yml")) as f:
        s = yaml.safe_load(f)["services"]
    for node in ("nats-0", "nats-1", "nats-2"):
        assert s[node]["image"] == "${STRATA_NATS_IMAGE:-nats:2.10-alpine}"
    for node in ("minio-1", "minio-2"):
        assert s[node]["image"] == "${STRATA_MINIO_IMAGE:-minio/minio:latest}"
    for name, binary in (("nats.Dockerfile", "nats-server"), ("minio.Dockerfile", "minio")):
        lines = dockerfile_lines(name)
        assert lines[:2] == ["ARG BASE_IMAGE=debian:bookworm-slim", "FROM ${BASE_IMAGE}"]
        assert f"COPY {binary} /usr/local/bin/{binary}" in lines
        assert lines[-1] == f'ENTRYPOINT ["{binary}"]'  # compose's command is its arguments


def test_nats_has_a_user_per_role_and_no_anonymous_access(compose, tmp_path):
    """The nats service runs with the authorization block `strata up` uses (passwords from
    compose/.env); each service logs in as its role; after compose's interpolation the config
    is one the real nats-server accepts."""
    s = compose["services"]
    nodes = nats_nodes(compose)
    confs = set()
    for node in nodes:
        conf = flag(s[node]["command"], "-c")
        (mount,) = [c for c in s[node]["configs"] if c["target"] == conf]
        confs.add(mount["source"])
    (source,) = confs  # one config for every node
    content = compose["configs"][source]["content"]
    assert content == f"max_payload: {MAX_PAYLOAD}\n" + nats_auth.compose_authorization_block()
    assert "no_auth_user" not in content
    for role in ROLES:
        env = s[role]["environment"]
        var = nats_auth.compose_password_var(role)
        assert env["STRATA_NATS_USER"] == role
        assert env["STRATA_NATS_PASSWORD"] == f"${{{var}:?{nats_auth.COMPOSE_MISSING}}}"
    passwords = nats_auth.write_env_file(str(tmp_path / ".env"))
    assert (tmp_path / ".env").stat().st_mode & 0o777 == 0o600
    assert nats_auth.write_env_file(str(tmp_path / ".env")) == passwords  # kept on a rerun
    text = content
    for user, pw in passwords.items():
        text = text.replace(
            f"${{{nats_auth.compose_password_var(user)}:?{nats_auth.COMPOSE_MISSING}}}", pw
        )
    text = text.replace("$$", "$")  # compose's escape
    assert text == f"max_payload: {MAX_PAYLOAD}\n" + nats_auth.authorization_block(passwords)
    (tmp_path / "nats.conf").write_text(text)
    for node in nodes:
        # Each node's own command line with the config at its place: nats-server answers an
        # unknown flag with its usage (exit 0), so the verdict is the "is valid" line.
        argv = [a.replace(ROUTE_VAR, "route-pw") for a in s[node]["command"]]
        argv[argv.index("-c") + 1] = str(tmp_path / "nats.conf")
        argv[argv.index("-sd") + 1] = str(tmp_path / node)
        res = subprocess.run(
            [nats_binary(), *argv, "-t"], capture_output=True, text=True, timeout=30
        )
        out = res.stdout + res.stderr
        assert res.returncode == 0 and "is valid" in out and "Usage" not in out, (node, out)


def test_the_image_build_takes_its_indexes_from_the_builder():
    """PIP_INDEX and TORCH_INDEX default to nothing (no host in the file); set, pip uses them."""
    lines = dockerfile_lines("Dockerfile")
    for arg in ("PIP_INDEX", "TORCH_INDEX", "WHEELS_URL"):
        assert f"ARG {arg}=" in lines, arg
    assert not any(ln.startswith("ARG") and "://" in ln for ln in lines)
    runs = " ".join(lines)
    assert 'index="--index-url $PIP_INDEX"' in runs and "pip install $index -r" in runs
    assert 'pip install --index-url "$TORCH_INDEX" torch' in runs


def test_the_debian_mirror_is_the_machines_apt_mirror(tmp_path, monkeypatch):
    """The live test's debootstrap takes STRATA_DEBIAN_MIRROR, else this machine's apt mirror
    (deb822 and one-line sources; the security archive skipped); with neither, one line."""
    from tests.compose import docker_env

    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\n# http://old.example/debian\nURIs: http://mirror.example/debian/\n"
        "Suites: bookworm\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
    )
    (d / "extra.list").write_text("deb [arch=amd64] http://other.example/debian bookworm main\n")
    (d / "notes.txt").write_text("URIs: http://ignored.example/\n")
    assert docker_env.apt_mirrors((str(d),)) == [
        "http://mirror.example/debian",
        "http://other.example/debian",
    ]
    monkeypatch.setattr(docker_env, "APT_SOURCES", (str(d),))
    monkeypatch.delenv("STRATA_DEBIAN_MIRROR", raising=False)
    assert docker_env.debian_mirror() == "http://mirror.example/debian"
    monkeypatch.setenv("STRATA_DEBIAN_MIRROR", "http://set.example/debian")
    assert docker_env.debian_mirror() == "http://set.example/debian"
    monkeypatch.delenv("STRATA_DEBIAN_MIRROR")
    monkeypatch.setattr(docker_env, "APT_SOURCES", (str(tmp_path / "none"),))
    with pytest.raises(docker_env.DockerEnvError, match="set STRATA_DEBIAN_MIRROR"):
        docker_env.debian_mirror()
