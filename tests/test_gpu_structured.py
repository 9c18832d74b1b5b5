"""Constrained decoding under CUDA graphs (GPU only; run by bench/gpu_check.sh).

A decode step with a constrained row replays two graphs of its batch bucket: the forward, then the
sampler that applies the slots' token bitmasks (a static input), with the engine's mask staging in
between (it collects the step still in flight first: the overlapped schedule). A batch mixing
constrained (JSON schema) and free requests replays that pair on every decode step, never an eager
step; the tokens equal the eager steps' of the same schedule, and those of the synchronous schedule
(``overlap`` off, which collects every step before planning the next) for as long as both ran the same
batches (the overlapped one still runs a finished request's row for one step, and a step's bf16
rounding depends on its batch size: the shared expert runs inside the MoE kernels up to 2 rows), every
constrained answer is JSON the grammar accepts,
and a batch without a constrained row keeps using the one-graph step without the mask. Staging the
masks and replaying both graphs never makes the host wait for the device.
"""

from __future__ import annotations

import json

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, cuda]
llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dsv4.text.tokenizer import Tokenizer
    from dsv4.tiny import ensure_tiny
    from dsv4.weights.loader import load_model
    path = ensure_tiny(tmp_path_factory.mktemp("dsv4cache_structured"), "mxfp4")
    model, _ = load_model(path, "cuda", torch.bfloat16, load_mtp=False, progress=False)
    return model, Tokenizer.from_dir(path)


class _Spy:
    """Records, per runner step, the graphs it replayed (``("step", bucket, flags)``, ``("forward",
    bucket)``, ``("sampler", bucket, flags)``), whether it was a decode-only step, and how many engine
    steps were in flight when its masks were staged."""

    def __init__(self, runner, engine):
        self.runner, self.engine = runner, engine
        self.steps: list[tuple[bool, list]] = []
        self.in_flight: list[int] = []
        run = runner.run

        def spy_run(batch, before_sample=None):
            self.steps.append((batch.decode_only, []))
            hook = None
            if before_sample is not None:
                def hook():
                    self.in_flight.append(len(engine._inflight))
                    before_sample()
            return run(batch, hook)
        runner.run = spy_run
        for name in ("_capture_one", "_capture_sampler"):
            self._wrap_capture(name)
        for key, entry in runner.graphs.items():
            self._count(entry, ("step",) + key)
        for bucket, entry in runner.forward_graphs.items():
            self._count(entry, ("forward", bucket))
        for key, entry in runner.sampler_graphs.items():
            self._count(entry, ("sampler",) + key)

    def _wrap_capture(self, name):
        original = getattr(self.runner, name)
        runner = self.runner

        def capture(bucket, flags):
            had = bucket in runner.forward_graphs
            entry = original(bucket, flags)
            if name == "_capture_one":
                self._count(entry, ("step", bucket, flags))
            else:
                if not had:
                    self._count(runner.forward_graphs[bucket], ("forward", bucket))
                self._count(entry, ("sampler", bucket, flags))
            return entry
        setattr(self.runner, name, capture)

    def _count(self, entry, key):
        replay = entry.graph.replay

        def counted():
            self.steps[-1][1].append(key)
            replay()
        entry.graph.replay = counted


def _generate(model, tok, graphs: bool, overlap: bool = True):
    from dsv4.engine.core import Engine
    from dsv4.engine.grammar import StructuredOutputsParams
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    from dsv4.testing import generate
    runner = Runner(model, max_num_seqs=4, max_model_len=256, qat_sim=True, max_num_batched_tokens=64)
    runner.full_bound = True
    if graphs:
        runner.capture(progress=False)
    engine = Engine(runner, tok, tok.eos_id)
    engine.overlap = overlap
    spy = _Spy(runner, engine)
    prompt = tok.encode("Describe it.<｜Assistant｜></think>")
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(max_tokens=64 if s % 2 == 0 else 96, temperature=0.8, seed=s,
                             structured_outputs=spec if s % 2 == 0 else None, ignore_eos=s % 2 == 1) for s in range(4)]
    return generate(engine, [(prompt, p) for p in params], skip_special_tokens=False), spy


