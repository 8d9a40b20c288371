"""Configuration of a model instance (prefill or decode).

`WorkerConfig` derives its engine settings from `EngineConfig`: every engine field a worker
may set is a setting of the same name (``STRATA_PREEMPTION_MODE`` / ``--preemption-mode``...),
with the dataclass's default and docstring, so a new engine field is a new setting.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from shared.config import ModelServiceConfig, attribute_docs
from shared.engine.params import EngineConfig, EngineConfigError

MAX_SOCKET_PATH = 107
"""Longest Unix socket path Linux binds (``sun_path`` is 108 bytes with its NUL)."""
STOP_MARGIN_S = 10.0
"""Beyond a drain and the pool flush, seconds a stop takes at most: the gRPC server's 1 s grace,
deregistration, NATS drain, and slack for a loaded node (`drain_grace_s`)."""

LAYERWISE_SPARE_CORES = 2
"""Cores beyond its torch threads a CPU prefill process needs for `auto` layer-wise transfer."""


def layerwise_auto(device: str, torch_threads: int, cores: int) -> bool:
    """What ``layerwise_transfer=auto`` means on ``device`` for a process with ``torch_threads``
    that may run on ``cores`` cores. On CUDA the per-layer copy is a small gather on the device
    and the host work (device-to-host transfer, frame encoding, gRPC sends) runs on CPU cores
    while the GPU computes: on. On CPU the copies, the encoding and the sends compete with the
    forward for the same cores (measured on a quiet 2-core box: layer-wise gave a higher TTFT
    at every length, docs/benchmarks/pd.md), so: on only when ``LAYERWISE_SPARE_CORES`` cores
    are left beside the torch threads (a pinned `strata up` model process has none)."""
    if device.startswith("cuda"):
        return True
    return cores - torch_threads >= LAYERWISE_SPARE_CORES


def pool_save_auto(device: str) -> str:
    """What ``kv_pool_save=auto`` means on ``device``. On CUDA a block's copy out is a device
    gather and the host work runs on cores the GPU leaves free: every block ("all"). On CPU the
    copy, the encoding, the gRPC send, the kvstore and MinIO all take cycles from the forward
    (measured on a 2-core box: writing every block through cost ~30% of output tok/s,
    docs/benchmarks/kvpool.md), so only blocks that recur ("reused"): a prefix hit, or a
    block computed again after it left memory unsaved, plus the rest at a graceful stop."""
    return "all" if device.startswith("cuda") else "reused"


_BOOL_WORDS = {"true", "false", "1", "0", "yes", "no", "on", "off"}
_TRUE_WORDS = {"true", "1", "yes", "on"}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


ENGINE_LIMITS: dict[str, dict[str, Any]] = {
    "kv_cache_bytes": {"ge": 0},
    "block_size": {"ge": 1, "le": 1024},
    "max_num_seqs": {"ge": 1},
    "max_num_batched_tokens": {"ge": 0},
    "num_speculative_tokens": {"ge": 0, "le": 16},
}
"""Bounds a worker puts on engine settings when they are parsed, beside `EngineConfig`'s own
checks (which every `WorkerConfig` also passes: a bad combination names its setting)."""

WORKER_DEFAULTS: dict[str, Any] = {"kv_cache_bytes": 0, "max_num_batched_tokens": 0}
"""Engine settings whose worker default differs from `EngineConfig`'s."""
WORKER_DEFAULT_DOCS = {
    "kv_cache_bytes": " 0 (default): auto, a share of the memory (`shared/worker/kv_budget.py`).",
    "max_num_batched_tokens": " 0 (default): auto, by device (`step_tokens_auto`).",
}


def step_tokens_auto(device: str, max_num_seqs: int) -> int:
    """What ``max_num_batched_tokens=0`` means on ``device``. On CUDA a step needs many tokens to
    fill the device: 2048. On CPU a 512-token chunk computes at the rate of a 2048-token one
    (the matrix products are already compute bound there), so a smaller chunk costs no
    throughput, and it cuts the wait of every prompt queued behind a big one: measured on a
    2-core box with 16 streams of 256-token prompts, TTFT mean 167 vs 428 ms, p99 540 vs 670 ms,
    956 vs 854 tok/s, a lone 2048-token prompt's TTFT unchanged (docs/benchmarks/engine.md). At least
    ``max_num_seqs``, so a step can hold every running decode."""
    return max(2048 if device.startswith("cuda") else 512, max_num_seqs)


ENGINE_DERIVED = ("collect_evicted_kv", "pool_save")
"""Engine fields a worker does not set: they follow from other settings (`engine_config`)."""


