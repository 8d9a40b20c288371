"""Structured outputs: grammars from a `StructuredSpec`, compiled once, and per-request matchers.

xgrammar does the work: a spec becomes an ``xgr.Grammar``, `GrammarCache` compiles it against
the checkpoint's vocabulary (LRU by a hash of the spec; bounded in spec size, compile time and
compiled size: a spec over a limit is a `GrammarError` naming it, which the gateway turns into a
400), and a `Constraint` (one matcher) per request says which tokens may come next as a CPU
token bitmask. Grammar state depends only on the generated tokens, so a matcher is rebuilt
anywhere by replaying them (`Constraint.replay`): the decode side of a prefill hand-off, a
failover resume, a recompute after preemption.

Kinds (``StructuredSpec.kind``): ``json`` (a JSON object, as OpenAI's ``json_object``), ``json_schema`` (``spec`` = the schema), ``regex``, ``choice`` (``spec`` = a
JSON list of strings), ``grammar`` (xgrammar EBNF) and ``tool_calls`` (``spec`` = JSON
``{"format": "hermes" | "llama3", "schema": <one call>, "parallel": bool}``: the call schema
wrapped in the model family's tool-call syntax, see `tool_call_grammar`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.protocol.sampling import StructuredSpec

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr


def _xgr():
    """xgrammar, imported on first use: with it comes transformers (about 0.6 s of CPU), which
    a worker serving no structured request never needs at start."""
    import xgrammar

    return xgrammar


_ROOT = re.compile(r"\broot\b")
_LOOSE_CHARS = r"[^\"\\\r\n]"  # EBNF of a string character, as xgrammar writes it...
_JSON_CHARS = r"[^\0-\x1f\"\\\r\n]"  # ...and as JSON needs it (no raw control chars)


class GrammarError(ValueError):
    """A spec that cannot be compiled (invalid, unsupported, too big or too slow); the message
    names the problem."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one request may ask the compiler to do."""

    max_spec_bytes: int = 64 << 10
    """Largest spec text (schema JSON, regex, choices, EBNF)."""
    compile_timeout_s: float = 10.0
    """Longest a compilation may take (it finishes in the background, is cached, and the
    request that asked gets the error)."""
    max_compiled_bytes: int = 64 << 20
    """Largest compiled grammar (xgrammar's ``memory_size_bytes``)."""
    cache_entries: int = 256
    """Compiled grammars kept (LRU)."""


def tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a Strata `Tokenizer` (HF ``tokenizers``): the raw vocabulary by id
    padded to the model's ``vocab_size``, its encoding detected as xgrammar does for HF."""
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    kind = _xgr().TokenizerInfo._detect_vocab_type_from_vocab(vocab) or _xgr().VocabType.RAW
    return _xgr().TokenizerInfo(
        encoded, kind, vocab_size=vocab_size, stop_token_ids=sorted(set(eos_token_ids))
    )


def _json_schema_grammar(text: str, strict: bool = True) -> xgr.Grammar:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("JSON schema must be an object")
    grammar = _xgr().Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=strict
    )
    text = str(grammar)
    if _LOOSE_CHARS in text:  # xgrammar 0.2.8: a length-bounded string lets control chars in
        return _xgr().Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))
    return grammar


def tool_call_grammar(fmt: str, call_schema: dict, parallel: bool) -> xgr.Grammar:
    """One call (or, with ``parallel``, one or more) in the family's syntax: hermes
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2/Qwen3, ChatML),
    llama3 a bare ``{"name": ..., "parameters": {...}}`` (one call)."""
    body = str(_json_schema_grammar(json.dumps(call_schema)))
    if fmt == "llama3":
        return _xgr().Grammar.from_ebnf(body)
    if fmt != "hermes":
        raise GrammarError(f"unknown tool-call format {fmt!r}")
    ebnf = _ROOT.sub("call_json", body)
    one = '"<tool_call>\\n" call_json "\\n</tool_call>"'
    more = f' ("\\n" {one})*' if parallel else ""
    return _xgr().Grammar.from_ebnf(f"{ebnf}\nroot ::= {one}{more}\n")


# Text up to the first "</think>": the states of a matcher of that tag (how much of it the text
# ends with), each able to stop; ">" after "</think" is the one character no state takes, so
# the body never contains the tag and the block ends at its first one, as the gateway's
# reasoning parser splits it ("</think>" has no proper border: a partial match restarts only
# at "<").
_THINK_BODY = """
tb0 ::= "" | [^<] tb0 | "<" tb1
tb1 ::= "" | "<" tb1 | "/" tb2 | [^</] tb0
tb2 ::= "" | "<" tb1 | "t" tb3 | [^<t] tb0
tb3 ::= "" | "<" tb1 | "h" tb4 | [^<h] tb0
tb4 ::= "" | "<" tb1 | "i" tb5 | [^<i] tb0
tb5 ::= "" | "<" tb1 | "n" tb6 | [^<n] tb0
tb6 ::= "" | "<" tb1 | "k" tb7 | [^<k] tb0
tb7 ::= "" | "<" tb1 | [^<>] tb0
"""
_THINK = {
    "optional": 'root ::= ("<think>" tb0 "</think>" [ \\n]*)?' + _THINK_BODY,
    "open": 'root ::= tb0 "</think>" [ \\n]*' + _THINK_BODY,
}


