"""gpt-oss: config parsing (transformers' defaults, 4.x and 5.x RoPE keys, one clear line for
what Strata cannot serve, MXFP4 included), the router and the clamped-SwiGLU experts against
transformers' own, the attention sinks' torch path counted as a native-kernel fallback, and
Strata against transformers 5.x on random tiny checkpoints saved with ``save_pretrained``:
logits, 32 greedy tokens, batches of prompts of different lengths, chunked prefill in float64,
two ranks (``--tp 2 --ep 2``: heads and sinks over tensor parallelism, experts over expert
parallelism)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.model import cpu_kernels
from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED, layer_types_of
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.model.parallel import check_shardable
from shared.model.validate import validate_checkpoint
from tests.model.paged_driver import PagedDriver
from tests.model.test_family_configs import _checkpoint
from tests.model.test_text_models import VOCAB, _prompt, hf_greedy

transformers = pytest.importorskip("transformers")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

ARCH = "GptOssForCausalLM"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _cfg(**kw) -> dict:
    return {"architectures": [ARCH], "model_type": "gpt_oss", **kw}


def _hf_config(**kw):
    return transformers.GptOssConfig(**{k: v for k, v in kw.items() if k != "architectures"})


# -- config parsing ----------------------------------------------------------------------------


def test_defaults_are_transformers():
    c, t = config_from_dict(_cfg()), _hf_config()
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (t.vocab_size, 2880, 36)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (64, 8, 64)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 4, 2880)
    assert c.moe_layers == tuple(range(36)) and c.routing.swiglu == (1.702, 7.0)
    assert c.attention_bias and c.o_proj_bias and not c.tie_word_embeddings
    assert c.rms_norm_eps == t.rms_norm_eps and c.max_position_embeddings == 131072
    # YaRN by default (factor 32 over 4096 positions, not truncated), theta 150000
    assert c.rope_theta == t.rope_parameters["rope_theta"] == 150000.0
    assert c.rope_scaling == {k: v for k, v in t.rope_parameters.items() if k != "rope_theta"}
    # every other layer sliding from layer 0, window 128: the served context is the window
    assert layer_types_of(_cfg()) == t.layer_types and c.sliding_window == 128
    assert c.max_model_len == 128


def test_4x_and_5x_rope_spellings_agree_and_match_transformers():
    """YaRN as ``rope_scaling`` + ``rope_theta`` (4.x, ``type``) and as ``rope_parameters``
    (5.x) read the same; the inverse frequencies and the cos/sin factor are transformers'."""
    from shared.model.models.gpt_oss import YarnRotary

    shape = dict(head_dim=16, max_position_embeddings=256)
    four = _cfg(
        rope_theta=5e4, rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 16.0}, **shape
    )
    five = _cfg(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "rope_theta": 5e4},
        **shape,
    )
    a, b = config_from_dict(four), config_from_dict(five)
    assert a.rope_scaling == b.rope_scaling and a.rope_theta == b.rope_theta == 5e4
    assert a.rope_scaling["original_max_position_embeddings"] == 256  # transformers' default
    for cfg, c in ((five, b), (_cfg(rope_theta=5e4, **shape), None), (_cfg(**shape), None)):
        c = c or config_from_dict(cfg)
        rot = gpt_oss.GptOssRotaryEmbedding(_hf_config(**cfg))
        ours = YarnRotary(c, "cpu")
        assert torch.equal(ours.inv_freq, rot.inv_freq)
        assert ours.factor == pytest.approx(rot.attention_scaling, rel=1e-12)
    plain = _cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **shape)
    assert config_from_dict(plain).rope_scaling is None


