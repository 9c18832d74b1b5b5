"""When speculation runs (issue 25's batch-32 target): ``disable_by_batch_size``'s default and checks,
the verify step's cost ratio, and the per-request acceptance policy through the engine.

The oracle is plain decoding (fp32, the parity model): with the policy, greedy tokens and logprobs
are plain decoding's whatever the drafts. Drafts are injected through ``Engine.propose``: always
wrong (the policy turns speculation off after one verify step and only probes on its schedule, so
the verify steps are few: without the policy every step would verify), always right (it stays on),
and wrong then right (a probe turns it on again), in one batch (mixed verify and plain rows).
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.engine.core import Engine
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.speculative import (DEFAULT_DISABLE_BY_BATCH_SIZE, SpecPolicy, SpeculativeConfig,
                                     verify_cost_ratio)
from dsv4.errors import UsageError
from dsv4.testing import generate

TOKENS = 120
PROBE = 16


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=5, with_mtp=True)


def _engine(model, spec, slots: int = 3) -> Engine:
    runner = Runner(model, max_num_seqs=slots, max_model_len=256, max_num_batched_tokens=96, speculative=spec)
    return Engine(runner, None, eos_id=1)


@pytest.fixture(scope="module")
def plain(model):
    rng = random.Random(4)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=1, ignore_eos=True)
    requests = [([rng.randrange(2, 512) for _ in range(n)], params) for n in (9, 21, 14)]
    return requests, generate(_engine(model, None), requests)


def _truth(requests, want) -> dict:
    """Each prompt's plain-decoding tokens, what a right draft continues."""
    return {tuple(p): w.token_ids for (p, _), w in zip(requests, want)}


def _right(truth: dict, req, k: int) -> list[int]:
    """``k`` drafts that are all right: plain decoding's next tokens (padded past its end)."""
    n = len(req.output_ids)
    return (list(truth[tuple(req.prompt_ids)][n:n + k]) + [3] * k)[:k]


def _wrong(truth: dict, req, k: int) -> list[int]:
    """``k`` drafts that are all wrong: plain decoding's next tokens plus one."""
    return [(t + 1) % 512 for t in _right(truth, req, k)]


def _same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- config


def test_disable_by_batch_size_default_and_override():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert spec.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE == 64
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1,
                                    "disable_by_batch_size": 8}).disable_by_batch_size == 8
    never = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": null}')
    assert never.disable_by_batch_size is None


@pytest.mark.parametrize("value", ["0", "-4", '"8"', "2.5", "true"])
def test_bad_disable_by_batch_size_is_one_clear_error(value):
    with pytest.raises(UsageError, match=r"speculative config: disable_by_batch_size must be an int >= 1 or null"):
        SpeculativeConfig.parse(f'{{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": {value}}}')


def test_verify_cost_ratio_is_the_measured_table():
    assert verify_cost_ratio(1, 3) == pytest.approx(1.81)
    assert verify_cost_ratio(32, 3) == pytest.approx(1.73)
    assert verify_cost_ratio(128, 3) == pytest.approx(1.73)               # constant beyond the table
    assert verify_cost_ratio(4, 3) == pytest.approx(1.81 + 2 / 5 * (1.73 - 1.81))   # log2 interpolation
    ratios = [verify_cost_ratio(b, 3) for b in range(1, 40)]
    assert ratios == sorted(ratios, reverse=True)
    assert verify_cost_ratio(1, 1) == pytest.approx(1 + 0.81 / 3)          # the extra cost scales with k
    for k in (1, 2, 3, 4, 8):                                            # a new request starts speculating
        assert SpecPolicy().start(k).ema >= verify_cost_ratio(1, k)


def test_policy_is_on_where_graphs_replay(model):
    """The cost table is of CUDA graph replays: an eager engine (here, the CPU) speculates at every
    step it can unless given a policy; a speculating engine with graphs gets one by default."""
    assert _engine(model, {"method": "ngram", "num_speculative_tokens": 3}).spec_policy is None
    runner = Runner(model, max_num_seqs=2, max_model_len=64, speculative={"method": "mtp", "num_speculative_tokens": 1})
    runner.graphs[(1, None)] = None              # as if captured (Runner.use_graphs)
    assert isinstance(Engine(runner, None, eos_id=1).spec_policy, SpecPolicy)


