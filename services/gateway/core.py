"""Pure gateway core: request validation, sampling parameters, admission, block hashes.

No NATS, no HTTP: `build_spec` turns a decoded JSON body into a `GenerateSpec` or raises
`ApiError` (a `StrataError` that also names the offending parameter); `sampling_for` applies the
context length and degradation rules once the prompt length is known.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from services.gateway.config import GatewayConfig
from services.gateway.constraints import request_constraint
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    body_schema,
    bus_int,
)
from shared.protocol.errors import StrataError
from shared.protocol.hashing import hash_blocks, mm_extra_keys, model_salt, request_salt, to_hex
from shared.protocol.sampling import SamplingParams, StructuredSpec
from shared.protocol.sched import DegradeRules


class ApiError(StrataError):
    """A client-facing error: code (-> HTTP status), message and the parameter at fault."""

    def __init__(self, code: str, message: str, param: str | None = None, **kw: Any):
        super().__init__(code, message, **kw)
        self.param = param


@dataclass(frozen=True)
class GenerateSpec:
    """One validated request, before tokenization."""

    kind: str  # "chat" | "completion"
    request: ChatCompletionRequest | CompletionRequest
    prompts: list[Any]  # chat: [messages]; completion: one str or token-id list per prompt
    image_urls: list[str] = field(default_factory=list)
    priority: int = 0
    slo_class: str = "interactive"
    ttft_slo_ms: float = 0.0  # 0 = the scheduler's default for slo_class
    constraint: StructuredSpec | None = None  # structured output / forced tool call
    constraint_param: str = ""  # the request field the constraint came from
    tool_format: str = "hermes"  # call syntax parsed from the output (services/gateway/tools.py)
    tenant: str = "default"  # fair queuing: the caller's tenant and weight (tenants.py)
    tenant_weight: float = 1.0
    # the root of the prompt's block-hash chain beside the model's (`request_salt`): the
    # request's vLLM cache_salt, prefixed with its tenant under STRATA_CACHE_ISOLATION=tenant
    cache_salt: str = ""

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def echo_only(self) -> bool:
        """Completions with echo and ``max_tokens: 0`` (OpenAI's legacy API, vLLM): the
        prompt comes back (with its logprobs when asked), nothing is generated; the engine
        computes one token, which the gateway drops."""
        r = self.request
        return isinstance(r, CompletionRequest) and r.echo and r.max_tokens == 0

    @property
    def include_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and opts.include_usage)

    @property
    def logprobs(self) -> int | None:
        """None (off) or the number of alternatives per token."""
        r = self.request
        if isinstance(r, ChatCompletionRequest):
            return (r.top_logprobs or 0) if r.logprobs else None
        return r.logprobs


# A ``\uD800``-``\uDFFF`` escape: the only way a lone surrogate gets into a decoded body
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class _IntOutOfRange(ValueError):
    pass


def _json_int(text: str) -> int:
    """`bus_int`, its refusal as `_IntOutOfRange` (told apart from malformed JSON)."""
    try:
        return bus_int(text)
    except ValueError:
        raise _IntOutOfRange(text if len(text) <= 40 else text[:20] + "...") from None


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body; malformed JSON, nesting too deep for the parser, an integer
    beyond 64 bits or a lone UTF-16 surrogate (neither can be encoded for the bus) or a
    non-object names the problem."""
    try:
        body = json.loads(raw, parse_int=_json_int)
    except _IntOutOfRange as exc:
        raise ApiError(
            "bad_request",
            f"request body has an integer out of range ({exc}): integers must fit in 64 bits",
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError("bad_request", f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError("bad_request", "request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError("bad_request", "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        check_text(body)
    return body


def check_text(obj: Any, where: str = "body") -> None:
    """Raise a 400 naming the field when a string in ``obj`` (keys too) holds a lone UTF-16
    surrogate such as ``"\\ud800"``: valid JSON, but not text UTF-8 (and msgpack) can carry."""
    stack: list[tuple[Any, str]] = [(obj, where)]
    while stack:
        o, path = stack.pop()
        if isinstance(o, str):
            if not o.isascii():
                try:
                    o.encode("utf-8")
                except UnicodeEncodeError:
                    raise ApiError(
                        "bad_request",
                        f"invalid text in '{path}': a lone UTF-16 "
                        "surrogate (\\ud800-\\udfff) is not a character",
                        param=path,
                    ) from None
        elif isinstance(o, dict):
            for k, v in o.items():
                stack.append((k, path))
                stack.append((v, f"{path}.{k}" if path != "body" else str(k)))
        elif isinstance(o, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(o))


def validation_error(exc: ValidationError) -> ApiError:
    errors = exc.errors()
    unknown = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return ApiError(
            "bad_request",
            f"unknown field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(u) for u in unknown)}: not supported by this server "
            "(docs/api.md lists the accepted fields)",
            param=unknown[0],
        )
    e = errors[0]
    loc = ".".join(str(p) for p in e["loc"]) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return ApiError("bad_request", f"invalid field '{loc}': {e['msg']}{more}", param=loc)


def build_spec(
    kind: str,
    body: dict[str, Any],
    cfg: GatewayConfig,
    served_model: str,
    headers: dict[str, str] | None = None,
    tool_format: str = "hermes",
) -> GenerateSpec:
    """Validate an OpenAI body (``kind`` "chat" or "completion") against the gateway limits;
    ``tool_format`` is the model family's tool-call syntax (`services.gateway.tools`)."""
    try:
        req = body_schema(kind).model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.model != served_model:
        raise ApiError(
            "not_found",
            f"model '{req.model}' does not exist; this gateway serves '{served_model}'",
            param="model",
        )
    if req.n > cfg.max_n:
        raise ApiError("bad_request", f"n must be <= {cfg.max_n}", param="n")
    if req.best_of is not None and req.best_of > 1:
        raise ApiError(
            "bad_request",
            "best_of > 1 is not supported (use n for several choices)",
            param="best_of",
        )
    _check_logit_bias(req.logit_bias)
    _check_vllm_extras(req)
    try:
        found = request_constraint(req, tool_format)
    except StrataError as exc:
        raise ApiError("bad_request", exc.message, param=getattr(exc, "param", None)) from None
    mt = _max_tokens(req)
    if mt == 0 and not (isinstance(req, CompletionRequest) and req.echo):
        raise ApiError(
            "bad_request",
            "max_tokens must be >= 1 (0 only on completions with echo: the prompt is scored, "
            "nothing generated)",
            param="max_tokens",
        )
    if mt is not None and mt > cfg.max_tokens_limit:
        raise ApiError(
            "bad_request", f"max_tokens must be <= {cfg.max_tokens_limit}", param="max_tokens"
        )
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(s == "" for s in stops) or len(stops) > 16:
        raise ApiError("bad_request", "stop must be 1..16 non-empty strings", param="stop")
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    priority, slo, ttft_slo_ms = _scheduling(req, headers)
    if isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise ApiError("bad_request", "messages must not be empty", param="messages")
        urls = [
            _url(p.image_url)
            for m in req.messages
            if isinstance(m.content, list)
            for p in m.content
            if p.type == "image_url"
        ]
        if urls and cfg.max_images == 0:  # a text-only model (see app.build_service)
            raise ApiError(
                "bad_request", f"model '{served_model}' does not accept images", param="messages"
            )
        if len(urls) > cfg.max_images:
            raise ApiError(
                "bad_request", f"at most {cfg.max_images} images per request", param="messages"
            )
        prompts: list[Any] = [req.messages]
    else:
        urls = []
        p = req.prompt
        one = isinstance(p, str) or (bool(p) and all(isinstance(t, int) for t in p))
        prompts = [p] if one else list(p)
        if not prompts:
            raise ApiError("bad_request", "prompt must not be empty", param="prompt")
        if len(prompts) * req.n > cfg.max_n:
            raise ApiError("bad_request", f"len(prompt) * n must be <= {cfg.max_n}", param="n")
    param, constraint = found if found else ("", None)
    return GenerateSpec(
        kind,
        req,
        prompts,
        urls,
        priority,
        slo,
        ttft_slo_ms,
        constraint,
        param,
        tool_format,
        cache_salt=req.cache_salt or "",
    )


def echo_scores_prompt(spec: GenerateSpec) -> bool:
    """Completions with ``echo`` and ``logprobs``: as vLLM (and OpenAI's legacy API) do, the
    choice's logprobs cover the echoed prompt's tokens too (what lm-evaluation-harness reads
    to score a context), computed as prompt logprobs with the same number of alternatives."""
    return spec.kind == "completion" and bool(spec.request.echo) and spec.logprobs is not None


def prompt_logprobs_of(spec: GenerateSpec) -> int | None:
    """The prompt logprobs the engine computes: the request's ``prompt_logprobs``, else the
    ``logprobs`` count when `echo_scores_prompt` (as vLLM sets them)."""
    n = spec.request.prompt_logprobs
    return spec.logprobs if n is None and echo_scores_prompt(spec) else n


def _check_vllm_extras(req: ChatCompletionRequest | CompletionRequest) -> None:
    """vLLM's extra fields that the schema alone cannot check (each 400 names its field)."""
    if req.truncate_prompt_tokens == 0:
        raise ApiError(
            "bad_request",
            "truncate_prompt_tokens must be -1 (the context length) or >= 1",
            param="truncate_prompt_tokens",
        )
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise ApiError(
            "bad_request", "allowed_token_ids must not be empty", param="allowed_token_ids"
        )
    if isinstance(req, ChatCompletionRequest):
        if req.reasoning_effort is not None:
            req.chat_template_kwargs = {
                "reasoning_effort": req.reasoning_effort,
                **(req.chat_template_kwargs or {}),
            }
        if req.continue_final_message and req.add_generation_prompt:
            raise ApiError(
                "bad_request",
                "cannot set both continue_final_message and add_generation_prompt to true "
                "(send add_generation_prompt: false to continue the last message)",
                param="continue_final_message",
            )
        if req.chat_template_kwargs:
            reserved = sorted(
                {"messages", "add_generation_prompt", "tools"} & set(req.chat_template_kwargs)
            )
            if reserved:
                raise ApiError(
                    "bad_request",
                    f"chat_template_kwargs may not set {reserved} (they have their own fields)",
                    param="chat_template_kwargs",
                )
    elif isinstance(req.prompt, list) and any(isinstance(p, list) and not p for p in req.prompt):
        raise ApiError("bad_request", "a token-id prompt must not be empty", param="prompt")


def _check_logit_bias(bias: dict[str, float] | None) -> None:
    for k, v in (bias or {}).items():
        if not (k.isdigit() and int(k) <= 2**31 - 1):
            raise ApiError(
                "bad_request", f"logit_bias key {k!r} is not a token id", param="logit_bias"
            )
        if not -100.0 <= v <= 100.0:
            raise ApiError(
                "bad_request", f"logit_bias[{k}] = {v} is outside [-100, 100]", param="logit_bias"
            )


def _url(image_url: Any) -> str:
    if image_url is None:
        raise ApiError("bad_request", "image_url part without a url", param="messages")
    return image_url if isinstance(image_url, str) else image_url.url


def _max_tokens(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def _scheduling(req: Any, headers: dict[str, str]) -> tuple[int, str, float]:
    """(priority, SLO class, TTFT SLO ms) from body fields, overridden by X-Strata-* headers."""
    priority = req.priority if req.priority is not None else 0
    if "x-strata-priority" in headers:
        try:
            priority = int(headers["x-strata-priority"])
        except ValueError:
            raise ApiError(
                "bad_request", "X-Strata-Priority must be an integer", param="priority"
            ) from None
    slo = req.slo_class or headers.get("x-strata-slo-class", "interactive")
    if slo not in ("interactive", "batch"):
        raise ApiError(
            "bad_request", "SLO class must be 'interactive' or 'batch'", param="slo_class"
        )
    ttft = req.ttft_slo_ms or 0.0
    if "x-strata-ttft-slo-ms" in headers:
        try:
            ttft = float(headers["x-strata-ttft-slo-ms"])
        except ValueError:
            ttft = math.nan
        if not 0.0 < ttft <= 3_600_000:  # also rejects nan and inf
            raise ApiError(
                "bad_request",
                "X-Strata-TTFT-SLO-Ms must be a number of ms in (0, 3600000]",
                param="ttft_slo_ms",
            )
    return priority, slo, ttft


def admit(spec: GenerateSpec, degrade_level: int, rules: DegradeRules) -> None:
    """Apply the scheduler's degradation level and rules before routing: 2 refuses batch, 3
    keeps top priority only (the scheduler enforces the same rules on route)."""
    if degrade_level >= 3 and spec.priority > rules.top_priority:
        raise ApiError(
            "overloaded",
            "server overloaded: only top-priority requests are admitted",
            retry_after=rules.retry_after_s,
        )
    if degrade_level >= 2 and spec.slo_class == "batch":
        raise ApiError(
            "overloaded",
            "server overloaded: batch requests are refused for now",
            retry_after=rules.retry_after_s,
        )


def sampling_for(
    spec: GenerateSpec,
    prompt_len: int,
    max_model_len: int,
    cfg: GatewayConfig,
    degrade_level: int = 0,
    rules: DegradeRules | None = None,
    bad_words_ids: list[list[int]] | None = None,
    vocab_size: int = 0,
) -> SamplingParams:
    """SamplingParams for one prompt of ``prompt_len`` tokens (context length checked here)."""
    r = spec.request
    if max_model_len and prompt_len >= max_model_len:
        raise ApiError(
            "context_length_exceeded",
            f"prompt has {prompt_len} tokens; this model's context length is {max_model_len}",
            param="messages" if spec.kind == "chat" else "prompt",
        )
    n_plp = prompt_logprobs_of(spec)
    if n_plp is not None and prompt_len * _prompt_logprob_bytes(n_plp) > _PROMPT_LOGPROBS_BYTES:
        most = _PROMPT_LOGPROBS_BYTES // _prompt_logprob_bytes(n_plp)
        raise ApiError(
            "bad_request",
            f"prompt_logprobs={n_plp} on a {prompt_len}-token prompt is more than one bus "
            f"message carries: at most {most} prompt tokens with this many alternatives",
            param="prompt_logprobs",
        )
    room = (max_model_len - prompt_len) if max_model_len else cfg.max_tokens_limit
    asked = 1 if spec.echo_only else _max_tokens(r)  # echo_only: the one token is dropped
    if degrade_level >= 1 and spec.slo_class == "batch":  # level 1 trims batch work first
        cap = (rules or DegradeRules()).batch_max_tokens_cap
        asked = min(asked or cfg.default_max_tokens, cap)
    if asked is not None and asked > room:
        raise ApiError(
            "context_length_exceeded",
            f"prompt ({prompt_len} tokens) + max_tokens "
            f"({asked}) exceeds the context length {max_model_len}",
            param="max_tokens",
        )
    max_tokens = asked if asked is not None else min(cfg.default_max_tokens, room)
    stops = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if vocab_size and r.allowed_token_ids:
        bad = next((t for t in r.allowed_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise ApiError(
                "bad_request",
                f"allowed_token_ids: {bad} is not in the vocabulary (size {vocab_size})",
                param="allowed_token_ids",
            )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(r.min_tokens, max_tokens),
            temperature=1.0 if r.temperature is None else r.temperature,
            top_p=1.0 if r.top_p is None else r.top_p,
            top_k=max(0, r.top_k or 0),
            min_p=r.min_p or 0.0,
            presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            repetition_penalty=r.repetition_penalty or 1.0,
            seed=None if r.seed is None else r.seed % (2**63),
            stop=stops,
            stop_token_ids=list(r.stop_token_ids or []),
            ignore_eos=r.ignore_eos,
            logprobs=spec.logprobs,
            prompt_logprobs=n_plp,
            skip_special_tokens=r.skip_special_tokens,
            spaces_between_special_tokens=r.spaces_between_special_tokens,
            structured=spec.constraint,
            logit_bias={int(k): v for k, v in r.logit_bias.items()} if r.logit_bias else None,
            allowed_token_ids=list(r.allowed_token_ids) if r.allowed_token_ids else None,
            bad_words_ids=bad_words_ids or [],
            include_stop_str_in_output=r.include_stop_str_in_output,
            cache_salt=spec.cache_salt,
        )
    except ValidationError as exc:
        raise validation_error(exc) from None


# prompt_logprobs ride the first token's bus message (8 MiB at most, services/infra): a token
# costs about 14 msgpack bytes per {id: logprob} pair plus its rank
_PROMPT_LOGPROBS_BYTES = 6 << 20


def _prompt_logprob_bytes(n: int) -> int:
    return (n + 1) * 14 + 4


def block_hashes(
    token_ids: list[int],
    image_spans: list[tuple[int, int, str]],
    fingerprint: str,
    kv_dtype: str,
    block_size: int,
    cache_salt: str = "",
) -> list[str]:
    """Chained hashes of the prompt's full blocks, rooted at the model and ``cache_salt``;
    image hashes are extra keys of the blocks their spans overlap (same function the engine
    and kvstore use)."""
    salt = request_salt(model_salt(fingerprint, kv_dtype, block_size), cache_salt)
    return to_hex(hash_blocks(token_ids, block_size, salt, mm_extra_keys(image_spans, block_size)))


def error_body(err: StrataError) -> dict[str, Any]:
    """OpenAI-style error object."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(err.http_status, "server_error")
    return {
        "error": {
            "message": err.message,
            "type": kind,
            "param": getattr(err, "param", None),
            "code": err.code,
        }
    }
