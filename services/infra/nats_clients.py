"""NATS API client credentials of a `strata up` cluster: issue, revoke and list them while it
runs (`strata creds`), the server reloading its users without a restart.

Under the server's data dir (``<data-dir>/nats``):

| file | what |
| --- | --- |
| ``credentials/<user>.password`` (0600) | each role's, ``api``'s and each client's password |
| ``auth.conf`` (0600) | the ``authorization`` block, passwords as bcrypt hashes (`nats.conf` includes it) |
| ``nats-server.pid`` | the running server's pid (its ``-P``), signalled to reload |

A client is its password file: `add_client` writes one, `revoke_client` deletes it; both rewrite
``auth.conf`` and send the server SIGHUP (its config reload). nats-server then refuses the
revoked user's logins and closes its open connections; permission changes (the gateway may
publish into a new client's inbox) apply to connections already open.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import time

from services.infra import nats_auth
from services.infra.procs import write_file

AUTH_CONF = "auth.conf"
PID_FILE = "nats-server.pid"


class CredsError(Exception):
    """A `strata creds` request that cannot be done (the message says why)."""


def cred_dir(data_dir: str) -> str:
    return os.path.join(data_dir, "credentials")


def client_names(data_dir: str) -> tuple[str, ...]:
    """The API clients: ``api``, then every other ``<name>.password`` that is not a role's."""
    d = cred_dir(data_dir)
    names = sorted(
        f[: -len(".password")]
        for f in (os.listdir(d) if os.path.isdir(d) else ())
        if f.endswith(".password")
    )
    return (nats_auth.API_USER, *(n for n in names if n not in nats_auth.USERS))


@contextlib.contextmanager
def _locked(data_dir: str):
    """One writer at a time (`strata up` starting the server, `strata creds`)."""
    os.makedirs(data_dir, exist_ok=True)
    fd = os.open(os.path.join(data_dir, ".auth.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_auth_conf(data_dir: str) -> dict[str, str]:
    passwords = nats_auth.ensure_credentials(cred_dir(data_dir))
    for name in client_names(data_dir)[1:]:
        with open(nats_auth.password_file(cred_dir(data_dir), name)) as f:
            passwords[name] = f.read().strip()
    hashed = {u: nats_auth.hash_password(p) for u, p in passwords.items()}
    write_file(os.path.join(data_dir, AUTH_CONF), nats_auth.authorization_block(hashed))
    return passwords


def write_auth_conf(data_dir: str) -> dict[str, str]:
    """Write ``auth.conf`` (bcrypt hashes only) for the roles, ``api`` and every client, making
    missing role passwords; returns every user's password (for the server's own clients)."""
    with _locked(data_dir):
        return _write_auth_conf(data_dir)


def add_client(data_dir: str, name: str) -> str:
    """Issue a new client ``name``: a random password in its 0600 file (returned: the path),
    the server reloaded. CredsError when the name is taken or not allowed."""
    try:
        nats_auth.check_client_name(name)
    except ValueError as exc:
        raise CredsError(str(exc)) from None
    path = nats_auth.password_file(cred_dir(data_dir), name)
    with _locked(data_dir):
        if os.path.exists(path):
            raise CredsError(f"client {name!r} exists already (revoke it first to reissue)")
        nats_auth.ensure_credentials(cred_dir(data_dir), (name,))
        _write_auth_conf(data_dir)
    return path


def revoke_client(data_dir: str, name: str) -> None:
    """Delete client ``name``'s credentials and reload: its logins are refused from now on."""
    if name == nats_auth.API_USER:
        raise CredsError(f"{name!r} is built in: rotate it by deleting its password file")
    path = nats_auth.password_file(cred_dir(data_dir), name)
    with _locked(data_dir):
        if name in nats_auth.USERS or not os.path.exists(path):
            raise CredsError(f"no client {name!r} (strata creds list shows them)")
        os.remove(path)
        _write_auth_conf(data_dir)


def reload_server(data_dir: str, wait_s: float = 10.0) -> int | None:
    """SIGHUP the nats-server running with this data dir (its pid file, checked against the
    process's command line so a reused pid is left alone): it re-reads its config. Returns the
    pid, or None when no server runs there (the change applies at its next start). Where
    `strata up` keeps the server's log (``<data-dir>/logs/nats.log``), waits for the server's
    verdict there: CredsError if it refused the new config."""
    try:
        with open(os.path.join(data_dir, PID_FILE)) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except (OSError, ValueError):
        return None
    conf = os.path.abspath(os.path.join(data_dir, "nats.conf")).encode()
    if not argv or b"nats-server" not in os.path.basename(argv[0]) or conf not in argv:
        return None
    log = os.path.join(os.path.dirname(os.path.abspath(data_dir)), "logs", "nats.log")
    start = os.path.getsize(log) if os.path.isfile(log) else -1
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + wait_s
    while start >= 0 and time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            f.seek(start)
            for line in f.read().splitlines():
                if "Failed to reload server configuration" in line:
                    raise CredsError(f"nats-server (pid {pid}) kept its old users: {line[-200:]}")
                if "Reloaded server configuration" in line:
                    return pid
        time.sleep(0.05)
    return pid


def cli(argv: list[str], default_data_dir: str, say=print) -> int:
    """Issue, revoke or list NATS API clients of `strata up --data-dir DIR`; a running
    nats-server reloads its users (no restart)."""
    p = argparse.ArgumentParser(prog="strata creds")
    p.add_argument("action", choices=["add", "revoke", "list"])
    p.add_argument("name", nargs="?", default="", help="client (its NATS user name)")
    p.add_argument(
        "--data-dir",
        default=default_data_dir,
        help="the data dir of strata up (default: .data/ of the checkout)",
    )
    a = p.parse_args(argv)
    nats_dir = os.path.join(os.path.abspath(a.data_dir), "nats")
    if not os.path.isfile(os.path.join(nats_dir, AUTH_CONF)):
        say(f"--data-dir {a.data_dir}: no strata up with NATS auth ran there (no nats/{AUTH_CONF})")
        return 1
    if a.action == "list":
        print("\n".join(client_names(nats_dir)))
        return 0
    if not a.name:
        say(f"strata creds {a.action}: name the client")
        return 2
    try:
        if a.action == "add":
            path = add_client(nats_dir, a.name)
        else:
            revoke_client(nats_dir, a.name)
        pid = reload_server(nats_dir)
    except CredsError as exc:
        say(f"strata creds {a.action}: {exc}")
        return 1
    done = f"reloaded nats-server (pid {pid})" if pid else "no nats-server runs: applies at start"
    if a.action == "add":
        say(
            f"client {a.name!r}: NATS user {a.name!r}, password in {path} (0600); it publishes "
            f"strata.api.v1.{a.name}.generate / .cancel, reply inboxes under _INBOX.{a.name}; "
            + done
        )
    else:
        say(f"client {a.name!r} revoked: its logins are refused; {done}")
    return 0