def _engine_settings() -> tuple[dict[str, Any], dict[str, Callable[[Any], Any]]]:
    """Pydantic fields for `EngineConfig`'s settable fields, and for every field the function
    that turns the setting's value into the engine's. ``X | None`` fields become settings a
    flag can spell: ``str | None`` -> ``''`` for None, ``bool | None`` -> ``auto`` for None."""
    hints = typing.get_type_hints(EngineConfig)
    docs = attribute_docs(EngineConfig)
    fields: dict[str, Any] = {}
    convert: dict[str, Callable[[Any], Any]] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_DERIVED:
            continue
        tp, doc, kw = hints[f.name], docs.get(f.name, ""), dict(ENGINE_LIMITS.get(f.name, {}))
        args = typing.get_args(tp) if isinstance(tp, types.UnionType) else ()
        inner = [a for a in args if a is not type(None)]
        if len(args) == 2 and len(inner) == 1 and f.default is None:  # X | None = None
            if inner[0] is bool:
                tp, default, kw["pattern"] = str, "auto", "^(auto|true|false)$"
                doc += " Setting: auto (None), true or false."
                convert[f.name] = lambda v: None if v == "auto" else v == "true"
            else:
                tp, default = inner[0], inner[0]()
                doc += f" Setting: {default!r} for None."
                convert[f.name] = lambda v: v or None
        else:
            default = WORKER_DEFAULTS.get(f.name, f.default)
            doc += WORKER_DEFAULT_DOCS.get(f.name, "")
            convert[f.name] = lambda v: v
        if f.name not in ModelServiceConfig.model_fields:  # device, dtype: already settings
            fields[f.name] = (tp, Field(default, description=doc, **kw))
    return fields, convert


_ENGINE_FIELDS, _TO_ENGINE = _engine_settings()

EngineSettings = create_model(  # type: ignore[call-overload]
    "EngineSettings",
    __base__=ModelServiceConfig,
    __doc__="`ModelServiceConfig` + every `EngineConfig` field a worker may set.",
    __module__=__name__,
    **_ENGINE_FIELDS,
)


