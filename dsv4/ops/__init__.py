"""The one dispatch point for every hot operation (DESIGN decision 1).

The model calls ``dsv4.ops.<op>(...)`` and never knows which implementation runs. Each call picks
an implementation by ``(op, device type, weight format)``: a kernel registered for exactly that
key, else the plain-torch reference in :mod:`dsv4.ops.reference` (the executable spec every kernel
is tested against). The format is the type of the weight the op consumes (``torch.Tensor`` for
plain BF16/FP32 weights, ``Fp8BlockWeight``, ``Mxfp4Weight``, ``Nvfp4Weight``); ops without a
weight have format ``None``. A kernel registered for one format is never handed another. A kernel
that cannot handle its inputs must raise, never fall back silently to different numerics.

``with ops.reference_only():`` runs everything on the reference (benchmarks, debugging).

A kernel covers the shapes and layouts of the real models; for others (the tiny model's 16-wide
indexer heads, say) it raises :class:`KernelUnsupported` before launching anything, and the call
runs on the reference instead (the same numbers: the reference is the spec), with one line on
stderr per op and reason. ``DSV4_STRICT_KERNELS=1`` turns that into an error (GPU tests and
benchmarks use it, so a measurement never silently runs the reference).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator

import torch


class KernelUnsupported(ValueError):
    """A kernel cannot take these inputs (a shape or layout outside what it covers). Raised by its
    wrapper before any launch; the dispatch then runs the reference (see the module docstring)."""


from . import numerics, reference  # noqa: E402
from .reference import sync_free  # noqa: E402

_KERNELS: dict[tuple[str, str, type | None], Callable] = {}
_LOCAL = threading.local()
_FALLBACKS_SEEN: set[tuple[str, str]] = set()


def _call(op: str, device: torch.device, fmt: type | None, *args):
    """Run ``op``: its kernel for (device, format) if one is registered, else the reference; a
    kernel that raises :class:`KernelUnsupported` hands the call to the reference."""
    fn = implementation(op, device, fmt)
    ref = getattr(reference, op)
    if fn is ref:
        return ref(*args)
    try:
        return fn(*args)
    except KernelUnsupported as e:
        if os.environ.get("DSV4_STRICT_KERNELS", "0") not in ("0", ""):
            raise
        key = (op, str(e))
        if key not in _FALLBACKS_SEEN:
            _FALLBACKS_SEEN.add(key)
            where = f" for {fmt.__name__} weights" if fmt is not None and fmt is not torch.Tensor else ""
            print(f"dsv4: the {op} kernel{where} does not cover this call ({e}); the reference runs it instead",
                  file=sys.stderr)
        return ref(*args)

#: ops whose implementation also depends on the weight format (keyed by the weight's type)
FORMAT_OPS = ("linear", "linear_pair", "grouped_linear", "moe")


def register(op: str, device_type: str, fmt: type | None = None) -> Callable[[Callable], Callable]:
    """Decorator: make ``fn`` the implementation of ``op`` on ``device_type`` for weights of type
    ``fmt`` (required for the ops in :data:`FORMAT_OPS`, ``None`` for the others)."""
    if not hasattr(reference, op):
        raise ValueError(f"register: unknown op {op!r}")
    if (op in FORMAT_OPS) != (fmt is not None):
        raise ValueError(f"register: op {op!r} " + ("needs a weight format" if op in FORMAT_OPS else
                                                     "takes no weight format"))

    def wrap(fn: Callable) -> Callable:
        _KERNELS[(op, device_type, fmt)] = fn
        return fn
    return wrap


def unregister(op: str, device_type: str, fmt: type | None = None) -> None:
    """Remove a registered kernel (tests)."""
    _KERNELS.pop((op, device_type, fmt), None)


_CUDA_KERNELS_LOADED = False


def _load_cuda_kernels() -> None:
    """Register the Triton kernels for CUDA, once, on the first op that runs on a CUDA tensor."""
    global _CUDA_KERNELS_LOADED
    _CUDA_KERNELS_LOADED = True
    from . import triton as kernels
    if kernels.enabled() and kernels.available():
        from .triton.runtime import triton_cache_dir
        cache = triton_cache_dir()         # before anything compiles
        kernels.register_all("cuda")
        # nothing else says why the first steps take seconds (long work shows progress)
        print(f"dsv4: GPU kernels compile on first use of each shape class (cached in {cache}); "
              "LLM and dsv4 serve compile them all at start-up (warm-up)", file=sys.stderr)


def implementation(op: str, device: torch.device, fmt: type | None = None) -> Callable:
    """The function that runs ``op`` for tensors on ``device`` and weights of type ``fmt``."""
    if device.type == "cuda" and not _CUDA_KERNELS_LOADED:
        _load_cuda_kernels()
    if not getattr(_LOCAL, "reference_only", False):
        fn = _KERNELS.get((op, device.type, fmt))
        if fn is not None:
            return fn
    return getattr(reference, op)


def has_kernel(op: str, device: torch.device, fmt: type | None = None) -> bool:
    """Whether ``op`` runs a kernel (not its reference) for tensors on ``device``."""
    return implementation(op, device, fmt) is not getattr(reference, op)


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Within the block (this thread), every op runs its reference implementation."""
    old = getattr(_LOCAL, "reference_only", False)
    _LOCAL.reference_only = True
    try:
        yield
    finally:
        _LOCAL.reference_only = old