@pytest.mark.parametrize(
    "kw,msg",
    [
        (
            dict(quantization_config={"quant_method": "mxfp4"}),
            "quantized gpt-oss (quantization_config quant_method 'mxfp4') is not supported",
        ),
        (dict(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok 5 exceeds the 4"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
        (dict(rope_parameters={"rope_type": "yarn"}), "YaRN rope parameters without 'factor'"),
        (dict(head_dim=15), "head_dim 15 must be even"),
        (dict(sliding_window=16), "sliding_window 16 is under 32 tokens"),
    ],
)
def test_what_cannot_be_served_is_refused_in_one_line(tmp_path, kw, msg):
    cfg = _cfg(**kw)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, cfg))  # torch-free, at `strata up`
    assert msg in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="config.json"):
        config_from_dict(cfg)


def test_validate_accepts_it_and_llava_refuses_it(tmp_path):
    assert ARCH in SUPPORTED and "gpt_oss" not in LLAVA_TEXT_TYPES
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(max_position_embeddings=131072)))
    assert info.architecture == ARCH and "serving a context of 128 tokens" in info.context_note
    full = _cfg(sliding_window=None)  # no window: every layer attends to the full context
    assert config_from_dict(full).sliding_window is None
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": "gpt_oss"}}
    with pytest.raises(CheckpointError, match="unsupported LLaVA text model_type 'gpt_oss'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))


def test_tensor_parallel_checks():
    """Heads (and their sinks) shard; the experts go by --ep, so plain --tp is refused."""
    c = config_from_dict(_cfg(num_attention_heads=4, num_key_value_heads=2))
    check_shardable(c, 2, experts=True)
    with pytest.raises(CheckpointError, match="add --ep 2"):
        check_shardable(c, 2)
    with pytest.raises(CheckpointError, match=r"4 must divide num_heads \(4\) and num_kv_heads"):
        check_shardable(c, 4, experts=True)


# -- the router and the experts against transformers' -------------------------------------------


def test_router_and_experts_are_transformers():
    """256 tokens over 8 experts, top-3, a clamp that bites (limit 1.5): the same experts and
    weights as transformers' router, and the same MoE output from the checkpoint's interleaved
    gate_up layout, turned into ours at load."""
    from shared.model import moe
    from shared.model.models.gpt_oss import GptOssDecoderLayer

    kw = dict(hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3)
    kw |= dict(swiglu_limit=1.5, swiglu_alpha=1.3, num_attention_heads=4, num_key_value_heads=2)
    kw |= dict(head_dim=8, num_hidden_layers=1)
    t = _hf_config(**kw, initializer_range=0.5)
    t._experts_implementation = "eager"
    torch.manual_seed(0)
    ref = gpt_oss.GptOssMLP(t)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    layer = GptOssDecoderLayer(config_from_dict(_cfg(**kw)))
    ours = layer.mlp
    with torch.no_grad():
        ours.gate.weight.copy_(ref.router.weight)
        ours.gate.bias.copy_(ref.router.bias)
        for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(ours.experts, n).copy_(getattr(ref.experts, n))
    layer.fold_experts()
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    w, ids = ours.route(x)
    _, ref_w, ref_ids = ref.router(x)
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, atol=1e-6, rtol=0)
    with torch.no_grad():
        out, want = ours(x), ref(x[None])[0][0]
    assert (out - want).abs().max().item() < 1e-5
    gu = x @ ref.experts.gate_up_proj[0] + ref.experts.gate_up_proj_bias[0]
    assert gu[:, ::2].max() > 1.5 and gu[:, 1::2].min() < -1.5  # both clamps bite
    assert moe.clamped_swiglu is not None


# -- against transformers ----------------------------------------------------------------------

CASES = {
    # GQA 4:2, YaRN (not truncated), biases, 4 experts top-2, layer 0 sliding (window 128: the
    # whole served context), a clamp that bites (limit 2)
    "yarn": dict(
        num_key_value_heads=2,
        rope_parameters={**YARN, "truncate": False, "rope_theta": 1e4},
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=2.0,
    ),
    # MHA, default RoPE, no attention bias, layer types the other way round, 8 experts top-3,
    # transformers' default clamp (7) and alpha
    "plain": dict(
        num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        attention_bias=False,
        layer_types=["full_attention", "sliding_attention"],
        num_local_experts=8,
        num_experts_per_tok=3,
    ),
}


