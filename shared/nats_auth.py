"""Client credentials and TLS for the NATS connection, from ``STRATA_NATS_*`` env vars.

`shared.bus.connect` applies them to every connection a service opens (the heartbeat thread's
too). Secrets are settings of the environment, not CLI flags, so they never show in ``ps``.

| env var | meaning |
| --- | --- |
| ``STRATA_NATS_USER`` | user name (the role under `strata up`); unset = anonymous |
| ``STRATA_NATS_PASSWORD`` | its password |
| ``STRATA_NATS_PASSWORD_FILE`` | or a file holding it (what `strata up` passes: 0600 in its data dir) |
| ``STRATA_NATS_INBOX_PREFIX`` | reply-inbox prefix (default ``_INBOX.<user>``: a user may read only its own inboxes) |
| ``STRATA_NATS_TLS_CA`` | CA bundle that signed the server's certificate (turns TLS on) |
| ``STRATA_NATS_TLS_CERT``, ``STRATA_NATS_TLS_KEY`` | client certificate and key, when the server verifies clients |
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shared.config import ConfigError, RuntimeSettings

INBOX_ROOT = "_INBOX"


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of ``user``: the server lets it subscribe only below this."""
    return f"{INBOX_ROOT}.{user}" if user else INBOX_ROOT


class NatsAuth(BaseModel):
    """How one client authenticates to nats-server (all empty = anonymous, no TLS)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str = Field("", description="NATS user name")
    password: str = Field("", repr=False, description="Password of ``user``")
    inbox_prefix: str = Field("", description="Reply-inbox prefix ('' = _INBOX.<user>)")
    tls_ca: str = Field("", description="CA file for the server certificate ('' = no TLS)")
    tls_cert: str = Field("", description="Client certificate file (mutual TLS)")
    tls_key: str = Field("", description="Client key file (mutual TLS)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NatsAuth:
        """Read ``STRATA_NATS_*``; a password file that cannot be read or a password without a
        user raises `ConfigError` naming the variable."""
        s = RuntimeSettings.from_env(env)
        user, password, path = s.nats_user, s.nats_password, s.nats_password_file
        if path and not password:
            try:
                with open(path) as f:
                    password = f.read().strip()
            except OSError as exc:
                raise ConfigError(
                    f"STRATA_NATS_PASSWORD_FILE={path}: cannot read it ({exc.strerror})"
                ) from None
        if password and not user:
            raise ConfigError("STRATA_NATS_PASSWORD is set but STRATA_NATS_USER is not")
        auth = cls(
            user=user,
            password=password,
            inbox_prefix=s.nats_inbox_prefix,
            tls_ca=s.nats_tls_ca,
            tls_cert=s.nats_tls_cert,
            tls_key=s.nats_tls_key,
        )
        if bool(auth.tls_cert) != bool(auth.tls_key):
            raise ConfigError("STRATA_NATS_TLS_CERT and STRATA_NATS_TLS_KEY go together")
        for var, value in (
            ("STRATA_NATS_TLS_CA", auth.tls_ca),
            ("STRATA_NATS_TLS_CERT", auth.tls_cert),
            ("STRATA_NATS_TLS_KEY", auth.tls_key),
        ):
            if value and not os.path.isfile(value):
                raise ConfigError(f"{var}={value}: no such file")
        return auth

    def env(self, password_file: str = "") -> dict[str, str]:
        """The ``STRATA_NATS_*`` vars that make `from_env` rebuild this (password as a file
        path when ``password_file`` is given)."""
        out = {"STRATA_NATS_USER": self.user}
        if password_file:
            out["STRATA_NATS_PASSWORD_FILE"] = password_file
        elif self.password:
            out["STRATA_NATS_PASSWORD"] = self.password
        for var, value in (
            ("STRATA_NATS_INBOX_PREFIX", self.inbox_prefix),
            ("STRATA_NATS_TLS_CA", self.tls_ca),
            ("STRATA_NATS_TLS_CERT", self.tls_cert),
            ("STRATA_NATS_TLS_KEY", self.tls_key),
        ):
            if value:
                out[var] = value
        return out

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        kw: dict[str, Any] = {"inbox_prefix": self.inbox_prefix or inbox_prefix(self.user)}
        if self.user:
            kw.update(user=self.user, password=self.password)
        if self.tls_ca or self.tls_cert:
            ctx = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kw["tls"] = ctx
        return kw
