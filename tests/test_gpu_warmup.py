"""GPU: after the start-up warm-up, prompts of any length at any position compile no kernel.

The twin of ``tests/test_warmup.py`` on real compiles: a Flash-geometry slice with the release
formats, Triton's own per-device kernel caches counted (:func:`dsv4.ops.triton.variants.total`)
before and after random prefills (lengths 1..max_num_batched_tokens at random positions, some with every
position's logits) and eager decode steps of random batch sizes.
"""

from __future__ import annotations

import random
import sys
import time

import pytest
import torch
from conftest import random_prefills
from dsv4.testing import decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_flash_slice_compiles_nothing_after_warm_up():
    from dsv4.config import preset
    from dsv4.engine.runner import Runner
    from dsv4.random_weights import build_random_model
    from dsv4.ops.triton import variants

    model = build_random_model(preset("flash", num_layers=2), "fp8-mxfp4", "cuda")
    runner = Runner(model, max_num_seqs=4, max_model_len=3000, qat_sim=True, max_num_batched_tokens=512)
    t0 = time.perf_counter()
    runner.warm_up(progress=True)
    print(f"warm-up {time.perf_counter() - t0:.1f} s, {variants.total()} variants", file=sys.stderr)
    before = variants.count()

    def grown() -> dict[str, int]:
        after = variants.count()
        return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    rng = random.Random(3)
    vocab = model.config.vocab_size
    for trial in range(3):
        for _ in random_prefills(runner, trial % 4, rng, long_chance=0.6, short_max=64, logits_chance=0.1):
            pass
        grew = grown()
        assert not grew, f"trial {trial}: prefills compiled new kernel variants: {grew}"
    for _ in range(6):
        slots = rng.sample(range(4), rng.randint(1, 4))
        decode(runner, slots, torch.randint(0, vocab, (len(slots),)))
    grew = grown()
    assert not grew, f"eager decode steps compiled new kernel variants: {grew}"


def test_parallel_precompile_leaves_nothing_to_compile_and_nothing_changed():
    """The parallel compile pass (start-up, before the capture) compiles what the capture and the
    warm-up launch: after it neither compiles anything, and the state it ran on (scratch slot,
    zeroed buffers, no launches) leaves the engine's results what they are without it."""
    from dsv4.config import preset
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    from dsv4.random_weights import build_random_model
    from dsv4.ops.triton import variants

    model = build_random_model(preset("flash", num_layers=2), "fp8-mxfp4", "cuda")

    def runner():
        return Runner(model, max_num_seqs=4, max_model_len=3000, qat_sim=True, max_num_batched_tokens=512)
    r = runner()
    seconds = r.precompile(progress=True)
    assert seconds > 0
    before = variants.total()
    r.capture(progress=False)
    r.warm_up(progress=False)
    assert variants.total() == before, "the capture or the warm-up compiled after the parallel pass"
    ids = tuple(torch.randint(2, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist())
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    outs = []
    for run in (r, runner()):
        o = run.run(ScheduledBatch((Row(0, 0, ids, sample=True, new=NewSequence(params, ids)),)))
        outs.append((o.sampled.token_ids.cpu(), o.sampled.logprobs.cpu()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
