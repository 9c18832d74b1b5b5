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
from dsv4.testing import generate

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


def _greedy_requests(seed: int, n: int = 3, max_tokens: int = 160):
    """Prompts with repeats (the n-gram drafter finds matches), greedy with logprobs; the first drawing
    from a fifth of the vocabulary (allowed_token_ids: drafts outside it are rejected); the second with a
    logit bias that all but forces a stop id which min_tokens holds back for 50 tokens (each verify
    position sees its own step), the third with repetition, frequency and presence penalties (each
    verify position sees the drafts before it)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(2, 512) for _ in range(rng.randint(3, 9))]
        prompt = (base * 4)[:rng.randint(5, 40)]
        knobs = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2) if i == 2 else \
            dict(logit_bias={base[0]: 40.0, base[1]: -3.0}, stop_token_ids=[base[0]], min_tokens=50) if i == 1 else \
            dict(allowed_token_ids=base + list(range(2, 512, 5)))
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True,
                                           **knobs)))
    return out


@pytest.fixture(scope="module")
def plain_outputs(model):
    return generate(_engine(model, None), _greedy_requests(1))


def test_allowed_token_ids_hold_through_the_engine(plain_outputs):
    (_, params), out = _greedy_requests(1)[0], plain_outputs[0]
    assert len(out.token_ids) == 160 and set(out.token_ids) <= set(params.allowed_token_ids)


def test_min_tokens_holds_a_forced_stop_id_back(plain_outputs):
    """The biased request (plain decoding): its stop id, which the bias all but forces, comes as token 51."""
    (_, params), out = _greedy_requests(1)[1], plain_outputs[1]
    stop = params.stop_token_ids[0]
    assert len(out.token_ids) == 51 and out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("method, k", [("ngram", 1), ("ngram", 2), ("ngram", 3), ("ngram", 4),
                                       ("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp", 4)])
def test_greedy_speculation_equals_plain_decoding(model, plain_outputs, method, k):
    """Three requests batched together (continuous batching: prompt chunks and verify rows share
    steps), 160 tokens each (20 window wraps, 10 HCA windows): the same tokens and logprobs."""
    spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = _engine(model, spec, budget=24)
    got = generate(engine, _greedy_requests(1))
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
        got = generate(engine, _greedy_requests(1))
        for g, w in zip(got, plain_outputs):
            assert g.token_ids == w.token_ids
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
    assert sum(g.num_cached_tokens for g in got) > 0


# ----------------------------------------------------------------------------- sampling


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    probs = probs.double()[keep]
    expected = probs / probs.sum() * counts.sum().double()
    return float(chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_rejection_sampling_keeps_the_target_distribution(knobs):
    """Verify rows over fixed logits on an 8-token vocabulary, 6000 seeds: the first emitted token
    follows the target at position 0 whatever the draft (a likely one and an unlikely one), and the
    second, where the first draft was kept, the target at position 1 (chi-square, fixed seeds)."""
    from dsv4.engine.sampling import SampleFlags, SlotSampling
    from dsv4.engine.speculative import verify
    V, b, S = 8, 6000, 3
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(S, V, generator=gen) * 1.5
    sampling = SlotSampling(b, V, "cpu")
    params = [SamplingParams(seed=i, **knobs) for i in range(b)]
    for i, p in enumerate(params):
        sampling.assign(i, p, [1])
    flags = SampleFlags.of(params, V)

    def target(row: torch.Tensor) -> torch.Tensor:     # the sampler's pipeline on one row, independently
        scaled = row / knobs["temperature"]
        p = torch.softmax(scaled, -1)
        if knobs.get("top_k"):
            p = torch.where(scaled >= scaled.topk(knobs["top_k"]).values[-1], p, 0.0)
            p = p / p.sum()
        if knobs.get("top_p", 1.0) < 1:
            order = p.argsort(descending=True)
            before = p[order].cumsum(0) - p[order]
            drop = torch.zeros(V, dtype=torch.bool)
            drop[order] = before >= knobs["top_p"]
            p = torch.where(drop, 0.0, p)
            p = p / p.sum()
        return p

    p0, p1 = target(logits[0]), target(logits[1])
    likely, unlikely = int(p0.argsort()[-2]), int(p0.argsort()[0])
    drafts = torch.tensor([[likely if i % 2 else unlikely, int(p1.argmax())] for i in range(b)])
    out, kept = verify(sampling, logits.expand(b, S, V), torch.arange(b), drafts, flags)
    tokens = out.token_ids
    assert ((tokens >= 0).sum(1) == kept).all()
    for half in (0, 1):                                 # each draft choice on its own
        first = tokens[half::2, 0]
        assert _chi2_pvalue(torch.bincount(first, minlength=V), p0) > 1e-3
    second = tokens[kept >= 2, 1]
    assert second.numel() > 500
    assert _chi2_pvalue(torch.bincount(second, minlength=V), p1) > 1e-3
    # the draw counters advanced by the emitted tokens (the next step draws fresh noise)
    assert torch.equal(sampling.rows.step[:b], kept)


def test_speculative_sampling_matches_plain_sampling_distribution(model):
    """Through the engine (MTP drafts, k = 3): the distribution of the
    second generated token, given the first, is the model's (chi-square over 1500 seeded requests
    against the exact conditional probabilities)."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    engine = _engine(model, {"method": "mtp", "num_speculative_tokens": 3}, slots=64, budget=1024)
    reqs = [(prompt, SamplingParams(temperature=1.0, top_k=4, seed=i, max_tokens=3, ignore_eos=True))
            for i in range(1500)]
    outs = generate(engine, reqs)
    assert engine.spec_stats.num_drafts > 0
    # the exact conditional distribution of token 2 given token 1, from plain forwards
    firsts = sorted({o.token_ids[0] for o in outs})
    plain = Runner(model, max_num_seqs=1, max_model_len=64)
    cond = {}
    for t in firsts:
        ids = prompt + [t]
        logits = plain.run(ScheduledBatch((Row(0, 0, tuple(ids), sample=False, logits=True,
                                               new=NewSequence(reqs[0][1], tuple(ids))),))).logits[0][-1]
        kth = logits.topk(4).values[-1]
        cond[t] = torch.softmax(torch.where(logits >= kth, logits, -torch.inf), -1)
    expected = sum(cond[o.token_ids[0]] for o in outs)
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=expected.numel())
    assert _chi2_pvalue(counts, expected / expected.sum()) > 1e-3


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_verify_step_of_the_graph_equals_the_varlen_step(model, method):
    """``Runner._verify_step`` (what a verify graph captures, run eagerly here) against the varlen
    step the CPU runs: the same emitted tokens, kept counts, logprobs and state, batch of 3 at
    different lengths, 12 steps, drafts right up to a random depth (n-gram) or the MTP block's."""
    from dsv4.engine.sampling import SampleFlags
    k = 3
    spec = {"method": method, "num_speculative_tokens": k}
    greedy = SamplingParams(temperature=0.0, max_tokens=1000, logprobs=0)
    rng = random.Random(3)
    runners = [Runner(model, max_num_seqs=3, max_model_len=CONTEXT, speculative=spec) for _ in range(2)]
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 17, 30)]
    for r in runners:
        for s, p in enumerate(prompts):
            _first(r, s, p, greedy)
    varlen, graph = runners
    for _ in range(12):
        lengths = list(varlen.lengths[:3])
        assert lengths == graph.lengths[:3]
        drafts = [[rng.randrange(2, 512) for _ in range(k)] for _ in range(3)]
        rows = tuple(Row(s, lengths[s], draft=tuple(drafts[s])) if method == "ngram" else
                     Row(s, lengths[s], device_draft=k) for s in range(3))
        want = varlen.run(ScheduledBatch(rows))
        idx = torch.arange(3)
        host = torch.tensor(drafts) if method == "ngram" else None
        out, kept = graph._verify_step(idx, host, SampleFlags(logprobs=0), graph.max_model_len)
        assert kept.tolist() == want.emitted
        for s in range(3):
            graph.lengths[s] += kept[s].item()
        assert torch.equal(out.token_ids, want.sampled.token_ids)
        torch.testing.assert_close(out.logprobs, want.sampled.logprobs, rtol=0, atol=1e-5)
        for s in range(3):
            _state_equal(varlen, graph, s, varlen.lengths[s])
        assert torch.equal(varlen.tokens, graph.tokens)
        if method == "mtp":
            assert torch.equal(varlen.drafts, graph.drafts)


