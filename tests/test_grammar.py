"""Constrained decoding in the engine (dsv4/engine/grammar.py) on the tiny random model, CPU.

The oracle is the grammar itself: llguidance re-checks every output token by token, and a free
request next to constrained ones must give exactly the tokens it gives alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

llguidance = pytest.importorskip("llguidance")

from dsv4.engine.grammar import StructuredOutputsParams, apply_token_bitmask  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.errors import RequestError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    from dsv4.engine.llm import LLM
    return LLM(max_num_seqs=8, max_model_len=512, progress=False)


def _run(llm, prompts, params) -> list:
    engine = llm.engine
    ids = [engine.add_request(p, sp, skip_special_tokens=False) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output
    return [done[i] for i in ids]


def _replay(llm, spec, tokens) -> bool:
    """True when the grammar accepts ``tokens`` (EOS last) as a finished answer."""
    grammars = llm.engine.grammars
    m = llguidance.LLMatcher(grammars.ll_tokenizer, grammars.check(spec))
    return all(m.consume_token(t) for t in tokens) and m.is_stopped()


def test_bitmask_matches_a_boolean_mask():
    g = torch.Generator().manual_seed(0)
    V = 70
    allowed = torch.rand(3, V, generator=g) < 0.3
    allowed[:, 31] = allowed[:, 63] = True          # the sign bit of a word
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bits = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(3, V, generator=g)
    out = apply_token_bitmask(logits, bits)
    assert torch.equal(out, logits.masked_fill(~allowed, float("-inf")))


def test_json_every_time_and_free_rows_unchanged(llm):
    """Mixed batch: six constrained requests (seeded, sampled) all end in JSON the grammar accepts;
    the two free requests beside them give bit for bit the tokens they give alone."""
    tok = llm.tokenizer
    prompt = tok.encode("Describe it.<｜Assistant｜></think>")
    spec = StructuredOutputsParams(json=SCHEMA)
    free = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in (11, 12)]
    alone = _run(llm, [prompt] * 2, free)
    constrained = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=spec) for s in range(6)]
    mixed = _run(llm, [prompt] * 8, constrained[:3] + free[:1] + constrained[3:] + free[1:])
    for out in mixed[:3] + mixed[4:7]:
        assert out.finish_reason == "stop"
        assert set(json.loads(out.text)) == {"name", "n", "tags"}
        assert _replay(llm, spec, out.token_ids)
    assert mixed[3].token_ids == alone[0].token_ids and mixed[7].token_ids == alone[1].token_ids


def test_reasoning_is_free_then_the_grammar_applies(llm):
    """Thinking mode: reasoning without special tokens or EOS, capped by thinking_token_budget, then
    exactly one of the choices."""
    tok = llm.tokenizer
    prompt = tok.encode("Pick one.<｜Assistant｜><think>")
    spec = StructuredOutputsParams(choice=["alpha", "beta"])
    outs = _run(llm, [prompt] * 4, [SamplingParams(max_tokens=100, temperature=1.0, seed=s, structured_outputs=spec,
                                                   thinking_token_budget=5 * s) for s in range(4)])
    think_end = tok.special_id("</think>")
    specials = {tok.special_id(t) for t in tok.special_tokens()}
    for s, out in enumerate(outs):
        k = out.token_ids.index(think_end)
        assert k <= 5 * s
        assert not specials & set(out.token_ids[:k])
        assert out.text.split("</think>", 1)[1] in ("alpha", "beta")
        assert out.finish_reason == "stop"


def test_closing_mode_finishes_within_a_small_limit(llm):
    tok = llm.tokenizer
    prompt = tok.encode("x<｜Assistant｜></think>")
    spec = StructuredOutputsParams(json=SCHEMA)
    for out in _run(llm, [prompt] * 6, [SamplingParams(max_tokens=48, temperature=1.0, seed=s,
                                                       structured_outputs=spec) for s in range(6)]):
        assert out.finish_reason == "stop" and len(out.token_ids) <= 48
        json.loads(out.text)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "bogus"}), "structured_outputs: invalid grammar"),
    (dict(grammar="start: x"), "structured_outputs: invalid grammar"),
    (dict(grammar="root ::= ("), "structured_outputs: invalid GBNF grammar"),
])
def test_bad_grammar_is_refused_before_anything_runs(llm, spec, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(RequestError, match=message) as e:
        llm.engine.check([1, 2, 3], params)
    assert e.value.param == "structured_outputs"
    with pytest.raises(RequestError):
        llm.engine.add_request([1, 2, 3], params)
    assert not llm.engine.has_unfinished


def test_exactly_one_kind():
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutputsParams()


def test_structured_bench_runs_on_the_cpu():
    """bench/structured_bench.py on the tiny preset (gpu_check.sh runs it on the Flash slice)."""
    p = subprocess.run([sys.executable, "bench/structured_bench.py", "--preset", "tiny", "--format", "bf16",
                        "--layers", "2", "--batch", "4", "--tokens", "6", "--context", "8", "--repeat", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if "/4" in line]
    assert [r[0] for r in rows] == ["0/4", "2/4", "4/4"] and all(float(r[1]) > 0 for r in rows)
