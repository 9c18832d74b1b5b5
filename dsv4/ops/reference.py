"""Plain-torch definitions of every hot DeepSeek-V4 operation: the executable spec.

Each function here is what a fast kernel must reproduce (DSV4_FACTS section 2); kernels are
tested against these on fresh random inputs. Everything runs on CPU. Math that the reference
semantics does in fp32 (norms, softmaxes, mHC, router, compressor) is done in fp32 here, and the
result is cast back to the activation dtype where the reference does so.

Shapes use: ``T`` tokens (flattened batch), ``H`` query heads, ``hd`` head dim, ``rd`` rope dims,
``nc`` hyper-connection streams, ``D`` hidden size, ``E`` experts, ``k`` experts per token.
"""

from __future__ import annotations

import contextlib
import math
import threading
from functools import lru_cache
from typing import Iterator

import torch
import torch.nn.functional as F

from . import numerics
from .noise import gumbel_noise
from .numerics import act_quant_sim, fp4_sim, fp8_sim  # noqa: F401  (part of the reference API)



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
    """cos, sin ``[*positions.shape, rd // 2]`` fp32 for integer ``positions`` and ``inv_freq [rd // 2]``
    (or several tables at once: ``inv_freq`` shaped to broadcast against ``positions.unsqueeze(-1)``)."""
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
    # built on the device itself (no host->device copy), once per (n, device)
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n ** -0.5


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard rotation over the last dim (a power of two), fp32 math."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: last dim {n} is not a power of two")
    return (x.float() @ _hadamard_matrix(n, x.device)).to(x.dtype)


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

    ``out [..., D]``, ``h [..., nc, D]``, ``post [..., nc]`` fp32, ``comb [..., nc, nc]`` fp32. The
    mixing weights stay fp32 and the mix is computed in fp32 (as DeepSeek's code does), then cast
    to ``h.dtype``.
    """
    mixed = post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + comb.float().transpose(-1, -2) @ h.float()
    return mixed.to(h.dtype)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """Final stream collapse: ``pre = sigmoid(mix * scale + base) + eps``; ``h [..., nc, D] -> [..., D]``."""
    x = h.flatten(-2).float()
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mix = (x @ fn.float().T) * r
    pre = torch.sigmoid(mix * scale.float()[0] + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)


# ----------------------------------------------------------------------------- matmuls
def _dense(w: object, dtype: torch.dtype) -> torch.Tensor:
    """A plain tensor cast to ``dtype``, or a packed weight dequantized to ``dtype`` (fp32 math)."""
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def _is_quantized(w: object) -> bool:
    """FP8-block / MXFP4 / NVFP4 weights (the ones DeepSeek's code multiplies on the FP8 grid)."""
    return not isinstance(w, torch.Tensor) and w.dtype_name not in ("bf16", "fp16", "fp32", "fp64")


_MM_OUT_DTYPE: dict[str, bool] = {}


def _mm_out_dtype_works(device: torch.device) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` (half operands, fp32 accumulate and output)
    runs on this device type; probed once per device type, on tiny tensors."""
    if device.type not in _MM_OUT_DTYPE:
        try:
            a = torch.zeros(2, 2, dtype=torch.bfloat16, device=device)
            torch.mm(a, a, out_dtype=torch.float32)
            _MM_OUT_DTYPE[device.type] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[device.type] = False
    return _MM_OUT_DTYPE[device.type]


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ w [N, K].T`` with operands in ``x.dtype`` and fp32 accumulation.

    ``out_dtype`` (default ``x.dtype``) is the result dtype; an fp32 result from half operands
    is exact products summed in fp32 (``torch.mm(out_dtype=)`` where the device has it, else the
    operands are upcast, which computes the same thing).
    """
    out_dtype = out_dtype or x.dtype
    w = w.to(x.dtype)
    if out_dtype == x.dtype:
        return F.linear(x, w)
    if out_dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype_works(x.device):
        y = torch.mm(x.reshape(-1, x.shape[-1]), w.T, out_dtype=torch.float32)
        return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x.to(out_dtype), w.to(out_dtype))


def linear(x: torch.Tensor, w: object, act_quant: bool = False, pow2: bool = True,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T -> [..., N]`` for a plain weight or a packed one, fp32 accumulation.

    ``w`` is a tensor ``[N, K]`` (BF16 checkpoints and the precision floor) or a packed weight
    (``Fp8BlockWeight``, ``Mxfp4Weight``, ``Nvfp4Weight``), dequantized to the activation dtype
    (never expanded at load time). With ``act_quant`` (the QAT simulation, DSV4_FACTS 2b) the input
    of an FP8/FP4 weight is first rounded to e4m3 per 1x128 block (power-of-two scales when
    ``pow2``): W8A8 / W4A8 numerics. Plain weights never quantize their input. The result is
    ``out_dtype`` (default ``x.dtype``).
    """
    if x.shape[-1] != w.shape[-1] or len(w.shape) != 2:
        name = getattr(w, "name", None)
        raise ValueError(f"linear: x has shape {tuple(x.shape)} but weight{' ' + name if name else ''} has "
                         f"shape {tuple(w.shape)} (needs [N, {x.shape[-1]}])")
    if act_quant and _is_quantized(w):
        x = act_quant_sim(x, 128, pow2)
    return matmul(x, _dense(w, x.dtype), out_dtype)


def grouped_linear(x: torch.Tensor, w: object, groups: int) -> torch.Tensor:
    """Block-diagonal projection (the grouped output projection ``wo_a``): group ``g`` of
    ``x [..., G, K]`` times rows ``g*r:(g+1)*r`` of ``w [G*r, K]`` -> ``[..., G, r]`` in ``x.dtype``.

    No activation quantization: DeepSeek's code dequantizes ``wo_a`` to BF16 and runs a BF16 einsum.
    """
    wg = _dense(w, x.dtype).unflatten(0, (groups, -1))  # [G, r, K]
    return torch.einsum("...gk,grk->...gr", x, wg)


# ----------------------------------------------------------------------------- MoE
#: bytes of dequantized expert weights the gather path holds at once
MOE_GATHER_BYTES = 256 << 20
_SYNC_FREE = threading.local()


@contextlib.contextmanager
def sync_free() -> Iterator[None]:
    """Within the block (this thread) the reference ops read no device value on the host, so a
    forward can be captured in a CUDA graph (the runner's capture, and tests, use it). CUDA graph
    capture in progress implies it."""
    old = getattr(_SYNC_FREE, "on", False)
    _SYNC_FREE.on = True
    try:
        yield
    finally:
        _SYNC_FREE.on = old


def host_reads_forbidden(x: torch.Tensor) -> bool:
    return getattr(_SYNC_FREE, "on", False) or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: object, w3: object,
        w2: object, limit: float, act_quant: bool = False, pow2: bool = True,
        shared: tuple[object, object, object] | None = None) -> torch.Tensor:
    """Routed experts: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``, plus the shared
    expert's output when ``shared = (w1, w3, w2)`` (:func:`shared_expert`; the two sums are each
    cast to ``x.dtype``, then added).

    ``x [T, D]``; ``topk_ids [T, k]`` int64 (``-1`` = no expert, e.g. another rank's); ``topk_weights
    [T, k]`` fp32; ``w1``, ``w3`` ``[E, I, D]`` and ``w2`` ``[E, D, I]``: stacked plain tensors or
    stacked packed weights. Expert: ``g = x w1^T``, ``u = x w3^T`` (fp32 accumulation and result),
    ``h = silu(min(g, L)) * clamp(u, -L, L) * weight`` cast to ``x.dtype`` (the routing weight goes in
    before ``w2``'s input is rounded), ``y = h w2^T``. With ``act_quant`` the inputs of FP8/FP4 experts are rounded
    to e4m3 per 1x128 block first. Returns ``[T, D]`` in ``x.dtype``.

    Only the selected experts are touched. Where host reads are forbidden (:func:`sync_free`, CUDA
    graph capture) each pair's expert weights are gathered by index on the device: no host read,
    fixed shapes. Otherwise tokens are grouped by expert, which reads the per-expert counts on the
    host once and reads each selected expert once, in place.
    """
    T, k = topk_ids.shape
    pairs = T * k
    expert = _expert_fn(w1, w3, w2, limit, act_quant, pow2, x.dtype)
    ids = topk_ids.reshape(-1)
    tok = torch.arange(T, device=x.device).repeat_interleave(k)
    route_w = topk_weights.reshape(-1, 1).float()
    y = torch.zeros(pairs, x.shape[1], dtype=torch.float32, device=x.device)
    if host_reads_forbidden(x):
        per_pair = _expert_bytes(w1, w3, w2, x.dtype)
        chunk = max(1, min(pairs, MOE_GATHER_BYTES // max(per_pair, 1)))
        for lo in range(0, pairs, chunk):
            hi = min(lo + chunk, pairs)
            sel = ids[lo:hi]
            y[lo:hi] = expert(x[tok[lo:hi]], sel.clamp(min=0), route_w[lo:hi])
    else:
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids + 1)[1:].tolist()   # per expert; host read, prefill only
        offset = int((ids < 0).sum())                    # ids of -1 sort first
        for e, n in enumerate(counts):
            if n:
                rows = order[offset:offset + n]
                y[rows] = expert(x[tok[rows]].unsqueeze(0), e, route_w[rows].unsqueeze(0)).squeeze(0)
                offset += n
    y = torch.where((ids >= 0).unsqueeze(-1), y, 0.0)
    out = y.view(T, k, -1).sum(1).to(x.dtype)
    if shared is not None:
        out = out + shared_expert(x, *shared, limit, act_quant, pow2)
    return out


def shared_expert(x: torch.Tensor, w1: object, w3: object, w2: object, limit: float, act_quant: bool = False,
                  pow2: bool = True) -> torch.Tensor:
    """The always-on expert of a MoE layer: 2-D ``w1``, ``w3`` ``[I, D]``, ``w2`` ``[D, I]`` (any
    format), ``h = swiglu(x w1^T, x w3^T)`` in fp32 cast to ``x.dtype`` (no routing weight), then
    ``h w2^T`` in fp32 cast to ``x.dtype``; inputs rounded like :func:`linear` rounds them."""
    g = linear(x, w1, act_quant, pow2, torch.float32)
    u = linear(x, w3, act_quant, pow2, torch.float32)
    h = swiglu(g, u, limit).to(x.dtype)   # w2's input in the activation dtype, as DeepSeek's code
    return linear(h, w2, act_quant, pow2, torch.float32).to(x.dtype)


def _expert_bytes(w1: object, w3: object, w2: object, dtype: torch.dtype) -> int:
    """Bytes of one expert's three matrices dequantized to ``dtype``."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(w.shape[-1] * w.shape[-2] for w in (w1, w3, w2)) * size


def _select(w: object, ids: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``ids`` (a device index tensor ``[n]``, or one host-known expert) of a stacked weight
    as ``dtype`` ``[n, N, K]`` (only those bytes are read; a host-known plain expert is a view)."""
    if isinstance(ids, int):
        one = w[ids] if isinstance(w, torch.Tensor) else w.expert(ids).dequantize(dtype)
        return one.to(dtype).unsqueeze(0)
    if isinstance(w, torch.Tensor):
        return w.index_select(0, ids).to(dtype)
    return w.select_experts(ids).dequantize(dtype)


def _expert_fn(w1: object, w3: object, w2: object, limit: float, act_quant: bool, pow2: bool,
               dtype: torch.dtype):
    """``f(x [n, m, D] or [n, D], ids [n], route_w [n, m, 1] or [n, 1]) -> fp32 outputs`` of expert
    ``ids[i]`` on row group ``i`` (``m`` rows share an expert in the grouped path)."""
    def quant(w: object, v: torch.Tensor) -> torch.Tensor:
        return act_quant_sim(v, 128, pow2) if act_quant and _is_quantized(w) else v

    def run(xs: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor) -> torch.Tensor:
        squeeze = xs.dim() == 2
        if squeeze:
            xs, route_w = xs.unsqueeze(1), route_w.unsqueeze(1)
        W1, W3, W2 = (_select(w, ids, dtype) for w in (w1, w3, w2))  # [n, I, D], [n, I, D], [n, D, I]
        g = _bmm_f32(quant(w1, xs), W1)
        u = _bmm_f32(quant(w3, xs), W3)
        h = (swiglu(g, u, limit) * route_w).to(dtype)   # the routing weight goes in before w2's rounding
        y = _bmm_f32(quant(w2, h), W2)
        return y.squeeze(1) if squeeze else y
    return run


def _bmm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [n, m, K] @ w[n].T -> [n, m, N]`` fp32, operands in ``x.dtype`` (exact products)."""
    w = w.to(x.dtype)
    if x.dtype in (torch.bfloat16, torch.float16) and _mm_out_dtype_works(x.device):
        return torch.bmm(x, w.transpose(1, 2), out_dtype=torch.float32)
    return torch.bmm(x.float(), w.float().transpose(1, 2))


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


def router(x: torch.Tensor, weight: object, func: str, k: int, bias: torch.Tensor | None = None,
           tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
           scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router: the gate's projection ``x [T, D] @ weight [E, D]^T`` in fp32 (the precision
    floor: the input is never rounded), :func:`router_scores`, then :func:`route`.

    Hash layers give ``tid2eid [vocab, k]`` and ``token_ids [T]`` (the picks are
    ``tid2eid[token_ids]``), the others ``bias [E]`` (or none) for the top-k selection.
    Returns ``(weights [T, k] fp32, ids [T, k] int64)``."""
    scores = router_scores(linear(x, weight, out_dtype=torch.float32), func)
    fixed = tid2eid[token_ids] if tid2eid is not None else None
    return route(scores, k, bias=bias, fixed_ids=fixed, scale=scale)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: ``silu(min(g, L)) * clamp(u, -L, L)`` (no clamp when ``limit <= 0``)."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- attention
#: elements of gathered compressed entries the attention reference holds at once (query chunks)
ATTENTION_GATHER_ELEMENTS = 1 << 24


def sparse_attention(q: torch.Tensor, kv_new: torch.Tensor, ring: object, slots: torch.Tensor,
                     start: torch.Tensor, window: int, sink: torch.Tensor, scale: float,
                     comp: object | None = None, comp_idx: torch.Tensor | None = None,
                     comp_len: torch.Tensor | None = None, comp_bound: int = 0,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-query attention over the sliding window and the compressed entries, with a sink.

    ``q [B, S, H, hd]`` at positions ``start[b] + s``; ``kv_new [B, S, hd]`` this forward's K=V rows
    (already rounded like the cache stores them); ``ring`` the slots' stored window rows (a
    ``dsv4.model.cache.RowStore`` ``[slots, window, hd]``, row ``pos % window``, read-only here:
    the caller stores ``kv_new`` after this call). Query ``t`` sees positions ``t - window + 1 .. t``.

    Compressed entries (CSA/HCA layers) come from ``comp`` (a ``RowStore`` ``[slots, n, hd]``),
    addressed either by ``comp_idx [B, S, k]`` (CSA: the indexer's picks, ``-1`` = none) or, dense,
    by ``comp_len [B, S]`` (HCA: entries ``0 .. comp_len - 1``, ``comp_bound`` a host-known bound
    on ``comp_len``). Work per query is O(window + k) (CSA) or O(comp_bound) (HCA). With ``comp_idx``,
    a nonzero ``comp_bound`` promises every index is below it (kernels read only those entries).

    Logits and softmax in fp32, scale ``scale``, plus the per-head sink logit ``sink [H]`` with a
    zero value. Returns ``[B, S, H, hd]`` in ``q.dtype``; given ``cos``, ``sin [B, S, rd/2]`` (the
    query positions' tables), with the inverse RoPE on its last ``rd`` dims applied to that result
    (:func:`apply_rope` ``inverse=True``: the K=V values carried RoPE at their key positions).
    """
    B, S, H, hd = q.shape
    dev = q.device
    ring_rows = ring.read(slots.unsqueeze(1), torch.arange(window, device=dev).unsqueeze(0))  # [B, W, hd]
    keys = torch.cat([ring_rows.float(), kv_new.float()], dim=1)                               # [B, W+S, hd]
    valid = _window_mask(start, S, window)                                                       # [B, S, W+S]
    dense = None
    if comp is not None and comp_idx is None:
        rows = torch.arange(comp_bound, device=dev)
        dense = comp.read(slots.unsqueeze(1), rows.unsqueeze(0)).float()                         # [B, n, hd]
        dense_ok = rows < comp_len.unsqueeze(-1)                                                 # [B, S, n]
    k = comp_idx.shape[-1] if comp_idx is not None else 1
    step = max(1, ATTENTION_GATHER_ELEMENTS // max(1, B * k * hd))
    outs = []
    for lo in range(0, S, step):
        hi = min(S, lo + step)
        qc = q[:, lo:hi].float()
        logits = [torch.einsum("bshd,bkd->bshk", qc, keys) * scale]
        masks = [valid[:, lo:hi]]
        values = []
        if comp_idx is not None:
            idx = comp_idx[:, lo:hi]
            ent = comp.read(slots.view(B, 1, 1), idx.clamp(min=0)).float()                     # [B, s, k, hd]
            logits.append(torch.einsum("bshd,bskd->bshk", qc, ent) * scale)
            masks.append(idx >= 0)
            values.append(ent)
        elif dense is not None:
            logits.append(torch.einsum("bshd,bkd->bshk", qc, dense) * scale)
            masks.append(dense_ok[:, lo:hi])
        logit = torch.cat(logits, -1).masked_fill(~torch.cat(masks, -1).unsqueeze(2), float("-inf"))
        sinks = sink.float().view(1, 1, -1, 1).expand(*logit.shape[:3], 1)
        probs = torch.softmax(torch.cat([logit, sinks], dim=-1), dim=-1)[..., :-1]
        nw = keys.shape[1]
        out = torch.einsum("bshk,bkd->bshd", probs[..., :nw], keys)
        if values:
            out = out + torch.einsum("bshk,bskd->bshd", probs[..., nw:], values[0])
        elif dense is not None:
            out = out + torch.einsum("bshk,bkd->bshd", probs[..., nw:], dense)
        outs.append(out)
    out = torch.cat(outs, dim=1).to(q.dtype)
    if cos is not None:
        out = apply_rope(out, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True)
    return out


def _window_mask(start: torch.Tensor, S: int, window: int) -> torch.Tensor:
    """Which of ``[ring rows (window), new rows (S)]`` each query sees: ``[B, S, window + S]``.

    Ring row ``r`` holds the newest position ``p < start`` with ``p % window == r`` (if any); a
    query at ``t`` sees positions in ``(t - window, t]``.
    """
    dev = start.device
    t = start.unsqueeze(1) + torch.arange(S, device=dev)                                 # [B, S]
    r = torch.arange(window, device=dev)
    ring_pos = start.unsqueeze(1) - 1 - torch.remainder(start.unsqueeze(1) - 1 - r, window)  # [B, W]
    ring_ok = (ring_pos >= 0).unsqueeze(1) & (ring_pos.unsqueeze(1) > t.unsqueeze(2) - window)
    s = torch.arange(S, device=dev)
    new_ok = (s.view(1, -1) <= s.view(-1, 1)) & (s.view(1, -1) > s.view(-1, 1) - window)  # [S, S]
    return torch.cat([ring_ok, new_ok.unsqueeze(0).expand(start.shape[0], -1, -1)], dim=2)


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


# ----------------------------------------------------------------------------- indexer
def indexer_scores(q: torch.Tensor, keys: object, slots: torch.Tensor, weights: torch.Tensor,
                   bound: int, scale: float = 1.0, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Lightning-indexer scores ``sum_h (w[b, s, h] * scale) * relu(q[b, s, h] . K[slot_b, c])`` for
    entries ``c < bound``, fp32; with ``visible [B, S]`` (int), entries ``c >= visible[b, s]`` (not
    yet visible to that query) score ``-inf``.

    ``q [B, S, nI, d]`` (rotated and, under QAT, FP4-rounded), ``keys`` the indexer's key store
    (``RowStore [slots, n, d]``, packed FP4 under QAT), ``weights [B, S, nI]``, ``scale`` the head
    weights' factor (``d**-0.5 * nI**-0.5``; fp32 ``weights * scale`` first). Returns ``[B, S, bound]``.
    """
    rows = torch.arange(bound, device=q.device)
    k = keys.read(slots.unsqueeze(1), rows.unsqueeze(0)).float()                  # [B, n, d]
    dots = torch.einsum("bshd,bcd->bshc", q.float(), k).relu()
    scores = (dots * (weights.float() * scale).unsqueeze(-1)).sum(2)
    if visible is not None:
        scores = scores.masked_fill(rows >= visible.unsqueeze(-1), float("-inf"))
    return scores


def topk_indices(scores: torch.Tensor, k: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest ``scores [..., n]`` (fp32), exact ties broken by the lowest
    index first, so the pick never depends on the batch or the backend (``-inf`` is picked last),
    listed in ascending index order (what is picked is a set: the attention sums over it; the order
    of reading is memory order, and a kernel finds the set without sorting it). With ``limit [...]``
    (int), a pick ``>= limit`` of its row becomes ``-1`` (the indexer's picks past the visible
    entries: the last ones of the list).

    The float's bits are mapped to an order-preserving int32, widened to int64 with the inverted
    index in the low half, so one integer top-k is exact and deterministic.
    """
    n = scores.shape[-1]
    ordered = numerics.ordered_int32(scores).to(torch.int64)      # monotone in the value, -0 ties +0
    idx = torch.arange(n, device=scores.device, dtype=torch.int64)
    key = (ordered << 32) | (0xFFFFFFFF - idx)
    picks = (0xFFFFFFFF - (key.topk(k, dim=-1).values & 0xFFFFFFFF)).sort(dim=-1).values
    if limit is not None:
        picks = torch.where(picks < limit.unsqueeze(-1), picks, -1)
    return picks


def draw_tokens(logits: torch.Tensor, scaled: torch.Tensor | None, temperature: torch.Tensor,
                greedy: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor,
                sampling: bool = True) -> torch.Tensor:
    """The sampler's last step (:mod:`dsv4.engine.sampling`): one token id per row of ``logits
    [B, V]`` (any float dtype, taken as fp32), int64 ``[B]``. A ``greedy [B]`` row (every row when
    not ``sampling``) takes ``argmax(logits)``; another draws ``argmax(scaled + gumbel)`` with the
    counter-based noise of (``seed_lo``, ``seed_hi``, ``step``) (:func:`dsv4.ops.noise.gumbel_noise`),
    where ``scaled`` is the row's truncated, temperature-scaled logits, or ``logits / temperature``
    when None. Ties go to the lowest id, NaN counts as the largest value (``torch.argmax``). Without
    ``sampling`` the rows' knobs are not read (they may be None)."""
    if not sampling:
        return logits.float().argmax(dim=-1)
    s = logits.float() / temperature[:, None] if scaled is None else scaled.float()
    drawn = (s + gumbel_noise(seed_lo, seed_hi, step, logits.shape[-1])).argmax(dim=-1)
    return torch.where(greedy, logits.float().argmax(dim=-1), drawn)


from .reference_fused import *  # noqa
