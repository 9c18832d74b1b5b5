"""Plain-torch definitions of every hot DeepSeek-V4 operation: the executable spec.

Each function here is what a fast kernel must reproduce (DSV4_FACTS section 2); kernels are
tested against these on fresh random inputs. Everything runs on CPU. Math that the reference
semantics does in fp32 (norms, softmaxes, mHC, router, compressor) is done in fp32 here, and the
result is cast back to the activation dtype where the reference does so.

Shapes use: ``T`` tokens (flattened batch), ``H`` query heads, ``hd`` head dim, ``rd`` rope dims,
``nc`` hyper-connection streams, ``D`` hidden size, ``E`` experts, ``k`` experts per token.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0


# ----------------------------------------------------------------------------- norms
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with weight, computed in fp32, cast back to ``x.dtype``. ``x [..., D]``, ``weight [D]``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without weight (per-head query norm). ``x [..., hd]``."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ----------------------------------------------------------------------------- RoPE
def rope_inv_freq(rope_dim: int, theta: float, yarn: object | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` fp32, optionally YaRN-scaled.

    ``yarn`` has ``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``.
    YaRN blends interpolated (``/factor``) and extrapolated frequencies with a linear ramp over the
    pair index between the correction dims of ``beta_fast`` and ``beta_slow`` rotations (floor/ceil
    truncated). DeepSeek-V4 applies no mscale to cos/sin.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None or yarn.factor <= 1:
        return freqs
    orig = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 where the pair keeps its original (high) frequency
    return freqs / yarn.factor * (1 - extrapolate) + freqs * extrapolate


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[*positions.shape, rd // 2]`` fp32 for integer ``positions``."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the *last* ``rd = 2 * cos.shape[-1]`` dims of ``x`` as interleaved pairs.

    Channels ``(2i, 2i+1)`` of the rope slice form the complex number ``x[2i] + j x[2i+1]``, multiplied
    by ``exp(j * angle_i)`` (``exp(-j * angle_i)`` when ``inverse``). ``cos``/``sin`` broadcast against
    ``x[..., :rd // 2]`` (add head dims with ``unsqueeze`` before calling). Math in fp32.
    """
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = rope.float().unflatten(-1, (rd // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


@lru_cache(maxsize=8)
def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n ** -0.5).to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard rotation over the last dim (a power of two), fp32 math."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: last dim {n} is not a power of two")
    return (x.float() @ _hadamard_matrix(n, x.device)).to(x.dtype)


