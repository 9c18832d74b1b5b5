"""What the kernel wrappers share on the host: whether Triton interprets, the SM count their grids
are sized from, output buffers (poisoned in tests), and the arrival counters of the kernels whose
last program finishes the work of the others (split-K, split attention, the MoE combine).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import triton.language as tl

#: programs-per-wave the grids are sized for off CUDA (Triton's interpreter): a handful, so the CPU
#: tests still split work the way a GPU does without running hundreds of interpreted programs
INTERPRETER_SMS = 8

_SMS: dict[int, int] = {}
_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}
_POISON = False
_ZEROED = False


def interpreting() -> bool:
    """Kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, read when asked)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels: ``$TRITON_CACHE_DIR`` when set, else
    ``$DSV4_CACHE/triton`` (default ``~/.cache/dsv4/triton``), set into the environment here so
    every compile of this process (and of the tensor-parallel workers it starts) uses it: a second
    start of ``dsv4 serve`` compiles nothing, and one ``DSV4_CACHE`` holds all of dsv4's caches.
    Falls back to Triton's own default, with a warning, when that directory cannot be created."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    from ...tiny import cache_dir
    path = cache_dir() / "triton"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        import warnings
        warnings.warn(f"dsv4: cannot create {path} for Triton's kernel cache ({e.strerror or e}); "
                      "using Triton's default", stacklevel=2)
        from triton import knobs
        return str(knobs.cache.dir)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return str(path)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
#: the activation dtypes the kernels take
FLOAT_DTYPES = tuple(_TL_DTYPES)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """Triton's name of a float activation dtype (bf16, fp16, fp32), for a constexpr argument."""
    return _TL_DTYPES[dtype]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); :data:`INTERPRETER_SMS` elsewhere."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output or workspace buffer. Under :func:`poisoned` it is filled with values a kernel
    never writes (NaN floats, 0xFF bytes: an e4m3 NaN, -1 integers), so an unwritten element shows."""
    if _ZEROED:
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        if t.element_size() == 1:
            t.view(torch.uint8).fill_(0xFF)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-1)
    return t


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Within the block every :func:`empty` buffer starts poisoned (tests)."""
    global _POISON
    old, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = old


@contextlib.contextmanager
def zeroed() -> Iterator[None]:
    """Within the block every :func:`empty` buffer starts zeroed: the parallel compile pass
    (:func:`dsv4.engine.warmup.precompile`) launches no kernel, and indices a kernel would have
    written must still be valid for the torch ops that read them."""
    global _ZEROED
    old, _ZEROED = _ZEROED, True
    try:
        yield
    finally:
        _ZEROED = old


class CounterError(RuntimeError):
    """Counters were first needed inside a CUDA-graph capture (the wrapper turns it into its own
    :class:`dsv4.ops.KernelUnsupported`)."""


def counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """``owner``'s int32 arrival counters on ``device``, at least ``n`` of them, zero between calls
    (the program that finishes the work re-arms its counter). One buffer per owner and device,
    allocated on first use (grown when more are needed), so the first call must be eager; not
    shared safely between streams running at the same time."""
    key = (owner, str(device))
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CounterError(f"{owner} (triton): the arrival counters are allocated on the first eager call; "
                               "run the op once on this device before capturing a CUDA graph")
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def counters_if_allocated(device: torch.device, owner: str) -> torch.Tensor | None:
    """``owner``'s counters on ``device`` when allocated (tests check they were re-armed)."""
    return _COUNTERS.get((owner, str(device)))
