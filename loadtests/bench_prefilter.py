"""Added latency of the gateway's CPU pre-filter: 10k patterns, prompts of about 8k tokens.

    .venv/bin/python -m loadtests.bench_prefilter [--patterns 10000] [--prompt-tokens 8192]
        [--repeats 200]

Builds a refuse list and a mask list of ``--patterns`` random 1-3 word phrases each (files in a
temporary folder, loaded as the gateway loads them), then times, per request: ``Prefilter.body``
on a chat body whose user message is ``--prompt-tokens`` * 4 characters of random words (the
refuse list never matches, the mask list matches a few phrases planted in it: the path every
admitted request takes), and the output side (`OutputMask` over the same text in 16-character
chunks, a streamed answer's worth). Prints the list load time and p50 / p99 per request as a
markdown table with the load average. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from services.gateway.prefilter import Prefilter


def _words(rng: random.Random, n: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--patterns", type=int, default=10_000)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    rng = random.Random(0)
    vocab = _words(rng, 50_000)
    phrases = [" ".join(rng.choices(vocab, k=rng.randint(1, 3))) for _ in range(2 * a.patterns)]
    text_words: list[str] = []
    while sum(len(w) + 1 for w in text_words) < a.prompt_tokens * 4:  # ~4 characters a token
        text_words.append(rng.choice(vocab))
    for k in range(5):  # a few mask-list hits
        text_words.insert(rng.randrange(len(text_words)), phrases[a.patterns + k])
    text = " ".join(text_words)
    with tempfile.TemporaryDirectory() as tmp:
        refuse, mask = os.path.join(tmp, "refuse.txt"), os.path.join(tmp, "mask.txt")
        with open(refuse, "w") as f:
            f.write("\n".join(p + " zzqx" for p in phrases[: a.patterns]))  # never in the text
        with open(mask, "w") as f:
            f.write("\n".join(phrases[a.patterns :]))
        t = time.perf_counter()
        pf = Prefilter.from_specs([f"refuse:R:{refuse}", f"mask:M:{mask}"], reload_s=3600)
        load_s = time.perf_counter() - t
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        inp, out = [], []
        for _ in range(a.repeats):
            t = time.perf_counter()
            pf.body(body)
            inp.append(time.perf_counter() - t)
            m = pf.output()
            t = time.perf_counter()
            for i in range(0, len(text), 16):
                m.feed(text[i : i + 16], False)
            m.feed("", True)
            out.append(time.perf_counter() - t)

    def row(name: str, xs: list[float]) -> str:
        xs = sorted(xs)
        p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
        return f"| {name} | {statistics.median(xs) * 1e3:.2f} | {p99 * 1e3:.2f} |"

    print(f"{a.patterns} patterns per list, 2 lists, prompt {len(text)} characters")
    print(f"lists loaded in {load_s * 1e3:.0f} ms; load average {os.getloadavg()[0]:.2f}\n")
    print("| path | p50 ms | p99 ms |\n| --- | --- | --- |")
    print(row("request text (Prefilter.body)", inp))
    print(row("streamed output (OutputMask, 16-char chunks)", out))


if __name__ == "__main__":
    main()