def build_grammar(spec: StructuredSpec) -> xgr.Grammar:
    """The (uncompiled) grammar of ``spec``; `GrammarError` for a bad one. With ``think`` the
    answer's grammar follows a thinking block (as vLLM applies a grammar after the reasoning
    when a reasoning parser is on): optional, or already opened by the template."""
    grammar = _answer_grammar(spec)
    if spec.think:
        return _xgr().Grammar.concat(_xgr().Grammar.from_ebnf(_THINK[spec.think]), grammar)
    return grammar


def _answer_grammar(spec: StructuredSpec) -> xgr.Grammar:
    try:
        if spec.kind == "json":
            return _json_schema_grammar('{"type": "object"}', strict=False)
        if spec.kind == "json_schema":
            return _json_schema_grammar(spec.spec)
        if spec.kind == "regex":
            return _xgr().Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not (
                isinstance(choices, list)
                and choices
                and all(isinstance(c, str) and c for c in choices)
            ):
                raise GrammarError("choice needs a non-empty list of non-empty strings")
            return _xgr().Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in choices)
            )
        if spec.kind == "grammar":
            return _xgr().Grammar.from_ebnf(spec.spec)
        if spec.kind == "tool_calls":
            d = json.loads(spec.spec)
            return tool_call_grammar(d["format"], d["schema"], bool(d.get("parallel")))
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError with the reason
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GrammarError(f"invalid {spec.kind} constraint: {first}") from None
    raise GrammarError(f"unknown constraint kind {spec.kind!r}")


def spec_key(spec: StructuredSpec) -> str:
    """Cache key: a hash of the kind, spec text and thinking block (not of ``resumed_tokens``)."""
    return hashlib.sha256(f"{spec.kind}\0{spec.spec}\0{spec.think}".encode()).hexdigest()


class GrammarCache:
    """Compiles specs against one vocabulary, once each (LRU of `GrammarLimits.cache_entries`).

    Thread-safe; ``hits`` / ``misses`` count lookups (tests and the benchmark read them)."""

    def __init__(self, info: xgr.TokenizerInfo, limits: GrammarLimits | None = None):
        self.info = info
        self.limits = limits or GrammarLimits()
        self._compiler = _xgr().GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar")
        self._lru: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``, compiling it on a miss (`GrammarError` if bad)."""
        if len(spec.spec.encode()) > self.limits.max_spec_bytes:
            raise GrammarError(
                f"{spec.kind} constraint is {len(spec.spec.encode())} bytes; the "
                f"limit is {self.limits.max_spec_bytes}"
            )
        key = spec_key(spec)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        fut = self._pool.submit(self._compile, spec)
        try:
            compiled = fut.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            raise GrammarError(
                f"{spec.kind} constraint took longer than "
                f"{self.limits.compile_timeout_s:g} s to compile"
            ) from None
        if compiled.memory_size_bytes > self.limits.max_compiled_bytes:
            raise GrammarError(
                f"{spec.kind} constraint compiles to {compiled.memory_size_bytes} "
                f"bytes; the limit is {self.limits.max_compiled_bytes}"
            )
        with self._lock:
            self._lru[key] = compiled
            while len(self._lru) > self.limits.cache_entries:
                self._lru.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        grammar = build_grammar(spec)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar's reason, on one line
            raise GrammarError(f"invalid {spec.kind} constraint: {exc}") from None


class Constraint:
    """One request's grammar state: which tokens may come next; ``accept`` advances it."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = _xgr().GrammarMatcher(compiled)
        self.rejected = 0  # tokens the grammar refused (a bug upstream if ever > 0)

    def replay(self, token_ids: Sequence[int]) -> None:
        """Feed tokens generated before this matcher existed (hand-off, resume, recompute)."""
        for t in token_ids:
            self.accept(t)

    def accept(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return False
        ok = self.matcher.accept_token(int(token_id))
        self.rejected += not ok
        return ok

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar accepts from its current state, stopping
        before a draft that would end it (the stop token is left to the target's own row, so
        every verify row has a next-token mask). The state is left unchanged."""
        accepted = n = 0
        for t in drafts:
            if not self.matcher.accept_token(int(t)):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
            n += 1
        if accepted:
            self.matcher.rollback(accepted)
        return n

    def draft_bitmasks(self, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:
        """``len(drafts) + 1`` bitmask rows: row j allows what may follow ``drafts[:j]`` (all
        of which the grammar must accept: `valid_prefix`). The state is left unchanged."""
        masks = allocate_bitmask(len(drafts) + 1, vocab_size)
        self.matcher.fill_next_token_bitmask(masks, 0)
        for j, t in enumerate(drafts, 1):
            if not self.matcher.accept_token(int(t)):
                raise ValueError(f"draft token {t} is outside the grammar")
            self.matcher.fill_next_token_bitmask(masks, j)
        if drafts:
            self.matcher.rollback(len(drafts))
        return masks

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into ``bitmask[row]`` (int32, CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask with ``rows`` rows (bit set = token allowed)."""
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in ``logits[rows]`` (``bitmask[j]`` is the
    mask of ``rows[j]``), in place; other rows are untouched."""
    if not rows:
        return
    import torch  # here, not at the top: the tokenizer imports this module and runs no model

    vocab = logits.shape[-1]
    bits = bitmask[: len(rows)].to(logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
