"""Async scheduling: decode step i+1 scheduled and prepared while the forward of step i runs.

The pipelined engine must give exactly the tokens of the strictly sequential one, take the
ahead path in steady decode, and never hand out a block that a forward in flight still writes.
"""

from __future__ import annotations

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.overlap import OverlapStepper
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(
        kv_cache_bytes=2 << 20,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    cfg.update(kw)
    return LLMEngine(load_model(path), EngineConfig(**cfg))


def _outputs(eng: LLMEngine, ps, params, layer_callback=None) -> dict[str, list]:
    """Every output of each request, in order (whole ``RequestOutput``s: tokens, logprobs,
    finish reason, prompt logprobs)."""
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    got: dict[str, list] = {f"r{i}": [] for i in range(len(ps))}
    while eng.has_unfinished_requests():
        for o in eng.step(layer_callback):
            got[o.request_id].append(o)
    return got


def _counters(eng: LLMEngine) -> dict:
    """``stats()`` without the times and the ahead count, which differ between the two steps."""
    s = vars(eng.stats()).copy()
    for k in (
        "forward_time_s",
        "step_time_s",
        "idle_gap_s",
        "last_forward_s",
        "last_step_s",
        "device_idle_s",
        "ahead_steps",
        "prefill_forward_s",
    ):
        s.pop(k)
    return s


def test_same_tokens_as_sequential_and_ahead_path_taken(qwen_ckpt):
    _, path = qwen_ckpt
    ps = prompts(3, [5, 17, 9, 30, 12, 7])  # 6 requests over 4 slots: arrivals mid-decode
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20),  # may hit EOS
        SamplingParams(temperature=0, max_tokens=3),  # finishes early: ahead step discarded
        SamplingParams(temperature=1.0, top_k=20, seed=1, max_tokens=31, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[7, 9, 11]),
        SamplingParams(temperature=0.5, seed=3, max_tokens=18, presence_penalty=0.5),
    ]
    sync = _engine(path, async_scheduling=False)
    pipe = _engine(path, async_scheduling=True)
    assert sync.overlap is None and isinstance(pipe.overlap, OverlapStepper)
    want, got = _outputs(sync, ps, params), _outputs(pipe, ps, params)
    assert got == want  # every output, whole: tokens, logprobs, finish reasons
    assert sync.stats().ahead_steps == 0
    assert pipe.stats().ahead_steps > 20  # steady decode took the overlapped path
    assert _counters(pipe) == _counters(sync)  # steps, prefix hits, preemptions, pool...
    assert pipe.stats().forward_time_s > 0 and pipe.stats().device_idle_s > 0
    assert _engine(path, async_scheduling=None).overlap is None  # auto: off on CPU
    for eng in (sync, pipe):  # every block back (no leak through deferred frees)
        assert eng.bm.num_free_blocks == eng.bm.num_blocks
        eng.close()


def test_abort_during_flight_frees_blocks_after_the_forward(qwen_ckpt):
    _, path = qwen_ckpt
    eng = _engine(path)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts(5, [10, 14])):
        eng.add_request(f"r{i}", p, sp)
    for _ in range(6):  # prefill, then decodes until a step is launched ahead
        eng.step()
    assert eng.overlap.flight is not None and eng.stats().ahead_steps > 0
    seq = eng.seqs["r0"]
    blocks = list(seq.block_table)
    free_before = eng.bm.num_free_blocks
    eng.abort_request("r0")  # r0 is in the forward in flight
    assert eng.bm.num_free_blocks == free_before  # not yet: the forward writes its last block
    assert all(eng.bm.ref_counts[b] > 0 for b in blocks)
    outs = eng.step()  # lands the forward: r0's result is dropped, its blocks freed
    assert [o.finish_reason for o in outs if o.request_id == "r0"] == ["abort"]
    assert all(o.request_id != "r0" or not o.new_token_ids for o in outs)
    assert eng.bm.num_free_blocks > free_before
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    eng.close()


def test_pure_decode_overlaps_and_matches_the_plain_step(qwen_ckpt):
    """A batch that only decodes: after the prefill every step but the last is launched ahead
    by the overlapped stepper, never by the plain one, with the same outputs."""
    _, path = qwen_ckpt
    ps = prompts(4, [6, 9, 5, 11])  # 4 requests, 4 slots: one prefill step, then decode only
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=8, seed=2, max_tokens=12, ignore_eos=True),
    ]
    sync, pipe = _engine(path, async_scheduling=False), _engine(path)
    assert _outputs(pipe, ps, params) == _outputs(sync, ps, params)
    assert sync.stats().ahead_steps == 0
    # 12 steps: the prefill, 10 decodes scheduled ahead, and the last decode, which ends every
    # request (it was scheduled ahead too, found finished at landing, and never launched)
    assert (pipe.stats().steps, pipe.stats().ahead_steps) == (12, 10)
    assert sync.stats().steps == 12
    for eng in (sync, pipe):
        assert eng.bm.num_free_blocks == eng.bm.num_blocks
        eng.close()


@pytest.mark.parametrize("what", ["drafts", "layer_callback"])
def test_what_stops_the_decode_ahead_still_matches_the_plain_step(qwen_ckpt, what):
    """Drafts (speculative decoding) and a layer callback need a step's outcome before the
    next step can be scheduled: the overlapped stepper runs them without going ahead, with the
    plain step's outputs, draft counters and prompt logprobs."""
    _, path = qwen_ckpt
    loop = [7, 8, 9, 10, 11, 12] * 3  # repeats, so prompt lookup proposes drafts
    ps = [loop, prompts(6, [9])[0]]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2),
    ]
    kw = dict(num_speculative_tokens=3) if what == "drafts" else {}
    layers: dict[str, list[int]] = {"sync": [], "pipe": []}
    cb = {k: (v.append if what == "layer_callback" else None) for k, v in layers.items()}
    sync = _engine(path, async_scheduling=False, **kw)
    pipe = _engine(path, **kw)
    want = _outputs(sync, ps, params, cb["sync"])
    assert _outputs(pipe, ps, params, cb["pipe"]) == want
    assert want["r1"][0].prompt_logprobs is not None
    assert pipe.stats().ahead_steps == 0 and _counters(pipe) == _counters(sync)
    if what == "drafts":
        assert sync.stats().spec_draft_tokens > 0
    else:
        assert layers["pipe"] == layers["sync"] and len(layers["sync"]) == 2 * sync.stats().steps
    for eng in (sync, pipe):
        eng.close()


def test_new_arrival_is_scheduled_next_step(qwen_ckpt):
    _, path = qwen_ckpt
    eng = _engine(path)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("a", prompts(1, [8])[0], sp)
    for _ in range(5):
        eng.step()
    eng.add_request("b", prompts(2, [6])[0], SamplingParams(temperature=0, max_tokens=2))
    b_tokens = []
    for _ in range(4):  # the waiting request stops the ahead path: prefill + 1 decode + landing
        b_tokens += [t for o in eng.step() if o.request_id == "b" for t in o.new_token_ids]
    assert len(b_tokens) == 2
    while eng.has_unfinished_requests():
        eng.step()
    eng.close()


def test_worker_setting_maps_to_the_engine():
    from shared.worker.config import WorkerConfig

    assert WorkerConfig().engine_config().async_scheduling is None  # auto
    assert WorkerConfig(async_scheduling="true").engine_config().async_scheduling is True
    assert WorkerConfig(async_scheduling="false").engine_config().async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        WorkerConfig(async_scheduling="maybe")
