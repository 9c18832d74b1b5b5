"""Constrained decoding in the engine (dsv4/engine/grammar.py) on the tiny random model, CPU.

The oracle is the grammar itself: llguidance re-checks every output token by token, and a free
request next to constrained ones must give exactly the tokens it gives alone.
"""

from __future__ import annotations

import dataclasses
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
from dsv4.testing import generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    from dsv4.engine.llm import LLM
    return LLM(max_num_seqs=8, max_model_len=512, progress=False)


def _run(llm, prompts, params) -> list:
    return generate(llm.engine, list(zip(prompts, params)), skip_special_tokens=False)


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


def _overlap_run(llm, prompts, params, overlap: bool):
    """``_run`` with the engine's overlapped schedule on or off; also returns, for each step whose
    masks were staged, how many steps were still in flight when its forward had been launched."""
    engine, runner = llm.engine, llm.engine.runner
    in_flight, run = [], runner.run

    def spy(batch, before_sample=None):
        def hook():
            in_flight.append(len(engine._inflight))
            before_sample()
        return run(batch, hook if before_sample is not None else None)
    engine.overlap, runner.run = overlap, spy
    try:
        return _run(llm, prompts, params), in_flight
    finally:
        engine.overlap = False
        del runner.run


def test_overlapped_masks_give_the_synchronous_tokens(llm):
    """The overlapped schedule (as on a GPU: the next step's forward launched before the previous
    step's tokens are seen; masks staged between forward and sampler) gives exactly the tokens of
    the synchronous one: constrained and free, greedy and sampled, thinking on (the grammar starts
    after </think>) and off, requests ending mid-batch (grammar done, max_tokens) while others wait
    for a slot (12 requests, 8 slots)."""
    tok = llm.tokenizer
    answer, think = tok.encode("Describe it.<｜Assistant｜></think>"), tok.encode("Think.<｜Assistant｜><think>")
    spec = StructuredOutputsParams(json=SCHEMA)
    prompts, params = [], []
    for i in range(12):
        constrained = i % 3 != 2
        prompts.append(think if i % 4 == 1 else answer)
        params.append(SamplingParams(max_tokens=(40, 90, 17)[i % 3], temperature=0.0 if i % 5 == 0 else 1.0, seed=i,
                                     structured_outputs=spec if constrained else None,
                                     thinking_token_budget=6 if i % 8 == 1 else None, ignore_eos=not constrained))
    sync, sync_flight = _overlap_run(llm, prompts, params, overlap=False)
    over, over_flight = _overlap_run(llm, prompts, params, overlap=True)
    assert max(sync_flight) == 0 and max(over_flight) == 1     # the overlapped schedule did run
    for i, (a, b) in enumerate(zip(sync, over)):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), i
    for i, out in enumerate(over):
        if i % 3 != 2:
            assert json.loads(out.text.split("</think>")[-1]).keys() == {"name", "n", "tags"}
    assert {o.finish_reason for o in over} == {"stop", "length"}


def test_a_thinking_budget_without_thinking_reads_no_stale_mask(llm):
    """A request with ``thinking_token_budget`` whose prompt opens no reasoning has no constraint,
    yet makes its steps apply masks: its slot's row must be all-allowed, not what the last
    constrained request in that slot left (an EOS-only mask once its answer was done)."""
    tok = llm.tokenizer
    prompt = tok.encode("Pick.<｜Assistant｜></think>")
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    alone = _run(llm, [prompt], [free])[0]
    _run(llm, [prompt], [SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["x"]))])
    budget = _run(llm, [prompt], [dataclasses.replace(free, thinking_token_budget=4)])[0]
    assert budget.token_ids == alone.token_ids and len(alone.token_ids) > 1


def test_before_sample_runs_between_the_forward_and_the_sampler(llm):
    """Runner.run's ``before_sample`` hook sees the step's forward done (positions moved on) and its
    sampler not yet run, and a mask written there is what the sampler applies: in a prefill step
    (varlen) and a decode step, for the constrained row only."""
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.runner import Runner
    runner = Runner(llm.runner.model, max_num_seqs=2, max_model_len=64)
    constrained = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["x"]))
    free = SamplingParams(temperature=0.0)
    prompt = (5, 6, 7)
    bits = runner.sampling.bitmask.bits
    seen = []

    def hook(token):
        def stage():
            seen.append((runner.state.positions[:2].tolist(), runner.tokens[:2].tolist()))
            bits[:2] = -1
            bits[0].zero_()
            bits[0, token // 32] = 1 << token % 32
        return stage
    rows = (Row(0, 0, prompt, new=NewSequence(constrained, prompt)), Row(1, 0, prompt, new=NewSequence(free, prompt)))
    first = runner.run(ScheduledBatch(rows), hook(9)).sampled.token_ids.tolist()
    second = runner.run(ScheduledBatch((Row(0, 3), Row(1, 3))), hook(11)).sampled.token_ids.tolist()
    assert seen == [([3, 3], [0, 0]), ([4, 4], [9, first[1]])]
    assert first[0] == 9 and second[0] == 11
    # the free row is the plain greedy continuation
    plain = Runner(llm.runner.model, max_num_seqs=1, max_model_len=64)
    a = plain.run(ScheduledBatch((Row(0, 0, prompt, new=NewSequence(free, prompt)),))).sampled.token_ids.tolist()
    b = plain.run(ScheduledBatch((Row(0, 3),))).sampled.token_ids.tolist()
    assert [first[1], second[1]] == a + b


def test_structured_bench_runs_on_the_cpu():
    """bench/structured_bench.py on the tiny preset (gpu_check.sh runs it on the Flash slice)."""
    p = subprocess.run([sys.executable, "bench/structured_bench.py", "--preset", "tiny", "--format", "bf16",
                        "--layers", "2", "--batch", "4", "--tokens", "6", "--context", "8", "--repeat", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if "/4" in line]
    assert [r[0] for r in rows] == ["0/4", "2/4", "4/4"] and all(float(r[1]) > 0 for r in rows)
