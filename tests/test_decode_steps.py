"""Several decode steps in a step that runs prompt chunks (``ScheduledBatch.decode_steps``,
``EngineConfig.prefill_decode_steps``).

While the host launches a prompt chunk's eager forward (tens of ms at any chunk size on a GPU), the
running requests take several decode steps (graph replays on a GPU) instead of one token in the
chunk's forward. The property: a request's tokens and logprobs do not change, in fp32 on the CPU
(where the steps are eager decode steps): with staggered arrivals, seeded sampling, logprobs, stop
tokens and ``max_tokens`` landing inside a step's decode steps, and with prefix caching saving the
state where a decode step inside such a step reaches a block boundary.
"""

from __future__ import annotations

import random

import pytest

from conftest import parity_config, random_model
from dsv4.engine.batch import NewSequence, Row, Save, ScheduledBatch
from dsv4.engine.core import Engine
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SamplingParams
from dsv4.testing import generate_arriving

CONTEXT = 320


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=11)


def _engine(model, steps: int | None, slots: int = 3, budget: int = 96, cache_bytes: int = 0) -> Engine:
    runner = Runner(model, max_num_seqs=slots, max_model_len=CONTEXT, max_num_batched_tokens=budget,
                    prefix_cache_bytes=cache_bytes)
    return Engine(runner, None, eos_id=1, long_prefill_token_threshold=40, prefill_decode_steps=steps)


def _spy(engine: Engine, saves: list | None = None) -> list[tuple[int, bool]]:
    """Record each step's ``decode_steps`` (and whether it also ran a prompt chunk); into ``saves``
    the decode step of each save planned inside a step's decode steps."""
    seen = []
    run = engine.runner.run

    def spy(batch, before_sample=None):
        seen.append((batch.decode_steps, any(not r.is_decode for r in batch.rows)))
        if saves is not None:
            saves.extend(sv.decode_step for sv in batch.saves if sv.decode_step is not None)
        return run(batch, before_sample)
    engine.runner.run = spy
    return seen


def _drain(engine: Engine, arrivals: list[list[tuple[list[int], SamplingParams]]]) -> dict[int, tuple]:
    """Each request's (tokens, logprobs, finish reason, cached tokens) by its index in the
    flattened arrivals (``arrivals[k]`` added before step k)."""
    return {i: (o.token_ids, o.logprobs, o.finish_reason, o.num_cached_tokens)
            for i, o in generate_arriving(engine, arrivals).items()}


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for i in want:
        assert got[i][0] == want[i][0], f"request {i}: tokens differ"
        assert got[i][1] == pytest.approx(want[i][1], abs=1e-5), f"request {i}: logprobs differ"
        assert got[i][2] == want[i][2], f"request {i}: finish reason differs"


def _arrivals(seed: int, stop: dict[int, int] | None = None) -> list[list[tuple[list[int], SamplingParams]]]:
    """Requests arriving over the first steps (so decoding requests share steps with prompt chunks),
    greedy and seeded sampling with logprobs, ``max_tokens`` from 1 up; ``stop``: request -> a
    stop token id."""
    rng = random.Random(seed)
    reqs = []
    for i in range(9):
        n = rng.choice([1, 5, 16, 17, 40, 63, 90, 130])
        max_tokens = rng.choice([1, 2, 3, 9, 25, 40])
        stops = [stop[i]] if stop and i in stop else []
        if i % 2:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1,
                                    stop_token_ids=stops)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, seed=70 + i,
                                    ignore_eos=True, logprobs=1, stop_token_ids=stops)
        reqs.append(([rng.randrange(2, 512) for _ in range(n)], params))
    return [reqs[:2], [], [], reqs[2:3], [], reqs[3:5], [], [], [], reqs[5:7], [], reqs[7:]]


def test_decode_steps_in_prompt_steps_change_no_token(model):
    """Requests decoding while others' prompts are prefilled take 3 (or 5) decode steps in those steps;
    every request's tokens, logprobs and finish reason equal those of one token a step."""
    want = _drain(_engine(model, 1), _arrivals(0))
    for steps in (3, 5):
        engine = _engine(model, steps)
        seen = _spy(engine)
        _same(_drain(engine, _arrivals(0)), want)
        assert any(n == steps and chunk for n, chunk in seen), seen      # the path ran at full length
        assert all(n == 1 or chunk for n, chunk in seen)                 # only steps with a prompt chunk


