"""The RoPE tables of a forward, made in one pass (:class:`dsv4.model.common.RopeSpec`): each is
bit for bit the table ``rope_cos_sin`` makes alone (elementwise fp32 arithmetic, the same per
element however many tables share the launch), on the CPU and (``-m gpu``) on a GPU at positions
up to a 1M context. The decode step's compressors read the ``window:m`` tables."""

from __future__ import annotations

import pytest
import torch

from dsv4 import ops
from dsv4.config import preset
from dsv4.model.transformer import Transformer

_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("B, S", [(1, 1), (32, 1), (1, 300), (3, 17)])
def test_tables_equal_one_by_one(device, B, S):
    model = Transformer(preset("tiny", num_layers=4), torch.float32, with_mtp=False).to(device)
    ratios = sorted({model.config.layer_ratio(i) for i in range(model.config.num_hidden_layers + 1)} - {0})
    assert model.rope_spec.names == ("main", "compress", *(f"window:{m}" for m in ratios))
    start = torch.randint(0, 1 << 20, (B,), generator=torch.Generator().manual_seed(B * S)).to(device)
    ctx = model.context(torch.zeros(B, S, dtype=torch.int64, device=device), torch.arange(B, device=device), start,
                        False, 1 << 20)
    pos = ctx.positions
    want = {"main": ops.rope_cos_sin(pos, model.inv_freq_main),
            "compress": ops.rope_cos_sin(pos, model.inv_freq_compress),
            **{f"window:{m}": ops.rope_cos_sin(pos // m * m, model.inv_freq_compress) for m in ratios}}
    for name, (cos, sin) in want.items():
        got = ctx.rope[name]
        assert got.cos.is_contiguous() and got.sin.is_contiguous(), name
        assert torch.equal(got.cos, cos) and torch.equal(got.sin, sin), name
    for m in ratios:
        assert all(torch.equal(a, b) for a, b in zip(ctx.window_rope(m), want[f"window:{m}"]))


def test_random_builds_compute_the_rope_buffers():
    """A random model built on the meta device (``build_random_model``, what the GPU benchmarks and
    tests use) leaves the RoPE buffers to ``init_rope`` (an int64 step buffer cannot be drawn at
    random) and gets the same tables as a plain build."""
    from dsv4.config import preset
    from dsv4.random_weights import build_random_model
    from dsv4.model.transformer import Transformer
    config = preset("tiny")
    model = build_random_model(config, "fp8-mxfp4", "cpu", dtype=torch.float32)
    plain = Transformer(config, torch.float32)
    for name in Transformer.ROPE_BUFFERS:
        assert torch.equal(getattr(model, name), getattr(plain, name)), name
