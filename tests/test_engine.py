"""Continuous batching: the scheduler's plans and the engine's outputs (CPU).

The central property: a request's tokens do not depend on what else runs. Many prompts pushed
through 3 slots (mixed prompt lengths, max_tokens, greedy and seeded sampling, chunked prompts)
give each request exactly the tokens it gets alone.
"""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.engine.core import Engine, EngineStats
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.scheduler import Request, Scheduler
from dsv4.errors import ContextOverflowError, RequestError


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=11)


def _engine(model, slots=3, context=160, chunk=16, budget=None) -> Engine:
    runner = Runner(model, max_num_seqs=slots, max_model_len=context, max_num_batched_tokens=budget or chunk)
    return Engine(runner, None, eos_id=1, long_prefill_token_threshold=chunk)


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
    return {rid: done[rid] for rid in ids}


def _requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        length = int(torch.randint(1, 40, (1,), generator=g))
        prompt = torch.randint(2, 512, (length,), generator=g).tolist()
        max_tokens = int(torch.randint(1, 12, (1,), generator=g))
        if i % 3 == 0:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=20 if i % 2 else 0,
                                    top_p=0.9 if i % 4 == 1 else 1.0, seed=100 + i, ignore_eos=True)
        reqs.append((prompt, params))
    return reqs


def test_tokens_do_not_depend_on_what_else_runs(model):
    reqs = _requests(10, seed=1)
    together = _run(_engine(model), reqs)
    for (prompt, params), got in zip(reqs, together.values()):
        alone = _run(_engine(model, slots=1), [(prompt, params)])
        assert list(alone.values())[0] == got
        assert len(got) == params.max_tokens


