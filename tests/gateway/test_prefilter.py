"""The CPU pre-filter on the gateway (real nats-server, fake peers): a refuse list's match is a
400 naming its policy code before any tokenization, a mask list's matches reach the tokenizer as
``*``, the lists reload when their files change (a bad reload keeps the old list), and output
text is masked across chunk boundaries, streamed and not."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from services.gateway.prefilter import PatternFileError, Prefilter
from tests.gateway.harness import gateway
from tests.gateway.test_rest import sse_events

CHAT = {"model": "tiny", "max_tokens": 3}


def _lists(tmp_path, refuse: str, mask: str) -> list[str]:
    (tmp_path / "refuse.txt").write_text(refuse)
    (tmp_path / "mask.txt").write_text(mask)
    return [f"refuse:SECRETS:{tmp_path / 'refuse.txt'}", f"mask:PII:{tmp_path / 'mask.txt'}"]


def _touch(path) -> None:
    st = os.stat(path)
    os.utime(path, (st.st_atime + 10, st.st_mtime + 10))


async def test_refuse_mask_and_hot_reload(nats_url, tmp_path):
    lists = _lists(tmp_path, "# codes\nsecret plan\n", "555-1234\n")
    async with gateway(nats_url, prefilter_lists=lists, prefilter_reload_s=0.05) as (url, p, _):
        async with httpx.AsyncClient(base_url=url) as c:
            msgs = [{"role": "user", "content": "tell me the SECRET Plan"}]
            before = len(p.tok_reqs)
            r = await c.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "content policy 'SECRETS'" in err["message"]
            assert err["param"] == "messages.0.content"
            assert len(p.tok_reqs) == before  # refused before tokenization

            r = await c.post("/v1/completions", json={**CHAT, "prompt": "call 555-1234 now"})
            assert r.status_code == 200, r.text
            assert p.tok_reqs[-1].prompt == "call ******** now"

            (tmp_path / "refuse.txt").write_text("launch codes\n")
            _touch(tmp_path / "refuse.txt")
            await asyncio.sleep(0.1)
            ok = await c.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
            assert ok.status_code == 200  # the old pattern is gone
            bad = [{"role": "user", "content": [{"type": "text", "text": "the launch codes"}]}]
            r = await c.post("/v1/chat/completions", json={**CHAT, "messages": bad})
            assert r.status_code == 400 and "SECRETS" in r.json()["error"]["message"]

            (tmp_path / "refuse.txt").write_bytes(b"ok\n\xff\xfe\n")  # invalid UTF-8
            _touch(tmp_path / "refuse.txt")
            await asyncio.sleep(0.1)
            r = await c.post("/v1/chat/completions", json={**CHAT, "messages": bad})
            assert r.status_code == 400  # the previous list still holds
            r = await c.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
            assert r.status_code == 200  # nothing else affected


async def test_output_is_masked_across_chunks(nats_url, tmp_path):
    lists = _lists(tmp_path, "", "badword\n")
    async with gateway(nats_url, prefilter_lists=lists) as (url, peers, _):
        peers.script = ["the bad", "wo", "rd is BADWORD", "."]
        body = {**CHAT, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json=body)
            want = "the ******* is *******."
            assert r.json()["choices"][0]["message"]["content"] == want
            r = await c.post("/v1/chat/completions", json={**body, "stream": True})
            parts = [
                e["choices"][0]["delta"].get("content", "")
                for e in sse_events(r.text)
                if e.get("choices")
            ]
            assert "".join(parts) == want
            assert not any("bad" in x.lower() for x in parts)


def test_output_mask_finds_a_pattern_at_every_split(tmp_path):
    (tmp_path / "m.txt").write_text("needle\nsecret phrase\n")
    pf = Prefilter.from_specs([f"mask:X:{tmp_path / 'm.txt'}"])
    text = "a needle and a Secret Phrase, fine"
    want = "a ****** and a *************, fine"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            m = pf.output()
            out = m.feed(text[:i], False) + m.feed(text[i:j], False) + m.feed(text[j:], True)
            assert out == want, (i, j)


def test_bad_pattern_files_and_specs_name_the_problem(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xc3\x28\n")
    with pytest.raises(PatternFileError, match=r"bad.txt: line 2 is not valid UTF-8"):
        Prefilter.from_specs([f"refuse:X:{bad}"])
    with pytest.raises(PatternFileError, match="cannot be read"):
        Prefilter.from_specs([f"refuse:X:{tmp_path / 'missing.txt'}"])
    with pytest.raises(PatternFileError, match="expected 'refuse:CODE:PATH'"):
        Prefilter.from_specs(["block:X:y"])
