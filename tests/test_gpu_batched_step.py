"""One varlen step on the GPU (run by bench/gpu_check.sh): decode rows and prompt chunks of several
slots in one forward equal the same rows run one by one, on a Flash slice with random FP8 + MXFP4
weights (the kernels at real shapes).

In fp32 without the QAT simulation the two agree to kernel precision at every position. In BF16 with
the simulation (production) a step's token count picks other MoE tiles, whose last-bit differences
can flip an FP8 activation rounding or a router near-tie somewhere in a long row and move what
follows it; there the whole rows agree in norm.
"""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, cuda]


@pytest.mark.parametrize("dtype", ["fp32", "bf16-qat"])
def test_mixed_step_equals_rows_one_by_one(dtype):
    from dsv4.config import preset
    from dsv4.engine.batch import NewSequence, Row, ScheduledBatch
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SamplingParams
    from dsv4.random_weights import build_random_model

    config = preset("flash", num_layers=2)
    qat = dtype == "bf16-qat"
    model = build_random_model(config, "fp8-mxfp4", "cuda", dtype=torch.bfloat16 if qat else torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(2, config.vocab_size, (n,), generator=g).tolist())   # noqa: E731
    greedy = SamplingParams(temperature=0.0)
    first = {s: ids(n) for s, n in ((0, 300), (1, 517), (2, 200))}

    def fresh() -> Runner:
        r = Runner(model, max_num_seqs=4, max_model_len=2048, qat_sim=qat)
        r.run(ScheduledBatch(tuple(Row(s, 0, p, new=NewSequence(greedy, p)) for s, p in first.items())))
        return r

    new = ids(700)
    rows = (Row(0, 300, logits=True), Row(1, 517, logits=True),               # decode rows
            Row(2, 200, ids(129), logits=True),                                # a chunk mid-prompt
            Row(3, 0, new, logits=True, new=NewSequence(greedy, new)))        # a new prompt
    together = fresh().run(ScheduledBatch(rows))
    alone_runner = fresh()
    for i, row in enumerate(rows):
        alone = alone_runner.run(ScheduledBatch((row,)))
        want, got = alone.logits[0].float(), together.logits[i].float()
        if qat:
            assert (got - want).norm() <= 3e-2 * want.norm(), f"row {i}"
        else:
            assert (got - want).abs().max() <= 2e-3 * want.abs().max(), f"row {i}"
    assert together.sampled.token_ids.shape == (4,)