def test_mixed_batch_replays_the_forward_and_sampler_graphs(tiny):
    model, tok = tiny
    eager, _ = _generate(model, tok, graphs=False)
    replay, spy = _generate(model, tok, graphs=True)
    sync, sync_spy = _generate(model, tok, graphs=True, overlap=False)
    eager_sync, _ = _generate(model, tok, graphs=False, overlap=False)
    same_batches = min(len(out.token_ids) for out in sync)       # until the first request finished
    for e, r, s, es in zip(eager, replay, sync, eager_sync):
        assert e.token_ids == r.token_ids and s.token_ids == es.token_ids
        assert r.token_ids[:same_batches] == s.token_ids[:same_batches]
        assert e.finish_reason == r.finish_reason == s.finish_reason
    for out in replay[0::2]:
        assert out.finish_reason == "stop"
        assert set(json.loads(out.text)) == {"name", "n"}
    # the overlapped schedule ran: a step in flight when the masks were staged (never without overlap)
    assert max(spy.in_flight) == 1 and max(sync_spy.in_flight) == 0
    for s in (spy, sync_spy):
        decode = [graphs for decode_only, graphs in s.steps if decode_only]
        assert decode and all(len(g) in (1, 2) for g in decode), decode      # no eager decode step (0)
        split = [g for g in decode if len(g) == 2]
        # every step with a constrained row: its bucket's forward, then a sampler with the mask
        assert split and all(f[0] == "forward" and m[0] == "sampler" and f[1] == m[1] and m[2].grammar
                             for f, m in split), split
        mixed = {g[1] for g in split if g[0][1] == 4}          # all four requests decoding
        assert len(mixed) == 1, mixed
        # once the constrained requests are done, the free ones replay the one-graph step without the mask
        last = max(i for i, g in enumerate(decode) if len(g) == 2)
        assert decode[last + 1:] and all(len(g) == 1 and g[0][0] == "step" and not g[0][2].grammar
                                         for g in decode[last + 1:])


def test_a_constrained_step_never_waits_for_the_device(tiny):
    """The masks staged between the forward and sampler graphs (page-locked uploads) and both replays
    make no implicit host-device synchronization (``torch.cuda``'s sync debug mode turns one into an
    error): the only wait of a constrained step is the engine's collection of the step before."""
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.grammar import GrammarCompiler, StructuredOutputsParams
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SampleFlags, SamplingParams
    model, tok = tiny
    V = model.config.vocab_size
    runner = Runner(model, max_num_seqs=2, max_model_len=256, qat_sim=True, max_num_batched_tokens=64)
    constrained = SamplingParams(temperature=0.8, seed=1, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free = SamplingParams(temperature=0.8, seed=2)
    flags = SampleFlags.of([constrained, free], V)
    runner.capture([SampleFlags(all_greedy=False), flags], buckets=[2], progress=False)
    assert set(runner.forward_graphs) == {2} and set(runner.sampler_graphs) == {(2, flags)}
    prompt = tuple(tok.encode("Describe it.<｜Assistant｜></think>"))
    constraint = GrammarCompiler(tok, V).constraint(constrained, prompt, 200)
    staged = []

    def stage():
        runner.sampling.bitmask.stage([(0, constraint), (1, None)])
        staged.append(len(staged))
    rows = (Row(0, 0, prompt, new=NewSequence(constrained, prompt)), Row(1, 0, prompt, new=NewSequence(free, prompt)))
    out = runner.run(ScheduledBatch(rows), stage).sampled.token_ids.tolist()
    for step in range(3):
        constraint.accept([out[0]])
        decode = ScheduledBatch((Row(0, runner.lengths[0]), Row(1, runner.lengths[1])))
        torch.cuda.synchronize()
        if step:                               # the first decode step warms up (page-locked buffers)
            torch.cuda.set_sync_debug_mode("error")
        try:
            ids = runner.run(decode, stage).sampled.token_ids
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out = ids.tolist()
    assert staged == [0, 1, 2, 3]
    assert set(runner.forward_graphs) == {2} and set(runner.sampler_graphs) == {(2, flags)}   # nothing new
