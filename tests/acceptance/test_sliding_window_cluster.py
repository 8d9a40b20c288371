"""``strata up`` on a Mistral checkpoint whose sliding window (64) is far under its position
limit: one start-up line says the context is capped at the window, a request within it equals
transformers' greedy tokens, and one past it is a 400 naming the context length (full attention
past the window would differ from transformers)."""

from __future__ import annotations

import pytest

from tests.acceptance.checkpoints import WINDOW, build_text, greedy
from tests.acceptance.conftest import strata_up

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPT = "The gateway streams tokens"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mistral_window")
    ck = build_text("mistral_window", tmp / "checkpoint")
    up = strata_up(str(tmp / "checkpoint"), tmp)
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0)
    yield ck, client, up
    assert up.stop() == 0, up.output()[-3000:]


def _model(client) -> str:
    return client.models.list().data[0].id


def test_within_the_window_equals_transformers_and_start_up_says_so(served):
    ck, client, up = served
    ids = ck.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    n = WINDOW - len(ids)  # fill the window to its last token
    ref, _ = greedy(ck, ids, n)
    r = client.completions.create(
        model=_model(client),
        prompt=PROMPT,
        max_tokens=n,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == ck.tokenizer.decode(ref, skip_special_tokens=True)
    lines = [x for x in up.output().splitlines() if "serving a context of" in x]
    assert len(lines) == 1 and f"sliding_window {WINDOW} < max_position_embeddings" in lines[0]


def test_past_the_window_is_a_400(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError, match=f"context length is {WINDOW}") as e:
        client.completions.create(
            model=_model(client), prompt=" ".join(["word"] * 3 * WINDOW), max_tokens=4
        )
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match=f"exceeds the context length {WINDOW}"):
        client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=WINDOW)
