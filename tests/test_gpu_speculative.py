"""Speculative decoding on the GPU (run by bench/gpu_check.sh), Flash slice with random FP8 + MXFP4
weights in fp32 (the kernels at real shapes): the captured verify step (one graph per batch bucket)
equals the eager varlen verify step, and greedy generation with n-gram and MTP speculation through
captured graphs gives plain decoding's tokens."""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, cuda]


@pytest.fixture(scope="module")
def model():
    from dsv4.config import preset
    from dsv4.random_weights import build_random_model
    return build_random_model(preset("flash", num_layers=2), "fp8-mxfp4", "cuda", dtype=torch.float32,
                              with_mtp=True)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_verify_graph_equals_eager_verify(model, method):
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    k = 3
    spec = {"method": method, "num_speculative_tokens": k}
    greedy = SamplingParams(temperature=0.0, logprobs=0, max_tokens=1000)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist())   # noqa: E731
    prompts = {0: ids(300), 1: ids(517), 2: ids(200)}

    def fresh() -> Runner:
        r = Runner(model, max_num_seqs=4, max_model_len=2048, speculative=spec)
        r.run(ScheduledBatch(tuple(Row(s, 0, p, new=NewSequence(greedy, p)) for s, p in prompts.items())))
        return r

    eager, graphed = fresh(), fresh()
    graphed.capture_verify(buckets=[4], progress=False)
    for step in range(6):
        drafts = {s: ids(k) for s in prompts}
        rows = lambda r: tuple(Row(s, r.lengths[s], draft=drafts[s]) if method == "ngram" else   # noqa: E731
                               Row(s, r.lengths[s], device_draft=k) for s in prompts)
        want, got = eager.run(ScheduledBatch(rows(eager))), graphed.run(ScheduledBatch(rows(graphed)))
        assert got.emitted == want.emitted, f"step {step}"
        assert torch.equal(got.sampled.token_ids.cpu(), want.sampled.token_ids.cpu()), f"step {step}"
        torch.testing.assert_close(got.sampled.logprobs, want.sampled.logprobs, rtol=0, atol=2e-3)
        assert eager.lengths == graphed.lengths
    assert graphed.verify_graphs


@pytest.mark.parametrize("method, policy", [("ngram", False), ("mtp", False), ("ngram", True), ("mtp", True)])
def test_greedy_generation_with_speculation_in_graphs(model, method, policy):
    """Plain decoding (decode graphs) against speculation (verify graphs, mixed steps eager): the same
    greedy tokens, up to a near-tie of plain decoding's top two (the decode and verify kernels round
    differently in the last bits), and the same logprobs to kernel precision until then. Without the
    speculation policy every step verifies; with it (probes every 8 steps) requests turn off and on,
    and steps with every request off overlap the host with the device."""
    from dsv4 import testing
    from dsv4.engine.core import Engine
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    from dsv4.engine.speculative import SpecPolicy
    g = torch.Generator().manual_seed(1)
    base = torch.randint(2, model.config.vocab_size, (40,), generator=g).tolist()
    prompts = [base * 3, base[:17] * 5, base[5:30]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)

    def generate(spec, oracle=None):
        runner = Runner(model, max_num_seqs=4, max_model_len=1024, speculative=spec, max_num_batched_tokens=512)
        runner.capture(buckets=[4], progress=False)
        if spec:
            runner.capture_verify(buckets=[4], progress=False)
        engine = Engine(runner, None, eos_id=1)
        if spec:
            engine.spec_policy = SpecPolicy(probe_every=8) if policy else None
        if oracle is not None:
            engine.propose = oracle
        return testing.generate(engine, [(p, params) for p in prompts]), engine

    want, _ = generate(None)
    oracle = None
    if method == "ngram":
        # a random model's greedy output rarely repeats itself within 64 tokens, so real n-gram
        # lookups would draft almost nothing: inject drafts instead (plain decoding's own next
        # tokens, the j-th call's draft wrong from position j % 4 on: every accepted length 0..3)
        truth = {tuple(p): w.token_ids for p, w in zip(prompts, want)}
        calls = iter(range(10 ** 6))

        def oracle(req):
            ahead = list(truth[tuple(req.prompt_ids)][len(req.output_ids):len(req.output_ids) + 3])
            ahead += [2] * (3 - len(ahead))
            cut = next(calls) % 4
            return ahead[:cut] + [(t + 1) % model.config.vocab_size for t in ahead[cut:]]
    got, engine = generate({"method": method, "num_speculative_tokens": 3}, oracle)
    assert engine.spec_stats.num_drafts > 0
    for w, o in zip(want, got):
        same = next((i for i, (a, b) in enumerate(zip(w.token_ids, o.token_ids)) if a != b), len(w.token_ids))
        if same < len(w.token_ids):                       # only where plain decoding nearly tied
            (_, first), (_, second) = w.top_logprobs[same][:2]
            assert first - second < 1e-3, f"diverged at {same} with a top-2 gap of {first - second}"
        torch.testing.assert_close(torch.tensor(o.logprobs[:same]), torch.tensor(w.logprobs[:same]), rtol=0, atol=2e-3)


