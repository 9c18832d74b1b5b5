"""Speculative decoding (issue 25): verify rows, rollback, n-gram and MTP drafts, rejection sampling.

The oracle is plain decoding. In fp32 on the CPU: a verify step that keeps ``a + 1`` of its tokens
leaves exactly the state ``a + 1`` plain decode steps leave (every ring row, open and previous
compressor window, the compressed entries and indexer keys below the length), at every rollback
depth, across window wraps and every compression boundary; greedy generations with speculation (n-gram,
MTP, injected drafts right with a chosen probability) give plain decoding's tokens and logprobs; with
sampling, the emitted distribution is the target's (chi-square).
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.speculative import SpeculativeConfig, ngram_propose
from dsv4.errors import UsageError

CONTEXT = 512


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=5, with_mtp=True)


def _first(runner: Runner, slot: int, prompt: list[int], params: SamplingParams) -> tuple[int, float | None]:
    out = runner.run(ScheduledBatch((Row(slot, 0, tuple(prompt), new=NewSequence(params, tuple(prompt))),)))
    s = out.sampled
    return int(s.token_ids.flatten()[0]), None if s.logprobs is None else float(s.logprobs.flatten()[0])


def _state_equal(a: Runner, b: Runner, slot: int, length: int) -> None:
    """Everything plain decoding leaves that can be read again: ring rows, open and previous windows,
    entries (and indexer keys) below ``length // ratio``; and the position."""
    assert int(a.state.positions[slot]) == int(b.state.positions[slot]) == length
    for i, (la, lb) in enumerate(zip(a.state.layers, b.state.layers)):
        for ta, tb in zip(la.ring.tensors(), lb.ring.tensors()):
            torch.testing.assert_close(ta[slot], tb[slot], rtol=1e-5, atol=1e-5, msg=f"layer {i} ring")
        for name in ("compressor", "indexer"):
            ca, cb = getattr(la, name), getattr(lb, name)
            if ca is None:
                continue
            n = length // ca.ratio
            for ta, tb in zip(ca.entries.tensors(), cb.entries.tensors()):
                torch.testing.assert_close(ta[slot, :n], tb[slot, :n], rtol=1e-5, atol=1e-5,
                                           msg=f"layer {i} {name} entries")
            for f in ("win_kv", "win_gate", "prev_kv", "prev_gate"):
                ta, tb = getattr(ca, f), getattr(cb, f)
                if ta is not None:
                    torch.testing.assert_close(ta[slot], tb[slot], rtol=1e-5, atol=1e-5, msg=f"layer {i} {name}.{f}")


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_rollback_leaves_the_state_plain_decoding_leaves(model, k):
    """Verify steps with drafts right up to a chosen depth ``a`` (every depth 0..k, at every
    alignment of the window 8 and the ratios 4 and 16 over 140 tokens) against ``a + 1`` plain decode
    steps: the same tokens and logprobs, the same state tensors."""
    spec = {"method": "ngram", "num_speculative_tokens": k}
    greedy = SamplingParams(temperature=0.0, max_tokens=10_000, logprobs=0)
    rng = random.Random(k)
    prompt = [rng.randrange(2, 512) for _ in range(11 + k)]
    total = 140
    ref = Runner(model, max_num_seqs=1, max_model_len=CONTEXT, speculative=spec)   # the tokens to draft from
    tokens = [_first(ref, 0, prompt, greedy)[0]]
    for _ in range(total + k):
        tokens.append(int(ref.run(ScheduledBatch((Row(0, len(prompt) + len(tokens) - 1),))).sampled.token_ids[0]))

    a_run = Runner(model, max_num_seqs=2, max_model_len=CONTEXT, speculative=spec)
    b_run = Runner(model, max_num_seqs=2, max_model_len=CONTEXT, speculative=spec)
    slot = 1
    ta, _ = _first(a_run, slot, prompt, greedy)
    tb, _ = _first(b_run, slot, prompt, greedy)
    assert ta == tb == tokens[0]
    n, depths = 1, set()
    while n < total:
        length = len(prompt) + n - 1                       # the slot's length; tokens[n - 1] is its next input
        depth = rng.randint(0, k)
        drafts = tokens[n:n + k]
        if depth < k:
            drafts[depth] = (drafts[depth] + 1 + rng.randrange(500)) % 512 or 3
        out = a_run.run(ScheduledBatch((Row(slot, length, draft=tuple(drafts)),)))
        assert out.emitted == [depth + 1]
        got = out.sampled.token_ids[0, :depth + 1].tolist()
        assert got == tokens[n:n + depth + 1]
        for j in range(depth + 1):
            o = b_run.run(ScheduledBatch((Row(slot, length + j),))).sampled
            assert int(o.token_ids[0]) == got[j]
            torch.testing.assert_close(out.sampled.logprobs[0, j], o.logprobs[0], rtol=0, atol=1e-5)
        n += depth + 1
        depths.add(depth)
        _state_equal(a_run, b_run, slot, len(prompt) + n - 1)
        assert a_run.lengths[slot] == b_run.lengths[slot]
    assert depths == set(range(k + 1))


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 9, 1, 2], 3, 1, 3) == [3, 9, 1]
    assert ngram_propose([5, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]         # the latest earlier match
    assert ngram_propose([1, 2, 3], 2, 1, 2) is None
    assert ngram_propose([4, 4], 3, 1, 1) == [4, 4, 4]                  # short continuation padded


@pytest.mark.parametrize("text, msg", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an int >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     "prompt_lookup_min (3) exceeds"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown field(s) ['draft_model']"),
    ('{"method": ngram}', "not valid JSON"),
    ('[1]', "must be a JSON object"),
])
def test_bad_config_is_one_clear_error(text, msg):
    with pytest.raises(UsageError, match="speculative config") as e:
        SpeculativeConfig.parse(text)
    assert msg in str(e.value)


