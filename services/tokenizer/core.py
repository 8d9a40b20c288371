"""Pure tokenizer core: chat messages / prompts -> token ids with image placeholders expanded.

No NATS here; `TokenizerCore.encode` takes and returns the bus messages so the handler is a
one-liner and tests call it directly. A request's output constraint (``constraint``) is compiled
here first, against this checkpoint's vocabulary: the gateway imports no torch (xgrammar needs
it), so this is where a bad JSON schema, regex or grammar becomes the 400 naming it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from shared.engine.structured import GrammarCache, GrammarError, GrammarLimits, tokenizer_info
from shared.model.config import load_config, parse_dtype_name
from shared.model.fingerprint import model_fingerprint
from shared.model.image import expand_image_placeholders
from shared.model.tokenizer import Tokenizer
from shared.protocol.errors import StrataError
from shared.protocol.sampling import StructuredSpec
from shared.protocol.tok import (
    DetokenizeReply,
    DetokenizeRequest,
    ImageSpan,
    TokenizeReply,
    TokenizeRequest,
)

_IMAGE_PART_TYPES = ("image", "image_url", "input_image")
_TEXT_PART_TYPES = ("text", "input_text")


class TokenizerCore:
    """Tokenizes for one checkpoint and says what the gateway needs for block hashing."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "",
        block_size: int = 16,
        grammar_timeout: float = 5.0,
    ):
        path = Path(model_dir)
        self.tokenizer = Tokenizer.from_dir(path)
        self.config = load_config(path)
        self.kv_dtype = parse_dtype_name(dtype) if dtype else self.config.dtype_name
        self.fingerprint = model_fingerprint(path, self.config.architecture, self.kv_dtype)
        self.block_size = block_size
        self.max_model_len = self.config.max_model_len
        self.image_token_id = self.config.image_token_id
        if self.image_token_id is None:
            self.image_token_id = self.tokenizer.image_token_id
        self.image_text = self.tokenizer.image_token
        multimodal = self.config.is_multimodal
        if self.image_text is None and multimodal and self.image_token_id is not None:
            self.image_text = self.tokenizer.id_to_token(self.image_token_id)  # config names it
        if not multimodal:
            self.image_text = None  # a text-only checkpoint: image parts are refused
        eos = set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = sorted(eos)
        self._grammar_limits = GrammarLimits(compile_timeout_s=grammar_timeout)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCache:
        """The grammar compiler, built on the first structured request: xgrammar brings torch
        and transformers with it (about 2.5 CPU-s), which a tokenizer that never sees a
        constraint should not pay at start. Building it is not counted in the compile timeout."""
        with self._grammars_lock:
            if self._grammars is None:
                info = tokenizer_info(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
                self._grammars = GrammarCache(info, self._grammar_limits)
            return self._grammars

    def check_constraint(self, spec: StructuredSpec, param: str) -> None:
        """Compile ``spec`` (cached); a ``bad_request`` ``"<param>: <problem>"`` when it cannot
        be (invalid, unsupported, too big or too slow to compile)."""
        try:
            self.grammars.get(spec)
        except GrammarError as exc:
            raise StrataError("bad_request", f"{param}: {exc}") from None

    def encode(self, req: TokenizeRequest) -> TokenizeReply:
        started = time.time()
        if req.constraint is not None:  # first, as the gateway did before it dropped torch
            self.check_constraint(req.constraint, req.constraint_param or "constraint")
        given = [x is not None for x in (req.messages, req.prompt, req.prompt_token_ids)]
        if sum(given) != 1:
            raise StrataError(
                "bad_request", "give exactly one of 'messages', 'prompt' or 'prompt_token_ids'"
            )
        n_images = 0
        if req.messages is not None:
            if not req.messages:
                raise StrataError("bad_request", "messages must not be empty")
            messages, n_images = self._flatten(req.messages)
            text = self._render(messages, req)
            ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        elif req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise StrataError(
                    "bad_request", f"prompt: token id {bad} is not in the vocabulary (size {vocab})"
                )
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        else:
            text = req.prompt or ""
            ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        spans: list[tuple[int, int]] = []
        if self.image_token_id is not None and self.config.num_image_tokens:
            found = sum(1 for t in ids if t == self.image_token_id)
            if found != n_images:
                raise StrataError(
                    "bad_request", f"prompt has {found} image placeholders but {n_images} images"
                )
            if n_images:
                ids, spans = expand_image_placeholders(
                    ids, self.image_token_id, self.config.num_image_tokens
                )
        elif n_images:
            raise StrataError("bad_request", "this model does not accept images")
        k = req.truncate_prompt_tokens
        if k is not None and (k == 0 or k < -1 or k > self.max_model_len):
            raise StrataError(
                "bad_request",
                f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] "
                "(the context length)",
            )
        k = self.max_model_len if k == -1 else k
        if k is not None and k < len(ids):
            cut = len(ids) - k  # keep the last k tokens (vLLM): an image may not be cut
            if any(o < cut for o, _ in spans):
                raise StrataError(
                    "bad_request", "truncate_prompt_tokens would cut an image out of the prompt"
                )
            ids, spans = ids[cut:], [(o - cut, n) for o, n in spans]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return TokenizeReply(
            token_ids=ids,
            image_spans=[ImageSpan(offset=o, length=n) for o, n in spans],
            text=text,
            model_fingerprint=self.fingerprint,
            kv_dtype=self.kv_dtype,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.tokenizer.vocab_size,
            bad_words_ids=self.bad_words_ids(req.bad_words),
            started_at=started,
            finished_at=time.time(),
        )

    def _render(self, messages: list[dict[str, Any]], req: TokenizeRequest) -> str:
        """The chat template's text: ``chat_template_kwargs`` are extra template variables;
        ``continue_final_message`` renders without the generation prompt and cuts the text
        right after the last message's content, leaving it open for the model to continue."""
        extra = dict(req.chat_template_kwargs or {})
        reserved = {"messages", "add_generation_prompt", "tools"} & set(extra)
        if reserved:
            raise StrataError(
                "bad_request",
                f"chat_template_kwargs may not set {sorted(reserved)} (they have their own fields)",
            )
        gen = req.add_generation_prompt and not req.continue_final_message
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=gen, tools=req.tools, **extra
            )
        except Exception as exc:  # jinja raises many types; a template error is the client's
            raise StrataError("bad_request", f"chat template failed: {exc}") from None
        if req.continue_final_message:
            last = messages[-1]["content"].strip()
            at = text.rfind(last) if last else -1
            if at < 0:
                raise StrataError(
                    "bad_request",
                    "continue_final_message: the last message's content is not in the "
                    "rendered chat template",
                )
            text = text[: at + len(last)]
        return text

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as tokens, as vLLM does: the word itself, and with a leading space
        when that is a different first token of the same length (the word inside a text)."""
        out: list[list[int]] = []
        for w in words:
            plain = self.tokenizer.encode(w.lstrip(), add_special_tokens=False)
            if plain:
                out.append(plain)
            spaced = self.tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        return out

    def decode(self, req: DetokenizeRequest) -> DetokenizeReply:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in req.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise StrataError(
                "bad_request", f"tokens: token id {bad} is not in the vocabulary (size {vocab})"
            )
        text = self.tokenizer.decode(req.token_ids, skip_special_tokens=req.skip_special_tokens)
        return DetokenizeReply(text=text)

    def _flatten(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """OpenAI content parts -> one string per message; image parts -> the image token."""
        out, n_images = [], 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise StrataError("bad_request", f"messages[{i}] must be an object with a role")
            content = m.get("content")
            if isinstance(content, list):
                pieces = []
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind in _TEXT_PART_TYPES:
                        pieces.append(str(part.get("text") or ""))
                    elif kind in _IMAGE_PART_TYPES:
                        if self.image_text is None:
                            raise StrataError(
                                "bad_request",
                                "this model does not accept images (text-only checkpoint)",
                            )
                        pieces.append(self.image_text)
                        n_images += 1
                    else:
                        raise StrataError("bad_request", f"messages[{i}]: unknown part {kind!r}")
                content = "".join(pieces)
            out.append({**m, "content": "" if content is None else str(content)})
        return out, n_images