def test_verify_graph_applies_the_grammar_masks(model):
    """A verify step with a constrained row (flag set ``grammar``) replays a verify graph that reads the
    staged per-position masks (``TokenBitmask.draft_bits``, a static input): the same tokens and kept
    counts as the eager varlen step with the same masks, each emitted token allowed at its position.
    Each mask allows two tokens, one the row's draft there, so drafts are kept and rejected."""
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.grammar import StructuredOutputsParams
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SampleFlags, SamplingParams
    k, V = 3, model.config.vocab_size
    spec = {"method": "ngram", "num_speculative_tokens": k}
    free = SamplingParams(temperature=0.0, logprobs=0, max_tokens=1000)
    constrained = SamplingParams(temperature=0.0, logprobs=0, max_tokens=1000,
                                 structured_outputs=StructuredOutputsParams(choice=["x"]))
    g = torch.Generator().manual_seed(2)
    ids = lambda n: tuple(torch.randint(2, V, (n,), generator=g).tolist())   # noqa: E731
    prompts = {0: (ids(300), constrained), 1: (ids(200), free)}

    def fresh() -> Runner:
        r = Runner(model, max_num_seqs=2, max_model_len=1024, speculative=spec)
        r.run(ScheduledBatch(tuple(Row(s, 0, p, new=NewSequence(q, p)) for s, (p, q) in prompts.items())))
        return r

    def pack(allowed: torch.Tensor) -> torch.Tensor:          # [..., V] bool -> [..., ceil(V/32)] int32
        words = (V + 31) // 32
        bits = torch.nn.functional.pad(allowed, (0, words * 32 - V)).view(*allowed.shape[:-1], words, 32)
        w = (bits.long() << torch.arange(32)).sum(-1)
        return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)

    eager, graphed = fresh(), fresh()
    graphed.capture_verify(flag_sets=[SampleFlags.of([constrained, free], V)], buckets=[2], progress=False)
    for step in range(8):
        drafts = ids(k)
        allowed = torch.ones(2, k + 1, V, dtype=torch.bool)
        allowed[0] = False
        for i in range(k + 1):
            allowed[0, i, torch.randint(2, V, (1,), generator=g)] = True
            if i < k:
                allowed[0, i, drafts[i]] = True
        for r in (eager, graphed):
            r.sampling.bitmask.draft_bits[:2] = pack(allowed).cuda()
        rows = lambda r: (Row(0, r.lengths[0], draft=drafts), Row(1, r.lengths[1], draft=ids(k)))   # noqa: E731
        g_state = g.get_state()
        want = eager.run(ScheduledBatch(rows(eager)))
        g.set_state(g_state)
        got = graphed.run(ScheduledBatch(rows(graphed)))
        assert got.emitted == want.emitted, f"step {step}"
        assert torch.equal(got.sampled.token_ids.cpu(), want.sampled.token_ids.cpu()), f"step {step}"
        emitted = got.sampled.token_ids[0, :got.emitted[0]].tolist()
        assert all(allowed[0, i, t] for i, t in enumerate(emitted)), f"step {step}"
    assert any(f.grammar for _, f, _ in graphed.verify_graphs)
