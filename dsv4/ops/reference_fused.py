"""Plain-torch definitions of the fused decode ops: each is a composition of the ops in
:mod:`dsv4.ops.reference` (and of the cache's own row rounding), written so a kernel can do the
whole chain in one launch. They are the spec the fused kernels are tested against; the model
calls them through :mod:`dsv4.ops.fused`.

Re-exported by :mod:`dsv4.ops.reference` (so ``dsv4.ops.register`` knows them).
"""

from __future__ import annotations

import torch

from .reference import apply_rope, hadamard, rms_norm, rms_norm_unweighted, fp4_sim


def rope_qnorm(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The query path: per-head RMS normalisation without weight, then RoPE on the last
    ``rd = 2 * cos.shape[-1]`` dims. ``q [..., H, hd]``, ``cos``/``sin`` broadcast against
    ``q[..., :rd // 2]``. Returns ``q.dtype``."""
    return apply_rope(rms_norm_unweighted(q, eps), cos, sin)


def kv_prepare(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               store: object) -> torch.Tensor:
    """The K=V path: ``kv_norm`` (RMSNorm with ``weight``), RoPE on the last ``rd`` dims, then the
    values as ``store`` (a ``dsv4.model.cache.RowStore``) keeps them: the FP8 round trip of the
    non-rope dims (``fp8`` layout) or a cast (``plain``). ``kv [..., hd]``; returns
    ``store.dtype``. Nothing is written: the caller stores the rows after attention."""
    return store.round_trip(apply_rope(rms_norm(kv, weight, eps), cos, sin))


def store_rows(store: object, slot_idx: torch.Tensor, row_idx: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values [..., dim]`` into ``store`` (a ``RowStore``) at ``(slot_idx, row_idx)`` (index
    tensors broadcast to ``values.shape[:-1]``), encoded in the store's layout (FP8 + e8m0 scale per
    64 + rope in the activation dtype; packed FP4 + e8m0 scale per 32; or a cast)."""
    store.write(slot_idx, row_idx, values)


def rope_hadamard(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp4: bool) -> torch.Tensor:
    """The indexer's query path: RoPE on the last ``rd`` dims, the normalised Walsh-Hadamard
    rotation over the last dim, and (QAT simulation) the FP4 round trip per 32. ``x.dtype``."""
    y = hadamard(apply_rope(x, cos, sin))
    return fp4_sim(y) if fp4 else y


__all__ = ["rope_qnorm", "kv_prepare", "store_rows", "rope_hadamard"]
