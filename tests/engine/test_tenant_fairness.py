"""Fair queuing in a real engine: a tenant sending 10x the requests of another does not push
the other's requests to the back of the waiting queue; the worker's per-tenant metrics count it.
"""

from prometheus_client import REGISTRY

from shared.engine.engine import LLMEngine
from shared.engine.fair_queue import Tenant
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from shared.worker.metrics import EngineMetrics
from tests.engine.conftest import prompts

SP = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
A, B = Tenant("tenant-a"), Tenant("tenant-b", weight=1.0)


def queued(path, a: int, b: int, length: int, **cfg) -> LLMEngine:
    """A small engine where tenant A has queued ``a`` prompts of ``length`` tokens, then B ``b``."""
    config = EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, **cfg)
    eng = LLMEngine(load_model(path), config)
    ps = prompts(3, [length] * (a + b))
    for i in range(a):
        eng.add_request(f"a{i}", ps[i], SP, tenant=A)
    for i in range(b):
        eng.add_request(f"b{i}", ps[a + i], SP, tenant=B)
    return eng


def admission_order(path, fair: bool) -> tuple[list[str], list[tuple[str, float]]]:
    """Tenant A queues 20 requests, then tenant B 2 (same prompt length); two run at a time."""
    eng = queued(path, 20, 2, 6, max_num_seqs=2, fair_queuing=fair)
    log: list[tuple[str, float]] = []
    while eng.seqs or eng.pending:
        eng.step()
        log += eng.drain_admissions()
    return [t for t, _ in log], log


def test_light_tenant_is_admitted_interleaved_and_counted(qwen_ckpt):
    _, path = qwen_ckpt
    order, log = admission_order(path, fair=True)
    assert len(order) == 22
    # start tags: a 0, 6, 12, ...; b 0, 6 -> a, b, a, b, then the rest of a
    assert order[:4] == ["tenant-a", "tenant-b", "tenant-a", "tenant-b"]
    assert order[4:] == ["tenant-a"] * 18

    m = EngineMetrics("decode", "fairq-test")
    m.admitted(log)
    for tenant, n in (("tenant-a", 20), ("tenant-b", 2)):
        labels = {"role": "decode", "instance": "fairq-test", "tenant": tenant}
        assert REGISTRY.get_sample_value("strata_tenant_admitted_total", labels) == n
        assert REGISTRY.get_sample_value("strata_tenant_queue_wait_seconds_count", labels) == n


def test_fifo_setting_serves_the_heavy_tenant_first(qwen_ckpt):
    _, path = qwen_ckpt
    order, _ = admission_order(path, fair=False)
    assert order == ["tenant-a"] * 20 + ["tenant-b"] * 2


def prompt_tokens_per_step(path, step_tokens: int) -> tuple[list[int], object, list[float]]:
    """A queues 3 prompts of 20 tokens and B one: each step's prompt tokens, the engine's
    stats and the step durations it logged."""
    eng = queued(path, 3, 1, 20, max_num_seqs=4, fair_step_tokens=step_tokens)
    per_step = []
    while eng.seqs or eng.pending:
        eng.step()
        if eng.current is not None:
            per_step.append(
                sum(s.num_new_tokens for s in eng.current.scheduled if s.num_new_tokens > 1)
            )
    return per_step, eng.stats(), eng.drain_step_times()


def test_contending_tenants_cap_each_steps_prompt_tokens_in_a_real_engine(qwen_ckpt):
    _, path = qwen_ckpt
    capped, stats, times = prompt_tokens_per_step(path, 8)
    assert max(capped) == 8 and stats.contended_steps > 0
    assert times and all(t > 0 for t in times)  # each step that ran a batch was timed
    m = EngineMetrics("decode", "fairstep-test")
    m.stepped(times)
    labels = {"role": "decode", "instance": "fairstep-test"}
    assert REGISTRY.get_sample_value("strata:engine_step_seconds_count", labels) == len(times)
    whole, stats, _ = prompt_tokens_per_step(path, 0)  # no cap: all 80 prompt tokens at once
    assert max(whole) == 64 and stats.contended_steps == 0


def split_run(path, slice_tokens: int) -> tuple[dict[str, list[int]], list[set[bool]], object]:
    """A queues 3 prompts of 20 tokens and B one, 6 tokens out each, with the step cap at 8 and
    ``fair_slice_tokens``: each request's tokens, what kinds of work each step ran (True:
    prompt chunk, False: decode) and the engine's stats."""
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = EngineConfig(
        kv_cache_bytes=1 << 20,
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        fair_step_tokens=8,
        fair_slice_tokens=slice_tokens,
        fair_lead=False,
    )
    eng = LLMEngine(load_model(path), config)
    ps = prompts(5, [20] * 4)
    for i, tenant in enumerate((A, A, A, B)):
        eng.add_request(f"r{i}", ps[i], sp, tenant=tenant)
    tokens: dict[str, list[int]] = {}
    kinds: list[set[bool]] = []
    while eng.seqs or eng.pending:
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if eng.current is not None and not eng.current.is_empty:
            kinds.append({s.num_new_tokens > 1 for s in eng.current.scheduled})
    return tokens, kinds, eng.stats()


def test_split_steps_keep_prompts_and_decodes_apart_with_the_same_tokens(qwen_ckpt):
    _, path = qwen_ckpt
    split, kinds, stats = split_run(path, 4)
    whole, whole_kinds, whole_stats = split_run(path, 0)
    assert split == whole and all(len(t) == 6 for t in split.values())
    assert stats.split_steps > 0 and whole_stats.split_steps == 0
    assert all(len(k) == 1 for k in kinds)  # no step ran prompt chunks beside decodes
    assert any(len(k) == 2 for k in whole_kinds)  # without the split, steps mixed them
