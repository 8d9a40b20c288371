"""Frozen, validated service configuration from ``STRATA_*`` env vars and mirroring CLI flags.

Each service subclasses `ServiceConfig`; a field ``foo_bar`` is read from ``--foo-bar`` or
``STRATA_FOO_BAR`` (the flag wins). Bad values fail fast with a message naming the setting.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import textwrap
import uuid
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "STRATA_"


class ConfigError(SystemExit):
    """Raised at start-up when a setting is invalid; exits with the message (one line naming
    every bad setting's env var and flag, what is wrong and the value given)."""


class ServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL, or a comma-separated seed list of a cluster's servers",
    )
    js_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="JetStream replicas of the KV-event stream and the registry "
        "bucket when this process creates them (1: one server; 3: a 3-node cluster)",
    )
    instance_id: str = Field("", description="Unique instance name (default: <role>-<random>)")
    log_level: str = Field("INFO", description="Python log level")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (0 = off)")
    metrics_host: str = Field(
        "",
        description="Address /metrics binds ('' = the service's own: host or grpc_host, "
        "else 127.0.0.1)",
    )

    @property
    def metrics_bind(self) -> str:
        """The address /metrics binds: ``metrics_host``, else the address the service itself
        binds (``host``, ``grpc_host``), else loopback; never every interface by default."""
        own = getattr(self, "host", "") or getattr(self, "grpc_host", "")
        return self.metrics_host or own or "127.0.0.1"

    @classmethod
    def load(cls, argv: list[str] | None = None, role: str = "", **overrides: Any) -> Self:
        """Build from defaults < env < CLI flags < ``overrides``; exits with a clear message."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            env = os.environ.get(ENV_PREFIX + name.upper())
            if env is not None:
                values[name] = env
        parser = argparse.ArgumentParser(prog=f"strata serve {role}".strip(), add_help=True)
        for name, field in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            parser.add_argument(flag, dest=name, default=None, help=field.description)
        args, unknown = parser.parse_known_args(argv or [])
        if unknown:
            raise ConfigError(f"unknown option(s) for {role or cls.__name__}: {' '.join(unknown)}")
        values.update({k: v for k, v in vars(args).items() if v is not None})
        values.update(overrides)
        if not values.get("instance_id"):
            values["instance_id"] = f"{role or 'svc'}-{uuid.uuid4().hex[:6]}"
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        name = str(e["loc"][0]) if e["loc"] else "?"
        flag = "--" + name.replace("_", "-")
        parts.append(f"{ENV_PREFIX}{name.upper()} ({flag}): {e['msg']} (got {e.get('input')!r})")
    return "invalid setting " + "; ".join(parts)


class ModelServiceConfig(ServiceConfig):
    """Settings shared by services that load the model."""

    model: str = Field("", description="Path to a local Hugging Face checkpoint directory")
    model_name: str = Field("", description="Public model name (default: directory name)")
    device: str = Field("cpu", description="torch device: cpu or cuda[:N]")
    dtype: str = Field("", description="float32 | bfloat16 | float16 (default: checkpoint dtype)")
    torch_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads per process")
    grpc_host: str = Field("127.0.0.1", description="Address the gRPC server binds and advertises")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    load_interval: float = Field(0.5, gt=0, description="Seconds between load reports")


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings of ``cls``'s annotated attributes (the string right below each), one line
    each, whitespace collapsed: the descriptions of settings generated from a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]
