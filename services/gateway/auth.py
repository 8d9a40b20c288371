"""API keys, model permissions and per-key rate limits (pure; the clock is injectable).

Keys come from ``STRATA_API_KEYS`` (comma-separated; every model, no limits) and/or a key file
(JSON or YAML)::

    {"keys": {"sk-abc": {"models": ["tiny"], "rpm": 60, "tpm": 100000}}}

A top-level mapping without ``"keys"`` is read the same way. Auth is off when neither is given
(local use). With a key file, secure defaults apply: a key without ``models`` may use no model
until one is listed (``["*"]`` allows all). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.core import ApiError


@dataclass(frozen=True)
class KeyPolicy:
    """What one API key may do."""

    name: str  # a short label for logs/metrics (never the key itself)
    models: tuple[str, ...] = ("*",)
    rpm: int = 0  # requests per minute; 0 = unlimited
    tpm: int = 0  # tokens (prompt + max_tokens) per minute; 0 = unlimited


@dataclass
class _Bucket:
    """Token bucket refilled at ``rate`` per second up to ``cap``."""

    cap: float
    level: float
    stamp: float
    rate: float = field(init=False)

    def __post_init__(self) -> None:
        self.rate = self.cap / 60.0

    def take(self, amount: float, now: float) -> float:
        """Take ``amount``; returns 0 on success, else seconds until it would fit."""
        self.level = min(self.cap, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount > self.cap:
            return float("inf")
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate


class Auth:
    """Authenticates requests and enforces per-key limits."""

    def __init__(self, keys: dict[str, KeyPolicy], clock: Callable[[], float] = time.monotonic):
        self.keys = keys
        self.clock = clock
        self._req: dict[str, _Bucket] = {}
        self._tok: dict[str, _Bucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @classmethod
    def from_config(cls, api_keys: list[str], key_file: str) -> Auth:
        keys = {k: KeyPolicy(name=f"env-{i}") for i, k in enumerate(api_keys)}
        if key_file:
            keys.update(load_key_file(key_file))
        return cls(keys)

    def authenticate(self, header: str | None, model: str) -> KeyPolicy | None:
        """The caller's policy (None when auth is off); 401 / 403 otherwise."""
        policy = self.check_key(header)
        if policy is not None and "*" not in policy.models and model not in policy.models:
            raise ApiError("forbidden", f"this API key may not use model '{model}'", param="model")
        return policy

    def check_key(self, header: str | None) -> KeyPolicy | None:
        """The policy of the key in an ``Authorization`` header (None when auth is off); 401
        when it is missing or unknown. Model permissions are `authenticate`'s."""
        if not self.enabled:
            return None
        token = (header or "").strip()
        if token.lower().startswith("bearer "):
            token = token[7:].strip()
        if not token:
            raise ApiError("unauthorized", "missing API key (Authorization: Bearer <key>)")
        policy = None
        for key, pol in self.keys.items():  # compare with every key: constant time per key
            if hmac.compare_digest(key.encode(), token.encode()):
                policy = pol
        if policy is None:
            raise ApiError("unauthorized", "invalid API key")
        return policy

    def charge(self, policy: KeyPolicy | None, tokens: int) -> None:
        """Count one request of ``tokens`` tokens; 429 with Retry-After when over a limit."""
        if policy is None:
            return
        now = self.clock()
        for limit, buckets, amount, what in (
            (policy.rpm, self._req, 1, "requests"),
            (policy.tpm, self._tok, tokens, "tokens"),
        ):
            if not limit:
                continue
            b = buckets.setdefault(policy.name, _Bucket(cap=limit, level=limit, stamp=now))
            wait = b.take(amount, now)
            if wait == float("inf"):
                raise ApiError(
                    "rate_limited",
                    f"request needs {amount} {what}, over this key's limit of {limit} per minute",
                )
            if wait > 0:
                raise ApiError(
                    "rate_limited",
                    f"rate limit of {limit} {what} per minute exceeded",
                    retry_after=round(wait, 3),
                )


def load_key_file(path: str) -> dict[str, KeyPolicy]:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    data = data.get("keys", data) if isinstance(data, dict) else None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of API key -> settings")
    out = {}
    for i, (key, spec) in enumerate(data.items()):
        spec = spec or {}
        out[str(key)] = KeyPolicy(
            name=str(spec.get("name", f"key-{i}")),
            models=tuple(spec.get("models", ())),  # secure default: nothing until listed
            rpm=int(spec.get("rpm", 0)),
            tpm=int(spec.get("tpm", 0)),
        )
    return out
