"""Incremental text with stop strings: emits text deltas, holding back a possible stop prefix."""

from __future__ import annotations

from collections.abc import Sequence


class TextTracker:
    """Feeds tokens to an ``IncrementalDetokenizer`` and finds stop strings in the text.

    Up to ``len(longest stop) - 1`` trailing characters are held back while they could still
    start a stop string; :meth:`flush` releases them when the request ends for another reason.
    """

    def __init__(self, detokenizer, stop: Sequence[str] = (), include_stop: bool = False):
        self.detok = detokenizer
        self.stop = list(stop)
        self.include_stop = include_stop  # vLLM include_stop_str_in_output: keep the stop text
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (text delta, hit a stop string)."""
        self.text += self.detok.add(token_id)
        if self.stop:
            lo = max(0, self.emitted - self.hold)
            hits = [(i, len(s)) for i, s in ((self.text.find(s, lo), s) for s in self.stop)]
            hits = [h for h in hits if h[0] >= 0]
            if hits:
                at, size = min(hits)  # the earliest stop string (at a tie the shorter, whole first)
                end = at + size if self.include_stop else at
                delta = self.text[self.emitted : end] if end > self.emitted else ""
                self.text = self.text[:end]
                self.emitted = len(self.text)
                return delta, True
        end = max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta, False

    def prime(self, token_ids: Sequence[int]) -> None:
        """Feed tokens that were already emitted elsewhere (a resumed request) without emitting
        their text, so the next delta continues exactly where the original stream stopped."""
        for t in token_ids:
            self.text += self.detok.add(t)
        self.emitted = len(self.text)

    def flush(self) -> str:
        flush = getattr(self.detok, "flush", None)
        if flush is not None:  # bytes the detokenizer held back (an incomplete character)
            self.text += flush()
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
