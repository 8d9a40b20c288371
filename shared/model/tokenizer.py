"""Tokenizer: HF ``tokenizers`` + ``tokenizer_config.json`` + Jinja chat template.

``apply_chat_template`` renders exactly as transformers does: a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, the loopcontrols extension, a non-escaping ``tojson``,
``raise_exception`` and ``strftime_now``, and the special tokens (``bos_token``, ...) in scope.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from shared.model.errors import CheckpointError

_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant masks) as a no-op block."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' Jinja environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (used when the config asks for it)."""
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


def _load_template(path: Path, cfg: dict, processor: dict) -> str | None:
    """The chat template wherever transformers saved it: ``chat_template.jinja`` (4.5x+),
    ``tokenizer_config.json``, a processor's ``chat_template.json``, ``processor_config.json``."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates; "default" is the one used without a name
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    if template is None and (path / "chat_template.json").exists():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    if template is None and isinstance(processor.get("chat_template"), str):
        return processor["chat_template"]
    return template


class Tokenizer:
    """Encode/decode and chat templating for one checkpoint directory."""

    def __init__(
        self,
        tok: HFTokenizer,
        config: dict,
        chat_template: str | None,
        extra_eos_ids: tuple[int, ...] = (),
    ):
        self._tok = tok
        self.config = config
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        self.special_tokens = {k: _token_str(config.get(k)) for k in _SPECIAL_KEYS}
        self.special_tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        added = tok.get_added_tokens_decoder()
        self.special_token_ids: set[int] = {i for i, t in added.items() if t.special}
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}
        self.eos_token_ids: set[int] = set(extra_eos_ids)
        eos = self.special_tokens.get("eos_token")
        if eos is not None and tok.token_to_id(eos) is not None:
            self.eos_token_ids.add(tok.token_to_id(eos))
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = tok.token_to_id(bos) if bos else None
        self.image_token: str | None = _token_str(config.get("image_token")) or (
            "<image>" if tok.token_to_id("<image>") is not None else None
        )
        self.image_token_id: int | None = (
            tok.token_to_id(self.image_token) if self.image_token else None
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, ``tokenizer_config.json``, the chat template, the image token
        (also from ``processor_config.json``) and (for EOS ids) ``generation_config.json``."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(
                f"{path}: no tokenizer.json (Strata needs the fast tokenizer "
                "file; save it with tokenizer.save_pretrained(dir))"
            )
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise CheckpointError(f"{file}: cannot be loaded ({e}); re-save the tokenizer") from e
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        proc_file = path / "processor_config.json"  # a multimodal processor's own settings
        processor = json.loads(proc_file.read_text()) if proc_file.exists() else {}
        if not cfg.get("image_token") and processor.get("image_token"):
            cfg = {**cfg, "image_token": processor["image_token"]}
        eos: tuple[int, ...] = ()
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            value = json.loads(gen_file.read_text()).get("eos_token_id")
            eos = (value,) if isinstance(value, int) else tuple(value or ())
        return cls(tok, cfg, _load_template(path, cfg, processor), eos)

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (``len(tokenizer)`` in transformers)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template (``tools``, ``documents`` and
        any other template variables go through ``kwargs``)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


class IncrementalDetokenizer:
    """Streams text for generated ids.

    Each ``add`` returns only the new, complete text: a trailing U+FFFD (bytes of a character
    still arriving) is held back. Text is decoded relative to the output ids alone (``prompt_ids``
    is accepted for API symmetry), so the concatenated deltas equal
    ``tokenizer.decode(output_ids)`` exactly.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prompt_len = len(prompt_ids or ())
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are settled text
        self._read = 0  # ids before it have been emitted
        self.text = ""
        # vLLM's spaces_between_special_tokens=False (with special tokens kept): an added token
        # right after another is its bare content, without the space a decoder may put before
        # it. ``_shift``: how much longer ``text`` is than the plain decode of ``ids``.
        added = getattr(tokenizer, "added_tokens", None) or {}
        self._added = added if not (spaces_between_special_tokens or skip_special_tokens) else {}
        self._last_added = False
        self._shift = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one id; return the text delta it completes (possibly "")."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        bare = self._added.get(int(token_id))
        after_added, self._last_added = self._last_added, bare is not None
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        if bare is not None and after_added and delta != bare:
            self._shift += len(bare) - len(delta)
            delta = bare
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (call when generation ends)."""
        rest = self._decode(self.ids)[len(self.text) - self._shift :]
        self.text += rest
        return rest
