"""Which slice of each checkpoint tensor a tensor/expert-parallel rank holds, and reading only that.

The split is data: :data:`SPLITS` maps an official tensor name to the dimension of its logical
weight that is divided across the ranks (DESIGN decision 4, :mod:`dsv4.parallel`); everything else
is replicated, except the routed experts, which are owned whole (expert parallel). The sizes come
from the rank's own model skeleton (built with local sizes), so the loader slices rank ``r`` of
``N`` as ``[r * n, (r + 1) * n)`` of the dimension, where ``n`` is the skeleton's extent.

Packed formats are cut on their block boundaries, every companion with its own block:

=============  ============================  ============================  ====================
format         weight part                   scale part(s)                 a split must fall on
=============  ============================  ============================  ====================
FP8 block      e4m3 ``[N, K]``               ``[N/128, K/128]``            128 rows / 128 cols
MXFP4          packed ``[N, K/2]``           e8m0 ``[N, K/32]``            any row / 128 cols
NVFP4          packed ``[N, K/2]``           e4m3 ``[N, K/16]``; global    any row / 128 cols
                                             and input scale replicated
BF16           ``[N, K]``                    --                            any
=============  ============================  ============================  ====================

A column (K) split of a quantized weight must also fall on the 1x128 blocks in which the QAT
simulation quantizes the *input* (DSV4_FACTS 2b); otherwise rank-local activation scales would
differ from one process's and change the numerics. A split that cuts a block is a
:class:`~dsv4.parallel.ShardError` naming the tensor, the format and the sizes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..parallel import ParallelGroup, ShardError

#: official name (of a parameter or a linear weight ``X.weight``) -> the dimension split across ranks
SPLITS: tuple[tuple[re.Pattern[str], int], ...] = tuple((re.compile(p), d) for p, d in (
    (r"^embed\.weight$", 0),                                  # vocab rows
    (r"^head\.weight$", 0),                                   # vocab rows
    (r"(^|\.)attn\.wq_b\.weight$", 0),                        # query heads (not indexer.wq_b)
    (r"(^|\.)attn\.attn_sink$", 0),                           # one sink per head
    (r"(^|\.)attn\.wo_a\.weight$", 0),                        # output groups
    (r"(^|\.)attn\.wo_b\.weight$", 1),                        # output groups' columns, summed
    (r"(^|\.)ffn\.shared_experts\.w[13]\.weight$", 0),        # shared expert intermediate rows
    (r"(^|\.)ffn\.shared_experts\.w2\.weight$", 1),           # ... and columns, summed
))
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(.+)$")
#: the input quantization block of the QAT simulation (K splits of quantized weights align to it)
ACT_BLOCK = 128
FP8_BLOCK = 128
_PACKED = ("U8", "I8", "F4")          # safetensors dtype names of packed FP4 bytes


def split_dim(name: str) -> int | None:
    """The dimension of ``name``'s logical tensor that is divided across ranks, None if replicated
    (routed experts are handled by :meth:`RankSlicer.expert_name`)."""
    for pattern, dim in SPLITS:
        if pattern.search(name):
            return dim
    return None


@dataclass(frozen=True)
class DiskTensor:
    """A tensor as its safetensors header describes it. ``shape`` is in torch elements (an ``F4``
    tensor's header counts FP4 values; here, like torch's ``float4_e2m1fn_x2``, bytes)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2}.get(self.dtype, 1)
        return math.prod(self.shape) * size


