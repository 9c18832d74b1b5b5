"""One forward per engine step (DESIGN decision 6): every prompt chunk and decode row together.

The property: a request's tokens and logprobs do not depend on what shares its steps. Requests with
prompts of 1 to 3000 tokens (across the sliding window and every compression ratio, at every
alignment), arriving together and staggered, through few slots and a large token budget, get
exactly the tokens (and logprobs to 1e-5) they get alone, in fp32 on the CPU. Tensor parallel 2
(gloo) runs the same steps as one process.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
from dsv4.engine.core import Engine
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.state import GenerationState
from dsv4.testing import generate_arriving

CONTEXT = 3100


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=5)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def test_varlen_forward_equals_each_row_alone(model):
    """Two steps of rows of different lengths (decode rows among them) in one forward each, against
    each row run by itself: logits agree to fp32 rounding."""
    cfg = model.config
    rng = random.Random(0)
    a, b, c = _prompt(rng, 37), _prompt(rng, 23), _prompt(rng, 50)

    def state():
        return GenerationState(cfg, 4, 256, torch.float32, torch.device("cpu"), qat_sim=False)

    alone = state()

    def one(slot, ids, start):
        logits, _ = model(torch.tensor([ids]), torch.tensor([slot]), torch.tensor([start]), alone.layers)
        alone.positions[slot] = start + len(ids)
        return logits[0]

    want = [one(0, a[:30], 0), one(1, b, 0), one(0, a[30:], 30), one(2, c, 0), one(1, [7], 23), one(3, [9], 0)]

    together = state()
    t = lambda *xs: torch.tensor(xs)   # noqa: E731
    first = model.forward_varlen(torch.tensor(a[:30] + b), [(t(0), t(0), 30, 30), (t(1), t(0), 23, 23)],
                                 together.layers, torch.arange(53))
    second = model.forward_varlen(torch.tensor([7, 9] + a[30:] + c),
                                  [(t(1, 3), t(23, 0), 1, 24), (t(0), t(30), 7, 37), (t(2), t(0), 50, 50)],
                                  together.layers, torch.arange(59))
    got = [first[:30], first[30:], second[2:9], second[9:], second[0:1], second[1:2]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item())


def _engine(model, slots: int, budget: int, chunk: int | None = None) -> Engine:
    runner = Runner(model, max_num_seqs=slots, max_model_len=CONTEXT, max_num_batched_tokens=budget)
    return Engine(runner, None, eos_id=1, long_prefill_token_threshold=chunk or 0)


def _requests(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompt lengths: every alignment against the window (8) and the ratios (4, 16) near 1, a few
    hundred and up to 3000; greedy and seeded sampling, with logprobs."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 129, 250, 1000, 2999] + \
        [rng.randint(1, 600) for _ in range(4)]
    rng.shuffle(lengths)
    out = []
    for i, n in enumerate(lengths):
        max_tokens = rng.randint(1, 20) if n < 2999 else 20
        if i % 2:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=300 + i,
                                    ignore_eos=True, logprobs=1)
        out.append((_prompt(rng, n), params))
    return out


def _drain(engine: Engine, arrivals: list[list[tuple[list[int], SamplingParams]]]
           ) -> dict[int, tuple[list[int], list[float]]]:
    """Add ``arrivals[k]`` before step k (then step until done); each request's tokens and logprobs
    by its index in the flattened arrivals."""
    return {i: (o.token_ids, o.logprobs) for i, o in generate_arriving(engine, arrivals).items()}


@pytest.fixture(scope="module")
def alone(model):
    """Each request of :func:`_requests` run by itself: one slot, whole prompts in one forward."""
    reqs = _requests(seed=1)
    return reqs, {i: _drain(_engine(model, 1, 4096), [[r]])[0] for i, r in enumerate(reqs)}


def _check(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for i in want:
        assert got[i][0] == want[i][0], f"request {i}: tokens differ"
        assert got[i][1] == pytest.approx(want[i][1], abs=1e-5), f"request {i}: logprobs differ"


@pytest.mark.slow
def test_requests_arriving_together_get_what_they_get_alone(model, alone):
    reqs, want = alone
    _check(_drain(_engine(model, 3, 4096), [reqs]), want)


@pytest.mark.slow
def test_staggered_arrivals_and_small_chunks_get_what_they_get_alone(model, alone):
    """Requests arrive over the first steps; a budget of 700 with chunks of at most 300 cuts the long
    prompts at other boundaries than alone (and shares steps between several prompts' chunks)."""
    reqs, want = alone
    arrivals = [reqs[:5], [], reqs[5:6], reqs[6:12], [], [], reqs[12:]]
    _check(_drain(_engine(model, 4, 700, chunk=300), arrivals), want)


def test_one_forward_per_step(model, monkeypatch):
    """Prompts admitted together and the running decodes share one forward; the scheduler fills the
    budget in order: decode rows first, then prompt chunks in arrival order."""
    engine = _engine(model, 4, 64)
    calls = []
    real = model.forward_varlen
    monkeypatch.setattr(model, "forward_varlen", lambda ids, groups, *a, **k: calls.append(
        [(g[0].tolist(), g[2]) for g in groups]) or real(ids, groups, *a, **k))
    keep = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    a = engine.add_request(list(range(2, 12)), keep)        # 10 tokens
    b = engine.add_request(list(range(2, 22)), keep)        # 20
    c = engine.add_request(list(range(2, 62)), keep)        # 60: 34 of it fits the first step
    engine.step()
    assert calls == [[([0], 10), ([1], 20), ([2], 34)]]
    engine.step()        # a and b decode (one group of one-token rows), c's remaining 26 tokens
    assert calls[1] == [([0, 1], 1), ([2], 26)]
    d = engine.add_request(list(range(2, 9)), keep)
    engine.step()        # only decodes and d's prompt
    assert calls[2] == [([0, 1, 2], 1), ([3], 7)]
    assert {a, b, c, d} == set(engine.tracks)


def test_a_bad_row_changes_nothing(model):
    """Every check of a step runs before any state moves: a row past the context, a wrong start, a
    slot twice or out of range is refused and the slots keep their lengths."""
    runner = Runner(model, max_num_seqs=2, max_model_len=64)
    params = SamplingParams(temperature=0.0)
    runner.run(ScheduledBatch((Row(0, 0, (5, 6, 7), new=NewSequence(params, (5, 6, 7))),)))
    before = list(runner.lengths), runner.state.positions.clone()
    bad = [
        (Row(0, 3), Row(1, 0, tuple(range(70)), new=NewSequence(params, tuple(range(70))))),   # context
        (Row(0, 2),),                                                                         # start
        (Row(0, 3), Row(0, 3)),                                                               # twice
        (Row(0, 3), Row(5, 0, (1,), new=NewSequence(params, (1,)))),                          # range
        (Row(1, 0, ()),),                                                                     # empty
    ]
    for rows in bad:
        with pytest.raises((ValueError, IndexError)):
            runner.run(ScheduledBatch(rows))
        assert (list(runner.lengths), runner.state.positions.tolist()) == (before[0], before[1].tolist())
