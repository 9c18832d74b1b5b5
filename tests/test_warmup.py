"""The start-up warm-up compiles every kernel specialization that serving reaches.

A Triton kernel compiles once per specialization (constexpr tile sizes chosen by row count,
integers that are 1 or multiples of 16, pointer alignment); on a GPU each compile stalls the engine
for seconds. Here every kernel is registered for the CPU and each launch only records the key
Triton's compiler would use (:mod:`dsv4.ops.triton.variants`) while the reference ops compute the
values, so the model runs at reference speed with every kernel's launch decisions made on the real
shapes. After :func:`dsv4.engine.warmup.warm_up`, prompts of random lengths at random positions,
with and without every position's logits, must add no specialization. (The GPU twin, on real
compiles, is in ``tests/test_gpu_warmup.py``.)
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from conftest import random_prefills  # noqa: E402

from dsv4 import ops  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.warmup import length_classes, warm_up  # noqa: E402
from dsv4.ops import reference  # noqa: E402
from dsv4.ops.triton import register_all, variants  # noqa: E402
from dsv4.tiny import resolve_model  # noqa: E402
from dsv4.weights.loader import load_model  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU twin compiles)")


def test_length_classes_cover_every_bucket_and_integer_class():
    got = length_classes(100)
    assert got == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 96, 100]
    for n in range(1, 101):      # every length shares its power-of-two bucket and class with one warmed
        bucket = 1 << (n - 1).bit_length()
        cls = "1" if n == 1 else n % 16 == 0
        assert any(1 << (m - 1).bit_length() == bucket and ("1" if m == 1 else m % 16 == 0) == cls for m in got), n
    assert length_classes(1) == [1]


def _keys_then_reference(kernel, ref):
    def run(*args, **kwargs):
        try:
            kernel(*args, **kwargs)          # launches record their keys only
        except ops.KernelUnsupported:
            pass
        return ref(*args, **kwargs)
    return run


@pytest.fixture
def record_keys(monkeypatch):
    """Every kernel registered for the CPU; launches record keys, reference ops give the values."""
    monkeypatch.setattr(ops, "_KERNELS", dict(ops._KERNELS))
    for op, fmt in register_all("cpu"):
        ops._KERNELS[(op, "cpu", fmt)] = _keys_then_reference(ops._KERNELS[(op, "cpu", fmt)], getattr(reference, op))
    variants.record_interpreter()
    monkeypatch.setattr(variants, "EXECUTE", False)


@pytest.mark.parametrize("model", ["tiny", "tiny:nvfp4"])
def test_no_new_variant_after_warm_up(record_keys, model):
    net, _ = load_model(resolve_model(model), torch.device("cpu"), torch.float16, progress=False)
    runner = Runner(net, max_num_seqs=2, max_model_len=1200, qat_sim=True, max_num_batched_tokens=300)
    warm_up(runner, progress=False)
    before = variants.snapshot()
    assert sum(map(len, before.values())) > 20          # the kernels really ran (as key records)
    rng = random.Random(7)
    for trial in range(6):
        for n, pos in random_prefills(runner, trial % 2, rng, long_chance=0.7, short_max=40, logits_chance=0.2):
            new = variants.new_since(before)
            assert not new, f"prefill of {n} tokens at position {pos} added kernel variants: {new}"


def test_no_new_variant_in_engine_steps_after_warm_up(record_keys):
    """Steps of the engine (decode rows with several prompts' chunks in one varlen forward, any mix
    of lengths and positions) reach only what the warm-up compiled."""
    from dsv4.engine.core import Engine
    from dsv4.engine.sampling import SamplingParams
    net, _ = load_model(resolve_model("tiny"), torch.device("cpu"), torch.float16, progress=False)
    runner = Runner(net, max_num_seqs=4, max_model_len=700, qat_sim=True, max_num_batched_tokens=300)
    warm_up(runner, progress=False)
    before = variants.snapshot()
    engine = Engine(runner, None, eos_id=-1)
    rng = random.Random(3)
    vocab = net.config.vocab_size
    for i in range(14):
        n = rng.choice([rng.randint(1, 20), rng.randint(20, 400)])
        engine.add_request([rng.randrange(vocab) for _ in range(n)],
                           SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0 if i % 2 else 0.8, seed=i,
                                          prompt_logprobs=1 if i % 5 == 0 else None))
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        new = variants.new_since(before)
        assert not new, f"engine step {steps} added kernel variants: {new}"


def test_one_block_of_each_kind_reaches_every_variant(record_keys):
    """The parallel compile pass runs one block of each kind (:func:`_one_layer_of_each_kind`): the
    full-depth forwards after it reach no kernel specialization it did not."""
    from dsv4.engine import warmup
    net, _ = load_model(resolve_model("tiny"), torch.device("cpu"), torch.float16, progress=False)
    runner = Runner(net, max_num_seqs=2, max_model_len=300, qat_sim=True, max_num_batched_tokens=100)
    with torch.inference_mode(), warmup._one_layer_of_each_kind(runner):
        assert len(runner.model.layers) < net.config.num_hidden_layers
        for item in warmup._items(runner, True)[0]:
            item()
    assert len(runner.model.layers) == net.config.num_hidden_layers == len(runner.state.layers)
    few = variants.snapshot()
    assert sum(map(len, few.values())) > 20
    with torch.inference_mode():
        for item in warmup._items(runner, True)[0]:
            item()
    assert not variants.new_since(few)