def _fmt(w: object) -> type:
    return torch.Tensor if isinstance(w, torch.Tensor) else type(w)


# ----------------------------------------------------------------------------- weight ops
def linear(x: torch.Tensor, w: object, act_quant: bool = False, pow2: bool = True,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ w.T -> [..., N]``; see :func:`reference.linear`."""
    return _call("linear", x.device, _fmt(w), x, w, act_quant, pow2, out_dtype)


def grouped_linear(x: torch.Tensor, w: object, groups: int) -> torch.Tensor:
    """Grouped output projection ``[..., G, K] -> [..., G, r]``; see :func:`reference.grouped_linear`."""
    return _call("grouped_linear", x.device, _fmt(w), x, w, groups)


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: object, w3: object,
        w2: object, limit: float, act_quant: bool = False, pow2: bool = True,
        shared: tuple[object, object, object] | None = None) -> torch.Tensor:
    """Routed experts over stacked weights, plus the shared expert ``(w1, w3, w2)``; see
    :func:`reference.moe`. Dispatched on the routed experts' format."""
    return _call("moe", x.device, _fmt(w1), x, topk_ids, topk_weights, w1, w3, w2, limit, act_quant, pow2, shared)


# ----------------------------------------------------------------------------- other ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _call("rms_norm", x.device, None, x, weight, eps)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    return _call("rms_norm_unweighted", x.device, None, x, eps)


def rope_inv_freq(rope_dim: int, theta: float, yarn: object | None = None) -> torch.Tensor:
    return reference.rope_inv_freq(rope_dim, theta, yarn)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _call("rope_cos_sin", positions.device, None, positions, inv_freq)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    return _call("apply_rope", x.device, None, x, cos, sin, inverse)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    return _call("hadamard", x.device, None, x)


def fp8_sim(x: torch.Tensor, block: int = 64, pow2: bool = True) -> torch.Tensor:
    return _call("fp8_sim", x.device, None, x, block, pow2)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _call("fp4_sim", x.device, None, x, block)


def mhc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return _call("mhc_post", h.device, None, out, h, post, comb)


def sparse_attention(q: torch.Tensor, kv_new: torch.Tensor, ring: object, slots: torch.Tensor,
                     start: torch.Tensor, window: int, sink: torch.Tensor, scale: float,
                     comp: object | None = None, comp_idx: torch.Tensor | None = None,
                     comp_len: torch.Tensor | None = None, comp_bound: int = 0, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None) -> torch.Tensor:
    return _call("sparse_attention", q.device, None, q, kv_new, ring, slots, start, window, sink, scale,
                                                        comp, comp_idx, comp_len, comp_bound, cos, sin)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None = None,
                     prev_gate: torch.Tensor | None = None) -> torch.Tensor:
    return _call("compress_windows", kv.device, None, kv, gate, prev_kv, prev_gate)


def indexer_scores(q: torch.Tensor, keys: object, slots: torch.Tensor, weights: torch.Tensor,
                   bound: int, scale: float = 1.0, visible: torch.Tensor | None = None) -> torch.Tensor:
    return _call("indexer_scores", q.device, None, q, keys, slots, weights, bound, scale, visible)


def topk_indices(scores: torch.Tensor, k: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    return _call("topk_indices", scores.device, None, scores, k, limit)


def draw_tokens(logits: torch.Tensor, scaled: torch.Tensor | None, temperature: torch.Tensor,
                greedy: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor,
                sampling: bool = True) -> torch.Tensor:
    """The sampler's argmax or Gumbel draw per row; see :func:`reference.draw_tokens`."""
    return _call("draw_tokens", logits.device, None, logits, scaled, temperature, greedy, seed_lo, seed_hi,
                 step, sampling)


def router(x: torch.Tensor, weight: object, func: str, k: int, bias: torch.Tensor | None = None,
           tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
           scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's projection, scores, selection (top-k or hash table) and weights of the routed
    experts; see :func:`reference.router`."""
    return _call("router", x.device, None, x, weight, func, k, bias, tid2eid, token_ids, scale)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return _call("swiglu", gate.device, None, gate, up, limit)


__all__ = ["register", "unregister", "implementation", "reference_only", "sync_free", "KernelUnsupported", "numerics", "reference", "FORMAT_OPS",
           "linear", "grouped_linear", "moe", "rms_norm", "rms_norm_unweighted", "rope_inv_freq", "rope_cos_sin",
           "apply_rope", "hadamard", "fp8_sim", "fp4_sim", "mhc_post", "sparse_attention",
           "compress_windows", "indexer_scores", "topk_indices", "draw_tokens", "router", "swiglu"]
