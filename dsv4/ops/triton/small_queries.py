"""A CSA layer's two query preparations in one launch (``queries_prepare``, spec in
``dsv4.ops.reference_fused``): program row 0 prepares the attention's queries (per-head RMS norm
without weight, then RoPE: the ``rope_qnorm`` rows of :mod:`.small_rows`), row 1 the indexer's
(RoPE, the Hadamard rotation, the FP4 round trip under QAT: the ``rope_hadamard`` rows of
:mod:`.small_quant`), at the same positions. Both run their own op's code, so the numerics are
theirs exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .small_quant import _hadamard_rows, hadamard_plan
from .small_rows import _plan, _rows


@triton.jit(do_not_specialize=["R", "R2"])
def _queries_kernel(x_ptr, sx, w_ptr, cos_ptr, sin_ptr, y_ptr, sy, R, D, Df, NOPE, RD2, G, eps,
                    slot_ptr, srow_ptr, rows_per_slot, s_data, s_scale, s_rope, NSCALE,
                    x2_ptr, sx2, cos2_ptr, sin2_ptr, y2_ptr, R2, G2, RD22, scale,
                    NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, FP8: tl.constexpr,
                    POW2: tl.constexpr, ROWS: tl.constexpr, NBP: tl.constexpr, QBLK: tl.constexpr,
                    BR2: tl.constexpr, STORE: tl.constexpr,
                    N: tl.constexpr, BM: tl.constexpr, ROPE2: tl.constexpr, FP4: tl.constexpr, IEEE: tl.constexpr,
                    DOT: tl.constexpr, FB: tl.constexpr):
    if tl.program_id(1) == 0:
        _rows(tl.program_id(0), x_ptr, sx, w_ptr, cos_ptr, sin_ptr, y_ptr, sy, R, D, Df, NOPE, RD2, G, eps,
              slot_ptr, srow_ptr, rows_per_slot, s_data, s_scale, s_rope, NSCALE,
              NORM, ROPE, INVERSE, FP8, POW2, ROWS, NBP, QBLK, BR2, STORE)
    else:
        _hadamard_rows(tl.program_id(0), x2_ptr, sx2, cos2_ptr, sin2_ptr, y2_ptr, R2, G2, RD22, scale,
                       N, BM, ROPE2, FP4, IEEE, DOT, FB)


def queries_prepare_triton(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, iq: torch.Tensor,
                           fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Both query preparations of a CSA layer in one launch; see
    :func:`dsv4.ops.reference_fused.queries_prepare`."""
    op = "queries_prepare"
    yq, qargs, qc, qprog, qwarps = _plan(op, q, q.dtype, norm=1, eps=eps, cos=cos, sin=sin)
    yi, iargs, ic, iprog = hadamard_plan(op, iq, cos, sin, fp4)
    if qprog or iprog:
        ic["ROPE2"] = ic.pop("ROPE")
        _queries_kernel[(max(qprog, iprog), 2)](*qargs, *iargs, **qc, **ic, num_warps=max(qwarps, 4),
                                                enable_fp_fusion=False)
    return yq, yi


REGISTRATIONS = [("queries_prepare", None, queries_prepare_triton)]

__all__ = ["queries_prepare_triton", "REGISTRATIONS"]
