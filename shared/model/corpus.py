"""A deterministic synthetic text corpus for training the default model's BPE tokenizer.

Generated from fixed word lists with ``random.Random(seed)`` (whose ``choice``/``randrange``
sequence is stable across Python versions), so the tokenizer is identical on every machine.
"""

from __future__ import annotations

import random

_WORDS = """
the of and to in is was for on that with as by at from it an be this which or are have not
had one were but all their there been has when who will more no if out so said what up its
about into than them can only other new some could time these two may then do first any my now
such like our over man me even most made after also did many before must through back years where
much your way well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same another
know while last might us great old year off come since against go came right used take three
model token cache layer block prefill decode request stream server client batch queue memory
tensor vector matrix attention network vision image pixel patch encoder decoder weight bias norm
scale rotary position sequence context window length prompt answer question reply chat user
assistant system message content text word letter number value result error retry timeout
engine worker thread process service gateway scheduler router store object bucket disk storage
hello world example simple quick brown fox jumps lazy dog river mountain ocean forest city
green blue red yellow black white light dark morning evening night summer winter spring autumn
computer program function variable class method module package library python rust language
music story picture garden kitchen window table chair door house street market school family
friend teacher doctor student water fire earth wind stone paper glass metal wood bread coffee
""".split()
_NUMBERS = [str(n) for n in (0, 1, 2, 3, 7, 10, 16, 32, 42, 64, 100, 128, 256, 512, 1024, 2024)]
_UNICODE = """café naïve über façade résumé Straße déjà año niño crème brûlée
你好 世界 模型 缓存 图像 今天 天气 很好 我们 学习 東京 日本語 こんにちは ありがとう 한국어 안녕하세요
Привет мир спасибо γειά σου κόσμε مرحبا שלום नमस्ते 😀 🚀 🎉 ❤️ 👍 🤖 🌍 ✨ ½ € £ ¥ © ™ → ∞ ≤ ≥""".split()
_PUNCT = [".", ",", "!", "?", ":", ";"]
_CODE = [
    "def main():\n    return 0\n",
    "for i in range(10):\n    print(i)\n",
    'x = {"key": [1, 2, 3]}\n',
    "if (a && b) { return c; }\n",
    "<html><body>hi</body></html>\n",
]


def corpus_lines(seed: int = 0, num_lines: int = 6000) -> list[str]:
    """Deterministic lines of mixed English, numbers, code, Unicode, CJK and emoji."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(10)
        if kind == 0:
            lines.append(_CODE[rng.randrange(len(_CODE))])
            continue
        n = 4 + rng.randrange(14)
        words = []
        for _ in range(n):
            r = rng.randrange(20)
            pool = _UNICODE if r < 3 else _NUMBERS if r < 5 else _WORDS
            w = pool[rng.randrange(len(pool))]
            words.append(w.capitalize() if rng.randrange(8) == 0 else w)
        lines.append(" ".join(words) + _PUNCT[rng.randrange(len(_PUNCT))])
    return lines
