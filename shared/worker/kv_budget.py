"""The KV cache budget of a prefill or decode instance when ``kv_cache_bytes`` is 0 (auto).

A fixed default is wrong at every size but one: 256 MiB holds 65,536 tokens of the tiny default
model but 4,096 of a 250M one, so that model queued and preempted where vLLM, sized from memory,
did not. Auto sizes it like vLLM's CPU backend sizes its own (a fraction of the machine's
memory), shared by the model processes of one host:

    budget = min(fraction x memory / host_engines,       # this instance's share
                 0.8 x available memory / host_engines,  # what is free now, with room left
                 max_num_seqs x max_model_len tokens)    # more than the batch can use is waste

``memory`` is the smaller of the machine's and the cgroup's limit (a container or pod), so a
pod gets a fraction of its own limit. ``host_engines`` is how many model processes share the
memory: `strata up` sets it to its prefill + decode count. On CUDA the share is taken of the
device memory free after the model loaded. The CPU pool is allocated lazily zeroed
(`KVCache.allocate`), so a large budget costs memory only as blocks come into use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MIN_AUTO_BYTES = 64 << 20
"""The least auto gives: a box too full for its share still gets a working cache."""
DEFAULT_FRACTION = {"cpu": 0.4, "cuda": 0.85}
"""``kv_memory_fraction`` 0 means this: of host memory on CPU (the rest is weights, activations
and the other services), of the device memory free after the model loaded on CUDA."""


@dataclass(frozen=True)
class Memory:
    """Bytes of memory the instance may count on: ``total`` (machine or cgroup limit) and
    ``available`` now."""

    total: int
    available: int
    where: str  # "memory" / "cgroup limit" / "cuda:0 free" (for the start-up line)


def host_memory() -> Memory:
    """This machine's memory (``/proc/meminfo``), capped by the cgroup's limit when lower."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:  # not Linux: physical pages, all counted as available
        info["MemTotal"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    total = info["MemTotal"]
    avail, where = info.get("MemAvailable", info.get("MemFree", total)), "memory"
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        total, avail, where = limit, min(avail, limit), "cgroup limit"
    return Memory(total, avail, where)


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def device_memory(device: str) -> Memory:
    """Free and total memory of a CUDA device (after the model was loaded on it)."""
    import torch

    free = torch.cuda.mem_get_info(torch.device(device))[0]
    return Memory(total=free, available=free, where=f"{device} free")


def auto_kv_bytes(
    token_bytes: int,
    max_tokens: int,
    memory: Memory,
    *,
    fraction: float,
    host_engines: int = 1,
    free_cap: float = 0.8,
) -> tuple[int, str]:
    """(budget in bytes, why in one line) for ``token_bytes`` per token and at most
    ``max_tokens`` tokens worth keeping (max_num_seqs x max_model_len); never more than
    ``free_cap`` of the memory available now (on CUDA the share is already of free memory)."""
    engines = max(1, host_engines)
    share = int(fraction * memory.total / engines)
    free = int(free_cap * memory.available / engines)
    useful = token_bytes * max_tokens
    budget, why = share, f"{fraction:.0%} of {fmt_bytes(memory.total)} {memory.where} / {engines}"
    if free < budget:
        budget, why = free, f"{free_cap:.0%} of {fmt_bytes(memory.available)} available / {engines}"
    if useful < budget:
        budget, why = useful, f"max_num_seqs x max_model_len = {max_tokens:,} tokens"
    if budget < MIN_AUTO_BYTES:
        budget, why = MIN_AUTO_BYTES, f"the floor ({why} is less)"
    return budget, f"{fmt_bytes(budget)} ({budget // token_bytes:,} tokens): {why}"


def fmt_bytes(n: int) -> str:
    """``n`` bytes as GiB (one decimal), or MiB under 1 GiB."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def resolve_kv_bytes(
    kv_cache_bytes: int,
    token_bytes: int,
    max_tokens: int,
    *,
    device: str,
    fraction: float,
    host_engines: int,
) -> tuple[int, str]:
    """The budget an instance runs with: ``kv_cache_bytes`` when set (> 0), else auto
    (``fraction`` 0: `DEFAULT_FRACTION` of the device kind)."""
    if kv_cache_bytes > 0:
        tokens = kv_cache_bytes // token_bytes
        return kv_cache_bytes, f"{fmt_bytes(kv_cache_bytes)} ({tokens:,} tokens): kv_cache_bytes"
    cuda = device.startswith("cuda")
    memory = device_memory(device) if cuda else host_memory()
    fraction = fraction or DEFAULT_FRACTION["cuda" if cuda else "cpu"]
    return auto_kv_bytes(
        token_bytes,
        max_tokens,
        memory,
        fraction=fraction,
        host_engines=host_engines,
        free_cap=1.0 if cuda else 0.8,
    )


def kv_budget_for(cfg, loaded) -> tuple[int, str]:
    """`resolve_kv_bytes` for a `WorkerConfig` and its loaded model (loaded in the serving
    dtype, which is its KV's dtype): what an instance, or a benchmark's in-process engine
    standing for one, runs with."""
    from shared.model.api import KVCache

    m = loaded.model
    shared = getattr(m, "kv_shared", False)  # K and V one tensor (DeepSeek's latent)
    token_bytes = KVCache.bytes_per_block(
        m.num_layers, 1, m.num_kv_heads, m.head_dim, m.dtype, shared=shared
    )
    return resolve_kv_bytes(
        cfg.kv_cache_bytes,
        token_bytes,
        cfg.max_num_seqs * loaded.config.max_model_len,
        device=cfg.device,
        fraction=cfg.kv_memory_fraction,
        host_engines=cfg.host_engines,
    )
