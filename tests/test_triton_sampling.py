"""The sampler kernel (dsv4/ops/triton/sampling.py) against :func:`dsv4.ops.reference.draw_tokens`.

CPU: through Triton's interpreter at small, odd vocabularies: the same token ids as the reference
for greedy rows, temperature draws and truncated (``scaled``) draws, ties, signed zeros, NaN and
all ``-inf`` rows; and :meth:`SlotSampling.sample` with the kernel equal to the reference sampler.
The interpreter's logs are NumPy's (an ulp from torch's at most), so the noise is compared bit
for bit only on the GPU (``-m gpu``): there at the real vocabulary, also replayed in a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from dsv4 import ops  # noqa: E402
from dsv4.engine.sampling import SamplingParams, SlotSampling  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.noise import gumbel_noise  # noqa: E402
from dsv4.ops.triton import fix_interpreter, runtime  # noqa: E402
from dsv4.ops.triton.sampling import draw_tokens_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    fix_interpreter()


@pytest.fixture(autouse=True)
def _poison():
    with runtime.poisoned():
        yield


def _rows(B: int, seed: int, greedy_share: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    temp = (torch.rand(B, generator=g) * 1.5 + 0.2).to(DEV)
    greedy = (torch.rand(B, generator=g) < greedy_share).to(DEV)
    lo = torch.randint(0, 2 ** 32, (B,), generator=g).to(DEV)
    hi = torch.randint(0, 2 ** 32, (B,), generator=g).to(DEV)
    step = torch.randint(0, 2 ** 40, (B,), generator=g).to(DEV)
    return temp, greedy, lo, hi, step


def _both(logits, scaled, rows, sampling=True):
    got = draw_tokens_triton(logits, scaled, *rows, sampling=sampling)
    want = ref.draw_tokens(logits, scaled, *rows, sampling=sampling)
    assert got.dtype == torch.int64 and got.shape == want.shape
    return got, want


@pytest.mark.parametrize("B,V", [(1, 3001), (5, 1024), (3, 4097), (9, 777)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_draw_tokens_matches_reference(B, V, dtype):
    g = torch.Generator().manual_seed(B * 1000 + V)
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype).to(DEV)
    rows = _rows(B, V)
    for sampling in (True, False):
        got, want = _both(logits, None, rows, sampling)
        assert torch.equal(got, want), (sampling, got, want)
    # truncated: a top-k style mask of -inf on the scaled logits
    scaled = logits.float() / 0.8
    kth = scaled.topk(min(V, 5), dim=-1).values[:, -1:]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    got, want = _both(logits, scaled, rows)
    assert torch.equal(got, want)
    drawn = ~rows[1]
    assert bool((scaled.gather(1, got[:, None]).squeeze(1)[drawn] > float("-inf")).all())   # never a masked id


def test_draw_tokens_edges():
    V = 2500
    logits = torch.full((6, V), -1.0)
    logits[0, [7, 1800, 2400]] = 5.0                       # a tie: the lowest id
    logits[1, 3] = -0.0
    logits[1] = torch.where(torch.arange(V) == 3, logits[1], torch.full((V,), -2.0))
    logits[1, 2000] = 0.0                                   # -0 == +0: the lower id (3)
    logits[2, 1500] = float("nan")                          # NaN counts as the largest
    logits[2, 10] = float("inf")
    logits[3] = float("-inf")                               # nothing finite: id 0
    logits[4, 2499] = 3.0                                   # the last id
    logits[5, 1201] = -float("nan")                         # a NaN with the sign bit is a NaN too
    logits = logits.to(DEV)
    rows = _rows(6, 1, greedy_share=0.0)
    got, want = _both(logits, None, rows, sampling=False)
    assert got.tolist() == want.tolist() == [7, 3, 1500, 0, 2499, 1201]
    # every row greedy inside a sampling batch takes the same argmax
    rows = (rows[0], torch.ones_like(rows[1]), *rows[2:])
    got, want = _both(logits, None, rows)
    assert got.tolist() == want.tolist() == [7, 3, 1500, 0, 2499, 1201]


@pytest.mark.parametrize("knobs", [dict(temperature=0.7), dict(temperature=0.9, top_p=0.8),
                                   dict(temperature=1.1, top_k=7), dict(temperature=0.6, min_p=0.1)])
def test_slot_sampling_with_the_kernel(knobs):
    """The sampler with the kernel registered draws what the reference sampler draws, step after step
    (greedy and seeded rows in one batch)."""
    V, B = 1500, 4
    ss = {name: SlotSampling(B + 1, V, DEV) for name in ("kernel", "reference")}
    for s in ss.values():
        for slot in range(B):
            params = SamplingParams(temperature=0.0) if slot == 1 else SamplingParams(seed=slot, **knobs)
            s.assign(slot, params, [1, 2, 3])
    idx = torch.arange(B, device=DEV)
    g = torch.Generator().manual_seed(7)
    ops.register("draw_tokens", DEV)(draw_tokens_triton)
    try:
        assert ops.implementation("draw_tokens", torch.device(DEV)) is draw_tokens_triton
        for _ in range(3):
            logits = (torch.randn(B, V, generator=g) * 2).to(DEV)
            flags = ss["kernel"].flags(range(B))
            got = ss["kernel"].sample(logits, idx, flags).token_ids
            with ops.reference_only():
                want = ss["reference"].sample(logits, idx, flags).token_ids
            assert torch.equal(got, want)
    finally:
        ops.unregister("draw_tokens", DEV)
        if DEV == "cuda":
            from dsv4.ops.triton.sampling import REGISTRATIONS
            for op, _fmt, fn in REGISTRATIONS:
                ops.register(op, DEV)(fn)


def _needs_cuda(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn))


@_needs_cuda
@pytest.mark.parametrize("B", [1, 3, 32, 64])
def test_gpu_draw_tokens_real_vocabulary(B):
    V = 129280
    torch.manual_seed(B)
    logits = (torch.randn(B, V, device="cuda") * 2).to(torch.bfloat16).float()
    rows = _rows(B, B)
    for sampling in (True, False):
        got, want = _both(logits, None, rows, sampling)
        assert torch.equal(got, want)
    # the noise, one side bit for bit: with scaled = -noise (id 0 masked) every value of a drawn row
    # is +0 unless the kernel's noise exceeds the reference's somewhere, so the lowest id left, 1, wins
    noise = gumbel_noise(*rows[2:], V)
    drawn = ~rows[1]
    probe = (-noise).index_fill(1, torch.tensor([0], device="cuda"), float("-inf"))
    got, want = _both(logits, probe, rows)
    assert torch.equal(got, want) and bool((got[drawn] == 1).all())


@_needs_cuda
def test_gpu_draw_tokens_cuda_graph():
    V, B = 129280, 8
    logits = torch.randn(B, V, device="cuda")
    rows = _rows(B, 3)
    eager = draw_tokens_triton(logits, None, *rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draw_tokens_triton(logits, None, *rows)
    logits.copy_(torch.randn(B, V, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref.draw_tokens(logits, None, *rows))
    assert not torch.equal(out, eager) or B == 0
