"""The `strata` command.

strata serve <role> [flags...]     run one service in this process (flags: see --help)
strata up [--model DIR] [...]      the whole cluster on this machine, Ctrl-C stops it
strata model build-default [DIR]   write the built-in default model (default: the cache)
strata model build-benchmark [DIR] write the standard benchmark model
strata compose-secrets [FILE]      compose's secrets, generated once (default compose/.env)
strata compose-minio-setup         (in compose) the kvstore's bucket-limited MinIO user
strata nats-credentials FILE       NATS passwords per role only (the k8s Secret strata-nats)
strata creds add|revoke|list NAME  NATS API clients of a (running) strata up, one user each
strata drain [--socket PATH]       retire the prefill/decode instance listening there (a preStop
                                   hook): it drains, then exits with code 75
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import time
import urllib.request

from pydantic import ValidationError

from services.cluster_config import MODEL_ROLES, ROLES, ClusterConfig
from services.infra.gateway_tls import local_context
from services.shape import apply_affinity
from shared.config import ConfigError, RuntimeSettings, add_model_flags, model_flag_values
from shared.model import build_kernels
from shared.model.errors import CheckpointError
from shared.service import FATAL_LINE, StartupError

APP_PACKAGE_ENV = "STRATA_APP_PACKAGE"
"""Package holding ``<role>/app.py`` (default ``services``; `RuntimeSettings.app_package`);
tests point it at dummy apps."""


def say(msg: str) -> None:
    print(f"[strata] {msg}", file=sys.stderr, flush=True)


def serve(role: str, argv: list[str]) -> int:
    """Import ``services.<role>.app`` lazily and run its ``main(argv)`` in this process."""
    if role not in ROLES:
        say(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        return 2
    try:  # pin before torch starts its thread pool (`strata up` fills STRATA_CPU_AFFINITY)
        settings = RuntimeSettings.from_env()
        if role in MODEL_ROLES and settings.cpu_kernels:  # STRATA_CPU_ISA runs on this CPU
            build_kernels.choose(settings.cpu_isa)
        apply_affinity()
    except ConfigError as exc:
        print(f"{FATAL_LINE} {role}: {exc.code}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, OSError) as exc:
        print(f"{FATAL_LINE} {role}: {exc}", file=sys.stderr, flush=True)
        return 1
    package = settings.app_package or "services"
    module = f"{package}.{role}.app"
    try:
        app = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in (package, f"{package}.{role}", module):
            raise  # the app exists but one of its own imports is missing: show the traceback
        say(
            f"the {role} service is not available: module {module} not found "
            f"(is services/{role}/app.py written and the project installed?)"
        )
        return 1
    main = getattr(app, "main", None)
    if not callable(main):
        say(f"{module} has no main(argv) function")
        return 1
    try:
        main(list(argv))
    except (ConfigError, CheckpointError, StartupError) as exc:
        # One line, no traceback: the problem and the fix (`strata up` reports this line).
        msg = str(exc.code if isinstance(exc, ConfigError) else exc)
        print(f"{FATAL_LINE} {role}: {msg}", file=sys.stderr, flush=True)
        return 1
    return 0


UP_DEFAULTS = {"port": 8000, "data_dir": "", "restart": True}
"""Where `strata up`'s default differs from `ClusterConfig`'s (``data_dir``: ``.data/`` of the
repo, filled in by `up_parser`): a fixed port, data kept across runs, crashed processes
restarted."""
UP_FIXED = {"die_with_parent": True}
"""`ClusterConfig` fields `strata up` sets and offers no flag for."""
UP_SKIP = ("stop_timeout", "role_args", *UP_FIXED)
"""`ClusterConfig` fields without a `strata up` flag (Python API only, or fixed)."""


def up_parser(prog: str = "strata up") -> argparse.ArgumentParser:
    """`strata up`'s flags, derived from `ClusterConfig` (`add_model_flags`): ``foo_bar`` ->
    ``--foo-bar``, a bool that is on by default -> ``--no-foo-bar``, ``env`` -> repeatable
    ``--env KEY=VALUE``; help from the field descriptions, defaults from the fields or
    `UP_DEFAULTS`."""
    p = argparse.ArgumentParser(prog=prog, description="Start the whole cluster on this machine.")
    defaults = {**UP_DEFAULTS, "data_dir": os.path.join(_root(), ".data")}
    add_model_flags(p, ClusterConfig, defaults=defaults, skip=UP_SKIP)
    return p


def config_from_args(a: argparse.Namespace) -> ClusterConfig:
    """The `ClusterConfig` of `up_parser`'s flags (``--data-dir`` made absolute); raises
    `ValidationError` for a bad value, `SystemExit` for an ``--env`` item without ``=``."""
    values = model_flag_values(ClusterConfig, a, "strata up", skip=UP_SKIP)
    values["data_dir"] = os.path.abspath(values["data_dir"])
    return ClusterConfig(**values, **UP_FIXED)


def up(argv: list[str]) -> int:
    """Start everything, print the URL, wait for Ctrl-C/SIGTERM, stop everything."""
    from services.cluster_config import default_model_dir, ensure_model
    from services.infra.supervisor import ServiceFailed
    from services.launcher import Cluster

    args = up_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValidationError as exc:
        e = exc.errors()[0]
        flag = "--" + str(e["loc"][0]).replace("_", "-") if e["loc"] else "a flag"
        say(f"bad setting {flag}: {e['msg']} (got {e.get('input')!r})")
        return 2
    if not cfg.model:
        say(
            f"no --model: serving the built-in default model ({default_model_dir()}, "
            "generated on first use)"
        )
        try:
            cfg = cfg.model_copy(update={"model": ensure_model("")})
        except RuntimeError as exc:
            say(str(exc))
            return 1
    cluster = Cluster(config=cfg, log_stream=sys.stdout)
    signal.signal(signal.SIGTERM, _interrupt)
    rc = 0
    try:
        infra = [] if cfg.nats_url else ["nats-server"]
        if cfg.minio and not cfg.minio_endpoint:
            infra.append("MinIO")
        joins = [f"NATS at {cfg.nats_url}"] if cfg.nats_url else []
        if cfg.minio and cfg.minio_endpoint:
            joins.append(f"MinIO at {cfg.minio_endpoint}")
        say(
            (f"joining {' and '.join(joins)}; " if joins else "")
            + f"starting {', '.join([*infra, 'the services'])} ({cluster.cfg.prefill} prefill, "
            f"{cluster.cfg.decode} decode"
            + (
                f"; instance ids prefixed {cluster.instance_prefix!r}"
                if cluster.instance_prefix
                else ""
            )
            + f"); logs in {cluster.log_dir}"
        )
        cluster.start()
        _banner(cluster)
        while cluster.watchdog is not None:  # restarts crashed processes (services.infra.restart)
            time.sleep(0.5)
            if cluster.watchdog.fatal:
                say(f"{cluster.watchdog.fatal}; stopping")
                rc = 1
                break
        while cluster.watchdog is None:
            time.sleep(0.5)
            for p in cluster.sup.exited():
                say(
                    f"{p.name} exited with code {p.returncode}; last lines:\n"
                    + "\n".join(f"  | {line}" for line in p.tail)
                )
            if not cfg.nats_url and (
                cluster.nats is None
                or cluster.nats.proc is None
                or cluster.nats.proc.poll() is not None
            ):
                say("nats-server exited; stopping")
                rc = 1
                break
    except KeyboardInterrupt:
        say("stopping...")
    except ServiceFailed as exc:
        say(f"start-up failed: {exc}")
        rc = 1
    except CheckpointError as exc:
        say(f"start-up failed: bad --model checkpoint: {exc}")
        rc = 1
    except (RuntimeError, TimeoutError, OSError) as exc:
        say(f"start-up failed: {exc}")
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
        say("stopped")
    return rc


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _banner(cluster) -> None:
    url = cluster.gateway_url
    name = os.path.basename(cluster.model_dir.rstrip("/"))
    cert = cluster.cfg.tls_cert
    ctx = local_context(cert) if cert else None
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2, context=ctx) as r:
            name = json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        pass
    body = json.dumps(
        {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    say(f"Strata is up at {url}  (model {name!r}; NATS {cluster.nats_url})")
    trust = f"--cacert {cert} " if cert else ""
    say(
        f"try:  curl {trust}{url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{body}'"
    )
    if cluster.cfg.nats_auth:
        from services.infra.nats_auth import API_USER, password_file

        say(
            f"NATS API (strata.api.v1.{API_USER}.generate): user {API_USER!r}, password in "
            f"{password_file(cluster.nats.cred_dir, API_USER)}, reply inboxes under "
            f"_INBOX.{API_USER}; one user per client: strata creds add NAME --data-dir "
            f"{cluster.data_dir}"
        )
    if cluster.watchdog is not None:
        say(
            f"crashed processes are restarted (backoff 0.5s doubling to 30s); restart counts: "
            f"http://{cluster.cfg.host}:{cluster.launcher_metrics_port}/metrics"
        )
    say("Ctrl-C stops everything.")


def model_cmd(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="strata model")
    p.add_argument("what", choices=["build-default", "build-benchmark"])
    p.add_argument("dir", nargs="?", default="", help="output dir (default: .cache/models/...)")
    a = p.parse_args(argv)
    from services.cluster_config import ensure_model

    try:
        if a.dir:
            from shared.model import default_model

            build = (
                default_model.build_benchmark_model
                if a.what == "build-benchmark"
                else default_model.build_default_model
            )
            out = str(build(a.dir))
        else:
            out = ensure_model("", benchmark=a.what == "build-benchmark")
    except (ImportError, RuntimeError) as exc:
        say(f"cannot build the model: {exc}")
        return 1
    print(out)
    return 0


def exit_now(code: int) -> None:
    """End a service process once its ``main`` has returned (drained, exit stack closed):
    flush the logs and skip the interpreter's finalization. Tearing down torch's modules and a
    last full GC took 0.5-1 s of CPU per process, several seconds when a cluster's processes
    stop together on a small machine, with nothing left to save (every thread the service
    started is done or a daemon)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\nroles: {', '.join(ROLES)}")
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        if not rest or rest[0].startswith("-"):
            say(f"usage: strata serve <role> [flags...]; roles: {', '.join(ROLES)}")
            sys.exit(2)
        exit_now(serve(rest[0], rest[1:]))
    if cmd == "up":
        sys.exit(up(rest))
    if cmd == "model":
        sys.exit(model_cmd(rest))
    if cmd == "compose-secrets":
        sys.exit(compose_secrets_cmd(rest))
    if cmd == "nats-credentials":
        sys.exit(nats_credentials_cmd(rest))
    if cmd == "compose-minio-setup":
        sys.exit(compose_minio_setup_cmd())
    if cmd == "creds":
        sys.exit(creds_cmd(rest))
    if cmd == "drain":
        sys.exit(drain_cmd(rest))
    say(
        f"unknown command {cmd!r}; commands: serve, up, model, creds, drain, compose-secrets, "
        "compose-minio-setup"
    )
    sys.exit(2)


