"""Frozen, validated service configuration from ``STRATA_*`` env vars and mirroring CLI flags.

Each service subclasses `ServiceConfig`; a field ``foo_bar`` is read from ``--foo-bar`` or
``STRATA_FOO_BAR`` (the flag wins). Bad values fail fast with a message naming the setting.
A ``list[str]`` setting is written comma-separated (``a:1,b:2``; empty = none; an empty entry
is refused).
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import os
import textwrap
import types
import typing
import uuid
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

ENV_PREFIX = "STRATA_"


class ConfigError(SystemExit):
    """Raised at start-up when a setting is invalid; exits with the message (one line naming
    every bad setting's env var and flag, what is wrong and the value given)."""


class ServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nats_url: list[str] = Field(
        ["nats://127.0.0.1:4222"],
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

    @field_validator("*", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any, info: ValidationInfo) -> Any:
        """A list setting (``list[str]``, ``list[float]``) given as one string (env, flag): its
        comma-separated items (the field's type then checks each)."""
        if (
            info.field_name
            and typing.get_origin(cls.model_fields[info.field_name].annotation) is list
        ):
            return comma_list(v)
        return v

    @field_validator("nats_url")
    @classmethod
    def _nats_urls(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs a nats://host:port URL")
        for u in v:
            if not is_nats_url(u):
                raise ValueError(f"{u!r} is not a nats://host:port URL")
        return v

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


class RuntimeSettings(BaseModel):
    """Process-wide ``STRATA_*`` settings that are not a service's flags: where the tooling
    keeps its files, the CPU kernel switches, the package `strata serve` imports, this
    process's CPU pinning and its NATS login. The one place, beside `ServiceConfig.load`, that
    reads ``STRATA_*`` variables (``tests/shared/test_settings.py`` checks); ``foo_bar`` is
    ``STRATA_FOO_BAR``, an empty variable counts as unset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache: str = Field(
        "", description="Cache folder for binaries, models, kernels ('' = the repo's .cache/)"
    )
    minio_bin: str = Field("", description="A minio binary to use instead of finding one")
    cpu_packed_gemm: bool = Field(
        True, description="Linear weights prepacked for oneDNN on CPU (off: plain F.linear)"
    )
    cpu_kernels: bool = Field(
        True, description="Native C kernels on CPU (off: torch decode attention, oneDNN GEMM)"
    )
    cpu_layer: bool = Field(
        True,
        description="A Llama-family decoder layer in one native call on CPU, float32 or bf16 "
        "(off: one kernel or torch op at a time)",
    )
    cpu_isa: Literal["auto", "portable", "avx2", "avx512", "avx512vnni", "avx512bf16"] = Field(
        "auto",
        description="Build of the native CPU kernels to load (shared/model/build_kernels.py; "
        "auto: the widest this CPU runs)",
    )
    cpu_gemm: Literal["auto", "native", "onednn"] = Field(
        "auto",
        description="float32 and bf16 CPU GEMM: native C kernel or oneDNN (auto: native)",
    )
    app_package: str = Field(
        "", description="Package holding <role>/app.py for `strata serve` ('' = services)"
    )
    cpu_affinity: str = Field("", description="Cores this process pins itself to ('0-3,6')")
    drain_socket: str = Field(
        "",
        description="`strata drain`: the Unix socket of the instance to drain (the instance's "
        "own STRATA_DRAIN_SOCKET, as its pod sets it)",
    )
    nats_user: str = Field("", description="NATS user")
    nats_password: str = Field("", repr=False, description="NATS password")
    nats_password_file: str = Field("", description="File holding the NATS password")
    nats_inbox_prefix: str = Field("", description="Reply-inbox prefix ('' = _INBOX.<user>)")
    nats_tls_ca: str = Field("", description="CA file of the NATS server certificate")
    nats_tls_cert: str = Field("", description="Client certificate for NATS (mutual TLS)")
    nats_tls_key: str = Field("", description="Client key for NATS (mutual TLS)")
    grpc_tls_cert: str = Field("", description="Certificate this process serves gRPC with (TLS)")
    grpc_tls_key: str = Field("", description="Key of grpc_tls_cert")
    grpc_tls_ca: str = Field("", description="CA the gRPC clients trust ('' = plaintext dialing)")
    grpc_tls_verify_clients: bool = Field(
        False, description="gRPC servers require client certificates signed by grpc_tls_ca"
    )

    @property
    def cache_dir(self) -> str:
        """`cache`, else ``.cache`` at the repository root."""
        return self.cache or str(Path(__file__).resolve().parents[1] / ".cache")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeSettings:
        """The settings in ``environ`` (default: this process's environment), validated once
        per distinct set of values; a bad value raises `ConfigError` naming the variable."""
        env = os.environ if environ is None else environ
        return _runtime_settings(
            tuple((n, env.get(ENV_PREFIX + n.upper()) or "") for n in cls.model_fields)
        )


@functools.lru_cache(maxsize=16)
def _runtime_settings(items: tuple[tuple[str, str], ...]) -> RuntimeSettings:
    try:
        return RuntimeSettings.model_validate({n: v for n, v in items if v})
    except ValidationError as exc:
        parts = [
            f"{ENV_PREFIX}{str(e['loc'][0]).upper()}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        ]
        raise ConfigError("invalid setting " + "; ".join(parts)) from None


def comma_list(v: Any) -> Any:
    """``"a, b"`` -> ``["a", "b"]`` (``""`` -> ``[]``); a list's items stripped; an empty item
    is refused (ValueError). Anything else is left to the field's type check."""
    if isinstance(v, str):
        if not v.strip():
            return []
        v = v.split(",")
    if isinstance(v, list | tuple):
        items = [x.strip() if isinstance(x, str) else x for x in v]
        if any(x == "" for x in items):
            raise ValueError("empty entry in the comma-separated list")
        return items
    return v


def is_nats_url(u: str) -> bool:
    """``nats://``, ``tls://``, ``ws://`` or ``wss://`` followed by an address."""
    scheme, sep, rest = u.partition("://")
    return bool(sep and rest) and scheme in ("nats", "tls", "ws", "wss")


def _describe(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        name = str(e["loc"][0]) if e["loc"] else "?"
        flag = "--" + name.replace("_", "-")
        parts.append(f"{ENV_PREFIX}{name.upper()} ({flag}): {e['msg']} (got {e.get('input')!r})")
    return "invalid setting " + "; ".join(parts)


class KVEventStreamConfig(ServiceConfig):
    """Settings of the roles that create or update the KV-event stream (kvstore, scheduler):
    how much of it is kept."""

    kv_events_max_bytes: int = Field(
        1 << 30,
        ge=0,
        description="Bytes the KV-event stream keeps (oldest events discarded beyond it; "
        "0 = unbounded); set when this process creates or updates the stream",
    )
    kv_events_max_age: float = Field(
        0.0, ge=0, description="Seconds the KV-event stream keeps an event (0 = no age limit)"
    )

    def stream_limits(self):
        from shared.kv_events_stream import StreamLimits

        return StreamLimits(self.kv_events_max_bytes, self.kv_events_max_age)


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


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    defaults: Mapping[str, Any] | None = None,
    skip: Collection[str] = (),
) -> None:
    """One typed flag per field of ``model`` (but ``skip``): ``foo_bar`` -> ``--foo-bar`` with
    ``dest="foo_bar"``, the help from the field's description and the default from the field
    (or ``defaults``, where the command's default differs from the model's). A bool that is on
    (or None: auto) by default gets ``--no-foo-bar``, one that is off ``--foo-bar``; a
    ``dict[str, str]`` gets a repeatable ``--foo-bar KEY=VALUE`` (`model_flag_values` parses
    it); a ``Literal`` takes one of its values; ``X | None`` takes an X. Read the values back
    with `model_flag_values`."""
    defaults = defaults or {}
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        default = defaults.get(name, field.get_default(call_default_factory=True))
        help_ = (field.description or "").replace("%", "%%")
        tp = _unoptional(field.annotation)
        if tp is bool:
            if default is False:
                parser.add_argument(flag, dest=name, action="store_true", help=help_)
            else:
                off = f"--no-{flag[2:]}"
                on = "on" if default else "auto"
                parser.add_argument(
                    off,
                    dest=name,
                    action="store_const",
                    const=False,
                    default=default,
                    help=f"turn off: {help_} (default: {on})",
                )
        elif typing.get_origin(tp) is dict:
            parser.add_argument(
                flag, dest=name, action="append", default=[], metavar="KEY=VALUE", help=help_
            )
        elif typing.get_origin(tp) is typing.Literal:
            choices = [v for v in typing.get_args(tp) if v != ""]  # "": the unset default
            shown = f" (default: {default})" if default not in (None, "") else ""
            parser.add_argument(
                flag, dest=name, choices=choices, default=default, help=help_ + shown
            )
        elif tp in (int, float, str):
            shown = f" (default: {default})" if default not in (None, "") else ""
            metavar = {int: "N", float: "S"}.get(tp, name.rsplit("_", 1)[-1].upper())
            if tp is int and name.endswith("port"):
                metavar = "PORT"
            parser.add_argument(
                flag, dest=name, type=tp, default=default, metavar=metavar, help=help_ + shown
            )
        else:
            raise TypeError(f"{model.__name__}.{name}: no flag for a {field.annotation}")


def model_flag_values(
    model: type[BaseModel], ns: argparse.Namespace, prog: str, skip: Collection[str] = ()
) -> dict[str, Any]:
    """The values of `add_model_flags`' flags in ``ns``, by field name; ``KEY=VALUE`` items
    become a dict (an item without ``=`` or key exits naming the flag)."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        value = getattr(ns, name)
        if typing.get_origin(_unoptional(field.annotation)) is dict:
            items: dict[str, str] = {}
            for item in value:
                key, sep, val = item.partition("=")
                if not sep or not key:
                    flag = "--" + name.replace("_", "-")
                    raise SystemExit(f"{prog}: {flag} expects KEY=VALUE, got {item!r}")
                items[key] = val
            value = items
        values[name] = value
    return values


def _unoptional(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else as is."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


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
