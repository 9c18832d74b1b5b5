"""Constrained decoding under CUDA graphs (GPU only; run by bench/gpu_check.sh).

A batch mixing constrained (JSON schema) and free requests replays one captured decode graph per
bucket, the one whose sampler applies the slots' token bitmasks (a static input); the replay gives
the eager steps' tokens, every constrained answer is JSON the grammar accepts, and a batch without a
constrained row keeps using the graph without the mask.
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


def _generate(model, tok, graphs: bool):
    from dsv4.engine.core import Engine
    from dsv4.engine.grammar import StructuredOutputsParams
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    runner = Runner(model, max_num_seqs=4, max_model_len=256, qat_sim=True, max_num_batched_tokens=64)
    runner.full_bound = True
    if graphs:
        runner.capture(progress=False)
    engine = Engine(runner, tok, tok.eos_id)
    replays = []
    if graphs:      # count the replays of each graph
        original = runner._capture_one

        def capture_one(bucket, flags):
            entry = original(bucket, flags)
            _count(entry, (bucket, flags), replays)
            return entry
        runner._capture_one = capture_one
        for key, entry in list(runner.graphs.items()):
            _count(entry, key, replays)
    prompt = tok.encode("Describe it.<｜Assistant｜></think>")
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(max_tokens=64 if s % 2 == 0 else 96, temperature=0.8, seed=s, structured_outputs=spec if s % 2 == 0 else None,
                             ignore_eos=s % 2 == 1) for s in range(4)]
    ids = [engine.add_request(prompt, p, skip_special_tokens=False) for p in params]
    done = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output
    return [done[i] for i in ids], runner, replays


def _count(entry, key, replays):
    replay = entry.graph.replay

    def counted():
        replays.append(key)
        replay()
    entry.graph.replay = counted


def test_mixed_batch_replays_one_graph_with_the_mask(tiny):
    model, tok = tiny
    eager, _, _ = _generate(model, tok, graphs=False)
    replay, runner, replays = _generate(model, tok, graphs=True)
    for e, r in zip(eager, replay):
        assert e.token_ids == r.token_ids
    for out in replay[0::2]:
        assert out.finish_reason == "stop"
        assert set(json.loads(out.text)) == {"name", "n"}
    assert replays, "no step replayed a graph"
    mixed = {k for k in replays if k[0] == 4}           # all four requests decoding
    assert len(mixed) == 1 and next(iter(mixed))[1].grammar, mixed
    # once the constrained requests are done, the free ones replay the graphs without the mask
    assert any(not flags.grammar for _, flags in replays[replays.index(next(iter(mixed))):])
