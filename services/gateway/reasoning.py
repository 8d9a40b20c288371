"""Reasoning split out of a chat answer at ``<think>`` tags (pure; no I/O).

Models that think before answering (Qwen3, QwQ, DeepSeek-R1 and their distillations) write
``<think>reasoning</think>answer``. With the gateway's ``reasoning_parser`` on (vLLM's
``--reasoning-parser qwen3`` / ``deepseek_r1``), a chat choice's reasoning goes to
``reasoning_content`` (the message's, or each delta's when streamed) and only the answer to
``content``, where the tool-call parser then looks for calls. Where the chat template itself
opened the block (the rendered prompt ends in ``<think>``, as DeepSeek-R1's does), the output
starts inside it. An output that never closes the block (cut by ``max_tokens``) is all
reasoning; one that does not open it is all content.

`ThinkSplitter` works on streamed text: a tag split over two chunks is held back until it is
complete, so no delta shows a piece of a tag.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = {"": None, "none": None, "think": "think", "qwen3": "think", "deepseek_r1": "think"}
"""``reasoning_parser`` values -> the parser (vLLM's names are aliases of the one tag rule)."""


def opens_in_reasoning(prompt_text: str) -> bool:
    """The rendered prompt ends inside a thinking block the template opened."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def _held(buf: str, tag: str) -> int:
    """Length of the longest end of ``buf`` that begins ``tag`` (a tag maybe split there)."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class ThinkSplitter:
    """One choice's output text, fed as it streams -> (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":  # before anything but whitespace: is it a thinking block?
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN) :], "reasoning"
                    continue
                if not head or OPEN.startswith(head):
                    return reasoning, content  # whitespace or part of the tag so far: wait
                self.state = "content"
                continue
            if self.state == "reasoning":
                k = self.buf.find(CLOSE)
                if k >= 0:
                    reasoning += self.buf[:k]
                    self.buf, self.state = self.buf[k + len(CLOSE) :], "content"
                    continue
                keep = _held(self.buf, CLOSE)
                cut = len(self.buf) - keep
                reasoning += self.buf[:cut]
                self.buf = self.buf[cut:]
                return reasoning, content
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end of the output (an unclosed block is reasoning)."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def split(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """A whole output -> (reasoning or None when there was no thinking block, content)."""
    s = ThinkSplitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    reasoning = r1 + r2
    started = in_reasoning or text.lstrip().startswith(OPEN)
    return (reasoning if started else None), c1 + c2
