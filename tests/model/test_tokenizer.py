"""Tokenizer, chat template and streaming detokenization against transformers' AutoTokenizer."""

import json

import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Ünïcödé façade — naïve café ½ € → ∞",
    "你好，世界！模型缓存。日本語のテキスト、한국어 텍스트",
    "emoji 😀🚀🎉 ❤️ 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<image> tail<|endoftext|>",
    "  leading and trailing spaces\t\n\n code: def f(x):\n    return x**2  ",
    "rare bytes \x00\x7f \u200b zero-width",
]
MESSAGES = [
    {"role": "system", "content": "You are helpful. 🤖"},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe 图像."}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And now? ✨"},
]
CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('no system') if loop.index0 != 0 else '' }}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}"
)


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory):
    """A byte-level BPE tokenizer built here, with BOS/EOS and a template using tojson."""
    path = tmp_path_factory.mktemp("custom_tok")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 20 + ["plain english words for merges"] * 50, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CUSTOM_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(params=["default", "custom"])
def both(request, default_model_dir, custom_dir):
    path = default_model_dir if request.param == "default" else custom_dir
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


def test_encode_decode_match(both):
    ours, hf = both
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(hf)
    # special = the ids that skip_special_tokens removes (all_special_ids only lists named ones)
    added = hf.added_tokens_decoder
    assert ours.special_token_ids == {
        i for i in added if hf.decode([i], skip_special_tokens=True) == ""
    }
    assert set(hf.all_special_ids) <= ours.special_token_ids


def test_chat_template_match(both):
    ours, hf = both
    msgs = MESSAGES if ours.bos_token_id is None else [m for m in MESSAGES if m["role"] != "system"]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
            msgs, add_generation_prompt=gen, tokenize=False
        )


def test_template_raise_exception(custom_dir):
    ours = Tokenizer.from_dir(custom_dir)
    bad = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    with pytest.raises(Exception, match="no system"):
        ours.apply_chat_template(bad)


def test_default_tokenizer_metadata(default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == {im_end, eot}
    assert tok.bos_token_id is None
    assert tok.image_token == "<image>" and tok.image_token_id == tok.token_to_id("<image>")
    assert tok.encode("<image>") == [tok.image_token_id]
    assert 2000 < tok.vocab_size <= 4096
    # rendering an image part yields the placeholder token
    text = tok.apply_chat_template([MESSAGES[1]])
    assert text == "<|im_start|>user\n<image>Describe 图像.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("skip", [True, False])
def test_streaming_detokenization(default_model_dir, skip):
    tok = Tokenizer.from_dir(default_model_dir)
    prompt = tok.encode("prompt ")
    for text in TEXTS:
        ids = tok.encode(text)
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = [det.add(i) for i in ids]
        assert all("\ufffd" not in d for d in deltas), text
        assert "".join(deltas) + det.flush() == tok.decode(ids, skip)
        assert det.flush() == ""
    # a multi-byte character split over byte tokens is held back until complete
    ids = [tok.token_to_id(c) for c in "ðŁĺĢ"]  # byte-level symbols of U+1F600's 4 bytes
    assert None not in ids
    det = IncrementalDetokenizer(tok, [])
    assert [det.add(i) for i in ids] == ["", "", "", "😀"]


def test_spaces_between_special_tokens_as_vllm(tmp_path):
    """A tokenizer without a decoder joins tokens with spaces (as a WordPiece / Metaspace one may
    around added tokens): vLLM's ``spaces_between_special_tokens=False`` makes an added token
    right after another its bare content; the default, or skipping specials, changes nothing."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    hf = HFTok(WordLevel({"hi": 0, "there": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = WhitespaceSplit()
    hf.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    a, b = tok.token_to_id("<a>"), tok.token_to_id("<b>")
    ids = [0, a, b, a, 1]

    def text(**kw) -> str:
        det = IncrementalDetokenizer(tok, [], **kw)
        return "".join(det.add(i) for i in ids) + det.flush()

    assert text(skip_special_tokens=False) == "hi <a> <b> <a> there" == tok.decode(ids, False)
    squeezed = text(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert squeezed == "hi <a><b><a> there"
    assert text(spaces_between_special_tokens=False) == text() == "hi there"
