"""One request's client-visible stream, assembled from bus chunks across failovers (pure).

`StreamAssembler` holds what `Pipeline.stream` needs to turn the `TokenChunk`s of one request
(possibly from several instances, one route after another) into one index-ordered stream: the
tokens already sent to the client, the instances failed away from, and the current route's
progress (acked, got a chunk, decode streamed). It imports no NATS and runs no asyncio: feed it
routes, acks, chunks, down notices and timeouts, and it answers with the chunk to send (or
None) or the `Failover` that ends the route.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol.errors import INSTANCE_ERRORS, StrataError
from shared.protocol.sched import RouteReply
from shared.protocol.stream import TokenChunk


@dataclass(frozen=True)
class Failover:
    """A route given up: ``instance`` (the one that failed) is excluded from the next route."""

    instance: str
    why: str


def owing_instance(route: RouteReply, got_chunk: bool) -> str:
    """The instance that owes the request's next chunk: a disaggregated route's prefill instance
    until any chunk of this route arrived (it publishes the first token), then decode."""
    if route.prefill_instance and not got_chunk:
        return route.prefill_instance
    return route.decode_instance


def down_failover(route: RouteReply, down: str, decode_streamed: bool) -> Failover | None:
    """What an instance declared down means for a request on ``route``: None when it does not
    matter (not one of this route's instances, e.g. a late notice about an earlier route's, or
    the prefill instance once decode streamed: the request lives on decode then)."""
    if not down or down not in (route.prefill_instance, route.decode_instance):
        return None
    if down == route.prefill_instance and decode_streamed:
        return None
    return Failover(down, "down: declared down by the scheduler")


class StreamAssembler:
    """Ordering, dedup and failover splice of one request's stream.

    Per route: `begin(route)`, then `ack` / `chunk` / `down` / `timed_out` as things arrive;
    `chunk` returns the client-visible chunk (duplicates dropped, partial overlaps trimmed to
    the new tokens, a chunk that arrived before an earlier one held until the gap is filled,
    stragglers of earlier routes ignored) and `down` / `timed_out` the
    `Failover` that ends the route, which `fail` records (the next route excludes it and
    resumes after ``sent``).
    """

    def __init__(self, max_failovers: int) -> None:
        self.max_failovers = max_failovers
        self.sent: list[int] = []  # token ids the client has seen, in order
        self.exclude: list[str] = []  # instances failed away from, oldest first
        self.route = RouteReply(decode_instance="", decode_addr="")
        self.attempt = -1  # the current route's `WorkItem.attempt` (0 for the first)
        self.steps: dict[str, int] = {}  # engine step counts this route's probes saw
        self.acked = False  # this route's submit was taken (ack or any chunk)
        self.got_chunk = False  # a chunk of this route arrived
        self.decode_streamed = False  # the route's decode instance sent a chunk
        self.finished = False  # the last chunk (with a finish reason) went out
        # This route's chunks that came before an earlier one (index -> chunk). One request's
        # chunks have several publishers (prefill's first token on the request's subject,
        # decode's on the gateway's) and NATS orders only each publisher's own messages: in a
        # NATS cluster decode's first chunk can arrive before prefill's, over another route.
        self.ahead: dict[int, TokenChunk] = {}

    @property
    def target(self) -> str:
        """The instance this route's submit went to (prefill when disaggregated)."""
        return self.route.prefill_instance or self.route.decode_instance

    @property
    def awaiting_ack(self) -> bool:
        """Nothing of this request reached the client and the submit is not acked yet."""
        return not self.acked and not self.sent

    def begin(self, route: RouteReply) -> None:
        """A new route (the first, or one after a failover) starts."""
        self.route = route
        self.attempt += 1
        self.steps = {}
        self.acked = self.got_chunk = self.decode_streamed = False
        self.ahead = {}

    def wait_limit(self, ack: float, first_token: float, stall: float) -> float:
        """Seconds to wait for the next message: the ack, the first token, or the next token."""
        if self.awaiting_ack:
            return ack
        return first_token if not (self.sent or self.ahead) else stall

    def engine_progressed(self, instance_id: str, steps: int) -> bool:
        """A probe of a silent route saw ``instance_id``'s engine at ``steps``: True the first
        time, then only when it stepped since the last probe (a stuck engine is a stall)."""
        last = self.steps.get(instance_id)
        self.steps[instance_id] = steps
        return last is None or steps > last

    def ack(self, instance_id: str) -> None:
        """The submit was taken by ``instance_id`` (a late ack from another one is ignored)."""
        if instance_id in ("", self.target):
            self.acked = True

    def chunk(self, c: TokenChunk) -> TokenChunk | Failover | None:
        """The client-visible part of ``c``, or None when nothing of it is new. A chunk that
        carries an error naming an instance that could not serve (`INSTANCE_ERRORS`: e.g.
        prefill's hand-off to a decode instance that died after routing) is a `Failover` with
        that instance excluded; any other error is raised."""
        if c.attempt != self.attempt or (c.instance_id and c.instance_id in self.exclude):
            # A straggler of a route given up: an instance failed away from, or the abort of
            # an earlier route's work on an instance this route uses again.
            return None
        self.acked = True  # a chunk implies the submit was taken
        if c.error is not None:
            if c.error.code in INSTANCE_ERRORS and c.instance_id:
                return Failover(c.instance_id, f"{c.error.code}: {c.error.message}")
            raise c.error.to_exception()
        self.got_chunk = True
        self.decode_streamed = self.decode_streamed or c.instance_id == self.route.decode_instance
        start = len(self.sent)
        if c.index > start:  # an earlier chunk is still on its way: never send across a gap
            self.ahead[c.index] = c
            return None
        if c.index + len(c.token_ids) <= start and c.finish_reason is None:
            return None  # duplicate
        c = self._with_ahead(_from(c, start))
        self.sent.extend(c.token_ids)
        if c.finish_reason is not None:
            self.finished = True
        return c

    def _with_ahead(self, c: TokenChunk) -> TokenChunk:
        """``c`` joined with the held chunks that now follow it without a gap (one chunk)."""
        parts, end = [c], c.index + len(c.token_ids)
        while parts[-1].finish_reason is None and self.ahead:
            i = min(self.ahead)
            if i > end:
                break
            nxt = self.ahead.pop(i)
            if nxt.index + len(nxt.token_ids) > end or nxt.finish_reason is not None:
                parts.append(_from(nxt, end))
                end += len(parts[-1].token_ids)
        if len(parts) == 1:
            return c
        lps = [lp for p in parts for lp in p.logprobs or ()]
        return c.model_copy(
            update={
                "token_ids": [t for p in parts for t in p.token_ids],
                "text": "".join(p.text for p in parts),
                "logprobs": lps if any(p.logprobs is not None for p in parts) else None,
                "finish_reason": parts[-1].finish_reason,
                "usage": parts[-1].usage,
            }
        )

    def down(self, instance_id: str) -> Failover | None:
        """The scheduler declared ``instance_id`` down: the failover, if it concerns this route."""
        return down_failover(self.route, instance_id, self.decode_streamed)

    def timed_out(self, waited: float) -> Failover:
        """Nothing arrived for ``waited`` s: blame the instance that owed the next message."""
        if self.awaiting_ack:
            return Failover(self.target, f"submit: no ack for {waited:.1f}s")
        return Failover(
            owing_instance(self.route, self.got_chunk), f"stall: no tokens for {waited:.1f}s"
        )

    def fail(self, fo: Failover, rid: str) -> None:
        """Give up the route: exclude ``fo.instance`` next time, or raise ``unavailable`` once
        ``max_failovers`` instances failed."""
        if len(self.exclude) >= self.max_failovers:
            raise StrataError(
                "unavailable",
                f"request {rid} failed on {len(self.exclude) + 1} "
                f"instances (last: {fo.instance}: {fo.why})",
            )
        self.exclude.append(fo.instance)


def _from(c: TokenChunk, start: int) -> TokenChunk:
    """``c`` without its tokens before index ``start`` (a partial overlap keeps the new ones)."""
    if c.index >= start:
        return c
    skip = start - c.index
    lps = c.logprobs[skip:] if c.logprobs else c.logprobs
    return c.model_copy(update={"index": start, "logprobs": lps, "token_ids": c.token_ids[skip:]})
