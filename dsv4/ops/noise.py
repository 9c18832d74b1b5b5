"""The sampler's noise, as a specification: counter-based uniforms and Gumbel noise that are a pure
function of (row seed, row step, vocabulary id), computed in 32-bit lanes of int64 tensors so
nothing overflows (two rounds of C. Wellons' lowbias32 hash). :mod:`dsv4.engine.sampling` draws
with it; :func:`dsv4.ops.reference.draw_tokens` is the op the Triton sampler kernel
(:mod:`dsv4.ops.triton.sampling`) recomputes bit for bit in uint32 lanes.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the low 32 bits of an int64
M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32): 16-bit halves of c, no overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 (C. Wellons): a well-mixing bijection of 32-bit values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed_lo: Tensor, seed_hi: Tensor, step: Tensor, vocab_size: int) -> Tensor:
    """Counter-based uniforms in (0, 1): ``[B, V]`` fp32, a pure function of (seed, step, id).

    ``seed_lo``, ``seed_hi`` [B] int64 hold the seed's 32-bit halves, ``step`` [B] int64. The
    row keys (k1, k2) are injective in the seed for a fixed step; each row's values are
    distinct across the vocabulary (bijections); 24 bits per value, centred in its bin.
    """
    k1 = _mix32(seed_lo ^ _mix32((step & M32) ^ 0x9E3779B9))  # [B]
    k2 = _mix32(seed_hi ^ _mix32(k1 ^ 0x85EBCA6B))  # [B]
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seed_lo.device)
    h = _mix32(_mix32(vocab[None, :] ^ k1[:, None]) ^ k2[:, None])  # [B, V] in [0, 2**32)
    return unit_interval(h)


def unit_interval(h: Tensor) -> Tensor:
    """32-bit hashes (int64 in [0, 2**32)) -> fp32 in (0, 1): the top 24 bits, centred in their bin.
    The top bin's centre ``1 - 2**-25`` is not an fp32 number and would round to 1 (whose Gumbel
    noise is +inf: that token would win whatever its probability, one draw in 2**24 per vocabulary
    entry), so it is held at the largest fp32 below 1."""
    return (((h >> 8).float() + 0.5) * 2.0**-24).clamp_(max=1.0 - 2.0**-24)


def gumbel_noise(seed_lo: Tensor, seed_hi: Tensor, step: Tensor, vocab_size: int) -> Tensor:
    """Gumbel(0, 1) noise ``[B, V]`` fp32: ``-log E`` with ``E = -log U ~ Exp(1)``.

    ``argmax(logits + noise)`` equals the exponential race ``argmax(p / E)``: it draws token
    i with probability ``softmax(logits)_i``.
    """
    return -torch.log(-torch.log(uniform_noise(seed_lo, seed_hi, step, vocab_size)))