def _build(name, path, **over):
    cfg = _hf_config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        initializer_range=0.25,
        sliding_window=128,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        **(CASES[name] | over),
    )
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1, biases at 0: off them, a dropped one shows
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if n.endswith("sinks"):  # sinks comparable to the scores: they move the softmax
                p.mul_(8.0)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _build(request.param, path)
    return hf, load_model(path), request.param


def test_config_read_from_the_checkpoint(pair):
    hf, ours, _ = pair
    c, t = ours.config, hf.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, t.num_key_value_heads, 16)
    assert c.num_experts == t.num_local_experts and c.moe_layers == (0, 1)
    assert c.attention_bias == t.attention_bias and c.sliding_window == 128
    assert c.routing.swiglu == (t.swiglu_alpha, t.swiglu_limit)
    sinks = ours.model.model.layers[0].self_attn.sinks
    assert torch.equal(sinks, hf.model.layers[0].self_attn.sinks)


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    ids = _prompt(41)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    drv = PagedDriver(ours.model, block_size=block_size)
    got = drv.prefill(drv.new_seq(), ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("block_size,chunk", [(4, 1), (16, 7)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunks over cached context and block boundaries change nothing, in float64 (the router
    included: transformers computes it in the model's dtype)."""
    hf, ours, _ = pair
    ids = _prompt(41)
    cfg = copy.deepcopy(hf.config)
    cfg._experts_implementation = "eager"  # its grouped GEMM takes no float64
    hf64 = type(hf)(cfg).double().eval()
    hf64.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ref = hf64(torch.tensor([ids])).logits[0]
    m64 = load_model(ours.path, dtype=torch.float64).model
    drv = PagedDriver(m64, block_size=block_size)
    seq = drv.new_seq()
    hidden = torch.cat([drv.step([(seq, ids[s : s + chunk])])[0] for s in range(0, 41, chunk)])
    got = m64.lm_head(hidden)  # compute_logits' LM head, kept in float64
    assert (got - ref).abs().max().item() < 1e-9


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    ids = _prompt(9, seed=3)
    ref = hf_greedy(hf, ids, 32)
    assert PagedDriver(ours.model, block_size=4).greedy(ids, 32) == ref
    assert PagedDriver(ours.model, block_size=16).greedy(ids, 32, chunk=4) == ref


def test_a_batch_of_prompts_of_different_lengths(pair):
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for 32
    greedy tokens: each prompt's logits and tokens are transformers' for that prompt alone."""
    hf, ours, _ = pair
    prompts = [_prompt(5, seed=4), _prompt(11, seed=5), _prompt(16, seed=6)]
    drv = PagedDriver(ours.model, block_size=4)
    seqs = [drv.new_seq() for _ in prompts]
    _, logits = drv.step(list(zip(seqs, prompts, strict=True)))
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert (logits[row] - ref).abs().max().item() < 1e-4, row
    toks = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(31):
        _, logits = drv.step([(s, [t[-1]]) for s, t in zip(seqs, toks, strict=True)])
        for t, nxt in zip(toks, logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    assert toks == [hf_greedy(hf, ids, 32) for ids in prompts]


def _fallbacks(op: str, reason: str) -> float:
    return cpu_kernels.FALLBACKS.labels(op, reason)._value.get()


def test_sinks_take_the_torch_path_and_say_so(pair):
    """No native attention kernel has the sink term: every layer's attention runs in torch and
    each call counts as a ``decode_attention`` / ``prefill_attention`` fallback, reason
    ``sinks`` (on CPU float32), and the layers run op by op, saying why."""
    _, ours, _ = pair
    m = ours.model
    before = {op: _fallbacks(op, "sinks") for op in ("decode_attention", "prefill_attention")}
    layers_before = _fallbacks("decoder_layer", "unsupported")
    drv = PagedDriver(m, block_size=4)
    seq = drv.new_seq()
    drv.step([(seq, _prompt(6))])  # one prefill per layer
    drv.step([(seq, [3])])  # one decode per layer
    n = m.config.num_layers
    assert _fallbacks("prefill_attention", "sinks") - before["prefill_attention"] == n
    assert _fallbacks("decode_attention", "sinks") - before["decode_attention"] == n
    assert _fallbacks("decoder_layer", "unsupported") - layers_before == 2
    for layer in m.model.layers:
        assert layer.native() is None and "attention sinks" in layer.native_reason


def test_bf16_close_to_fp32(pair):
    hf, ours, _ = pair
    low = load_model(ours.path, dtype=torch.bfloat16)
    ids = _prompt(20)
    drv = PagedDriver(low.model, block_size=4)
    got = drv.prefill(drv.new_seq(), ids, chunk=6)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert drv.cache.k.dtype == torch.bfloat16
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.1


# -- two ranks ---------------------------------------------------------------------------------


def _rank(rank, port, path, out):
    """``--tp 2 --ep 2``: heads, their sinks and the KV heads over tensor parallelism, the
    experts (with their biases) over expert parallelism, the router whole on each rank."""
    from shared.model.ep import shard_experts
    from shared.model.parallel import TPGroup, shard_model
    from tests.model.test_tensor_parallel import _run, quit_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = TPGroup(rank, 2)
        model = shard_model(load_model(path, dtype=torch.float32).model, tp, experts=True)
        shard_experts(model, tp, replicated_kv=False)
        logits, toks, cache = _run(model)
        a = model.model.layers[0].self_attn
        moe = model.model.layers[1].mlp
        torch.save(
            dict(
                logits=logits,
                toks=toks,
                q=tuple(a.q_proj.weight.shape),
                sinks=a.sinks.detach().clone(),
                kv=tuple(cache.k.shape),
                experts=moe.experts.gate_up_proj.shape[0],
                bias=tuple(moe.experts.down_proj_bias.shape),
                a2a=moe.alltoall_bytes,
                ar=tp.allreduce_bytes,
            ),
            f"{out}/{rank}.pt",
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    quit_rank()


def test_two_ranks_match_unsharded(tmp_path):
    from tests.model.test_tensor_parallel import _free_port, _run

    _build("yarn", tmp_path / "ck")
    ours = load_model(tmp_path / "ck")
    ref_logits, ref_toks, ref_cache = _run(ours.model)
    mp.spawn(_rank, args=(_free_port(), str(ours.path), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert (r0["logits"] - ref_logits).abs().max() < 1e-4
    assert r0["toks"] == ref_toks and r1["toks"] == ref_toks
    c = ours.config
    sinks = ours.model.model.layers[0].self_attn.sinks
    assert torch.equal(torch.cat([r0["sinks"], r1["sinks"]]), sinks)  # each rank its heads'
    assert r0["q"] == (2 * c.head_dim, c.hidden_size)  # 2 of 4 heads
    kv = list(ref_cache.k.shape)
    kv[-2] //= 2
    assert list(r0["kv"]) == kv and r0["experts"] == c.num_experts // 2
    assert r0["bias"] == (c.num_experts // 2, c.hidden_size)
    assert r0["a2a"] > 0 and r0["ar"] > 0


# -- the acceptance checkpoint -----------------------------------------------------------------


def test_the_acceptance_checkpoint_loads_and_matches(tmp_path):
    """`tests.acceptance.checkpoints.build_text` (the real tokenizer, its 4096 ids): the light
    check accepts the directory, and Strata's greedy tokens are transformers'."""
    from tests.acceptance.checkpoints import build_text

    ck = build_text("gpt_oss", tmp_path / "gpt_oss")
    assert validate_checkpoint(ck.path).architecture == ARCH
    ids = ck.tokenizer("def tiers(kv_cache):")["input_ids"]
    ours = load_model(ck.path)
    assert PagedDriver(ours.model, block_size=4).greedy(ids, 12) == hf_greedy(ck.model, ids, 12)
