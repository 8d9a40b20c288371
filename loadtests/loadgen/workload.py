"""Pure workload generation: what to send and when (no HTTP here).

A `Job` is one request: a completion ``prompt`` or chat ``messages``, ``max_tokens`` and an
arrival offset. Text is built from `WORDS`, English words that each encode to one token (with
their leading space) in the default model's tokenizer, so ``n`` words is about ``n`` tokens on
Strata's models; the report uses the server's token counts anyway.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass, field
from typing import Any

WORDS = (
    "the of and to in is that for it as with was on be by at this are from or an have not but "
    "all can more one will about there when what which their time so up out some only into "
    "them other then its also two these may new now way most people first over after any such "
    "many use work world year day good much how state part life back where just being through "
    "long well great right old even still see own here last like high small"
).split()


@dataclass
class Job:
    """One request to send; ``arrival`` is seconds from the run's start (0 = closed loop)."""

    index: int
    max_tokens: int
    prompt: str | None = None  # /v1/completions when set
    messages: list[dict[str, Any]] | None = None  # /v1/chat/completions when set
    arrival: float = 0.0
    tenant: int = -1
    image: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return "/v1/completions" if self.prompt is not None else "/v1/chat/completions"


def words(rng: random.Random, n: int) -> list[str]:
    """``n`` words drawn from `WORDS` by ``rng``."""
    return [rng.choice(WORDS) for _ in range(n)]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of ``n`` requests of a Poisson process with ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"--rate must be > 0, got {rate}")
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def image_data_url(seed: int, size: int = 64) -> str:
    """A small deterministic PNG (a colour and a bar that depend on ``seed``) as a data URL."""
    from PIL import Image

    rng = random.Random(f"image:{seed}")
    img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    bar = tuple(rng.randrange(256) for _ in range(3))
    for x in range(size):
        for y in range(rng.randrange(size // 4, size // 2)):
            img.putpixel((x, y), bar)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic workload."""

    num_requests: int = 32
    input_min: int = 64  # words of the user part (about tokens)
    input_max: int = 256
    output_tokens: int = 32
    tenants: int = 0  # >0: each request belongs to a tenant sharing its system prompt
    system_prompt_tokens: int = 0  # words of each tenant's system prompt
    image_fraction: float = 0.0  # share of requests that carry one image (chat only)
    chat: bool = True  # chat messages (else a completion prompt)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.image_fraction <= 1.0:
            raise ValueError(f"--image-fraction must be in [0, 1], got {self.image_fraction}")
        if not 1 <= self.input_min <= self.input_max:
            raise ValueError("need 1 <= input_min <= input_max")
        if self.image_fraction and not self.chat:
            raise ValueError("images need chat requests (not --api completion)")


def synthetic_jobs(spec: SyntheticSpec, arrivals: list[float] | None = None) -> list[Job]:
    """``spec.num_requests`` jobs; ``arrivals`` (same length) sets their arrival offsets."""
    rng = random.Random(f"synthetic:{spec.seed}")
    systems = [
        " ".join(words(random.Random(f"tenant:{spec.seed}:{t}"), spec.system_prompt_tokens))
        for t in range(spec.tenants)
    ]
    jobs = []
    for i in range(spec.num_requests):
        user = " ".join(words(rng, rng.randint(spec.input_min, spec.input_max)))
        tenant = i % spec.tenants if spec.tenants else -1
        image = rng.random() < spec.image_fraction
        arrival = arrivals[i] if arrivals else 0.0
        if not spec.chat:
            prompt = (systems[tenant] + " " + user) if tenant >= 0 else user
            jobs.append(Job(i, spec.output_tokens, prompt=prompt, arrival=arrival, tenant=tenant))
            continue
        msgs: list[dict[str, Any]] = []
        if tenant >= 0:
            msgs.append({"role": "system", "content": systems[tenant]})
        content: Any = user
        if image:
            content = [
                {"type": "text", "text": user},
                {"type": "image_url", "image_url": {"url": image_data_url(i)}},
            ]
        msgs.append({"role": "user", "content": content})
        jobs.append(
            Job(i, spec.output_tokens, messages=msgs, arrival=arrival, tenant=tenant, image=image)
        )
    return jobs