def test_more_rows_than_disable_by_batch_size_decode_plainly(model, plain):
    """Three requests over ``disable_by_batch_size = 2``: no verify row while all three decode; the
    plain rows are counted; the tokens are plain decoding's."""
    requests, want = plain
    engine = _engine(model, {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    truth = _truth(requests, want)
    engine.propose = lambda req: _right(truth, req, 2)
    got = generate(engine, requests)
    _same(got, want)
    stats = engine.spec_stats
    assert stats.num_drafts == 0 and stats.num_policy_plain_rows >= 3 * (TOKENS - 2)
    assert sum(g.spec_decode.num_policy_plain_rows for g in got) == stats.num_policy_plain_rows


# ----------------------------------------------------------------------------- the acceptance policy


def test_policy_turns_wrong_drafts_off_and_keeps_right_ones(model, plain):
    """One batch: request 0's drafts always right (it verifies every step), request 1's always wrong
    (one verify step, then only the probes: every 16th step), request 2's wrong for its first 40
    tokens and right after (a probe turns it on again). Plain decoding's tokens and logprobs."""
    requests, want = plain
    k = 3
    truth, kind = _truth(requests, want), {tuple(p): i for i, (p, _) in enumerate(requests)}

    def propose(req):
        i = kind[tuple(req.prompt_ids)]
        right = i == 0 or (i == 2 and len(req.output_ids) >= 40)
        return (_right if right else _wrong)(truth, req, k)

    engine = _engine(model, {"method": "ngram", "num_speculative_tokens": k})
    engine.spec_policy = SpecPolicy(probe_every=PROBE)
    engine.propose = propose
    got = generate(engine, requests)
    _same(got, want)
    right, wrong, late = (g.spec_decode for g in got)
    assert right.num_policy_plain_rows == 0 and right.num_accepted_tokens == k * right.num_drafts
    # always wrong: its first step, then one verify per probe (the steps are at most its tokens)
    assert wrong.num_accepted_tokens == 0
    assert 1 + (TOKENS // 2) // PROBE <= wrong.num_drafts <= 1 + TOKENS // PROBE
    assert wrong.num_policy_plain_rows >= TOKENS - 2 - wrong.num_drafts
    # wrong then right: off after its first step, on again at the first probe after token 40
    assert late.num_accepted_tokens >= k * (late.num_drafts - 2 - 40 // PROBE)
    assert late.num_policy_plain_rows <= 40 + PROBE


def test_steps_of_one_kind_where_verify_graphs_replay(model, plain):
    """``one_kind_steps`` (on whenever the runner has verify graphs: a mixed step runs eagerly): the
    requests of the test above, but no step of decode rows mixes verify and plain rows; the batch
    verifies while its expected extra tokens pay for the verify step. Plain decoding's tokens."""
    requests, want = plain
    k = 3
    truth, kind = _truth(requests, want), {tuple(p): i for i, (p, _) in enumerate(requests)}

    def propose(req):
        return (_right if kind[tuple(req.prompt_ids)] == 0 else _wrong)(truth, req, k)

    engine = _engine(model, {"method": "ngram", "num_speculative_tokens": k})
    # (a table of its own: at 3 rows it costs 2.15x a decode step, whatever the engine's table says)
    engine.spec_policy = SpecPolicy(probe_every=PROBE, cost=((1, 2.39), (32, 1.62)))
    engine.one_kind_steps = True
    engine.propose = propose
    kinds = []
    run = engine.runner.run

    def spy(batch):
        if all(r.is_decode for r in batch.rows) and len(batch.rows) == 3:
            kinds.append({r.is_verify for r in batch.rows})
        return run(batch)
    engine.runner.run = spy
    got = generate(engine, requests)
    _same(got, want)
    assert {True} in kinds and {False} in kinds and {True, False} not in kinds
    # the always-right request alone does not pay for verifying all three (1 + 3 < 3 x 2.15)
    assert got[0].spec_decode.num_policy_plain_rows > TOKENS // 2


def test_without_the_policy_wrong_drafts_verify_every_step(model, plain):
    """The same always-wrong drafts with the policy off (``spec_policy = None``): a verify row at
    every step, what the policy above avoids."""
    requests, want = plain
    engine = _engine(model, {"method": "ngram", "num_speculative_tokens": 3})
    engine.spec_policy = None
    truth = _truth(requests, want)
    engine.propose = lambda req: _wrong(truth, req, 3)
    got = generate(engine, requests[:1])
    _same(got, want[:1])
    assert got[0].spec_decode.num_drafts == TOKENS - 2 and got[0].spec_decode.num_policy_plain_rows == 0


def test_policy_applies_to_mtp_drafts(model, plain):
    """MTP (random weights: its drafts are almost never right): the verify steps are the first ones
    and two per probe (a probe after plain steps first refreshes the stale drafts: only its second
    verify step counts); plain decoding's tokens."""
    requests, want = plain
    engine = _engine(model, {"method": "mtp", "num_speculative_tokens": 2})
    engine.spec_policy = SpecPolicy(probe_every=PROBE)
    got = generate(engine, requests)
    _same(got, want)
    for g in got:
        s = g.spec_decode
        assert s.num_policy_plain_rows > TOKENS // 2
        assert s.num_drafts <= 4 + 2 * (TOKENS // PROBE)


def test_plain_steps_overlap_while_every_request_is_off(model, plain):
    """As on a GPU (``overlap``: a step stays in flight while the host plans the next): always-wrong
    drafts for every request, so after their first verify step the steps overlap, and each probe
    collects the steps in flight first (the drafts follow the last token). Plain decoding's tokens;
    the verify steps only the first and the probes."""
    requests, want = plain
    truth = _truth(requests, want)
    engine = _engine(model, {"method": "ngram", "num_speculative_tokens": 3})
    engine.overlap = True
    engine.spec_policy = SpecPolicy(probe_every=PROBE)
    in_flight = []
    launch = engine._launch

    def spy(plan):
        in_flight.append(len(engine._inflight))
        return launch(plan)
    engine._launch = spy
    engine.propose = lambda req: _wrong(truth, req, 3)
    got = generate(engine, requests)
    _same(got, want)
    assert sum(n > 0 for n in in_flight) > TOKENS // 2            # most steps launched with one in flight
    for g in got:
        assert g.spec_decode.num_accepted_tokens == 0
        assert 1 + (TOKENS // 2) // PROBE <= g.spec_decode.num_drafts <= 1 + TOKENS // PROBE