def test_a_long_prompt_is_chunked_and_does_not_stall_decodes(model):
    engine = _engine(model, slots=2, context=200, chunk=8, budget=10)
    short = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request(list(range(2, 120)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    produced = 0
    for _ in range(10):   # while the long prompt is chunked in, the short request keeps decoding
        produced += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == short)
    assert produced == 10


def test_abort_frees_the_slot_and_others_are_unaffected(model):
    reqs = _requests(4, seed=2)
    reference = _run(_engine(model, slots=2), reqs)
    engine = _engine(model, slots=2)
    ids = [engine.add_request(p, sp) for p, sp in reqs]
    victim = engine.add_request([9, 9, 9], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    done, aborted_seen = {}, False
    steps = 0
    while engine.has_unfinished:
        steps += 1
        if steps == 3:
            # abort from another thread, as a server's disconnect handler would
            t = threading.Thread(target=engine.abort, args=(victim,))
            t.start()
            t.join()
        for out in engine.step():
            if out.request_id == victim and out.finished:
                assert out.finish_reason == "abort"
                aborted_seen = True
            elif out.finished:
                done[out.request_id] = out.output.token_ids
    assert aborted_seen
    assert [done[i] for i in ids] == list(reference.values())
    assert sorted(engine.scheduler.free_slots) == [0, 1]


def test_admission_errors_are_named_and_touch_nothing(model):
    engine = _engine(model, slots=2, context=64)
    with pytest.raises(ContextOverflowError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds max_model_len \(64\)"):
        engine.add_request(list(range(2, 62)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="outside"):
        engine.add_request([1, 5000], SamplingParams())
    rid = engine.add_request([3, 4], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([3, 4], SamplingParams(max_tokens=2), request_id="x")
    assert not engine.scheduler.waiting or engine.scheduler.waiting[0].request_id == rid
    assert len(engine.scheduler.requests) == 1


def test_stop_token_finishes_and_frees_the_slot(model):
    engine = _engine(model, slots=1)
    probe = _run(_engine(model, slots=1), [([7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
    tokens = list(probe.values())[0]
    stop_at = tokens[2]
    rid = engine.add_request([7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_at],
                                                       ignore_eos=True))
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    final = [o for o in outs if o.finished][0]
    assert final.request_id == rid and final.finish_reason == "stop"
    assert final.output.token_ids == tokens[:tokens.index(stop_at) + 1]
    assert engine.scheduler.free_slots == [0]


def test_scheduler_plan_budget_and_fcfs():
    s = Scheduler(max_num_seqs=2, max_model_len=100, max_num_batched_tokens=10, long_prefill_token_threshold=6)
    a = Request("a", list(range(2, 16)), SamplingParams(max_tokens=3))   # 14 prompt tokens
    b = Request("b", [5, 6], SamplingParams(max_tokens=3))
    c = Request("c", [7], SamplingParams(max_tokens=3))
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()                     # a, b admitted (2 slots), c waits
    assert [r.request_id for r in s.running] == ["a", "b"] and list(s.waiting) == [c]
    assert [(ch.request.request_id, ch.start, len(ch.token_ids)) for ch in plan.prefill] == [("a", 0, 6), ("b", 0, 2)]
    plan = s.schedule()                     # b decodes (1 token); a gets 6 more
    assert [r.request_id for r in plan.decode] == ["b"]
    assert [(ch.start, len(ch.token_ids)) for ch in plan.prefill] == [(6, 6)]
    s.finish(b, "stop")
    plan = s.schedule()                     # c takes b's slot in the same step b ended
    assert c.slot == b.slot and c in s.running
    assert [(ch.request.request_id, ch.start) for ch in plan.prefill] == [("a", 12), ("c", 0)]


def test_engine_check_names_the_field_and_changes_nothing(model):
    engine = _engine(model, slots=2, context=64)
    assert engine.check([3, 4], SamplingParams(max_tokens=10)) is None
    with pytest.raises(RequestError, match="empty") as e:
        engine.check([], SamplingParams())
    assert (e.value.param, e.value.code) == (None, None)
    with pytest.raises(RequestError, match=r"outside \[0, 512\)") as e:
        engine.check([1, 5000], SamplingParams())
    assert not isinstance(e.value, ContextOverflowError) and e.value.code is None
    # the prompt alone does not fit: the prompt is at fault
    with pytest.raises(ContextOverflowError, match="the prompt has 64 tokens, but max_model_len is 64") as e:
        engine.check(list(range(2, 66)), SamplingParams(max_tokens=1))
    assert (e.value.param, e.value.code) == (None, "context_length_exceeded")
    # it fits, its max_tokens do not: max_tokens is at fault (raised by the scheduler)
    with pytest.raises(ContextOverflowError, match=r"= 70 exceeds max_model_len \(64\)") as e:
        engine.check(list(range(2, 62)), SamplingParams(max_tokens=10))
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    assert not engine.has_unfinished
    assert (engine.vocab_size, engine.max_num_seqs, engine.max_model_len) == (512, 2, 64)


def test_engine_stats_count_running_waiting_and_slots(model):
    engine = _engine(model, slots=3)
    assert engine.stats() == EngineStats(running=0, waiting=0, slots_used=0, slots_total=3)
    for i in range(5):
        engine.add_request([3 + i, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.stats() == EngineStats(running=0, waiting=5, slots_used=0, slots_total=3)
    engine.step()
    assert engine.stats() == EngineStats(running=3, waiting=2, slots_used=3, slots_total=3)
    while engine.has_unfinished:
        engine.step()
    assert engine.stats() == EngineStats(running=0, waiting=0, slots_used=0, slots_total=3)


def test_engine_fail_all_ends_everything_and_the_engine_keeps_working(model):
    reqs = _requests(6, seed=3)
    reference = _run(_engine(model), [reqs[0]])
    engine = _engine(model)
    engine.overlap = True                 # keep a step in flight, as on a GPU
    ids = [engine.add_request(p, sp) for p, sp in reqs]
    engine.step()
    engine.step()
    assert engine.has_unfinished and engine.stats().running == 3
    ended = engine.fail_all()
    assert sorted(ended) == sorted(ids)
    assert not engine.has_unfinished
    assert engine.stats() == EngineStats(running=0, waiting=0, slots_used=0, slots_total=3)
    assert engine.step() == []            # nothing left over from the failed requests
    assert engine.fail_all() == []
    assert list(_run(engine, [reqs[0]]).values()) == list(reference.values())
