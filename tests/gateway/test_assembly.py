"""`StreamAssembler` at toy size: hand-made chunks in, exact client-visible chunks out."""

from __future__ import annotations

import pytest

from services.gateway.assembly import Failover, StreamAssembler
from shared.protocol.errors import ErrorInfo, StrataError
from shared.protocol.sched import RouteReply
from shared.protocol.stream import TokenChunk

DISAGG = RouteReply(decode_instance="dec-a", decode_addr="h:1", prefill_instance="pre-a")
DEC_B = RouteReply(decode_instance="dec-b", decode_addr="h:2")


def ch(
    index: int,
    toks: list[int],
    inst: str = "dec-a",
    finish: str | None = None,
    logprobs: list[dict[int, float]] | None = None,
    attempt: int = 0,
) -> TokenChunk:
    return TokenChunk(
        attempt=attempt,
        request_id="r",
        index=index,
        token_ids=toks,
        finish_reason=finish,
        instance_id=inst,
        logprobs=logprobs,
    )


def feed(asm: StreamAssembler, chunks: list[TokenChunk]) -> list[tuple[int, list[int], str | None]]:
    out = []
    for c in chunks:
        got = asm.chunk(c)
        if got is not None:
            out.append((got.index, got.token_ids, got.finish_reason))
    return out


def test_in_order_chunks_pass_through_and_finish():
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    out = feed(asm, [ch(0, [10], "pre-a"), ch(1, [11, 12]), ch(3, [13], finish="stop")])
    assert out == [(0, [10], None), (1, [11, 12], None), (3, [13], "stop")]
    assert asm.sent == [10, 11, 12, 13] and asm.finished


def test_duplicates_dropped_and_partial_overlap_trimmed():
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DEC_B)
    lps = [{11: -0.1}, {12: -0.2}, {13: -0.3}]
    out = feed(asm, [ch(0, [10, 11], "dec-b"), ch(0, [10], "dec-b"), ch(0, [10, 11], "dec-b")])
    assert out == [(0, [10, 11], None)]
    got = asm.chunk(ch(1, [11, 12, 13], "dec-b", logprobs=lps))
    assert (got.index, got.token_ids, got.logprobs) == (2, [12, 13], [{12: -0.2}, {13: -0.3}])
    # A duplicate that carries the finish reason still ends the stream, with no tokens.
    assert feed(asm, [ch(3, [13], "dec-b", finish="length")]) == [(4, [], "length")]
    assert asm.sent == [10, 11, 12, 13] and asm.finished


def test_a_chunk_ahead_of_an_earlier_one_waits_for_the_gap_to_fill():
    """Prefill's first token (on the request's subject) and decode's next ones (on the
    gateway's) have different publishers, and in a NATS cluster decode's can arrive first (seen
    in tests/multihost/test_cluster_under_faults.py). They are held, then sent joined and in
    order once the missing one arrives: none lost, none sent twice."""
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    held = [
        ch(2, [12, 13], logprobs=[{12: -0.2}, {13: -0.3}]),
        ch(1, [11], logprobs=[{11: -0.1}]),
        ch(1, [11], logprobs=[{11: -0.1}]),  # a duplicate of a held chunk
    ]
    assert feed(asm, held) == [] and asm.sent == []
    assert asm.wait_limit(1.0, 2.0, 3.0) == 3.0  # the route streams: a stall, not a first token
    got = asm.chunk(ch(0, [10], "pre-a", logprobs=[{10: -0.05}]).model_copy(update={"text": "a"}))
    assert (got.index, got.token_ids, got.finish_reason) == (0, [10, 11, 12, 13], None)
    assert got.logprobs == [{10: -0.05}, {11: -0.1}, {12: -0.2}, {13: -0.3}] and got.text == "a"
    assert feed(asm, [ch(4, [14], finish="length")]) == [(4, [14], "length")]
    assert asm.sent == [10, 11, 12, 13, 14] and asm.finished


def test_held_chunks_overlapping_and_finishing_are_joined_once():
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    assert feed(asm, [ch(3, [13], finish="stop"), ch(1, [11, 12]), ch(2, [12])]) == []
    assert feed(asm, [ch(0, [10], "pre-a")]) == [(0, [10, 11, 12, 13], "stop")]
    assert asm.sent == [10, 11, 12, 13] and asm.finished
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    assert feed(asm, [ch(2, [12])]) == []
    asm.begin(DEC_B)  # a new route: what the old one held is gone with it
    assert asm.ahead == {}


