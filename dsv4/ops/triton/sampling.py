"""The sampler's last step in two launches (:func:`dsv4.ops.reference.draw_tokens`): per row the
argmax of the logits (greedy) or of the truncated, temperature-scaled logits plus the counter-based
Gumbel noise (:mod:`dsv4.ops.noise`), the noise made in registers.

The reference builds the noise as ``[B, V]`` int64 tensors, some forty elementwise ops over the
vocabulary, then a log, a log, an add and two argmaxes: ~150 kernels a sampled decode step, each
reading and writing ``B x V`` values. Here:

1. ``_draw_partial_kernel``, grid ``(B, S)``: split ``s`` of row ``b`` walks its share of the
   vocabulary in ``BLOCK``-wide tiles, hashes the ids (lowbias32 twice in uint32 lanes: the int64
   reference's values bit for bit), turns the hashes into Gumbel noise with the CUDA math library's
   ``logf`` (libdevice: what ``torch.log`` runs on the GPU), and keeps the largest *key*: the value's
   order-preserving int32 in the high half, the inverted id in the low half, so one integer max
   gives the largest value and, among equal values, the lowest id (``torch.argmax``; NaN above
   everything, ``-0 == +0``). A greedy row skips the noise.
2. ``_draw_final_kernel``, one program a row: the largest of the row's ``S`` keys, as a token id.

The division by the temperature is IEEE (``div_rn``), as torch's. Under Triton's interpreter (no
libdevice) the logs are NumPy's, within an ulp of torch's CPU ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .numerics import ordered_key

#: vocabulary ids one program takes per tile, its warps, and the programs per SM the split grid aims
#: for: searched on an H100 (``bench/sampler_bench.py --tune``, V = 129280): at batch 32 / 64 the
#: greedy argmax 9.7 / 14.8 us and the draw 21 / 38 us, against 26 / 44 and 25 / 47 with 4 warps
#: and 2 programs an SM; batch 1 and 8 take 5-6 / 6-9 us with any of them
BLOCK = 1024
NUM_WARPS = 8
PROGRAMS_PER_SM = 4

try:
    from triton.language.extra import libdevice
except ImportError:        # pragma: no cover (every Triton with CUDA support ships it)
    libdevice = None


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (:func:`dsv4.ops.noise._mix32`)."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _log(x, INTERP: tl.constexpr):
    if INTERP:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _gumbel(ids, k1, k2, INTERP: tl.constexpr):
    """Gumbel noise of vocabulary ``ids`` (uint32) for row keys ``k1``, ``k2`` (uint32):
    :func:`dsv4.ops.noise.gumbel_noise`, bit for bit on the GPU."""
    h = _mix32(_mix32(ids ^ k1) ^ k2)
    u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08, 0.99999994039535522)
    return -_log(-_log(u, INTERP), INTERP)


@triton.jit(do_not_specialize=["V", "per", "S", "l_stride", "s_stride"])
def _draw_partial_kernel(logits_ptr, scaled_ptr, temp_ptr, greedy_ptr, lo_ptr, hi_ptr, step_ptr, part_ptr,
                         V, per, S, l_stride, s_stride, BLOCK: tl.constexpr, SAMPLING: tl.constexpr,
                         HAS_SCALED: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    start = sp * per
    end = tl.minimum(start + per, V)
    row64 = row.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -9223372036854775808, tl.int64)
    greedy = True
    if SAMPLING:
        greedy = tl.load(greedy_ptr + row) != 0
    if greedy:
        for off in range(start, end, BLOCK):
            i = off + offs
            m = i < end
            x = tl.load(logits_ptr + row64 * l_stride + i, mask=m, other=0.0).to(tl.float32)
            best = tl.maximum(best, tl.where(m, ordered_key(x, i), -9223372036854775808))
    else:
        # the row's keys (dsv4.ops.noise.uniform_noise), from the low 32 bits of seed and step
        step = tl.load(step_ptr + row).to(tl.uint32)
        k1 = _mix32(tl.load(lo_ptr + row).to(tl.uint32) ^ _mix32(step ^ tl.full((), 0x9E3779B9, tl.uint32)))
        k2 = _mix32(tl.load(hi_ptr + row).to(tl.uint32) ^ _mix32(k1 ^ tl.full((), 0x85EBCA6B, tl.uint32)))
        t = tl.load(temp_ptr + row).to(tl.float32)
        for off in range(start, end, BLOCK):
            i = off + offs
            m = i < end
            if HAS_SCALED:
                s = tl.load(scaled_ptr + row64 * s_stride + i, mask=m, other=0.0).to(tl.float32)
            else:
                x = tl.load(logits_ptr + row64 * l_stride + i, mask=m, other=0.0).to(tl.float32)
                s = tl.math.div_rn(x, tl.broadcast_to(t, x.shape))
            v = s + _gumbel(i.to(tl.uint32), k1, k2, INTERP)
            best = tl.maximum(best, tl.where(m, ordered_key(v, i), -9223372036854775808))
    tl.store(part_ptr + row64 * S + sp, tl.max(best, axis=0))


@triton.jit(do_not_specialize=["S"])
def _draw_final_kernel(part_ptr, out_ptr, S, SP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SP)
    keys = tl.load(part_ptr + row * S + j, mask=j < S, other=-9223372036854775808)
    tl.store(out_ptr + row, 4294967295 - (tl.max(keys, axis=0) & 4294967295))


def _config(B: int, V: int, sms: int) -> tuple[int, int, int]:
    """``(BLOCK, num_warps, splits a row)`` for ``B`` rows of ``V`` ids on ``sms`` SMs: enough
    programs to fill the GPU, each at least one tile (``bench/sampler_bench.py --tune`` searches)."""
    tiles = triton.cdiv(V, BLOCK)
    return BLOCK, NUM_WARPS, max(1, min(tiles, triton.cdiv(PROGRAMS_PER_SM * sms, B)))


def draw_tokens_triton(logits: torch.Tensor, scaled: torch.Tensor | None, temperature: torch.Tensor,
                       greedy: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor,
                       sampling: bool = True) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.draw_tokens` (same signature, same ids)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, V] with unit stride over V, got {tuple(logits.shape)}")
    B, V = logits.shape
    if scaled is not None and (scaled.shape != logits.shape or scaled.stride(-1) != 1):
        raise ValueError(f"scaled must be {tuple(logits.shape)} with unit stride over V, got {tuple(scaled.shape)}")
    if V >= 1 << 31:
        raise ValueError(f"a vocabulary of {V} ids does not fit the kernel's 32-bit ids")
    if sampling and any(t is None for t in (temperature, greedy, seed_lo, seed_hi, step)):
        raise ValueError("a sampling draw needs the rows' temperature, greedy flag, seeds and step")
    interp = runtime.interpreting()
    if not interp and libdevice is None:      # pragma: no cover
        raise RuntimeError("Triton's libdevice is missing: the sampler's noise needs the CUDA math library's logf")
    out = runtime.empty((B,), torch.int64, logits.device)
    if B == 0:
        return out
    if V == 0:
        raise ValueError("draw_tokens over an empty vocabulary")
    block, warps, S = _config(B, V, runtime.sm_count(logits.device))
    per = triton.cdiv(triton.cdiv(V, block), S) * block
    S = triton.cdiv(V, per)
    part = runtime.empty((B, S), torch.int64, logits.device)
    # (the rows' knobs are read only when sampling; otherwise every knob pointer is the logits, never
    # dereferenced, so a greedy launch has one specialization whatever the caller passed)
    knobs = [t if sampling else logits for t in (temperature, greedy, seed_lo, seed_hi, step)]
    _draw_partial_kernel[(B, S)](
        logits, logits if scaled is None else scaled, *knobs, part,
        V, per, S, logits.stride(0), logits.stride(0) if scaled is None else scaled.stride(0),
        BLOCK=block, SAMPLING=bool(sampling), HAS_SCALED=scaled is not None, INTERP=interp, num_warps=warps)
    _draw_final_kernel[(B,)](part, out, S, SP=max(2, triton.next_power_of_2(S)), num_warps=1)
    return out


REGISTRATIONS = [("draw_tokens", None, draw_tokens_triton)]

__all__ = ["draw_tokens_triton", "REGISTRATIONS"]
