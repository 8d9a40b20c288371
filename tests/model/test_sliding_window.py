"""Sliding-window checkpoints: Strata attends to the full context and caps the served context at
the window, so every sequence it serves is windowed-attention exact. A prompt within the window
matches transformers (logits and greedy tokens, the window filled to the last token); a longer
one, which full attention would get wrong, is refused by the gateway with a 400."""

import pytest
import torch

from services.gateway.config import GatewayConfig
from services.gateway.core import ApiError, build_spec, sampling_for
from services.tokenizer.core import TokenizerCore
from shared.model.loader import load_model
from tests.acceptance.checkpoints import VOCAB, hf_tokenizer
from tests.model.paged_driver import PagedDriver

transformers = pytest.importorskip("transformers")

WINDOW = 48
CASES = {
    "mistral": ("Mistral", dict(sliding_window=WINDOW)),
    # Qwen2: only layers from max_window_layers on are windowed
    "qwen2": ("Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "phi3": ("Phi3", dict(sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Gemma-2: every other layer windowed (default layer_types), soft-capped attention
    "gemma2": ("Gemma2", dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16)),
    # Gemma-3: layer 0 windowed (and on the local RoPE), layer 1 full
    "gemma3": (
        "Gemma3",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}
_CONFIG = {"Gemma3": "Gemma3TextConfig"}  # config classes not named <cls>Config


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    cls, kw = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    cfg = getattr(transformers, _CONFIG.get(cls, cls + "Config"))(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,
        max_position_embeddings=256,
        **kw,
    )
    torch.manual_seed(0)
    hf = getattr(transformers, cls + "ForCausalLM")(cfg).eval()
    hf.save_pretrained(path)
    hf_tokenizer().save_pretrained(path)
    return hf, load_model(path)


def _prompt(n, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf, ids, n):
    out, past, inp = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = hf(inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            inp = torch.tensor([[out[-1]]])
    return out


def test_the_served_context_is_the_window(pair):
    _, ours = pair
    assert ours.config.sliding_window == WINDOW
    assert ours.config.max_model_len == WINDOW < ours.config.max_position_embeddings


def test_within_the_window_logits_and_greedy_match(pair):
    hf, ours = pair
    ids = _prompt(WINDOW)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    drv = PagedDriver(ours.model, block_size=4)
    assert (drv.prefill(drv.new_seq(), ids) - ref).abs().max().item() < 1e-4
    short = _prompt(16, seed=3)  # 16 prompt + 32 generated = the whole window
    ref_tokens = _hf_greedy(hf, short, WINDOW - 16)
    assert PagedDriver(ours.model, block_size=16).greedy(short, WINDOW - 16) == ref_tokens


def test_past_the_window_full_attention_would_be_wrong(pair):
    """Why the cap: at 80 tokens transformers' windowed logits differ from full attention's."""
    hf, ours = pair
    ids = _prompt(80)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    drv = PagedDriver(ours.model, block_size=4)
    got = drv.prefill(drv.new_seq(), ids)
    assert (got[:WINDOW] - ref[:WINDOW]).abs().max().item() < 1e-4
    assert (got[WINDOW:] - ref[WINDOW:]).abs().max().item() > 1e-2


def test_the_gateway_refuses_a_prompt_longer_than_the_window(pair):
    _, ours = pair
    core = TokenizerCore(ours.path)
    assert core.max_model_len == WINDOW
    cfg = GatewayConfig()
    spec = build_spec("completion", {"model": "m", "prompt": "x"}, cfg, "m")
    with pytest.raises(ApiError, match=f"this model's context length is {WINDOW}") as e:
        sampling_for(spec, WINDOW + 12, core.max_model_len, cfg)
    assert e.value.http_status == 400
    asked = build_spec("completion", {"model": "m", "prompt": "x", "max_tokens": 20}, cfg, "m")
    with pytest.raises(ApiError, match=f"exceeds the context length {WINDOW}"):
        sampling_for(asked, 40, core.max_model_len, cfg)
    # within the window: max_tokens defaults to what is left of it
    assert sampling_for(spec, 40, core.max_model_len, cfg).max_tokens == WINDOW - 40
