"""Structured outputs with speculative decoding (issue 26): a constrained request verifies n-gram drafts,
each verify position masked by the grammar state after the drafts before it.

The oracle is plain decoding with the same constraint (fp32, the parity model with the tiny model's
tokenizer): greedy tokens and logprobs equal whatever the drafts (right, wrong, forbidden by the
grammar at every depth), with thinking on and a thinking budget; :meth:`Constraint.draft_masks`
equals the masks plain decoding computes token by token and leaves the constraint as it was; with
sampling, the emitted distribution is the masked target's (chi-square, of ``verify`` on fixed logits
and through the engine).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")

from conftest import parity_config, random_model  # noqa: E402
from dsv4.engine.batch import NewSequence, Row, ScheduledBatch  # noqa: E402
from dsv4.engine.core import Engine  # noqa: E402
from dsv4.engine.grammar import StructuredOutputsParams  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SampleFlags, SamplingParams, SlotSampling  # noqa: E402
from dsv4.testing import generate  # noqa: E402

K = 3
LIMIT = 40       # a constraint's token limit in the draft-mask test
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = "[A-Z]{3}-[0-9]{2}"
CHOICE = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=5)


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    from dsv4.text.tokenizer import Tokenizer
    t = Tokenizer.from_dir(tiny_checkpoint)
    assert t.vocab_size <= parity_config().vocab_size
    return t


def _engine(model, tok, spec, slots: int = 3) -> Engine:
    runner = Runner(model, max_num_seqs=slots, max_model_len=256, max_num_batched_tokens=96, speculative=spec)
    return Engine(runner, tok, eos_id=tok.eos_id)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, **kw)


def _requests(tok) -> list:
    """A JSON schema, a regex and a choice after ``</think>``; the choice with thinking on (free
    reasoning until ``</think>``), once under a thinking budget; a thinking budget with no grammar."""
    def answer(text):
        return tok.encode(text + "<｜Assistant｜></think>")

    def think(text):
        return tok.encode(text + "<｜Assistant｜><think>")
    return [(answer("Describe it."), _greedy(60, structured_outputs=StructuredOutputsParams(json=SCHEMA))),
            (answer("The code?"), _greedy(30, structured_outputs=StructuredOutputsParams(regex=REGEX))),
            (answer("Pick one."), _greedy(20, structured_outputs=StructuredOutputsParams(choice=CHOICE))),
            (think("Pick one."), _greedy(40, structured_outputs=StructuredOutputsParams(choice=CHOICE))),
            (think("Describe it."), _greedy(40, structured_outputs=StructuredOutputsParams(json=SCHEMA),
                                             thinking_token_budget=6)),
            (think("Go on."), _greedy(24, thinking_token_budget=4))]


@pytest.fixture(scope="module")
def plain(model, tok):
    requests = _requests(tok)
    return requests, generate(_engine(model, tok, None), requests, skip_special_tokens=False)


def _check_answers(tok, outs) -> None:
    """Each output is what its constraint allows (the random model never writes these by itself)."""
    think_end = "</think>"
    texts = [o.text.split(think_end)[-1] for o in outs]
    assert set(json.loads(texts[0])) == {"name", "n"}
    assert re.fullmatch(REGEX, texts[1]) and texts[2] in CHOICE and texts[3] in CHOICE
    assert set(json.loads(texts[4])) == {"name", "n"}
    reasoning = outs[4].token_ids.index(tok.special_id(think_end))
    assert reasoning <= 6
    assert tok.special_id(think_end) in outs[5].token_ids[:5]


def _same(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, i
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason), i
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
        assert [[t for t, _ in x] for x in g.top_logprobs] == [[t for t, _ in x] for x in w.top_logprobs]


def _drafter(tok, requests, want):
    """Drafts from plain decoding's own tokens (the prompts differ), cycling per call through: a token
    the grammar forbids (a special token, which no constraint here allows) at depth 0, 1, .. k - 1
    after right ones, all right, and all off by one (wrong, often forbidden too)."""
    truth = {tuple(p): w.token_ids for (p, _), w in zip(requests, want)}
    forbidden = tok.special_id("<｜Assistant｜>")
    calls = iter(range(10 ** 6))

    def propose(req):
        n = len(req.output_ids)
        ahead = (list(truth[tuple(req.prompt_ids)][n:n + K]) + [3] * K)[:K]
        mode = next(calls) % (K + 2)
        if mode < K:
            return ahead[:mode] + [forbidden] + ahead[mode + 1:]
        return ahead if mode == K else [(t + 1) % 512 for t in ahead]
    return propose


def test_greedy_constrained_speculation_equals_plain_decoding(model, tok, plain):
    """Six constrained requests (JSON schema, regex, choice; thinking on, a thinking budget with and
    without a grammar) verify injected drafts with the policy off (every step verifies): plain
    decoding's tokens, logprobs, texts, finish reasons; every answer matches its constraint; drafts
    accepted at every depth and rejected."""
    requests, want = plain
    _check_answers(tok, want)
    engine = _engine(model, tok, {"method": "ngram", "num_speculative_tokens": K})
    for part in (slice(0, 3), slice(3, 6)):        # three at a time (three slots)
        engine.propose = _drafter(tok, requests[part], want[part])
        _same(generate(engine, requests[part], skip_special_tokens=False), want[part])
    stats = engine.spec_stats
    assert stats.num_drafts > 30
    assert len(stats.accepted_per_pos) == K and all(n > 0 for n in stats.accepted_per_pos)
    assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_policy_and_overlap_with_constrained_speculation(model, tok, plain):
    """The speculation policy and the overlapped schedule (as on a GPU) with constrained requests:
    always-right drafts keep verifying, always-forbidden drafts turn speculation off after one
    verify step (then only probes); plain decoding's tokens."""
    from dsv4.engine.speculative import SpecPolicy
    requests, want = plain
    requests, want = requests[:3], want[:3]
    truth = {tuple(p): w.token_ids for (p, _), w in zip(requests, want)}
    good = tuple(requests[0][0])
    forbidden = tok.special_id("<｜Assistant｜>")

    def propose(req):
        n = len(req.output_ids)
        if tuple(req.prompt_ids) == good:
            return (list(truth[tuple(req.prompt_ids)][n:n + K]) + [3] * K)[:K]
        return [forbidden] * K
    engine = _engine(model, tok, {"method": "ngram", "num_speculative_tokens": K})
    engine.spec_policy = SpecPolicy(probe_every=8)
    engine.overlap = True
    engine.propose = propose
    got = generate(engine, requests, skip_special_tokens=False)
    _same(got, want)
    right, *wrong = (g.spec_decode for g in got)
    assert right.num_drafts > 5 and right.num_accepted_tokens >= K * (right.num_drafts - 1)
    for w in wrong:
        assert w.num_accepted_tokens == 0 and w.num_policy_plain_rows > 0


