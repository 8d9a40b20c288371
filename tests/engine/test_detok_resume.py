"""A resumed stream's text continues exactly where the original stopped, even mid-character."""

from __future__ import annotations

import pytest

from shared.engine.detok import TextTracker
from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok():
    from services.cluster_config import ensure_model

    return Tokenizer.from_dir(ensure_model(""))


def _tracker(tok):
    return TextTracker(IncrementalDetokenizer(tok, []), stop=())


def test_failover_cut_inside_a_multibyte_character(tok):
    text = "ok 🚀🚀 漢字 done"
    ids = tok.encode(text)
    full = tok.decode(ids)
    for cut in range(1, len(ids)):
        first = _tracker(tok)
        sent = "".join(first.add(t)[0] for t in ids[:cut])
        resumed = _tracker(tok)
        resumed.prime(ids[:cut])
        rest = "".join(resumed.add(t)[0] for t in ids[cut:]) + resumed.flush()
        assert sent + rest == full, f"cut at token {cut}"


def test_flush_releases_an_incomplete_tail(tok):
    ids = tok.encode("a🚀")
    t = _tracker(tok)
    out = "".join(t.add(i)[0] for i in ids[:-1])
    out += t.flush()  # the request ended mid-character: what was held back still comes out
    assert out == tok.decode(ids[:-1])