def test_failover_resume_splices_and_ignores_stragglers():
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    assert feed(asm, [ch(0, [10], "pre-a"), ch(1, [11]), ch(2, [12])]) == [
        (0, [10], None),
        (1, [11], None),
        (2, [12], None),
    ]
    fo = asm.down("dec-a")
    assert fo == Failover("dec-a", "down: declared down by the scheduler")
    asm.fail(fo, "r")
    assert asm.exclude == ["dec-a"]
    asm.begin(DEC_B)
    assert not asm.acked and not asm.got_chunk and not asm.awaiting_ack  # tokens already out
    # dec-b resumes after the sent tokens (it was told them); a late dec-a chunk is a straggler.
    out = feed(
        asm,
        [
            ch(3, [99], "dec-a", attempt=1),
            ch(2, [12, 13], "dec-b", attempt=1),
            ch(4, [14], "dec-b", "stop", attempt=1),
        ],
    )
    assert out == [(3, [13], None), (4, [14], "stop")]
    assert asm.sent == [10, 11, 12, 13, 14]


def test_an_earlier_routes_abort_on_a_reused_instance_does_not_end_the_new_route():
    """The prefill instance is declared down after its first token, before decode streamed.
    The next route uses the same decode instance (the only one). The failover's cancel stops
    the first route's decode work there, which publishes an abort: from an instance the new
    route uses, so only its attempt number tells it is a straggler."""
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    assert asm.attempt == 0
    assert feed(asm, [ch(0, [10], "pre-a")]) == [(0, [10], None)]
    fo = asm.down("pre-a")
    assert fo == Failover("pre-a", "down: declared down by the scheduler")
    asm.fail(fo, "r")
    asm.begin(RouteReply(decode_instance="dec-a", decode_addr="h:1"))
    assert asm.attempt == 1
    err = TokenChunk(
        request_id="r", index=1, instance_id="dec-a", error=ErrorInfo(code="internal", message="x")
    )
    out = feed(
        asm,
        [
            ch(1, [], "dec-a", "abort", attempt=0),  # the first route's work, cancelled
            err,  # an error of the first route (attempt 0) is a straggler too
            ch(1, [11], "dec-a", attempt=1),
            ch(2, [12], "dec-a", "length", attempt=1),
        ],
    )
    assert out == [(1, [11], None), (2, [12], "length")]
    assert asm.sent == [10, 11, 12] and asm.finished


def test_down_notices_that_do_not_concern_the_route():
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    assert asm.down("dec-z") is None  # not this route's
    assert asm.down("pre-a") == Failover("pre-a", "down: declared down by the scheduler")
    feed(asm, [ch(0, [10], "pre-a"), ch(1, [11], "dec-a")])
    assert asm.down("pre-a") is None  # decode streamed: the request lives on decode


def test_timeouts_blame_who_owes_the_next_message():
    asm = StreamAssembler(max_failovers=2)
    asm.begin(DISAGG)
    assert asm.awaiting_ack and asm.wait_limit(1.0, 2.0, 3.0) == 1.0
    assert asm.timed_out(1.0) == Failover("pre-a", "submit: no ack for 1.0s")
    asm.ack("pre-z")  # a late ack from another instance changes nothing
    assert asm.awaiting_ack
    asm.ack("pre-a")
    assert asm.wait_limit(1.0, 2.0, 3.0) == 2.0
    assert asm.timed_out(2.0) == Failover("pre-a", "stall: no tokens for 2.0s")
    feed(asm, [ch(0, [10], "pre-a")])
    assert asm.wait_limit(1.0, 2.0, 3.0) == 3.0
    assert asm.timed_out(3.0) == Failover("dec-a", "stall: no tokens for 3.0s")


def test_error_chunk_raises_and_failovers_are_capped():
    asm = StreamAssembler(max_failovers=1)
    asm.begin(DEC_B)
    err = TokenChunk(
        request_id="r",
        index=0,
        instance_id="dec-b",
        error=ErrorInfo(code="bad_request", message="nope"),
    )
    with pytest.raises(StrataError, match="nope"):
        asm.chunk(err)
    asm.fail(Failover("dec-b", "stall: x"), "r")
    with pytest.raises(StrataError, match="failed on 2 instances") as exc:
        asm.fail(Failover("dec-c", "down: y"), "r")
    assert exc.value.code == "unavailable" and asm.exclude == ["dec-b"]