def compose_secrets_cmd(argv: list[str]) -> int:
    """Random secrets for compose/docker-compose.yml (kept if already there)."""
    p = argparse.ArgumentParser(prog="strata compose-secrets")
    p.add_argument(
        "file",
        nargs="?",
        default=os.path.join(_root(), "compose", ".env"),
        help="env file docker compose reads (default: compose/.env), mode 0600",
    )
    a = p.parse_args(argv)
    from services.infra.compose_secrets import SECRET_VARS, write_env_file

    write_env_file(a.file)
    say(
        f"compose secrets in {a.file} (0600): NATS passwords per role, "
        + ", ".join(SECRET_VARS)
        + "; external NATS API clients log in as 'api' with STRATA_NATS_PASSWORD_API"
    )
    return 0


def nats_credentials_cmd(argv: list[str]) -> int:
    """The NATS passwords alone (the k8s Secret strata-nats); compose needs compose-secrets."""
    p = argparse.ArgumentParser(prog="strata nats-credentials")
    p.add_argument("file", help="env file to write, mode 0600 (existing passwords kept)")
    a = p.parse_args(argv)
    from services.infra.nats_auth import write_env_file

    users = write_env_file(a.file)
    say(
        f"NATS passwords for {', '.join(users)} in {a.file} (0600); external NATS API clients "
        f"log in as 'api' with STRATA_NATS_PASSWORD_API"
    )
    return 0


