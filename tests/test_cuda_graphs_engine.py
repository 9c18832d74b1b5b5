"""Whole-step CUDA graphs in the engine (GPU only; run by bench/gpu_check.sh).

For every tiny release (BF16, FP8+MXFP4, FP8+NVFP4) and QAT setting, graph replay gives the same
tokens as eager steps (greedy and seeded sampling, a logit bias, min_tokens and an allow-list, every batch
bucket as requests come and go; also
with 4 decode steps of the running requests in each step that admits a prompt),
and a replayed step allocates nothing: the allocator's counters are flat over 100 steps.
"""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, cuda]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dsv4cache_graphs")


def _requests(vocab):
    from dsv4.engine.sampling import SamplingParams
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(9):   # 9 requests through 5 slots: batches of 5..1 rows, buckets 8, 4, 2, 1
        prompt = torch.randint(2, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        # two requests take the sampler's bias tables (a flag set captured on first use)
        bias = dict(logit_bias={prompt[0]: 4.0, 5: -100.0}, min_tokens=6, stop_token_ids=[7]) if i == 5 else \
            dict(allowed_token_ids=sorted(set(prompt) | set(range(2, vocab, 7)))) if i == 6 else {}
        params = SamplingParams(max_tokens=8 + 3 * i, temperature=0.0 if i % 2 else 0.8, top_p=0.95 if i % 3 else 1.0,
                                seed=i, ignore_eos=True, logprobs=2 if i == 4 else None, **bias)
        out.append((prompt, params))
    return out


def _generate(model, qat, graphs, requests, steps=1):
    from dsv4.engine.core import Engine
    from dsv4.engine.runner import Runner
    runner = Runner(model, max_num_seqs=5, max_model_len=256, qat_sim=qat, max_num_batched_tokens=32)
    runner.full_bound = True
    if graphs:
        runner.capture(progress=False)
    # the same decode steps in a step with a prompt chunk both ways (the default differs with graphs),
    # so both run the same steps: a step's bf16 rounding depends on its rows
    engine = Engine(runner, None, eos_id=1, prefill_decode_steps=steps)
    run, runner.substeps = runner.run, 0

    def counted(batch, before_sample=None):
        runner.substeps += batch.decode_steps > 1
        return run(batch, before_sample)
    runner.run = counted
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = (o.output.token_ids, o.output.logprobs)
    return [done[i] for i in ids], runner


@pytest.mark.parametrize("variant,steps", [("bf16", 1), ("mxfp4", 1), ("nvfp4", 1), ("mxfp4", 4)])
@pytest.mark.parametrize("qat", [False, True])
def test_graph_replay_gives_the_eager_tokens(cache_dir, variant, qat, steps):
    """``steps`` 4: the running requests take 4 decode steps (graph replays) in each step that admits
    a prompt, before the prompt's eager forward."""
    from dsv4.tiny import ensure_tiny
    from dsv4.weights.loader import load_model
    model, _ = load_model(ensure_tiny(cache_dir, variant), "cuda", torch.bfloat16, load_mtp=False, progress=False)
    reqs = _requests(model.config.vocab_size)
    eager, _ = _generate(model, qat, False, reqs, steps)
    replay, runner = _generate(model, qat, True, reqs, steps)
    assert runner.graphs, "no graph was captured"
    assert (runner.substeps > 0) == (steps > 1)
    for (et, el), (gt, gl) in zip(eager, replay):
        assert et == gt
        if el is not None:
            assert el == gl


def test_a_replayed_step_allocates_nothing(cache_dir):
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    from dsv4.tiny import ensure_tiny
    from dsv4.weights.loader import load_model
    model, _ = load_model(ensure_tiny(cache_dir, "mxfp4"), "cuda", torch.bfloat16, load_mtp=False, progress=False)
    runner = Runner(model, max_num_seqs=4, max_model_len=512, qat_sim=True)
    runner.capture(progress=False)
    prompt = (5, 6, 7)
    runner.run(ScheduledBatch(tuple(Row(s, 0, prompt, new=NewSequence(SamplingParams(temperature=0.7, seed=s), prompt))
                                    for s in range(3))))
    runner.decode_step([0, 1, 2])
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(100):
        runner.decode_step([0, 1, 2])
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert after["allocation.all.allocated"] == before["allocation.all.allocated"]   # not one allocation
