"""Tokenizing a growing conversation: a plain encode of every turn against the encode cache.

    python bench/encode_cache.py [--turns 10] [--system-words 3500] [--turn-words 2200]

An agent resends its whole conversation every turn; the server renders it with the DSV4 chat
encoding and tokenizes it (dsv4/text/encode_cache.py). Per turn: the prompt's tokens, the time of a
plain ``tokenizers`` encode and of ``Tokenizer.encode`` (which reuses the previous turn's ids up to a
special token), and a check that both give the same ids. The tokenizer is the byte-level one sized
to a real vocabulary that ``bench/serve_random.py`` serves with; CPU only.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.text.chat import encode_messages  # noqa: E402
from dsv4.text.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402
from dsv4.text.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-words", type=int, default=3500)
    ap.add_argument("--turn-words", type=int, default=2200)
    ap.add_argument("--answer-words", type=int, default=110)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(write_tiny_tokenizer(Path(tempfile.mkdtemp()), 129280, pad=True))
    rng = random.Random(0)
    words = ["the", "agent", "calls", "tool", "with", "arguments", "file", "path", "def", "return", "import",
             "class", "value", "error", "东京", "naïve"]

    def say(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))
    messages = [{"role": "system", "content": say(args.system_words)}]
    print("turn  tokens  plain encode ms  Tokenizer.encode ms  same ids")
    for turn in range(args.turns):
        messages.append({"role": "user", "content": say(args.turn_words)})
        text = encode_messages(messages)
        t0 = time.perf_counter()
        plain = list(tok.hf.encode(text, add_special_tokens=False).ids)
        t1 = time.perf_counter()
        ids = tok.encode(text)
        t2 = time.perf_counter()
        print(f"{turn + 1:4d} {len(ids):7d} {(t1 - t0) * 1e3:16.1f} {(t2 - t1) * 1e3:20.1f}  {ids == plain}")
        messages.append({"role": "assistant", "content": say(args.answer_words)})


if __name__ == "__main__":
    main()