# ----------------------------------------------------------------------------- QAT simulation
def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``x [..., n]`` as fp32 blocks ``[..., ceil(n / block), block]``; a ragged last block is zero-padded
    (zeros never change a block's amax)."""
    n = x.shape[-1]
    pad = -n % block
    xf = F.pad(x.float(), (0, pad)) if pad else x.float()
    return xf.unflatten(-1, (xf.shape[-1] // block, block)), n


def fp8_sim(x: torch.Tensor, block: int = 64, pow2_scale: bool = True) -> torch.Tensor:
    """Round ``x [..., n]`` through FP8 e4m3 with one scale per ``block`` values of the last dim.

    (A ragged last block, as in tiny test geometries, gets its own scale.)

    scale = amax / 448 (a power of two rounded up when ``pow2_scale``, as with ue8m0 scales);
    returns the dequantized values in ``x.dtype``. This is the QAT simulation of the KV cache.
    """
    xb, n = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = amax / FP8_E4M3_MAX
    if pow2_scale:
        scale = _pow2_ceil(scale)
    q = (xb / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)[..., :n].to(x.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already scaled into [-6, 6]) to the nearest e2m1 value, ties to the even code,
    saturating at +-6 (the same rounding the FP4 weight quantizer uses)."""
    from ..weights.formats import round_to_e2m1
    return round_to_e2m1(x)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round ``x [..., n]`` through FP4 e2m1 with one power-of-two scale per ``block`` values."""
    xb, n = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = _pow2_ceil(amax / E2M1_MAX)
    return (round_e2m1(xb / scale) * scale).flatten(-2)[..., :n].to(x.dtype)


# ----------------------------------------------------------------------------- mHC
def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project ``softmax(...) + eps`` matrices ``[..., nc, nc]`` towards doubly stochastic.

    One column normalisation, then ``iters - 1`` rounds of (row, column); ``eps`` in every
    denominator. A fixed count: never a convergence test.
    """
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
            norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre: collapse ``nc`` streams into a block input and compute the post/comb weights.

    ``h [..., nc, D]``, ``fn [(2+nc)*nc, nc*D]``, ``base [(2+nc)*nc]``, ``scale [3]``.
    Returns ``y [..., D]`` (``h.dtype``), ``post [..., nc]`` fp32, ``comb [..., nc, nc]`` fp32.
    The projection output splits as pre, post, comb (in that order).
    """
    nc = h.shape[-2]
    x = h.flatten(-2).float()
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mix = (x @ fn.float().T) * r
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mix[..., :nc] * scale[0] + base[:nc]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., nc:2 * nc] * scale[1] + base[nc:2 * nc])
    comb = mix[..., 2 * nc:] * scale[2] + base[2 * nc:]
    comb = torch.softmax(comb.unflatten(-1, (nc, nc)), dim=-1) + hc_eps
    comb = sinkhorn(comb, iters, hc_eps)
    y = (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)
    return y, post, comb


def mhc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post: ``h_next[k] = post_k * out + sum_j comb[j, k] * h[j]``.

    ``out [..., D]``, ``h [..., nc, D]``, ``post [..., nc]``, ``comb [..., nc, nc]``; result ``h.dtype``.
    Mixing happens in the activation dtype, as in the reference.
    """
    dt = h.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dt).transpose(-1, -2) @ h


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """Final stream collapse: ``pre = sigmoid(mix * scale + base) + eps``; ``h [..., nc, D] -> [..., D]``."""
    x = h.flatten(-2).float()
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mix = (x @ fn.float().T) * r
    pre = torch.sigmoid(mix * scale.float()[0] + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)


# ----------------------------------------------------------------------------- attention
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Multi-query attention with a per-query key mask and a per-head sink.

    ``q [B, S, H, hd]``; ``kv [B, K, hd]`` is both key and value (one shared head, K=V);
    ``valid [B, S, K]`` bool says which keys each query sees (sliding window, visible compressed
    entries, the indexer's top-k); ``sink [H]`` is an extra logit in the softmax denominator with a
    zero value vector. Logits and softmax in fp32, scale ``scale``. A query with no valid key gets
    zeros. Returns ``[B, S, H, hd]`` in ``q.dtype``.
    """
    logits = torch.einsum("bshd,bkd->bshk", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sinks = sink.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bshk,bkd->bshd", probs, kv.float()).to(q.dtype)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None = None,
                     prev_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Pool one window of compressor rows into one entry (before norm/RoPE), fp32.

    Without overlap (HCA): ``kv, gate [..., m, hd]``; entry = ``sum softmax_m(gate) * kv``.
    With overlap (CSA): ``kv, gate [..., m, 2*hd]`` and the previous window's ``a`` halves
    ``prev_kv, prev_gate [..., m, hd]``; the softmax runs over the ``2m`` slots
    ``[prev a halves, this window's b halves]`` (a ``-inf`` prev gate gives those slots weight 0).
    ``gate`` already includes the positional bias ``ape``.
    """
    kv, gate = kv.float(), gate.float()
    if prev_kv is not None:
        hd = prev_kv.shape[-1]
        kv = torch.cat([prev_kv.float(), kv[..., hd:]], dim=-2)
        gate = torch.cat([prev_gate.float(), gate[..., hd:]], dim=-2)
    return (torch.softmax(gate, dim=-2) * kv).sum(-2)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores ``sum_h w[b, s, h] * relu(q[b, s, h] . keys[b, c])``, fp32.

    ``q [B, S, nI, d]``, ``keys [B, C, d]``, ``weights [B, S, nI]`` (already scaled by
    ``d**-0.5 * nI**-0.5``). Returns ``[B, S, C]``.
    """
    dots = torch.einsum("bshd,bcd->bshc", q.float(), keys.float()).relu()
    return (dots * weights.float().unsqueeze(-1)).sum(2)


# ----------------------------------------------------------------------------- MoE
def router_scores(logits: torch.Tensor, func: str) -> torch.Tensor:
    """Expert affinities from router logits (fp32): sqrt(softplus), sigmoid or softmax."""
    logits = logits.float()
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    if func == "softmax":
        return logits.softmax(-1)
    raise ValueError(f"unknown scoring function {func!r}")


def route(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None,
          fixed_ids: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``k`` experts per token and their weights.

    ``scores [T, E]`` fp32. Selection is ``fixed_ids [T, k]`` (hash layers) or ``topk(scores + bias)``
    (the bias only selects). Weights are the selected scores normalised to sum 1, times ``scale``.
    Returns ``(weights [T, k] fp32, ids [T, k] int64)``.
    """
    if fixed_ids is not None:
        ids = fixed_ids.long()
    else:
        sel = scores if bias is None else scores + bias.float()
        ids = sel.topk(k, dim=-1).indices
    w = scores.gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: ``silu(min(g, L)) * clamp(u, -L, L)`` (no clamp when ``limit <= 0``)."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up