def test_config_checked_against_the_model(model):
    with pytest.raises(UsageError, match="exceeds the sliding window"):
        Runner(model, max_num_seqs=1, max_model_len=64, speculative={"method": "ngram", "num_speculative_tokens": 8})
    plain = random_model(parity_config(), seed=5)
    with pytest.raises(UsageError, match="needs the checkpoint's MTP block"):
        Runner(plain, max_num_seqs=1, max_model_len=64, speculative={"method": "mtp", "num_speculative_tokens": 1})


# ----------------------------------------------------------------------------- through the engine


def _engine(model, spec, slots: int = 3, budget: int = 64):
    from dsv4.engine.core import Engine
    runner = Runner(model, max_num_seqs=slots, max_model_len=CONTEXT, max_num_batched_tokens=budget, speculative=spec)
    return Engine(runner, None, eos_id=1)


def _generate(engine, requests):
    ids = [engine.add_request(p, params) for p, params in requests]
    done = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output
    return [done[i] for i in ids]


def _greedy_requests(seed: int, n: int = 3, max_tokens: int = 160):
    """Prompts with repeats (the n-gram drafter finds matches), greedy with logprobs."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(2, 512) for _ in range(rng.randint(3, 9))]
        prompt = (base * 4)[:rng.randint(5, 40)]
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)))
    return out


@pytest.fixture(scope="module")
def plain_outputs(model):
    return _generate(_engine(model, None), _greedy_requests(1))


@pytest.mark.parametrize("method, k", [("ngram", 1), ("ngram", 2), ("ngram", 3), ("ngram", 4),
                                       ("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp", 4)])
def test_greedy_speculation_equals_plain_decoding(model, plain_outputs, method, k):
    """Three requests batched together (continuous batching: prompt chunks and verify rows share
    steps), 160 tokens each (20 window wraps, 10 HCA windows): the same tokens and logprobs."""
    spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = _engine(model, spec, budget=24)
    got = _generate(engine, _greedy_requests(1))
    for g, w in zip(got, plain_outputs):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
        assert [[t for t, _ in x] for x in g.top_logprobs] == [[t for t, _ in x] for x in w.top_logprobs]
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens == k * stats.num_drafts
    assert sum(g.spec_decode.num_drafts for g in got if g.spec_decode) == stats.num_drafts


def test_speculation_with_prefix_caching(model, plain_outputs):
    """The same requests twice through one engine with the prefix cache on (the second time their
    prompts' states come from the cache): the tokens and logprobs of plain decoding."""
    from dsv4.engine.core import Engine
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runner = Runner(model, max_num_seqs=3, max_model_len=CONTEXT, max_num_batched_tokens=24, speculative=spec,
                    prefix_cache_bytes=8 << 20)
    engine = Engine(runner, None, eos_id=1)
    for _ in range(2):
        got = _generate(engine, _greedy_requests(1))
        for g, w in zip(got, plain_outputs):
            assert g.token_ids == w.token_ids
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
    assert sum(g.num_cached_tokens for g in got) > 0
