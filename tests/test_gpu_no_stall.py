"""GPU: admitting a request, prefilling it and sampling its first token never make the host wait
for the device (no pageable host -> device copy, no Python scalar written into a device tensor).

Such a wait serializes the host's kernel launches with the device's work: measured on an H100
(``bench/profile_prefill.py``), four of them per prefill made a 128-token prefill of a 4-layer Flash
slice take launch time + kernel time instead of the larger of the two. ``torch.cuda``'s sync debug
mode turns any implicit synchronization into an error here.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_admission_prefill_and_first_sample_never_wait_for_the_device():
    from dsv4.config import preset
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    from dsv4.random_weights import build_random_model

    model = build_random_model(preset("flash", num_layers=1), "fp8-mxfp4", "cuda")
    runner = Runner(model, max_num_seqs=3, max_model_len=1024, qat_sim=True, max_num_batched_tokens=512)
    runner.warm_up(progress=False)             # every variant a step of <= 512 tokens reaches (compiles may synchronize)
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=1, logprobs=2)
    ids = tuple(range(5, 300))

    def step(slot: int, decoding: tuple[int, ...]) -> torch.Tensor:
        """One step: a new prompt in ``slot`` (two chunks' worth of rows in one forward) with decode rows."""
        rows = tuple(Row(s, runner.lengths[s]) for s in decoding)
        rows += (Row(slot, 0, ids, new=NewSequence(params, ids)),)
        return runner.run(ScheduledBatch(rows)).sampled.token_ids

    first = step(0, ())
    step(2, (0,))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = step(1, (0, 2))                # admission, a mixed varlen step, sampling: no host wait
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert again.tolist()[-1] == first.tolist()[0]    # same prompt, same seed: the same first token
    assert runner.state.positions.tolist()[:3] == [len(ids) + 2, len(ids), len(ids) + 1]
