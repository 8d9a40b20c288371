"""OpenAI response objects built from `TokenChunk`s (pure; no I/O).

`Formatter` knows the request kind, id, model and how to spell a token; ``chunk()`` makes one
streamed ``chat.completion.chunk`` / ``text_completion`` object, ``final()`` the non-streamed
response from every choice's accumulated `ChoiceState`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.reasoning import split
from services.gateway.tools import parse_tool_calls
from shared.protocol.stream import TokenChunk


@dataclass
class ChoiceState:
    """Everything streamed so far for one choice."""

    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    completion_tokens: int | None = None
    prompt_logprobs: list[dict[int, float]] | None = None  # vLLM prompt_logprobs (1st chunk)
    prompt_ranks: list[int] = field(default_factory=list)

    def add(self, c: TokenChunk) -> None:
        if c.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_ranks = c.prompt_logprobs, c.prompt_ranks or []
        self.text.append(c.text)
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs or [])
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
        if c.usage is not None:
            self.cached_tokens = c.usage.cached_tokens
            self.completion_tokens = c.usage.completion_tokens or len(self.token_ids)


def usage(choices: list[ChoiceState], prompt_lens: list[int]) -> dict[str, Any]:
    """Usage over all choices: each distinct prompt counted once, completions summed."""
    completion = sum(
        c.completion_tokens if c.completion_tokens is not None else len(c.token_ids)
        for c in choices
    )
    prompt = sum(prompt_lens)
    cached = max((c.cached_tokens for c in choices), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Formatter:
    """Builds the response objects of one request."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        token_str: Callable[[int], str],
        logprobs: int | None,
    ):
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.token_str = token_str
        self.top_n = logprobs
        self.tool_format: str | None = None  # set: chat output is parsed for tool calls
        self.token_ids = False  # vLLM return_token_ids: prompt and output token ids too
        # reasoning parser on (chat): per choice, whether its output starts inside a thinking
        # block the template opened (`services.gateway.reasoning`); None: off
        self.reasoning: list[bool] | None = None
        # completions with echo and logprobs: per choice, the prompt ids whose logprobs (the
        # engine's prompt logprobs) lead the choice's logprobs, as vLLM gives them; None: off
        self.echo_prompt_ids: list[list[int]] | None = None
        self.prompt_logprobs_field = True  # the request asked for ``prompt_logprobs`` itself

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self, index: int, prompt_ids: list[int] | None = None) -> dict[str, Any]:
        """First chat chunk of a choice: the assistant role with empty content (and, with
        ``token_ids`` on, the prompt's token ids, as vLLM sends them)."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.token_ids:
            choice["token_ids"] = []
            out["prompt_token_ids"] = prompt_ids or []
        return out

    def prompt_chunk(self, index: int, echo: str, prompt_ids: list[int]) -> dict[str, Any]:
        """First completion chunk of a choice when it echoes the prompt or returns token ids:
        the prompt text (echo) and the prompt's token ids (return_token_ids)."""
        choice: dict[str, Any] = {
            "index": index,
            "text": echo,
            "logprobs": None,
            "finish_reason": None,
        }
        if self.token_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = []
        return {**self._head("text_completion"), "choices": [choice]}

    def chunk(self, index: int, c: TokenChunk, text_offset: int = 0) -> dict[str, Any]:
        if self.echo_prompt_ids is not None and c.prompt_logprobs is not None:
            lps = self._echo_logprobs(
                self.echo_prompt_ids[index],
                c.prompt_logprobs,
                c.token_ids,
                c.logprobs or [],
                text_offset,
            )
        else:
            lps = self._logprobs(c.token_ids, c.logprobs or [], text_offset)
        ids = {"token_ids": list(c.token_ids)} if self.token_ids else {}
        plp = None
        if c.prompt_logprobs is not None and self.prompt_logprobs_field:
            plp = self.prompt_logprobs(c.prompt_logprobs, c.prompt_ranks or [])
        if self.kind == "chat":
            choice = {
                "index": index,
                "delta": {"content": c.text} if c.text else {},
                "logprobs": lps,
                "finish_reason": c.finish_reason,
                **ids,
            }
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
            if plp is not None:  # chat: on the response (here: the chunk), as vLLM has it
                out["prompt_logprobs"] = plp
            return out
        choice = {
            "index": index,
            "text": c.text,
            "logprobs": lps,
            "finish_reason": c.finish_reason,
            **ids,
        }
        if plp is not None:  # completions: on the choice
            choice["prompt_logprobs"] = plp
        return {**self._head("text_completion"), "choices": [choice]}

    def prompt_logprobs(
        self, lps: list[dict[int, float]], ranks: list[int]
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's shape: None for the first prompt token, then per token ``{"<id>": {logprob,
        rank, decoded_token}}`` for the prompt token (its rank in the vocabulary; each entry's
        first key) and its top-n alternatives (ranked 1..n)."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for d, rank in zip(lps, ranks, strict=True):
            chosen = next(iter(d))
            order = sorted(d.items(), key=lambda kv: -kv[1])  # the prompt token sorts last
            rank_of = {t: r for r, (t, _) in enumerate(order, 1)}  # when not in the top-n
            out.append(
                {
                    str(t): {
                        "logprob": v,
                        "rank": rank if t == chosen else rank_of[t],
                        "decoded_token": self.token_str(t),
                    }
                    for t, v in d.items()
                }
            )
        return out

    def tool_call_chunks(self, index: int, k: int, call: dict[str, Any]) -> list[dict[str, Any]]:
        """Call ``k`` of a choice as OpenAI stream fragments: id, type and name with empty
        arguments, then the arguments."""
        f = call["function"]
        head = {
            "index": k,
            "id": call["id"],
            "type": "function",
            "function": {"name": f["name"], "arguments": ""},
        }
        args = {"index": k, "function": {"arguments": f["arguments"]}}
        return [
            {
                **self._head("chat.completion.chunk"),
                "choices": [
                    {
                        "index": index,
                        "delta": {"tool_calls": [d]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for d in (head, args)
        ]

    def finish_chunk(self, index: int, reason: str) -> dict[str, Any]:
        choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}

    def final(
        self,
        choices: list[ChoiceState],
        prompt_lens: list[int],
        echo: list[str] | None = None,
        prompt_ids: list[list[int]] | None = None,
    ) -> dict[str, Any]:
        """The whole response; ``echo`` and ``prompt_ids`` are per choice (the text ``echo``
        prepends; with ``token_ids`` on, each choice's prompt ids)."""
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            prefix = echo[c.index] if echo else ""
            gen, reasoning = "".join(c.text), None
            if self.kind == "chat" and self.reasoning is not None:
                reasoning, gen = split(gen, self.reasoning[c.index])
            text = prefix + gen
            lps = None
            if self.echo_prompt_ids is not None:
                lps = self._echo_logprobs(
                    self.echo_prompt_ids[c.index],
                    c.prompt_logprobs,
                    c.token_ids,
                    c.logprobs,
                    len(prefix),
                )
            elif self.top_n is not None:
                lps = self._logprobs(c.token_ids, c.logprobs, len(prefix))
            if self.kind == "chat" and self.tool_format:
                content, calls = parse_tool_calls(text, self.tool_format)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if self.reasoning is not None:
                    message["reasoning_content"] = reasoning
                reason = c.finish_reason
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
                out.append(
                    {"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason}
                )
            elif self.kind == "chat":
                message = {"role": "assistant", "content": text}
                if self.reasoning is not None:
                    message["reasoning_content"] = reasoning
                out.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": lps,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out.append(
                    {
                        "index": c.index,
                        "text": text,
                        "logprobs": lps,
                        "finish_reason": c.finish_reason,
                    }
                )
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        resp = {**self._head(obj), "choices": out, "usage": usage(choices, prompt_lens)}
        ordered = sorted(choices, key=lambda c: c.index)
        plps = [
            None
            if c.prompt_logprobs is None or not self.prompt_logprobs_field
            else self.prompt_logprobs(c.prompt_logprobs, c.prompt_ranks)
            for c in ordered
        ]
        if any(p is not None for p in plps):  # vLLM: chat on the response, completions per choice
            if self.kind == "chat":
                resp["prompt_logprobs"] = plps[0]
            else:
                for choice, p in zip(out, plps, strict=True):
                    choice["prompt_logprobs"] = p
        if (
            self.token_ids
        ):  # vLLM: chat has the prompt's ids on the response, completions per choice
            ordered = sorted(choices, key=lambda c: c.index)
            for choice, c in zip(out, ordered, strict=True):
                if self.kind != "chat":
                    choice["prompt_token_ids"] = (prompt_ids or [])[c.index]
                choice["token_ids"] = list(c.token_ids)
            if self.kind == "chat":
                resp["prompt_token_ids"] = (prompt_ids or [[]])[0]
        return resp

    def _echo_logprobs(
        self,
        prompt_ids: list[int],
        plps: list[dict[int, float]] | None,
        ids: list[int],
        lps: list[dict[int, float]],
        gen_offset: int,
    ) -> dict[str, Any]:
        """Completions logprobs over the echoed prompt, then the outputs (vLLM's echo with
        logprobs): the first prompt token has no logprob (None, as its top_logprobs); every
        other prompt token its logprob and, as alternatives, the prompt token and the top-n
        the engine computed; prompt text offsets count from 0, the outputs' from
        ``gen_offset`` (the echoed text's length)."""
        tokens, values, tops, offsets, pos = [], [], [], [], 0
        for k, tid in enumerate(prompt_ids):
            tokens.append(self.token_str(tid))
            offsets.append(pos)
            pos += len(tokens[-1])
            d = plps[k - 1] if plps is not None and 0 < k <= len(plps) else None
            values.append(None if d is None else d.get(tid, -9999.0))
            tops.append(None if d is None else {self.token_str(t): v for t, v in d.items()})
        out = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}
        out["text_offset"] = offsets
        gen = self._logprobs(ids, lps, gen_offset)
        if gen is not None:
            for key in out:
                out[key] += gen[key]
        return out

    def _logprobs(self, ids: list[int], lps: list[dict[int, float]], text_offset: int) -> Any:
        if self.top_n is None or not lps:
            return None
        rows = list(zip(ids, lps, strict=False))
        if self.kind == "chat":
            content = []
            for tid, lp in rows:
                tok = self.token_str(tid)
                top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top_n]
                content.append(
                    {
                        "token": tok,
                        "logprob": lp.get(tid, -9999.0),
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {
                                "token": self.token_str(t),
                                "logprob": v,
                                "bytes": list(self.token_str(t).encode()),
                            }
                            for t, v in top
                        ],
                    }
                )
            return {"content": content}
        tokens, offsets, pos = [], [], text_offset
        for tid, _ in rows:
            tokens.append(self.token_str(tid))
            offsets.append(pos)
            pos += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.get(t, -9999.0) for t, lp in rows],
            "top_logprobs": [
                {
                    self.token_str(t): v
                    for t, v in sorted(lp.items(), key=lambda kv: -kv[1])[: max(self.top_n, 1)]
                }
                for _, lp in rows
            ],
            "text_offset": offsets,
        }
