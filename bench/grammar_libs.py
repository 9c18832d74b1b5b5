"""Grammar library choice (issue 26): mask time per token, llguidance against xgrammar, on the CPU.

    python bench/grammar_libs.py [--vocab 512 129280]

For each vocabulary size (the tiny DSV4 tokenizer, padded to 129,280 ids for the real width), both
libraries compile the same JSON schema and walk the tokens of one valid answer, computing the
allowed-token bitmask before each token; prints the tokenizer set-up and compile times and the mean
and largest mask time. xgrammar is optional (``pip install xgrammar``); the engine uses llguidance
(why: ``dsv4/engine/grammar.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.text.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
ANSWER = json.dumps({"name": "The old lighthouse keeper woke before dawn", "age": 42,
                     "tags": ["harbour", "bread", "moon orbits"], "ok": True}, separators=(",", ":"))


def walk(ids: list[int], fill, accept) -> tuple[float, float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        assert accept(t), f"token {t} refused"
    return 1e6 * sum(times) / len(times), 1e6 * max(times)


def llguidance_row(tok, V: int, ids: list[int]) -> str:
    import llguidance
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=V, eos_token=1)
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}))
    t2 = time.perf_counter()
    row = torch.zeros((V + 31) // 32, dtype=torch.int32)
    mean, worst = walk(ids, lambda: m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4), m.consume_token)
    return f"{'llguidance':>11} {t1 - t0:>9.2f} s {1e3 * (t2 - t1):>9.1f} ms {mean:>8.1f} us {worst:>8.0f} us"


def xgrammar_row(tok, V: int, ids: list[int]) -> str:
    try:
        import xgrammar as xgr
    except ImportError:
        return f"{'xgrammar':>11} not installed"
    t0 = time.perf_counter()
    vocab = [tok.id_to_token(i) for i in range(V)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=V, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")))
    t2 = time.perf_counter()
    bits = xgr.allocate_token_bitmask(1, V)
    mean, worst = walk(ids, lambda: m.fill_next_token_bitmask(bits, 0), m.accept_token)
    return f"{'xgrammar':>11} {t1 - t0:>9.2f} s {1e3 * (t2 - t1):>9.1f} ms {mean:>8.1f} us {worst:>8.0f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 129280])
    args = ap.parse_args()
    for V in args.vocab:
        tok = build_tiny_tokenizer(V, pad=V > 600)
        ids = tok.encode(ANSWER, add_special_tokens=False).ids
        print(f"\n## vocabulary {V}: {len(ids)} tokens of {ANSWER}")
        print(f"{'library':>11} {'tokenizer':>11} {'compile':>12} {'mask mean':>11} {'mask max':>11}")
        print(llguidance_row(tok, V, ids))
        print(xgrammar_row(tok, V, ids))


if __name__ == "__main__":
    main()