def disk_tensor(handle, name: str, file: Path) -> DiskTensor:
    """Header facts of ``name`` in an open ``safe_open`` handle (no data read)."""
    info = handle.get_slice(name)
    dtype, shape = info.get_dtype(), tuple(info.get_shape())
    if dtype == "F4" and shape:
        shape = (*shape[:-1], shape[-1] // 2)
    return DiskTensor(file, dtype, shape)


def _blocks(part: str, parts: dict[str, DiskTensor] | None) -> tuple[int, int] | None:
    """Logical weight elements per element of an on-disk part, (rows, cols); None for a scalar
    companion (replicated). ``parts`` is the weight's group (None for a plain tensor)."""
    if parts is None or "weight" not in parts:
        return (1, 1)
    packed = parts["weight"].dtype in _PACKED
    if part == "weight":
        return (1, 2) if packed else (1, 1)
    if part in ("scale", "weight_scale_inv"):
        return (1, 32) if packed else (FP8_BLOCK, FP8_BLOCK)
    if part == "weight_scale" and "weight_scale_2" in parts:
        return (1, 16)
    return None   # weight_scale_2, input_scale, a ModelOpt FP8 per-tensor weight_scale


def _format(parts: dict[str, DiskTensor] | None) -> str:
    if parts is None or len(parts) == 1:
        return "plain"
    if "weight_scale_2" in parts:
        return "NVFP4"
    return "MXFP4" if parts["weight"].dtype in _PACKED else "FP8 block"


def _alignment(dim: int, parts: dict[str, DiskTensor] | None) -> tuple[int, str]:
    """The boundary a split of ``dim`` must fall on, and why."""
    fmt = _format(parts)
    if fmt == "plain":
        return 1, ""
    if fmt == "FP8 block":
        return FP8_BLOCK, f"the {FP8_BLOCK}x{FP8_BLOCK} FP8 scale blocks"
    if dim == 1:
        return ACT_BLOCK, f"the 1x{ACT_BLOCK} blocks of the input quantization"
    return 1, ""


class RankSlicer:
    """Rank ``tp.rank``'s view of a checkpoint: which tensors it reads and which slice of each.

    ``expected`` is the rank's skeleton ``state_dict()`` (meta tensors of local shapes, local expert
    indices); ``n_experts`` the config's routed expert count.
    """

    def __init__(self, tp: ParallelGroup, expected: dict[str, torch.Tensor], n_experts: int):
        self.tp, self.expected, self.n_experts = tp, expected, n_experts
        self.expert_lo, self.expert_hi = tp.local_range(n_experts, "routed experts (n_routed_experts)",
                                                        "ffn.experts")

    def expert_name(self, name: str) -> str | None:
        """``name`` with a routed expert's global index replaced by this rank's local one; None if
        another rank owns that expert; unchanged for every other tensor."""
        match = _EXPERT.match(name)
        if match is None or not self.tp.parallel:
            return name
        e = int(match.group(2))
        if not self.expert_lo <= e < self.expert_hi:
            return None
        return f"{match.group(1)}.{e - self.expert_lo}.{match.group(3)}"

    def expert_rows(self) -> slice:
        """This rank's experts along the leading dim of a fused ``[E, ...]`` stack."""
        return slice(self.expert_lo, self.expert_hi)

    def index(self, weight_name: str, part: str, disk: DiskTensor, disk_name: str,
              parts: dict[str, DiskTensor] | None = None) -> tuple[slice, ...] | None:
        """The slice of on-disk tensor ``disk_name`` (``part`` of the logical tensor ``weight_name``;
        ``parts``: its quantized group, None for a plain tensor) this rank reads; None: all of it.

        Raises :class:`ShardError` when the split cuts a format block, ``ValueError`` when the
        on-disk extent does not match the config (the caller names the file).
        """
        dim = split_dim(weight_name)
        if dim is None or not self.tp.parallel or weight_name not in self.expected:
            return None
        blocks = _blocks(part, parts)
        if blocks is None:
            return None
        local = self.expected[weight_name].shape
        n = local[dim]
        full = n * self.tp.world_size
        lo, hi = self.tp.rank * n, (self.tp.rank + 1) * n
        block = blocks[dim] if len(local) == 2 else blocks[0]
        if len(disk.shape) != len(local) or disk.shape[dim] != math.ceil(full / block):
            want = list(local)
            want[dim] = full
            raise ValueError(f"tensor `{disk_name}` has shape {list(disk.shape)} ({disk.dtype}); the config "
                             f"implies a logical {want}")
        if part == "weight" or parts is None:
            align, why = _alignment(dim, parts)
            if lo % align or (hi % align and hi != full):
                what = "rows" if dim == 0 else "columns"
                raise ShardError(
                    f"cannot shard `{weight_name}` ({_format(parts)}, logical {full} {what}) across "
                    f"{self.tp.world_size} ranks: rank {self.tp.rank} would hold {what} [{lo}, {hi}), which "
                    f"cuts {why} (each rank's share must be a multiple of {align})")
        rng = slice(lo // block, -(-hi // block))
        return tuple(rng if d == dim else slice(None) for d in range(len(disk.shape)))


def read(handle, name: str, disk: DiskTensor, index: tuple[slice, ...] | None) -> torch.Tensor:
    """Read ``name`` (all of it, or only ``index``) from an open ``safe_open`` handle. Only the
    slice's bytes are read (safetensors slicing; a memory map for ``F4`` tensors, which this
    safetensors cannot slice)."""
    if index is None:
        return handle.get_tensor(name)
    if disk.dtype != "F4":
        return handle.get_slice(name)[index]
    stat = disk.file.stat()
    start, header = _data_offsets(str(disk.file), stat.st_mtime_ns, stat.st_size)
    begin, end = header[name]["data_offsets"]
    data = np.memmap(disk.file, dtype=np.uint8, mode="r", offset=start + begin, shape=disk.shape)
    out = torch.from_numpy(np.array(data[index]))           # a copy of only those bytes
    return out.view(torch.float4_e2m1fn_x2)


@lru_cache(maxsize=64)
def _data_offsets(file: str, mtime_ns: int, size: int) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) of a safetensors file (cached per version)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))
