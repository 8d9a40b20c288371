"""The auto KV budget (`shared/worker/kv_budget.py`) at toy sizes, the worker setting that picks
it, and the lazily zeroed CPU pool that makes a large budget cheap until it is used."""

from __future__ import annotations

import pytest
import torch

from shared.model.api import KVCache
from shared.worker.config import WorkerConfig
from shared.worker.kv_budget import MIN_AUTO_BYTES, Memory, auto_kv_bytes, resolve_kv_bytes

GIB = 1 << 30
TOKEN = 64 << 10  # the 250M benchmark model: 64 KiB of KV per token


def test_auto_is_a_share_of_memory_split_among_the_hosts_engines():
    mem = Memory(total=24 * GIB, available=22 * GIB, where="memory")
    one, why = auto_kv_bytes(TOKEN, 10**9, mem, fraction=0.4, host_engines=1)
    two, _ = auto_kv_bytes(TOKEN, 10**9, mem, fraction=0.4, host_engines=2)
    assert one == int(0.4 * 24 * GIB) and two == one // 2
    assert "40% of 24.0 GiB memory / 1" in why and f"{one // TOKEN:,} tokens" in why
    # the old fixed 256 MiB held 4,096 such tokens; two engines on 24 GiB hold ~19x that each
    assert two // TOKEN > 16 * 4096


def test_auto_is_capped_by_free_memory_and_by_what_the_batch_can_use():
    busy = Memory(total=24 * GIB, available=2 * GIB, where="memory")
    b, why = auto_kv_bytes(TOKEN, 10**9, busy, fraction=0.4, host_engines=2)
    assert b == int(0.8 * 2 * GIB / 2) and "available" in why
    roomy = Memory(total=24 * GIB, available=22 * GIB, where="memory")
    b, why = auto_kv_bytes(TOKEN, 64 * 2048, roomy, fraction=0.4)
    assert b == TOKEN * 64 * 2048 and "max_num_seqs x max_model_len" in why
    tiny = Memory(total=64 << 20, available=32 << 20, where="cgroup limit")
    assert auto_kv_bytes(TOKEN, 10**9, tiny, fraction=0.4)[0] == MIN_AUTO_BYTES


def test_a_set_budget_is_used_as_is_and_auto_reads_this_machine():
    assert resolve_kv_bytes(256 << 20, TOKEN, 10**9, device="cpu", fraction=0, host_engines=1) == (
        256 << 20,
        "256 MiB (4,096 tokens): kv_cache_bytes",
    )
    b, why = resolve_kv_bytes(0, TOKEN, 10**9, device="cpu", fraction=0, host_engines=1)
    assert b >= MIN_AUTO_BYTES
    assert any(w in why for w in ("40% of", "available", "max_num_seqs")), why


def test_workers_default_to_auto_and_the_engine_gets_the_resolved_budget():
    cfg = WorkerConfig.load([], role="decode", model="m")
    assert cfg.kv_cache_bytes == 0 and cfg.host_engines == 1 and cfg.kv_memory_fraction == 0
    assert cfg.engine_config(3 << 30).kv_cache_bytes == 3 << 30
    fixed = WorkerConfig.load(["--kv-cache-bytes", str(64 << 20)], role="decode", model="m")
    assert fixed.engine_config(3 << 30).kv_cache_bytes == 64 << 20


def test_the_cpu_pool_is_zero_and_becomes_resident_only_where_written():
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    kv = KVCache.allocate(8, 4096, 16, 4, 64, torch.bfloat16)  # 2 x 256 MiB
    assert kv.k.shape == (8, 4096, 16, 4, 64) and kv.k.dtype == torch.bfloat16
    assert rss() - before < 64 << 20  # not resident yet
    kv.k[:, 7] = 1.5
    assert float(kv.k[:, 7].float().mean()) == 1.5
    assert not kv.k[:, 8:4000:97].any() and not kv.v[:, ::101].any()  # zeros where unwritten


def _anon_huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of this process's mappings over ``t``'s bytes."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_the_cpu_pool_is_backed_by_huge_pages_where_the_kernel_has_them():
    """The pool's own mapping is advised for transparent huge pages, so the pool's blocks,
    scattered reads of a decode step, cost few TLB misses."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off on this kernel")
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    kv = KVCache.allocate(2, 2048, 16, 4, 64, torch.float32)  # 2 x 64 MiB
    # The kernel merges the fresh mapping with an adjacent anonymous one of the same flags (a
    # live, written pool of an earlier test), and smaps counts per mapping: so compare before
    # and after writing, never against zero.
    before = _anon_huge_bytes(kv.k)
    kv.k.fill_(1.0)
    assert _anon_huge_bytes(kv.k) - before >= 8 << 20  # written: 2 MiB pages, not 4 KiB


def test_the_budget_of_a_loaded_model_counts_its_kv_bytes_per_token():
    from services.cluster_config import ensure_model
    from shared.model.loader import load_model
    from shared.worker.kv_budget import kv_budget_for

    loaded = load_model(ensure_model(""))  # tiny default: 4 layers x 2 KV heads x 64, fp32
    cfg = WorkerConfig.load(["--kv-cache-bytes", str(4 << 20)], role="decode", model="m")
    assert kv_budget_for(cfg, loaded) == (4 << 20, "4 MiB (1,024 tokens): kv_cache_bytes")
    auto = WorkerConfig.load(["--max-num-seqs", "2"], role="decode", model="m")
    budget, why = kv_budget_for(auto, loaded)  # 2 x max_model_len fits in any machine's share
    assert budget == 2 * loaded.config.max_position_embeddings * 4096, why
