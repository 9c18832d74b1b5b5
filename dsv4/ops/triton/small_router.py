"""The MoE router after the gate's projection as one Triton kernel (``dsv4.ops.router``).

Grid ``(tokens,)``: a program holds its token's ``E`` fp32 logits in registers and does what
:func:`dsv4.ops.reference.router` composes (DSV4_FACTS section 2, "MoE"):

    scores = sqrt(softplus(logits))  (or sigmoid, softmax)
    ids    = tid2eid[token_id]        hash layers: the table lookup
           = top-k of scores + bias   the others: k rounds of (max, lowest index at the max)
    w      = scores[ids] / (sum + 1e-20) * routed_scaling_factor

Softplus is torch's: ``x`` above 20, else ``log1p(exp(x))`` (to an ulp or so). The picks come out in descending
order of ``scores + bias`` like ``torch.topk``; an exact tie goes to the lower expert index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .small_util import check, pow2

_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
_MAX_EXPERTS = 1024


@triton.jit
def _log1p(y):
    """``log(1 + y)`` to an ulp or so for ``y >= 0`` (Goldberg's form: the rounding of ``1 + y``
    cancels), without libdevice (Triton's interpreter has none)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * tl.div_rn(y, u - 1.0))


@triton.jit
def _router_kernel(logits_ptr, sl, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale,
                   FUNC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                   HASH: tl.constexpr, BIAS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    em = e < E
    x = tl.load(logits_ptr + t * sl + e, mask=em, other=0.0).to(tl.float32)
    if FUNC == 0:
        s = tl.sqrt_rn(tl.where(x > 20.0, x, _log1p(tl.exp(x))))
    elif FUNC == 1:
        s = tl.sigmoid(x)
    else:
        ex = tl.where(em, tl.exp(x - tl.max(tl.where(em, x, -float("inf")), axis=0)), 0.0)
        s = tl.div_rn(ex, tl.sum(ex, axis=0))
    j = tl.arange(0, KP)
    jm = j < K
    if HASH:
        tok = tl.load(tok_ptr + t)
        ids = tl.load(table_ptr + tok * K + j, mask=jm, other=0).to(tl.int32)
    else:
        sel = s
        if BIAS:
            sel = s + tl.load(bias_ptr + e, mask=em, other=0.0)
        sel = tl.where(em, sel, -float("inf"))
        ids = tl.zeros([KP], tl.int32)
        for i in tl.static_range(K):
            top = tl.max(sel, axis=0)
            pick = tl.min(tl.where(sel == top, e, EP), axis=0)
            ids = tl.where(j == i, pick, ids)
            sel = tl.where(e == pick, -float("inf"), sel)
    w = tl.sum(tl.where(e[None, :] == ids[:, None], s[None, :], 0.0), axis=1)          # scores[ids]
    w = tl.where(jm, w, 0.0)
    w = tl.div_rn(w, tl.sum(w, axis=0) + 1e-20) * scale
    tl.store(w_ptr + t * K + j, w, mask=jm)
    tl.store(ids_ptr + t * K + j, ids.to(tl.int64), mask=jm)


def router_triton(logits: torch.Tensor, func: str, k: int, bias: torch.Tensor | None = None,
                  tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    op = "router"
    check(func in _FUNCS, op, f"scoring function {func!r}; implemented: {', '.join(_FUNCS)}")
    check(logits.dim() == 2 and logits.dtype == torch.float32, op,
          f"logits {logits.dtype} {tuple(logits.shape)}; needs fp32 [T, E]")
    T, E = logits.shape
    check(0 < k <= E <= _MAX_EXPERTS, op, f"top-{k} of {E} experts; the kernel holds 1..{_MAX_EXPERTS}")
    hashed = tid2eid is not None
    check(hashed == (token_ids is not None), op, "give tid2eid and token_ids together")
    if hashed:
        check(tid2eid.dim() == 2 and tid2eid.shape[1] == k and tid2eid.is_contiguous()
              and tid2eid.dtype in (torch.int32, torch.int64), op,
              f"tid2eid {tid2eid.dtype} {tuple(tid2eid.shape)}; needs a contiguous int [vocab, {k}] table")
        check(token_ids.numel() == T and token_ids.dtype in (torch.int32, torch.int64), op,
              f"token_ids {token_ids.dtype} {tuple(token_ids.shape)}; needs {T} int ids")
        token_ids = token_ids.reshape(T).contiguous()
    if bias is not None:
        check(tuple(bias.shape) == (E,) and bias.dtype == torch.float32, op,
              f"bias {bias.dtype} {tuple(bias.shape)}; needs fp32 ({E},)")
        bias = bias.contiguous()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    w = runtime.empty((T, k), torch.float32, logits.device)
    ids = runtime.empty((T, k), torch.int64, logits.device)
    if T == 0:
        return w, ids
    dummy = logits
    _router_kernel[(T,)](logits, logits.stride(0), bias if bias is not None else dummy,
                         tid2eid if hashed else dummy, token_ids if hashed else dummy, w, ids, E, float(scale),
                         FUNC=_FUNCS[func], K=k, KP=pow2(k), EP=pow2(E), HASH=hashed, BIAS=bias is not None,
                         num_warps=4 if E > 512 else 2)
    return w, ids


REGISTRATIONS = [("router", None, router_triton)]