class WorkerConfig(EngineSettings):  # type: ignore[misc, valid-type]
    """A prefill or decode instance: the model, its engine and its KV transfer settings."""

    transfer_timeout: float = Field(30.0, gt=0, description="Seconds to wait for a KV transfer")
    kv_memory_fraction: float = Field(
        0.0,
        ge=0,
        le=0.95,
        description="Auto KV budget (kv_cache_bytes 0): the share of memory for the KV caches "
        "of this host's model processes; 0: 0.4 of host memory on CPU, 0.85 of the device "
        "memory free after loading on CUDA",
    )
    host_engines: int = Field(
        1,
        ge=1,
        description="Model processes sharing this machine's memory (the auto KV budget is "
        "divided by it); strata up sets it",
    )
    tp: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks of this instance: this process is rank 0 and starts "
        "N-1 rank processes (gloo on CPU, NCCL on CUDA, one GPU each); each keeps 1/N of the "
        "attention heads, MLP and KV heads and gets 1/N of torch_threads",
    )
    ep: int = Field(
        1,
        ge=1,
        le=64,
        description="Expert-parallel ranks of this instance (MoE checkpoints): this process is "
        "rank 0 and starts N-1 rank processes like --tp; rank r holds the contiguous block of "
        "experts r*E/N..(r+1)*E/N-1 (plus ep_spare replica slots), tokens move by all-to-all; "
        "attention, dense layers and KV are replicated (with --tp N too: split by TP over the "
        "same ranks). N must divide the expert count",
    )
    ep_spare: int = Field(
        0,
        ge=0,
        le=64,
        description="Expert-parallel: extra expert slots per rank for EPLB's replicas of hot "
        "experts (eplb_interval_steps)",
    )
    ep_micro_batches: int = Field(
        1,
        ge=1,
        le=8,
        description="Expert-parallel: split each rank's tokens of a MoE layer into this many "
        "micro-batches, so one's dispatch/combine all-to-alls run while another's experts "
        "compute (2: the two-batch overlap; 1: none)",
    )
    frame_merge_bytes: int = Field(
        256 << 10, ge=0, description="Merge layer frames below this size into one (direct mode)"
    )
    layerwise_transfer: bool = Field(
        "auto",  # type: ignore[assignment] - resolved to a bool by the validator below
        validate_default=True,
        description="Push KV layer by layer while computing (direct mode): true, false or auto = "
        "on for CUDA, on CPU only with spare cores (see layerwise_auto)",
    )
    kvstore_addrs: list[str] = Field(
        [], description="Comma-separated kvstore gRPC addresses (pool mode)"
    )
    kv_int8: bool = Field(
        False,
        description="Send and store KV as int8 with per-row float32 scales (~3.8x fewer bytes)",
    )
    kv_pool_save: Literal["all", "reused", "off"] = Field(
        "auto",  # type: ignore[assignment] - resolved by the validator below
        validate_default=True,
        description="With a kvstore, which full blocks this instance computes go to the pool "
        "(a restart or another instance reuses them): all = every one as it is computed "
        "(write-through; also what a failed-over stream continues from); reused = those a "
        "second request uses or that are computed again after leaving memory, the rest at a "
        "graceful stop; off (false) = only evicted blocks; auto = all on CUDA, reused on CPU, "
        "where the copies compete with the forward for the same cores (see pool_save_auto); "
        "true = all",
    )
    kv_pool_flush_s: float = Field(
        5.0,
        ge=0,
        description="At a graceful stop, seconds to hand the pool the cached blocks it was not "
        "given (kv_pool_save=reused), so a restart finds them; 0: none",
    )
    kv_pool_load: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Prefix blocks the pool holds and engine memory lacks: auto = load those "
        "the measured cost model says are cheaper to load than to recompute; always; never",
    )

    autopd_linger_s: float = Field(
        30.0,
        ge=0,
        description="AutoPD: after a role change, seconds the old role's submit subject stays "
        "served once idle (work routed before the change whose prefill ran elsewhere)",
    )

    drain_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A retirement's drain (the autoscaler's, or `strata drain`'s): seconds this "
        "instance waits for its open requests to finish once no scheduler routes to it; what "
        "is still open then is stopped as on SIGTERM (its streams fail over to another "
        "instance). Kubernetes' terminationGracePeriodSeconds is sized from it (drain_grace_s)",
    )
    drain_socket: str = Field(
        "",
        description="Unix socket (mode 0600) on which `strata drain` asks this instance to retire "
        "(drain, then exit with code 75): the Kubernetes preStop hook; empty: none",
    )

    @field_validator("drain_socket")
    @classmethod
    def _socket_path(cls, v: str) -> str:
        if v and len(os.fsencode(v)) > MAX_SOCKET_PATH:
            raise ValueError(f"longer than a Unix socket path may be ({MAX_SOCKET_PATH} bytes)")
        if v and not os.path.isdir(os.path.dirname(os.path.abspath(v))):
            raise ValueError("its folder does not exist")
        return v

    @field_validator("kv_pool_save", mode="before")
    @classmethod
    def _resolve_pool_save(cls, v, info: ValidationInfo):
        word = str(v).strip().lower()
        if word == "auto":
            return pool_save_auto(info.data.get("device", "cpu"))
        if word in _BOOL_WORDS:  # the boolean it was: true = all, false = off
            return "all" if word in _TRUE_WORDS else "off"
        return word

    @field_validator("layerwise_transfer", mode="before")
    @classmethod
    def _resolve_layerwise(cls, v, info: ValidationInfo):
        if not isinstance(v, str):
            return v
        word = v.strip().lower()
        if word == "auto":
            d = info.data
            return layerwise_auto(d.get("device", "cpu"), d.get("torch_threads", 1), usable_cores())
        if word not in _BOOL_WORDS:
            raise ValueError("expected auto, true or false")
        return word

    @model_validator(mode="after")
    def _engine_accepts(self) -> WorkerConfig:
        """`EngineConfig`'s own checks at parse time, naming the setting (not at engine start)."""
        try:
            self.engine_config()
        except EngineConfigError as exc:
            err = PydanticCustomError("value_error", "{why}", {"why": exc.why})
            detail = InitErrorDetails(
                type=err, loc=(exc.setting,), input=getattr(self, exc.setting, exc.value)
            )
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self

    def engine_config(self, kv_cache_bytes: int = 0) -> EngineConfig:
        """The engine's settings: each `EngineConfig` field from the setting of its name, and
        `collect_evicted_kv` on in pool mode (evicted blocks go to the kvstore), and
        `pool_save` there from ``kv_pool_save`` (which computed blocks go too). An auto
        ``kv_cache_bytes`` (0) takes the resolved ``kv_cache_bytes`` given (`kv_budget`; the
        parse-time check, which has no model yet, passes `EngineConfig`'s default)."""
        values = {name: to_engine(getattr(self, name)) for name, to_engine in _TO_ENGINE.items()}
        if not values["max_num_batched_tokens"]:
            values["max_num_batched_tokens"] = step_tokens_auto(self.device, self.max_num_seqs)
        if not values["kv_cache_bytes"]:
            values["kv_cache_bytes"] = kv_cache_bytes or EngineConfig.kv_cache_bytes
        pool = bool(self.kvstore_addrs)
        return EngineConfig(
            **values, collect_evicted_kv=pool, pool_save=self.kv_pool_save if pool else "off"
        )


def drain_grace_s(cfg: WorkerConfig) -> float:
    """The longest a retirement takes from the drain request to the exit: two load-report
    intervals (every scheduler sees ``draining``), ``drain_timeout_s``, the pool flush and
    `STOP_MARGIN_S`. A Kubernetes pod's terminationGracePeriodSeconds must be at least this,
    or the kubelet kills the instance mid-drain."""
    return 2 * cfg.load_interval + cfg.drain_timeout_s + cfg.kv_pool_flush_s + STOP_MARGIN_S
