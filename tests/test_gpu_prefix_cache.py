"""Prefix caching on the GPU (run by bench/gpu_check.sh): a Flash slice with random FP8 + MXFP4 weights,
CUDA graphs captured, caching on against off through the engine; the state is copied into a slot by
device copies only (no device -> host synchronization).

In fp32 without the QAT simulation the first tokens agree and the first token's logprob to kernel
precision; in BF16 with the simulation (production) only the first token is compared, a later
near-tie can go either way (see test_gpu_batched_step.py).
"""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, cuda]


@pytest.mark.parametrize("dtype", ["fp32", "bf16-qat"])
def test_cached_prefixes_equal_caching_off_on_the_gpu(dtype):
    from dsv4.config import preset
    from dsv4.engine.core import Engine
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    from dsv4.random_weights import build_random_model

    config = preset("flash", num_layers=2)
    qat = dtype == "bf16-qat"
    model = build_random_model(config, "fp8-mxfp4", "cuda", dtype=torch.bfloat16 if qat else torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, config.vocab_size, (n,), generator=g).tolist()   # noqa: E731
    system = ids(600)
    prompts = [system + ids(50), system + ids(70), system + ids(90), system + ids(20)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(cache_bytes):
        runner = Runner(model, max_num_seqs=2, max_model_len=2048, qat_sim=qat, prefix_cache_bytes=cache_bytes)
        runner.capture(progress=False)
        engine = Engine(runner, None, eos_id=1)
        outs = []
        for p in prompts:
            rid = engine.add_request(p, params)
            while engine.has_unfinished:
                for o in engine.step():
                    if o.finished and o.request_id == rid:
                        outs.append(o.output)
        return outs

    on, off = run(256 << 20), run(0)
    # the first user (650 tokens) saves its state at its prompt's last block boundary, 640; the
    # second parts from those blocks after 600 tokens and saves the state at 512, where the third
    # and fourth start (as test_prefix_cache.py::test_users_sharing_a_system_prompt_save_where_they_part)
    assert [o.num_cached_tokens for o in on] == [0, 0, 512, 512]
    for a, b in zip(on, off):
        assert a.token_ids[0] == b.token_ids[0]
        tol = 5e-2 if qat else 2e-3
        assert abs(a.logprobs[0] - b.logprobs[0]) <= tol * max(1.0, abs(b.logprobs[0]))
        if not qat:
            assert a.token_ids == b.token_ids


def test_restore_and_save_never_wait_for_the_device():
    """A restore and a save are device copies: neither synchronizes with the device."""
    from dsv4.config import preset
    from dsv4.engine.prefix_store import PrefixStore
    from dsv4.engine.state import GenerationState
    from dsv4.model.cache import block_size

    config = preset("flash", num_layers=3)
    state = GenerationState(config, 3, 1024, torch.bfloat16, "cuda", qat_sim=True)
    store = PrefixStore(state, block_size(config), 64 << 20)
    tail = list(range(8, 8 + store.tail_pages))
    store.save(0, 0, [0, 1, 2], tail)       # first calls may allocate; then measure
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        store.save(0, 0, [0, 1, 2], tail)
        store.save(0, 0, [0, 1, 2], tail, stage=0)      # a tail a forward left in the stage
        store.restore(1, [0, 1, 2], tail)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for p in state.pieces():
        if p.kind == "window":
            assert torch.equal(p.tensor[1].view(torch.uint8), p.tensor[0].view(torch.uint8))


@pytest.mark.parametrize("cuts", [[300], [200, 300]])
def test_a_boundary_inside_a_chunk_saves_the_tail_a_chunk_ending_there_leaves(cuts):
    """The forward's snapshot at block 2 (position 256) inside a prompt chunk, through the kernels
    (fp32 activations and state, FP8 + MXFP4 weights): restored, it equals the state of chunks cut
    at 256 to kernel precision. (With the QAT simulation the two chunkings' GEMMs of different M
    round an activation differently now and then, and the FP8 act-quant turns that into flips that
    grow layer by layer: no oracle there; the CPU tests check the QAT storage exactly.)"""
    import random
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_prefix_snapshot import _prefill, _restored
    from dsv4.config import preset
    from dsv4.engine.runner import Runner
    from dsv4.random_weights import build_random_model

    config = preset("flash", num_layers=2)
    model = build_random_model(config, "fp8-mxfp4", "cuda", dtype=torch.float32)
    rng = random.Random(0)
    prompt = [rng.randrange(2, config.vocab_size) for _ in range(cuts[-1])]
    runner = lambda: Runner(model, max_num_seqs=2, max_model_len=1024,  # noqa: E731
                            prefix_cache_bytes=256 << 20)
    ran, ref = runner(), runner()
    _prefill(ran, prompt, cuts, {256: 0})
    _prefill(ref, prompt, sorted({256, *cuts}), {256: 0})
    for got, want in zip(_restored(ran, 256, 0), _restored(ref, 256, 0), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
