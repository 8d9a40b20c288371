"""The `strata` command.

strata serve <role> [flags...]     run one service in this process (flags: see --help)
strata up [--model DIR] [...]      the whole cluster on this machine, Ctrl-C stops it
strata model build-default [DIR]   write the built-in default model (default: the cache)
strata model build-benchmark [DIR] write the standard benchmark model
strata nats-credentials [FILE]     NATS passwords per role for compose (default compose/.env)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import urllib.request

from pydantic import ValidationError

from services.launcher import ROLES, ClusterConfig
from services.shape import apply_affinity
from shared.config import ConfigError
from shared.model.errors import CheckpointError
from shared.service import FATAL_LINE, StartupError

APP_PACKAGE_ENV = "STRATA_APP_PACKAGE"
"""Package holding ``<role>/app.py`` (default ``services``); tests point it at dummy apps."""


def say(msg: str) -> None:
    print(f"[strata] {msg}", file=sys.stderr, flush=True)


def serve(role: str, argv: list[str]) -> int:
    """Import ``services.<role>.app`` lazily and run its ``main(argv)`` in this process."""
    if role not in ROLES:
        say(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        return 2
    try:  # pin before torch starts its thread pool (`strata up` fills STRATA_CPU_AFFINITY)
        apply_affinity()
    except (ValueError, OSError) as exc:
        print(f"{FATAL_LINE} {role}: {exc}", file=sys.stderr, flush=True)
        return 1
    package = os.environ.get(APP_PACKAGE_ENV) or "services"
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


def up_parser(prog: str = "strata up") -> argparse.ArgumentParser:
    d = ClusterConfig()
    p = argparse.ArgumentParser(prog=prog, description="Start the whole cluster on this machine.")
    p.add_argument("--model", default="", help="checkpoint dir (default: the built-in model)")
    p.add_argument("--host", default=d.host, help="address every service binds")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0 = free port)")
    p.add_argument("--nats-port", type=int, default=0, help="nats-server port (0 = free port)")
    p.add_argument("--minio-port", type=int, default=0, help="MinIO port (0 = free port)")
    p.add_argument("--no-minio", action="store_true", help="no MinIO (KV pool stays in DRAM)")
    p.add_argument(
        "--data-dir",
        default=os.path.join(_root(), ".data"),
        help="NATS/MinIO data and service logs (default: .data/)",
    )
    for role in ("scheduler", "tokenizer", "vision", "kvstore", "decode"):
        p.add_argument(
            f"--{role}",
            type=int,
            default=getattr(d, role),
            metavar="N",
            help=f"{role} instances (default {getattr(d, role)})",
        )
    p.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="prefill instances; 0 = decode prefills (default: from the machine: "
        "0 below 8 cores, else 1)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads per prefill/decode process (default: its share of the cores)",
    )
    p.add_argument("--device", default=d.device, help="torch device: cpu or cuda[:N]")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument(
        "--metrics-port-base",
        type=int,
        default=0,
        help="first Prometheus port, +1 per process (0 = free ports)",
    )
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout)
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart crashed services, nats-server or MinIO",
    )
    p.add_argument(
        "--launcher-metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of strata_launcher_restarts_total (0 = a free port)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra env for every service (repeatable)",
    )
    p.add_argument("--no-color", action="store_true", help="plain log prefixes")
    p.add_argument(
        "--no-nats-auth",
        action="store_true",
        help="NATS without users (anyone on the network may use every subject)",
    )
    p.add_argument("--nats-tls-cert", default="", help="nats-server TLS certificate (TLS on)")
    p.add_argument("--nats-tls-key", default="", help="nats-server TLS key")
    p.add_argument("--nats-tls-ca", default="", help="CA of the server certificate (for clients)")
    p.add_argument(
        "--nats-tls-verify",
        action="store_true",
        help="clients must present a certificate signed by --nats-tls-ca",
    )
    return p


def config_from_args(a: argparse.Namespace) -> ClusterConfig:
    env = {}
    for item in a.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"strata up: --env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return ClusterConfig(
        model=a.model,
        host=a.host,
        port=a.port,
        nats_port=a.nats_port,
        minio_port=a.minio_port,
        minio=not a.no_minio,
        data_dir=os.path.abspath(a.data_dir),
        scheduler=a.scheduler,
        tokenizer=a.tokenizer,
        vision=a.vision,
        kvstore=a.kvstore,
        prefill=a.prefill,
        decode=a.decode,
        torch_threads=a.torch_threads,
        device=a.device,
        log_level=a.log_level,
        metrics_port_base=a.metrics_port_base,
        ready_timeout=a.ready_timeout,
        env=env,
        die_with_parent=True,
        restart=not a.no_restart,
        launcher_metrics_port=a.launcher_metrics_port,
        nats_auth=not a.no_nats_auth,
        nats_tls_cert=a.nats_tls_cert,
        nats_tls_key=a.nats_tls_key,
        nats_tls_ca=a.nats_tls_ca,
        nats_tls_verify=a.nats_tls_verify,
    )


def up(argv: list[str]) -> int:
    """Start everything, print the URL, wait for Ctrl-C/SIGTERM, stop everything."""
    from services.infra.supervisor import ServiceFailed
    from services.launcher import Cluster, default_model_dir, ensure_model

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
    cluster = Cluster(config=cfg, log_stream=sys.stdout, color=False if args.no_color else None)
    signal.signal(signal.SIGTERM, _interrupt)
    rc = 0
    try:
        infra = "nats-server, MinIO" if cfg.minio else "nats-server"
        say(
            f"starting {infra} and the services ({cluster.cfg.prefill} prefill, "
            f"{cluster.cfg.decode} decode); "
            f"logs in {cluster.log_dir}"
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
            if (
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
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            name = json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        pass
    body = json.dumps(
        {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    say(f"Strata is up at {url}  (model {name!r}; NATS {cluster.nats_url})")
    say(f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    if cluster.cfg.nats_auth:
        from services.infra.nats_auth import API_USER, password_file

        say(
            f"NATS API (strata.api.v1.generate): user {API_USER!r}, password in "
            f"{password_file(cluster.nats.cred_dir, API_USER)}, reply inboxes under _INBOX.api"
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
    from services.launcher import ensure_model

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
        sys.exit(serve(rest[0], rest[1:]))
    if cmd == "up":
        sys.exit(up(rest))
    if cmd == "model":
        sys.exit(model_cmd(rest))
    if cmd == "nats-credentials":
        sys.exit(nats_credentials_cmd(rest))
    say(f"unknown command {cmd!r}; commands: serve, up, model, nats-credentials")
    sys.exit(2)


def nats_credentials_cmd(argv: list[str]) -> int:
    """Random NATS passwords for compose/docker-compose.yml's users (kept if already there)."""
    p = argparse.ArgumentParser(prog="strata nats-credentials")
    p.add_argument(
        "file",
        nargs="?",
        default=os.path.join(_root(), "compose", ".env"),
        help="env file docker compose reads (default: compose/.env), mode 0600",
    )
    a = p.parse_args(argv)
    from services.infra.nats_auth import write_env_file

    users = write_env_file(a.file)
    say(
        f"NATS passwords for {', '.join(users)} in {a.file} (0600); external NATS API clients "
        f"log in as 'api' with STRATA_NATS_PASSWORD_API"
    )
    return 0


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
