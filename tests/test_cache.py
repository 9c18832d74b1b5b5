"""The generation-state storage (dsv4/model/cache.py, dsv4/engine/state.py).

FP8 K=V rows and FP4 indexer keys are stored exactly as the QAT simulation rounds them: reading a
row back gives, bit for bit, what ``fp8_sim`` / ``fp4_sim`` give. The byte accounting matches the
layout (448 FP8 + 7 scale + 128 rope bytes an entry at V4 geometry in BF16).
"""

from __future__ import annotations

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.config import preset
from dsv4.engine.runner import Runner
from dsv4.engine.state import GenerationState, state_layout
from dsv4.model.cache import RowStore
from dsv4.ops import numerics
from dsv4.testing import prefill


def _values(*shape, seed, scale=3.0):
    v = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    v[..., :5] *= 1e-6   # tiny values in the first block
    return v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dim, rope", [(512, 64), (32, 16), (100, 10)])
def test_fp8_store_reads_back_the_simulation_bit_for_bit(dtype, pow2, dim, rope):
    store = RowStore.allocate("fp8", 3, 5, dim, dtype, "cpu", rope_dim=rope, pow2=pow2)
    values = _values(2, 4, dim, seed=1).to(dtype)
    slots, rows = torch.tensor([[2], [0]]), torch.tensor([[4, 1, 0, 3]])
    store.write(slots, rows, values)
    got = store.read(slots, rows)
    nope = dim - rope
    want = torch.cat([numerics.fp8_sim(values[..., :nope], 64, pow2), values[..., nope:]], dim=-1)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(store.round_trip(values), want)
    assert store.data.dtype == torch.float8_e4m3fn and store.rope.dtype == dtype
    assert store.scale.dtype == (torch.uint8 if pow2 else torch.float32)
    if pow2:   # the stored byte is the exponent of a power-of-two scale
        s = numerics.e8m0_to_float(store.scale[2, 4])
        assert torch.equal(numerics.pow2_ceil(s), s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_store_reads_back_the_simulation_bit_for_bit(dtype):
    store = RowStore.allocate("fp4", 2, 6, 128, dtype, "cpu")
    values = _values(2, 6, 128, seed=2).to(dtype)
    store.write(torch.arange(2).view(2, 1), torch.arange(6).view(1, 6), values)
    got = store.read(torch.arange(2).view(2, 1), torch.arange(6).view(1, 6))
    assert torch.equal(got, numerics.fp4_sim(values, 32))
    assert store.data.shape == (2, 6, 64) and store.data.dtype == torch.uint8 and store.scale.shape == (2, 6, 4)


def test_plain_store_keeps_the_activation_dtype():
    store = RowStore.allocate("plain", 2, 3, 16, torch.float32, "cpu")
    v = _values(3, 16, seed=3)
    store.write(torch.tensor([1]), torch.arange(3), v)
    assert torch.equal(store.read(torch.tensor([1]), torch.arange(3)), v)


def test_bytes_per_entry_at_v4_geometry():
    """Flash: 448 FP8 bytes + 7 e8m0 scales + 64 BF16 rope dims = 583 bytes per K=V row; indexer
    keys 64 + 4 bytes; plain BF16 rows 1024 bytes."""
    c = preset("flash")
    fp8 = RowStore.allocate("fp8", 1, 1, c.head_dim, torch.bfloat16, "meta", c.rope_dim)
    assert fp8.nbytes_per_row() == 448 + 7 + 128
    assert RowStore.allocate("fp4", 1, 1, c.index_head_dim, torch.bfloat16, "meta").nbytes_per_row() == 64 + 4
    assert RowStore.allocate("plain", 1, 1, c.head_dim, torch.bfloat16, "meta").nbytes_per_row() == 1024


def test_state_layout_matches_allocated_bytes():
    config = parity_config()
    for qat in (False, True):
        layout = state_layout(config, torch.float32, qat)
        state = GenerationState(config, 3, 64, torch.float32, "cpu", qat_sim=qat)
        assert layout.bytes(3, 64) == pytest.approx(state.nbytes() - 3 * 8, rel=0.05)
        assert set(layout.layers) == {"sliding", "csa", "hca"}
    flash = state_layout(preset("flash"), torch.bfloat16, qat_sim=True)
    # per token: CSA layers keep an entry per 4 tokens (K=V 583 B + indexer key 68 B), HCA one per 128
    per_token = sum(flash.per_token.values())
    expected = flash.layers["csa"] * (583 + 68) / 4 + flash.layers["hca"] * 583 / 128
    assert per_token == pytest.approx(expected)
    assert flash.max_context(80 << 30) > 1_000_000  # a 1M-token context fits in 80 GiB of state


def test_scale_fmt_fp32_keeps_fp32_kv_scales():
    config = parity_config(scale_fmt="fp32")
    assert not config.kv_scale_pow2
    model = random_model(config, seed=4)
    runner = Runner(model, 1, 64, qat_sim=True)
    prefill(runner, 0, list(range(2, 30)))
    ring = runner.state.layers[0].ring
    assert ring.scale.dtype == torch.float32
    scales = ring.scale[0].flatten()
    assert not torch.equal(numerics.pow2_ceil(scales[scales > 0]), scales[scales > 0])


def test_block_size_is_the_lcm_of_window_and_ratios():
    from dsv4.model.cache import block_size
    assert block_size(preset("flash")) == 128 and block_size(preset("pro")) == 128
    assert block_size(preset("tiny")) == 16 and block_size(parity_config()) == 16
    assert block_size(parity_config(sliding_window=12)) == 48


@pytest.mark.parametrize("qat", [False, True])
def test_state_pieces_at_a_block_boundary(qat):
    """What each layer declares: at a block boundary the ``open`` pieces hold nothing that is read
    again (garbling them changes no later logit), the ``window`` pieces are needed (garbling them
    does), and the entry rows past the boundary are not read either. Every buffer is declared once."""
    from dsv4.model.cache import block_size
    model = random_model(parity_config(), seed=7)
    B = block_size(model.config)
    seq = torch.randint(2, 512, (3 * B + 5,), generator=torch.Generator().manual_seed(4)).tolist()
    def garbled(kinds):
        runner = Runner(model, max_num_seqs=1, max_model_len=128, qat_sim=qat)
        prefill(runner, 0, seq[:2 * B])
        for p in runner.state.pieces():
            rows = p.tensor[0]
            if p.kind in kinds:
                rows.copy_(torch.randn(rows.shape).to(rows.dtype))
            if p.kind == "entries" and "garbage-after" in kinds:
                rows[2 * B // p.ratio:].copy_(torch.randn(rows[2 * B // p.ratio:].shape).to(rows.dtype))
        return prefill(runner, 0, seq[2 * B:], all_logits=True)

    want = garbled(set())
    assert torch.equal(garbled({"open", "garbage-after"}), want)
    assert not torch.allclose(garbled({"window"}), want)
    state = GenerationState(model.config, 2, 64, torch.float32, "cpu")
    declared = [p.tensor for p in state.pieces()]
    held = [t for layer in state.layers for t in layer.tensors()]
    assert len(declared) == len(held) and all(a is b for a, b in zip(declared, held))
