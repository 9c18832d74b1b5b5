"""The speculative window rollback kernel (``window_rollback``, :mod:`dsv4.ops.triton.small_rollback`)
against its reference composition (:func:`dsv4.ops.reference_fused.window_rollback`): bit-exact
(every value is a copy or zero), on poisoned windows (NaN: a row the kernel fails to write shows),
at every kept count, start offsets across window boundaries, overlap (CSA) and not (HCA). CPU:
Triton's interpreter at small shapes; GPU (``-m gpu``): V4's widths and ratios."""

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
from dsv4.ops.triton.small_rollback import window_rollback_triton  # noqa: E402

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