def creds_cmd(argv: list[str]) -> int:
    """`strata creds`: NATS API clients of `strata up --data-dir DIR` (`nats_clients.cli`)."""
    from services.infra.nats_clients import cli

    return cli(argv, default_data_dir=os.path.join(_root(), ".data"), say=say)


def drain_cmd(argv: list[str]) -> int:
    """`strata drain`: the retirement of one instance, asked over its drain socket
    (`shared.worker.drain`); 0 once it drained, 1 if requests outlived its drain bound."""
    p = argparse.ArgumentParser(prog="strata drain")
    p.add_argument(
        "--socket",
        default=RuntimeSettings.from_env().drain_socket,
        help="the instance's STRATA_DRAIN_SOCKET (default: that variable here, as in its pod)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait at most (default: the instance's own bound, drain_timeout_s)",
    )
    a = p.parse_args(argv)
    if not a.socket:
        say("drain: no socket: pass --socket PATH or set STRATA_DRAIN_SOCKET (the instance's)")
        return 2
    from shared.worker.drain import request_drain

    return request_drain(a.socket, say, a.timeout)


def compose_minio_setup_cmd() -> int:
    """compose's minio-setup container: the kvstore's bucket-limited MinIO user."""
    from services.infra.compose_secrets import SetupError, provision_from_env

    try:
        user = provision_from_env()
    except (SetupError, ConfigError) as exc:
        msg = str(exc.code if isinstance(exc, ConfigError) else exc)
        print(f"{FATAL_LINE} minio-setup: {msg}", file=sys.stderr, flush=True)
        return 1
    say(f"MinIO user {user} limited to the KV bucket")
    return 0


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