def test_draft_masks_equal_plain_masks_and_change_nothing(model, tok):
    """``Constraint.draft_masks`` against the masks plain decoding computes while accepting the same
    tokens one at a time, through the reasoning (its budget), ``</think>``, the grammar and the
    closing reserve; the constraint is as before afterwards; rows after a forbidden draft allow EOS
    only."""
    engine = _engine(model, tok, None)
    think = tok.encode("Go.<｜Assistant｜><think>")
    params = _greedy(LIMIT, structured_outputs=StructuredOutputsParams(json=SCHEMA), thinking_token_budget=3)
    reasoning, answer = tok.encode("ab cd ef"), tok.encode('{"name":"' + "xy" * 40)     # 5 tokens, then more
    words = (engine.vocab_size + 31) // 32

    def fresh():
        return engine.grammars.constraint(params, think, LIMIT)

    # a walk plain decoding could take: the script's next token where allowed, else the lowest allowed
    # token but EOS (the budget of 3 forces </think> inside the reasoning; the reserve closes the string)
    plain, tokens, closing, walker = [], [], [], fresh()
    while len(tokens) < LIMIT and (not tokens or tokens[-1] != tok.eos_id):
        row = torch.empty(words, dtype=torch.int32)
        walker.mask_row(row)
        ok = [t for t in range(engine.vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1]
        script = reasoning if walker.reasoning else answer
        want = script.pop(0) if script else None
        t = want if want in ok else next((t for t in ok if t != tok.eos_id), tok.eos_id)
        plain.append(row)
        tokens.append(t)
        closing.append(walker.closing)
        walker.accept([t])
    assert tokens.index(tok.special_id("</think>")) == 3 and tokens[-1] == tok.eos_id
    assert set(json.loads(tok.decode(tokens[4:-1]))) == {"name", "n"} and any(closing)   # closed by the reserve
    c = fresh()
    for at in range(len(tokens) - K):
        drafts = tokens[at:at + K]
        before = (c.generated, c.reasoning, c.reasoning_tokens, c.left)
        out = c.draft_masks(drafts, torch.empty(K + 1, words, dtype=torch.int32))
        assert (c.generated, c.reasoning, c.reasoning_tokens, c.left) == before
        for i in range(K + 1):
            assert torch.equal(out[i], plain[at + i]), (at, i)
        c.accept(drafts[:1])
    # a forbidden draft: its own row is the plain one, the later rows allow EOS only
    c = fresh()
    out = c.draft_masks([tokens[0], tok.special_id("<｜Assistant｜>"), tokens[2]],
                        torch.empty(K + 1, words, dtype=torch.int32))
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    eos = torch.zeros(words, dtype=torch.int32)
    eos[tok.eos_id // 32] = 1 << tok.eos_id % 32
    assert torch.equal(out[2], eos) and torch.equal(out[3], eos)


def test_verify_step_of_the_graph_applies_the_masks_like_the_varlen_step(model, tok):
    """``Runner._verify_step`` (what a verify graph captures, run eagerly) against the varlen step, with
    staged per-position masks (a choice grammar; one free row beside it): the same tokens and kept
    counts, and every emitted token allowed by its position's mask."""
    spec = {"method": "ngram", "num_speculative_tokens": K}
    engine = _engine(model, tok, None)
    answer = tuple(tok.encode("Pick.<｜Assistant｜></think>"))
    constrained = _greedy(20, structured_outputs=StructuredOutputsParams(choice=CHOICE))
    free = _greedy(20)
    runners = [Runner(model, max_num_seqs=2, max_model_len=128, speculative=spec) for _ in range(2)]
    c = engine.grammars.constraint(constrained, list(answer), 20)
    for r in runners:                  # the prompts, the first token sampled under the first mask
        r.sampling.bitmask.stage([(0, c), (1, None)])
        r.run(ScheduledBatch((Row(0, 0, answer, new=NewSequence(constrained, answer)),
                              Row(1, 0, answer, new=NewSequence(free, answer)))))
    varlen, graph = runners
    first = int(varlen.tokens[0])
    assert first == int(graph.tokens[0])
    c.accept([first])
    alpha = tok.encode("alpha")
    for drafts in ([alpha[1], alpha[2], 7], [tok.special_id("<｜Assistant｜>"), 9, 9], [9, 9, 9]):
        rows = (Row(0, varlen.lengths[0], draft=tuple(drafts)), Row(1, varlen.lengths[1], draft=(5, 6, 7)))
        for r in runners:
            r.sampling.bitmask.stage([(0, c), (1, None)], {0: drafts, 1: (5, 6, 7)})
        want = varlen.run(ScheduledBatch(rows))
        flags = varlen.sampling.flags([0, 1])
        assert flags.grammar
        out, kept = graph._verify_step(torch.arange(2), torch.tensor([drafts, [5, 6, 7]]), flags, graph.max_model_len)
        assert kept.tolist() == want.emitted
        assert torch.equal(out.token_ids, want.sampled.token_ids)
        for s in range(2):
            graph.lengths[s] += int(kept[s])
        masks = c.draft_masks(drafts, torch.empty(K + 1, (graph.model.config.vocab_size + 31) // 32,
                                                  dtype=torch.int32))
        emitted = want.sampled.token_ids[0, :want.emitted[0]].tolist()
        for i, t in enumerate(emitted):
            assert (int(masks[i, t // 32]) >> (t % 32)) & 1, (drafts, emitted)
        c.accept(emitted)
        if c.matcher.is_stopped():
            break
    assert c.error is None


# ----------------------------------------------------------------------------- sampling


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the masked target's support was emitted"
    probs = probs.double()[keep]
    expected = probs / probs.sum() * counts.sum().double()
    return float(chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=3)])
def test_rejection_sampling_keeps_the_masked_target_distribution(knobs):
    """Verify rows over fixed logits on an 8-token vocabulary, 6000 seeds, a different mask at each
    position: the first emitted token follows the masked target at position 0 whether the draft is
    allowed or forbidden there, and the second (where the first draft was kept) the masked target
    at position 1; the mask comes before top-k, as in plain sampling (chi-square, fixed seeds)."""
    from dsv4.engine.speculative import verify
    V, b, S = 8, 6000, 3
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(S, V, generator=gen) * 1.5
    sampling = SlotSampling(b, V, "cpu")
    sampling.bitmask.enable_drafts(S - 1)
    params = [SamplingParams(seed=i, structured_outputs=StructuredOutputsParams(choice=["x"]), **knobs)
              for i in range(b)]
    for i, p in enumerate(params):
        sampling.assign(i, p, [1])
    flags = SampleFlags.of(params, V)
    assert flags.grammar
    allowed = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]],
                           dtype=torch.bool)
    bits = (allowed.int() << torch.arange(V)).sum(1, dtype=torch.int32)              # one word a mask
    sampling.bitmask.draft_bits[:, :, 0] = bits

    def target(row: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        scaled = torch.where(ok, row, -torch.inf) / knobs["temperature"]
        if knobs.get("top_k"):
            scaled = torch.where(scaled >= scaled.topk(knobs["top_k"]).values[-1], scaled, -torch.inf)
        return torch.softmax(scaled, -1)

    p0, p1 = target(logits[0], allowed[0]), target(logits[1], allowed[1])
    raw = torch.softmax(logits[0], -1)
    likely = int(p0.argsort()[-2])                                   # allowed, second most likely
    forbidden = int(torch.where(allowed[0], -1.0, raw).argmax())    # the most likely forbidden token
    assert not allowed[0, forbidden] and allowed[0, likely]
    drafts = torch.tensor([[likely if i % 2 else forbidden, int(p1.argmax())] for i in range(b)])
    out, kept = verify(sampling, logits.expand(b, S, V), torch.arange(b), drafts, flags)
    tokens = out.token_ids
    assert ((tokens >= 0).sum(1) == kept).all()
    assert (kept[0::2] == 1).all()                                   # a forbidden draft is never kept
    for half in (0, 1):
        first = tokens[half::2, 0]
        assert _chi2_pvalue(torch.bincount(first, minlength=V), p0) > 1e-3
    second = tokens[kept >= 2, 1]
    assert second.numel() > 500
    assert _chi2_pvalue(torch.bincount(second, minlength=V), p1) > 1e-3


def test_constrained_sampling_through_the_engine_keeps_the_masked_distribution(model, tok):
    """Through the engine (n-gram verify rows, k = 2): 500 seeded requests constrained to a choice; the
    second token, drawn by a verify step whose draft is the likeliest allowed token for half of them
    and a forbidden one for the rest, follows the masked conditional distribution given the first
    (chi-square against the exact probabilities: a plain forward and the grammar's mask)."""
    prompt = tok.encode("Pick one.<｜Assistant｜></think>")
    spec = StructuredOutputsParams(choice=CHOICE)
    reqs = [(prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=4, structured_outputs=spec))
            for i in range(500)]
    engine = _engine(model, tok, {"method": "ngram", "num_speculative_tokens": 2}, slots=64)
    engine.runner.max_num_batched_tokens = 1024
    words = (engine.vocab_size + 31) // 32
    plain = Runner(model, max_num_seqs=1, max_model_len=64)

    def masked_next(after: list[int]) -> torch.Tensor:      # the masked distribution after prompt + after
        c = engine.grammars.constraint(reqs[0][1], prompt, 4)
        c.accept(after)
        row = torch.empty(words, dtype=torch.int32)
        c.mask_row(row)
        ids = tuple(prompt + after)
        logits = plain.run(ScheduledBatch((Row(0, 0, ids, sample=False, logits=True,
                                               new=NewSequence(reqs[0][1], ids)),))).logits[0][-1]
        ok = torch.tensor([(int(row[t // 32]) >> (t % 32)) & 1 for t in range(logits.numel())], dtype=torch.bool)
        return torch.softmax(torch.where(ok, logits, -torch.inf), -1)

    firsts = masked_next([]).nonzero().flatten().tolist()
    cond = {t: masked_next([t]) for t in firsts}
    forbidden = tok.special_id("<｜Assistant｜>")

    def propose(req):
        first = req.output_ids[0]
        return [int(cond[first].argmax()) if req.params.seed % 2 else forbidden, forbidden]
    engine.propose = propose
    outs = generate(engine, reqs)
    assert all(any(c.startswith(o.text) for c in CHOICE) for o in outs)    # cut at max_tokens, or whole
    assert any(o.text in CHOICE for o in outs)
    assert engine.spec_stats.num_drafts >= len(reqs) and 0 < engine.spec_stats.num_accepted_tokens
    expected = sum(cond[o.token_ids[0]] for o in outs)
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=expected.numel())
    assert _chi2_pvalue(counts, expected / expected.sum()) > 1e-3