def test_a_stop_token_inside_a_steps_decode_steps_ends_the_request_there(model):
    """A stop token sampled at a step's 1st or 2nd decode step ends the request there: the tokens
    decoded after it in the same step are dropped, as one token a step would never have made them."""
    plain = _drain(_engine(model, 1), _arrivals(1))
    # stop each request on its 3rd token, which decode steps of 4 reach in the middle of a step
    stop = {i: toks[2] for i, (toks, *_rest) in plain.items() if len(toks) > 3}
    want = _drain(_engine(model, 1), _arrivals(1, stop))
    assert any(len(want[i][0]) == 3 and want[i][2] == "stop" for i in stop)
    _same(_drain(_engine(model, 4), _arrivals(1, stop)), want)


def test_prefix_cache_saves_inside_a_steps_decode_steps(model):
    """Prefix caching on (block 16): a decode step inside a multi-step step that reaches a block
    boundary saves the state there; the next turn of each conversation hits it and every token and
    logprob equals caching off with one token a step."""
    rng = random.Random(3)
    first = [([rng.randrange(2, 512) for _ in range(n)], SamplingParams(max_tokens=m, temperature=0.0,
                                                                        ignore_eos=True, logprobs=0))
             for n, m in ((20, 30), (7, 41), (33, 26))]
    late = [([rng.randrange(2, 512) for _ in range(60)], SamplingParams(max_tokens=3, temperature=0.0,
                                                                       ignore_eos=True))]

    def turns(engine: Engine):
        one = _drain(engine, [first[:1], [], first[1:], [], [], late, [], [], late, [], [], late])
        follow = [(first[i][0] + one[i][0] + [5, 6, 7], first[i][1]) for i in range(3)]
        return one, _drain(engine, [follow])

    off_one, off_two = turns(_engine(model, 1))
    engine = _engine(model, 4, cache_bytes=8 << 20)
    inside = []
    seen = _spy(engine, inside)
    on_one, on_two = turns(engine)
    _same(on_one, off_one)
    _same(on_two, off_two)
    assert any(n == 4 for n, _ in seen) and any(j < 3 for j in inside), (seen, inside)   # saves mid-step
    plain_on = turns(_engine(model, 1, cache_bytes=8 << 20))[1]
    for i in range(3):      # each turn-2 prompt hits turn 1's state up to its last full block (the last
        fed = len(first[i][0]) + len(off_one[i][0]) - 1     # output token was never fed)
        assert on_two[i][3] == plain_on[i][3] == fed // 16 * 16 > len(first[i][0]) // 16 * 16


def test_a_step_of_several_decode_steps_takes_plain_decode_rows_only(model):
    """The runner refuses, before any state moves, a step of several decode steps with a decode row
    it cannot repeat (one asking for logits), one that would pass the context, and a save after a
    decode step the step does not run."""
    runner = Runner(model, max_num_seqs=3, max_model_len=40, prefix_cache_bytes=1 << 20)
    params = SamplingParams(temperature=0.0)
    runner.run(ScheduledBatch((Row(0, 0, (5, 6, 7), new=NewSequence(params, (5, 6, 7))),
                               Row(1, 0, tuple(range(2, 39)), new=NewSequence(params, tuple(range(2, 39)))))))
    before = list(runner.lengths), runner.state.positions.tolist()
    chunk = Row(2, 0, (9, 9), new=NewSequence(params, (9, 9)))
    bad = [
        ScheduledBatch((Row(0, 3, logits=True), chunk), decode_steps=2),         # a decode row with logits
        ScheduledBatch((Row(1, 37), chunk), decode_steps=4),                     # 37 + 4 > 40
        ScheduledBatch((Row(0, 3), chunk), (Save(0, 0, (0,), (), decode_step=5),), decode_steps=2),
        ScheduledBatch((Row(0, 3), chunk), decode_steps=0),
    ]
    for batch in bad:
        with pytest.raises(ValueError):
            runner.run(batch)
        assert (list(runner.lengths), runner.state.positions.tolist()) == before
    out = runner.run(ScheduledBatch((Row(0, 3), chunk), decode_steps=3))
    assert out.emitted == [3, 1] and list(out.sampled.token_ids.shape) == [2, 3]
    assert out.sampled.token_ids[1, 1:].tolist() == [-1, -1]
    assert runner.lengths[:3] == [6, 37, 2]
