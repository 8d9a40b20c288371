"""The CPU pre-filter: word / phrase lists checked on the gateway before tokenization (no GPU
work for a refused request), and on the output text as it streams.

Each list is a UTF-8 file, one pattern a line (``#`` starts a comment line), with an action:
``refuse`` (the request is a 400 naming the list's policy code) or ``mask`` (each match becomes
``*`` of the same length). Matching is case-insensitive substring search with one Aho-Corasick
automaton per list (``pyahocorasick``: linear in the text whatever the number of patterns). A list
is reloaded when its file changes (checked at most every ``reload_s``); a reload that fails
(unreadable, invalid UTF-8) keeps the previous patterns and is counted and logged.

Output: `OutputMask` masks every list's matches in a choice's text, holding back the last
``longest - 1`` characters so a match split across chunks is still found.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ahocorasick

from services.gateway.core import ApiError
from shared.metrics import Counter

log = logging.getLogger(__name__)

HITS = Counter("strata_gateway_prefilter_hits_total", "Pre-filter matches", ["code", "action"])
RELOADS = Counter(
    "strata_gateway_prefilter_reloads_total", "Pattern list (re)loads", ["code", "result"]
)


class PatternFileError(ValueError):
    """A pattern file that cannot be used: the message names the file and the problem."""


def _read(path: str) -> list[str]:
    try:
        raw = open(path, "rb").read()  # noqa: SIM115 - read at once
    except OSError as exc:
        raise PatternFileError(f"{path}: cannot be read ({exc.strerror})") from None
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise PatternFileError(f"{path}: line {n} is not valid UTF-8") from None
        if text and not text.startswith("#"):
            out.append(text)
    return out


@dataclass
class PatternList:
    """One file of patterns with its action and policy code."""

    action: str  # "refuse" | "mask"
    code: str
    path: str
    stamp: tuple[float, int] = (0.0, -1)
    automaton: Any = None
    longest: int = 0
    size: int = 0

    @classmethod
    def parse(cls, spec: str) -> PatternList:
        """``ACTION:CODE:PATH`` (the path last, so it may hold colons)."""
        parts = spec.split(":", 2)
        if len(parts) != 3 or parts[0] not in ("refuse", "mask") or not parts[1] or not parts[2]:
            raise PatternFileError(
                f"prefilter list {spec!r}: expected 'refuse:CODE:PATH' or 'mask:CODE:PATH'"
            )
        pl = cls(parts[0], parts[1], parts[2])
        pl.load()
        return pl

    def load(self) -> None:
        st = os.stat(self.path) if os.path.exists(self.path) else None
        patterns = _read(self.path)
        auto = ahocorasick.Automaton()
        for p in patterns:
            auto.add_word(p.lower(), len(p))
        if patterns:
            auto.make_automaton()
        self.automaton = auto if patterns else None
        self.longest = max((len(p) for p in patterns), default=0)
        self.size = len(patterns)
        self.stamp = (st.st_mtime, st.st_size) if st else (0.0, -1)
        RELOADS.labels(self.code, "ok").inc()

    def spans(self, text: str) -> list[tuple[int, int]]:
        """``[start, end)`` of every match (case-insensitive when lowering keeps the length)."""
        if self.automaton is None:
            return []
        low = text.lower()
        hay = low if len(low) == len(text) else text
        return [(end - n + 1, end + 1) for end, n in self.automaton.iter(hay)]


def _mask(text: str, spans: list[tuple[int, int]]) -> str:
    chars = list(text)
    for a, b in spans:
        chars[a:b] = "*" * (b - a)
    return "".join(chars)


@dataclass
class Prefilter:
    lists: list[PatternList]
    reload_s: float = 1.0
    _checked: float = field(default=0.0, repr=False)

    @classmethod
    def from_specs(cls, specs: list[str], reload_s: float = 1.0) -> Prefilter | None:
        return cls([PatternList.parse(s) for s in specs], reload_s) if specs else None

    def maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_s:
            return
        self._checked = now
        for pl in self.lists:
            try:
                st = os.stat(pl.path)
                if (st.st_mtime, st.st_size) != pl.stamp:
                    pl.load()
                    log.info("prefilter %s: reloaded %d patterns", pl.code, pl.size)
            except (OSError, PatternFileError) as exc:
                RELOADS.labels(pl.code, "failed").inc()
                log.warning("prefilter %s: reload failed, keeping the old list: %s", pl.code, exc)

    def text(self, text: str, where: str) -> str:
        """``text`` with mask lists applied; a refuse list's match is a 400 naming its code."""
        for pl in self.lists:
            spans = pl.spans(text)
            if not spans:
                continue
            HITS.labels(pl.code, pl.action).inc(len(spans))
            if pl.action == "refuse":
                raise ApiError(
                    "bad_request",
                    f"request refused by content policy '{pl.code}' (in '{where}')",
                    param=where,
                )
            text = _mask(text, spans)
        return text

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat or completions body with every prompt text checked (a copy when masked)."""
        self.maybe_reload()
        out = dict(body)
        if isinstance(body.get("prompt"), str):
            out["prompt"] = self.text(body["prompt"], "prompt")
        elif isinstance(body.get("prompt"), list):
            out["prompt"] = [
                self.text(p, f"prompt.{k}") if isinstance(p, str) else p
                for k, p in enumerate(body["prompt"])
            ]
        if isinstance(body.get("messages"), list):
            out["messages"] = [self._message(m, k) for k, m in enumerate(body["messages"])]
        return out

    def _message(self, m: Any, k: int) -> Any:
        if not isinstance(m, dict):
            return m
        c = m.get("content")
        where = f"messages.{k}.content"
        if isinstance(c, str):
            return {**m, "content": self.text(c, where)}
        if isinstance(c, list):
            parts = [
                {**p, "text": self.text(p["text"], where)}
                if isinstance(p, dict) and isinstance(p.get("text"), str)
                else p
                for p in c
            ]
            return {**m, "content": parts}
        return m

    def output(self) -> OutputMask:
        return OutputMask(self)


class OutputMask:
    """One choice's output text, masked by every list as it streams (sliding window)."""

    def __init__(self, pf: Prefilter):
        self.pf = pf
        self.held = ""

    def feed(self, text: str, final: bool) -> str:
        buf = self.held + text
        for pl in self.pf.lists:
            spans = pl.spans(buf)
            if spans:
                HITS.labels(pl.code, "output").inc(len(spans))
                buf = _mask(buf, spans)
        hold = 0 if final else max((pl.longest for pl in self.pf.lists), default=1) - 1
        cut = max(0, len(buf) - hold)
        self.held = buf[cut:]
        return buf[:cut]