INJECT_CONTEXT = 640


def _inject_engine(model, spec):
    from dsv4.engine.core import Engine
    runner = Runner(model, max_num_seqs=2, max_model_len=INJECT_CONTEXT, max_num_batched_tokens=96, speculative=spec)
    return Engine(runner, None, eos_id=1)


@pytest.fixture(scope="module")
def plain_500(model):
    rng = random.Random(10)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (13, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=500, logprobs=0, ignore_eos=True)
    return [(p, params) for p in prompts], generate(_inject_engine(model, None), [(p, params) for p in prompts])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_injected_drafts_500_tokens_equal_plain_decoding(model, plain_500, k):
    """Two requests decoding 500 tokens together (62 window wraps, 31 HCA windows, 125 CSA windows)
    with drafts that are plain decoding's own tokens, each right with probability 0.6 (so every
    accepted length 0..k occurs): the tokens and logprobs of plain decoding."""
    requests, want = plain_500
    rng = random.Random(k)
    oracle = {tuple(p): w.token_ids for (p, _), w in zip(requests, want)}
    engine = _inject_engine(model, {"method": "ngram", "num_speculative_tokens": k})

    def propose(req):
        ref = oracle[tuple(req.prompt_ids)]
        n = len(req.output_ids)
        right = ref[n:n + k] + [3] * (n + k - len(ref))
        return [t if rng.random() < 0.6 else (t + 1 + rng.randrange(500)) % 512 for t in right]
    engine.propose = propose
    engine.spec_policy = None           # every step verifies: every rollback depth, whatever the acceptance
    got = generate(engine, requests)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
    stats = engine.spec_stats
    assert stats.num_drafts > 100
    assert len(stats.accepted_per_pos) == k and all(n > 0 for n in stats.accepted_per_pos)   # every depth reached
    assert stats.num_accepted_tokens < stats.num_draft_tokens                                   # and rejections
