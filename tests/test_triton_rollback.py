"""The speculative rollback kernels (:mod:`dsv4.ops.triton.small_rollback`) against their reference
compositions (:mod:`dsv4.ops.reference_fused`), bit-exact (every value is a copy or zero):

- ``window_rollback``: on poisoned windows (NaN: a row the kernel fails to write shows), at every
  kept count, start offsets across window boundaries, overlap (CSA) and not (HCA);
- ``rows_save`` / ``rows_restore``: a ring's tensors of every layout (FP8 values, e8m0 scales of 7
  bytes a row, the RoPE part in bf16; FP4 codes) and a compressor's fp32 windows, saves into poisoned
  buffers, positions that wrap around the ring, every kept count.

CPU: Triton's interpreter at small shapes; GPU (``-m gpu``): V4's widths and ratios."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from dsv4.model.cache import CompressorState, RowStore  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import register_all  # noqa: E402,F401
from dsv4.ops.triton import runtime  # noqa: E402
from dsv4.ops.triton.small_rollback import rows_restore_triton, rows_save_triton, window_rollback_triton  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from dsv4.ops.triton import fix_interpreter
    fix_interpreter()


def _state(slots: int, ratio: int, dim: int, overlap: bool, S: int, device: str, seed: int) -> CompressorState:
    g = torch.Generator().manual_seed(seed)
    entries = RowStore.allocate("plain", slots, 4, dim, torch.float32, device)
    st = CompressorState.allocate(entries, slots, ratio, dim, overlap, device)
    st.enable_log(S)
    for t in (st.win_kv, st.win_gate, st.log_kv, st.log_gate) + ((st.prev_kv, st.prev_gate) if overlap else ()):
        t.copy_(torch.randn(t.shape, generator=g))
    return st


def _check(ratio: int, dim: int, overlap: bool, S: int, B: int, device: str, seed: int) -> None:
    n_slots = B + 3
    a = _state(n_slots, ratio, dim, overlap, S, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(n_slots, generator=g)[:B].to(device)
    start = torch.randint(0, 5 * ratio, (B,), generator=g).to(device)
    kept = torch.randint(0, S + 1, (B,), generator=g).to(device)
    kept[0], kept[-1] = 0, S                                          # the extremes, always
    saved = a.save(slots)
    saved = tuple(t + 0 for t in saved)
    b = _state(n_slots, ratio, dim, overlap, S, device, seed)
    # poison the windows the rollback must rewrite entirely (both sides: the reference too)
    for st in (a, b):
        for t in (st.win_kv, st.win_gate) + ((st.prev_kv, st.prev_gate) if overlap else ()):
            t[slots] = float("nan")
    ref.window_rollback(a, saved, slots, start, S, kept)
    window_rollback_triton(b, saved, slots, start, S, kept)
    for name in ("win_kv", "win_gate", "prev_kv", "prev_gate"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is not None:
            assert not ta[slots].isnan().any(), name
            assert torch.equal(ta, tb), f"{name}: {(ta != tb).sum()} values differ"


@pytest.mark.parametrize("ratio, dim, overlap, S, B", [(4, 8, True, 4, 5), (4, 12, True, 2, 3), (16, 8, False, 5, 4),
                                                       (4, 8, False, 3, 4), (8, 6, True, 5, 6)])
def test_window_rollback_equals_reference(ratio, dim, overlap, S, B):
    _check(ratio, dim, overlap, S, B, "cpu", seed=ratio * 100 + S * 10 + B)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ratio, dim, overlap", [(4, 512, True), (4, 128, True), (128, 512, False)])
@pytest.mark.parametrize("B", [1, 32])
def test_gpu_window_rollback_equals_reference(ratio, dim, overlap, B):
    for S in (2, 4, 5):
        _check(ratio, dim, overlap, S, B, "cuda", seed=ratio + dim + S + B)


def _ring(layout: str, slots: int, rows: int, dim: int, device: str, seed: int) -> list[torch.Tensor]:
    """A ring's tensors filled with random bytes (every value a copy: NaN bit patterns included)."""
    rope = 0 if layout != "fp8" else (64 if dim >= 512 else 16)       # Flash: 448 FP8 values, 7 scales, 64 RoPE
    ring = RowStore.allocate(layout, slots, rows, dim, torch.bfloat16, device, rope_dim=rope)
    g = torch.Generator().manual_seed(seed)
    for t in ring.tensors():
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    return ring.tensors()


def _rows_check(tensors: list[torch.Tensor], B: int, n: int, positional: bool, device: str, seed: int) -> None:
    n_slots, R = tensors[0].shape[:2]
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(n_slots, generator=g)[:B].to(device)
    start = torch.randint(0, 4 * R, (B,), generator=g).to(device) if positional else None
    with runtime.poisoned():
        got = rows_save_triton(tensors, slots, start, n)
    want = ref.rows_save(tensors, slots, start, n)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if not positional:
        return
    kept = torch.randint(0, n + 1, (B,), generator=g).to(device)
    kept[0], kept[-1] = 0, n
    # the forward overwrote the rows; the restore puts the rejected ones back
    after = [t.clone() for t in tensors]
    for t in after:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    a, b = [t.clone() for t in after], [t.clone() for t in after]
    ref.rows_restore(a, want, slots, start, kept)
    rows_restore_triton(b, got, slots, start, kept)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    # and only they: the last row keeps all it was given (kept = n), the first gets all back (kept = 0)
    r = (int(start[-1]) + n - 1) % R
    assert torch.equal(b[0][int(slots[-1]), r].view(torch.uint8), after[0][int(slots[-1]), r].view(torch.uint8))
    if B > 1:
        r = int(start[0]) % R
        assert torch.equal(b[0][int(slots[0]), r].view(torch.uint8), want[0][0, 0].view(torch.uint8))


@pytest.mark.parametrize("layout, dim, S, B", [("fp8", 80, 4, 3), ("fp4", 64, 2, 5), ("plain", 24, 5, 4),
                                               ("fp8", 80, 8, 1)])
def test_ring_rows_save_restore_equal_reference(layout, dim, S, B):
    _rows_check(_ring(layout, B + 2, 8, dim, "cpu", seed=S * 10 + B), B, S, True, "cpu", seed=S + B)


@pytest.mark.parametrize("ratio, dim, overlap, B", [(4, 8, True, 3), (16, 6, False, 2)])
def test_window_rows_save_equals_reference(ratio, dim, overlap, B):
    st = _state(B + 2, ratio, dim, overlap, 4, "cpu", seed=ratio + B)
    windows = [st.win_kv, st.win_gate] + ([st.prev_kv, st.prev_gate] if overlap else [])
    _rows_check(windows, B, ratio, False, "cpu", seed=ratio * B)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 32])
def test_gpu_rows_save_restore_equal_reference(B):
    # Flash's ring (window 128, head dim 512, RoPE 64) and its indexer's FP4 keys; an HCA window
    for S in (2, 4, 5):
        _rows_check(_ring("fp8", B + 3, 128, 512, "cuda", seed=S + B), B, S, True, "cuda", seed=S * B)
        _rows_check(_ring("fp4", B + 3, 128, 128, "cuda", seed=S + B), B, S, True, "cuda", seed=S * B + 1)
    st = _state(B + 3, 128, 512, False, 4, "cuda", seed=B)
    _rows_check([st.win_kv, st.win_gate], B, 128, False, "cuda", seed=B)
