"""Host-side helpers of the small-op kernels (:mod:`dsv4.ops.triton.small`): input checks and row
views. (Their rounding is :mod:`dsv4.ops.triton.numerics`; buffers and the SM count
:mod:`dsv4.ops.triton.runtime`.)
"""

from __future__ import annotations

import math

import torch

from .. import KernelUnsupported


class KernelInputError(KernelUnsupported):
    """A small-op kernel was handed inputs it does not implement (shape, dtype, layout)."""


def check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise KernelInputError(f"{op} (triton): {msg}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check(t.dtype in FLOAT_DTYPES, op, f"{name} has dtype {t.dtype}; needs float32, float16 or bfloat16")


def rows(x: torch.Tensor, inner: int) -> torch.Tensor:
    """``x`` as ``[R, inner]`` with a unit inner stride and one row stride (a view when the layout
    allows, else a contiguous copy: same values, one extra copy)."""
    x2 = x.reshape(-1, inner)
    if inner > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def row_stride(x2: torch.Tensor) -> int:
    """The row stride of a ``[R, inner]`` view (any value works for a single row)."""
    return x2.stride(0) if x2.shape[0] > 1 else x2.shape[1]


def pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def broadcast_rows(table: torch.Tensor, lead: tuple[int, ...], width: int, op: str, name: str
                   ) -> tuple[torch.Tensor, int]:
    """A per-row table (cos/sin ``[..., width]``) broadcast against rows of shape ``lead``, as a
    contiguous ``[R / G, width]`` plus ``G``: row ``r`` reads table row ``r // G``.

    Covers tables broadcast over trailing lead dims (e.g. ``cos [B, S, 1, rd/2]`` against heads);
    any other broadcast is expanded to one table row per row first (same values)."""
    check(table.shape[-1] == width, op, f"{name} has last dim {table.shape[-1]}; needs {width}")
    tshape = (1,) * (len(lead) + 1 - table.dim()) + tuple(table.shape[:-1])
    check(len(tshape) == len(lead) and all(t in (1, n) for t, n in zip(tshape, lead)), op,
          f"{name} of shape {tuple(table.shape)} does not broadcast against rows {tuple(lead)}")
    k = len(lead)
    while k > 0 and tshape[k - 1] == 1:
        k -= 1
    if tuple(tshape[:k]) == tuple(lead[:k]):
        g = math.prod(lead[k:])
        return table.reshape(-1, width).contiguous(), g
    return table.reshape(*tshape, width).expand(*lead, width).reshape(-1, width).contiguous(), 1
