"""Fused routed-expert MoE (``dsv4.ops.moe``) over stacked MXFP4 / NVFP4 / FP8-block experts.

Computes what :func:`dsv4.ops.reference.moe` computes (DSV4_FACTS sections 2 "MoE" and 2b):
for every (token t, slot j) pair with expert ``e = topk_ids[t, j] >= 0``

    g = x̂ W1[e]^T,  u = x̂ W3[e]^T                        fp32 accumulation
    h = (silu(min(g, L)) * clamp(u, -L, L) * topk_weights[t, j]).to(x.dtype)
    y = ĥ W2[e]^T                                          fp32
    out[t] = sum_j y  (j = 0 .. k-1, in that order), cast to x.dtype

where ``x̂``/``ĥ`` are the inputs, or with ``act_quant`` their e4m3 rounding per 1x128 block
(``numerics.fp8_quantize(v, 128, pow2)``, dequantized and cast to ``x.dtype`` like the
reference). Weights are dequantized in registers: e2m1 codes are decoded exactly (the three
magnitude bits placed in an fp16 exponent/mantissa give ``e2m1 * 2^-14``, subnormals included;
:mod:`dsv4.ops.triton.numerics`),
MXFP4 scales ``2^(s-127)`` and NVFP4 e4m3 block scales are applied per 32 / 16 values, the
NVFP4 global scale and nothing else is applied after the product. FP8-block scales (fp32 or e8m0)
apply per 128x128 block. Every value fed to a product is exactly the reference's (MXFP4 and the
act-quant inputs exactly; NVFP4's ``e2m1 * block_scale`` exactly, its global scale on the fp32
result rather than rounded into bf16 weights), so results differ from the reference only by fp32
summation order (and that one bf16 rounding for NVFP4 and fp32-scaled FP8 weights).

Ids of ``-1`` (expert parallel: a rank holding experts ``[r E/N, (r+1) E/N)`` gets local ids and
``-1`` for the other ranks' picks) are skipped everywhere and contribute nothing; a token with none
gets a zero row. Ids must lie in ``[-1, E)`` (not checked: that would read them on the host).

Refused with :class:`MoeKernelError` (a :class:`dsv4.ops.KernelUnsupported`: the dispatch runs the
reference), before anything is allocated or launched: weights other than stacked MXFP4 / NVFP4 /
FP8-block (block 128) or of mixed formats / FP8 scale kinds, shapes not ``[E, I, D]`` / ``[E, D, I]``,
FP4 ``D`` or ``I`` not a multiple of 8, non-contiguous ``x`` / ids / weights / scales, ``x`` not a 2-D
bf16/fp16/fp32 tensor, ids not int32/int64 ``[T, k]``, routing weights not fp32 ``[T, k]``, tensors on
different devices, ``T * k * max(D, I) >= 2^31``.

The kernels live in three modules: :mod:`.moe_experts` (an expert's weight tiles, decoded in
registers, and the GEMM over them, shared by both paths; the activation quantization),
:mod:`.moe_decode` (few pairs: no sort, CUDA-graph capturable) and :mod:`.moe_grouped` (prefill:
pairs sorted by expert). This module checks the inputs and picks the path.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass

import torch

from ...weights.formats import Fp8BlockWeight, FormatCode, Mxfp4Weight, Nvfp4Weight
from .. import KernelUnsupported
from . import moe_decode, moe_grouped, runtime
from .moe_experts import quantized

#: pairs (tokens x top-k) up to which the decode kernels run; above, the grouped GEMM
DECODE_MAX_PAIRS = 256
#: ... and for MXFP4 experts with act-quant whose grouped GEMM runs on the exactly dequantized
#: operands (the engine's QAT path): above, the 16-pair tiles on tensor cores, which decode a weight
#: value in fewer instructions than the CUDA-core GEMV and read an expert once for all its tokens.
#: H200, Flash layer with its FP8 shared expert, a CUDA graph of calls with their own ids
#: (bench/moe_decode_tune.py --max-pairs 288 and --path grouped, results/2026-11-29b/call3_sizes.txt),
#: GEMV against grouped: 16 tokens 577 / 679 us, 24 tokens 841 / 921, 32 tokens 1097 / 1103, 48
#: tokens 1618 / 1389. Random routing there; in the engine's decode step at batch 32 the GEMV was
#: slower (5.72 against 5.09 ms; tokens that share experts favour the grouped tiles, which read an
#: expert once), so the bound is 16 tokens, not 24
MXFP4_DECODE_MAX_PAIRS = 96
#: tokens up to which the decode kernels also run the shared expert (one more expert a token, its
#: weights read once per token); above, the linear ops run it as one batched GEMV. H200, Flash layer
#: (MXFP4 routed, FP8 shared, act-quant), the MoE with its shared expert, the linear ops -> fused:
#: 4 tokens 182.6 -> 174.9 us, 8 tokens 315.8 -> 324.3 us (bench/moe_decode_tune.py
#: --shared-fused-max 8, results/2026-11-29b/call2_sizes.txt)
SHARED_FUSED_MAX_TOKENS = 4
#: tile configs per path and projection: (BN, BK, num_warps, num_stages, K-loop pipelining depth:
#: 1 = plain loop; the decode GEMV's loop orders its own loads, moe_experts._gemm, and takes 1);
#: FP8 experts use BK 128
CONFIGS = {
    # decode, BM = 1: one program per (token, expert) pair and N tile, a CUDA-core GEMV. A few
    # tokens' random top-k rarely share an expert, so 16-pair tl.dot tiles were mostly padding: on
    # an H100 (Flash layer, MXFP4, act-quant) they took 1.7-2.1x the GEMV's time at 1-32 tokens
    # (bench/results/2026-11-25c/moe_decode_tune.txt), though the GEMV reads a shared expert per pair
    # The two GEMVs' tiles chosen apart (bench/moe_decode_tune.py, H200, Flash layer, 24 configs;
    # results/2026-11-29b/call2_tune.txt): these are the fastest at 1, 4 and 8 tokens (58.1 / 182.6
    # / 315.8 us) and within 10% of the fastest at 2 (103.6 against 94.8 us). Before the GEMVs'
    # inputs were rounded ahead of them, wider tiles won from 2 tokens on (results/2026-11-29).
    "gemv": dict(w13=(16, 256, 4, 3, 1), w2=(32, 128, 4, 3, 1)),
    "grouped": dict(w13=(64, 128, 8, 3, 1), w2=(128, 128, 8, 3, 1)),  # prefill, BM = 64 (16 < 2048 pairs)
    # prefill, MXFP4 on dequantized operands (no QDOT), BM = 128 from 64 pairs an expert on, the
    # gate/up GEMM transposed (moe_grouped._gemm_wt: the weight rows on the MMA's M side).
    # bench/moe_prefill_tune.py, H100, Flash layer (results/2026-11-27c): 8192 tokens 35.1 ms (QDOT,
    # BM 64) -> 13.9 ms (untransposed) -> 12.0 ms (both transposed); 4096 tokens 8.74 ms (untransposed,
    # BM 64) -> 6.11 ms. The down GEMM is not transposed: each of its compiled variants let the next K
    # step's decoded weights overwrite the registers of an MMA still in flight (a race; Triton 3.6 with
    # its ptxas 12.8, bench/wgmma_hazards.py; results/2026-11-28e): 4.51 against 3.35 ms at 8192 tokens
    # on the H100 above.
    "grouped_mxfp4": dict(w13=(64, 64, 8, 4, 4), w2=(128, 128, 8, 3, 3), wt=True),
    # ... and from MXFP4_WIDE_TILE_PAIRS pairs an expert on, 256-pair tiles; the gate/up GEMM of 64 weight
    # rows (each decoded weight value serves twice the pairs): H200, Flash layer, 8192 tokens
    # (bench/moe_prefill_tune.py --cases 11 16 --bm 128 256, results/2026-11-28e) 7.30 -> 6.53 ms. The
    # down GEMM untransposed, 64-wide K steps (its transposed variants race, as above).
    # Both gate/up configs: the gate and up rows stacked into one MMA (moe_grouped._gemm_wt; before,
    # two MMAs of 64 rows spilled at 255 registers). H200, same run (results/2026-11-28f/call4_*):
    # 8192 tokens 6.53 -> 6.11 ms, 4096 tokens 3.78 -> 3.74 ms. Then for 256-pair tiles one warpgroup
    # a program (32 + 32 stacked rows, 3 stages: 248 registers, two programs a multiprocessor, which
    # wait at no common barrier, so one decodes while the other multiplies), and the down GEMM at 4
    # stages: H200, 8192 tokens (results/2026-11-28g/call4_moe_8192.txt) gate/up 6.10 -> 5.64 ms,
    # down 3.19 -> 3.02 ms, the MoE 9.78 -> 9.16 ms. (At 128-pair tiles one warpgroup a program was
    # slower: 3.73 -> 3.83 ms at 4096 tokens, call3_moe_4096.txt.)
    "grouped_mxfp4_wide": dict(w13=(32, 64, 4, 3, 3), w2=(128, 64, 8, 4, 4), wt=True),
    # ... fewer pairs an expert (short prompts, mixed steps): BM 16 below 24 an expert, else 64, four
    # warps and four stages. H100, Flash layer (results/2026-11-27b/moe_tune_*.txt), the MoE's two
    # GEMMs, before -> after: 512 tokens (12 pairs an expert) 4.64 -> 2.58 ms; 1024 (24) 4.70 ->
    # 4.50 ms (BM 16: 4.56); 2048 (48) 4.96 -> 4.60 ms (BM 32: 6.59; the down GEMM transposed:
    # 1.28-1.69 vs 1.31 ms, results/2026-11-27c)
    "grouped_mxfp4_few": dict(w13=(64, 128, 4, 4, 3), w2=(128, 128, 4, 4, 3)),
    # ... and its 64-pair tiles (24 to 64 pairs an expert: Flash prompts of ~1000-2700 tokens) with the
    # gate/up GEMM transposed, where register_mma_safe: the wide config's gate/up tiles (32 + 32 stacked
    # rows, one warpgroup), the few config's down GEMM. H200, Flash layer, 2048 tokens, gate/up GEMM
    # (bench/moe_prefill_tune.py --tokens 2048 --bm 64, results/2026-11-28h/call9_moe_2048.txt): 2.87 ->
    # 2.49 ms, same output. (2 x 128 rows a program: 2.40 ms, and MoE 4.13 -> 3.65 ms at 2048 tokens, 4.01
    # -> 3.54 at 1024, call10_moe_mid_*.txt; but 255 registers and 32 bytes of stack, which
    # tests/test_kernel_registers.py refuses.)
    "grouped_mxfp4_mid": dict(w13=(32, 64, 4, 3, 3), w2=(128, 128, 4, 4, 3), wt=True),
}
#: from this many pairs an expert on average the dequantized MXFP4 grouped GEMMs take 128-pair tiles
#: (at 96 an expert, the padding of half-empty tiles costs less than the smaller tiles' extra weight
#: decoding: 6.11 vs 8.74 ms); their gate/up GEMM runs transposed from MXFP4_SMALL_TILE_PAIRS on
#: ("grouped_mxfp4_mid")
MXFP4_LARGE_TILE_PAIRS = 64
#: from this many pairs an expert on average, 256-pair tiles ("grouped_mxfp4_wide"): H200, Flash
#: layer, both GEMMs (the down one transposed at BK 64 then), 128-pair -> 256-pair tiles: 6144 tokens
#: (144 an expert) 9.95 -> 9.05 ms, 4096 (96 an expert) 5.58 -> 8.67 ms (results/2026-11-28e/wide_tune.txt)
MXFP4_WIDE_TILE_PAIRS = 144
#: below this many pairs an expert on average the dequantized MXFP4 grouped GEMM takes 16-pair tiles
MXFP4_SMALL_TILE_PAIRS = 24
_FORMATS = (FormatCode.FP8_F32, FormatCode.FP8_UE8M0, FormatCode.MXFP4, FormatCode.NVFP4)


def _scales_fit_bf16(weights: tuple) -> bool:
    """Whether every e8m0 scale byte of these MXFP4 weights is ``<= 128`` (a scale ``<= 2``, so
    ``2^(s-1)`` is a bf16 and :func:`.numerics.mxfp4_to_bf16` dequantizes exactly; real experts'
    scales sit far below). Read once per weight (one host sync, in the warm-up) and kept while the
    scale tensor is unchanged (its version counter); inside a CUDA-graph capture an unknown weight
    takes the general decode instead of synchronizing."""
    for w in weights:
        scale = w.kernel_operands()[2]
        seen = getattr(w, "_scale_max_seen", None)
        if seen is None or seen[0] != scale._version:
            if scale.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            seen = (scale._version, int(scale.view(torch.uint8).max()) if scale.numel() else 0)
            w._scale_max_seen = seen
        if seen[1] > 128:
            return False
    return True


def _exact_dequantized(fmt: FormatCode, pow2: bool, dtype: torch.dtype) -> bool:
    """Whether the act-quant product can run on the dequantized operands instead of the e4m3
    values and scales, with every product still exact: MXFP4 weights ``e2m1 * 2^(s-127)`` have at
    most two significant bits and bf16's (and fp32's) exponent range, and with power-of-two
    activation scales ``x̂ = q * 2^k`` has e4m3's four, so both are exact in bf16 / fp32 and each
    product ``x̂ w`` is the reference's ``(q w) s_x s_w``. The grouped GEMM then does one dot per K
    tile into one accumulator, instead of four K = 32 dots a 128 block, each followed by scaling the
    partial sums (the QDOT path NVFP4 and non-power-of-two scales need)."""
    return fmt == FormatCode.MXFP4 and pow2 and dtype in (torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def register_mma_safe() -> bool:
    """Whether the transposed gate/up GEMM (``moe_grouped._gemm_wt``: a pipelined Hopper MMA whose
    left operand, the decoded weights, sits in registers) may run with the ptxas Triton compiles with.
    ptxas from 13.3 on keeps such an MMA's registers until it retires (triton-lang/triton#9433). The
    kernel now retires each K step's product before the next step's decode (``moe_grouped._retired``),
    as the FP8 GEMV does; with 12.8, the one Triton 3.6 ships, CI checks its compiled variants on every
    run (``tests/test_kernel_registers.py``, ``bench/wgmma_hazards.py``). A ptxas no run has checked,
    or one that cannot be asked, still takes the untransposed kernels (the decoded weights go through
    shared memory). Not Hopper (the interpreter, Blackwell's MMAs): safe."""
    if runtime.interpreting():
        return True
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10:
        return True
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
        found = re.search(r"release (\d+)\.(\d+)", get_ptxas_version(90))
    except Exception:                                   # noqa: BLE001 (no ptxas to ask: not safe)
        found = None
    version = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    if version == (12, 8) or version >= (13, 3):
        return True
    print(f"dsv4: Triton's ptxas ({'%d.%d' % version if found else 'version unknown'}) may overwrite the "
          "registers of an MMA still running (triton-lang/triton#9433), so long prompts run the MXFP4 MoE "
          "on its slower untransposed tiles; a ptxas from CUDA 13.3 on (TRITON_PTXAS_PATH) lifts this",
          file=sys.stderr)
    return False


def tiles(P: int, E: int, decode: bool, mx_plain: bool) -> tuple[int, str]:
    """``(BM, CONFIGS key)`` for ``P`` pairs over ``E`` experts: the decode GEMV (one pair a
    program), else grouped tiles of BM pairs of one expert (``mx_plain``: MXFP4 on dequantized
    operands, larger tiles once experts average a full one, where :func:`register_mma_safe`).
    bench/moe_prefill_tune.py tries others."""
    if decode:
        return 1, "gemv"
    if mx_plain:
        if P < MXFP4_SMALL_TILE_PAIRS * E:
            return 16, "grouped_mxfp4_few"
        if not register_mma_safe():
            return 64, "grouped_mxfp4_few"
        if P < MXFP4_LARGE_TILE_PAIRS * E:
            return 64, "grouped_mxfp4_mid"
        return (256, "grouped_mxfp4_wide") if P >= MXFP4_WIDE_TILE_PAIRS * E else (128, "grouped_mxfp4")
    if P < 2048:
        return 16, "grouped"
    return 64, "grouped"


class MoeKernelError(KernelUnsupported):
    """The inputs do not fit the Triton MoE kernel (the message names the argument); raised before
    any launch, so the dispatch runs the reference for that call."""


@dataclass
class Launch:
    """Everything the decode and grouped paths launch with (one MoE call)."""
    fmt: int                                  # FormatCode of the experts (the kernels' FMT)
    T: int
    D: int
    I: int
    E: int
    k: int
    P: int                                    # pairs, T * k
    BM: int                                   # pairs per program
    w13: tuple                                # tile configs (CONFIGS), BK fixed to 128 for FP8
    w2: tuple
    xdt: object                               # tl dtype of x
    qdot: bool                                # products on the quantized q (act_quant, grouped)
    act_quant: bool
    pow2: bool
    q_dtype: torch.dtype
    limit: float
    x: torch.Tensor
    xin: tuple                                # (x̂, q, scales) of x
    ids: torch.Tensor
    rw: torch.Tensor
    weights: tuple                            # ((data, scale, global) of w1, of w3, of w2)
    h: torch.Tensor                           # [P, I] gate/up output
    y: torch.Tensor                           # [P, D] fp32 expert rows
    out: torch.Tensor                         # [T, D]
    shared: SharedLaunch | None = None        # the shared expert, run by the decode kernels
    wt: bool = False                          # the gate/up GEMM transposed (moe_grouped._gemm_wt)
    mx_bf16: bool = False                     # MXFP4 tiles dequantized in bf16 (_scales_fit_bf16)


@dataclass
class SharedLaunch:
    """The shared expert as the decode kernels run it: one more "expert" of ``T`` rows (weight 1)."""
    fmt: int                                  # its FormatCode (may differ from the routed experts')
    I: int                                    # its intermediate width (I / N under expert parallel)
    weights: tuple                            # ((data, scale, global) of w1, of w3, of w2)
    h: torch.Tensor                           # [T, I] gate/up output
    y: torch.Tensor                           # [T, D] fp32 rows
    h_all: torch.Tensor | None = None         # [P + T, I]: Launch.h's rows then h's, one buffer (same width)


def _format_code(w: object) -> FormatCode:
    code = w.kernel_operands()[0] if hasattr(w, "kernel_operands") else None
    if code not in _FORMATS:
        raise MoeKernelError(f"moe: no Triton kernel for weights of type {type(w).__name__}")
    return code


def _weight_tensors(w: object, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(data, scales, global scales or None) of a stacked weight as the kernels read them: FP8
    bytes, FP4 codes as int32 words (8 codes each), scales as bytes (or fp32)."""
    code, data, scale, gscale = w.kernel_operands()
    if code < FormatCode.MXFP4 and w.block != 128:
        raise MoeKernelError(f"moe: {name} has FP8 block {w.block}; the kernel needs 128")
    if gscale is not None and (gscale.dtype != torch.float32 or not gscale.is_contiguous()):
        raise MoeKernelError(f"moe: {name} global scale must be contiguous fp32 [E]")
    for t, what in ((data, "data"), (scale, "scales")):
        if not t.is_contiguous():
            raise MoeKernelError(f"moe: {name} {what} must be contiguous")
    if code < FormatCode.MXFP4:
        data = data.view(torch.uint8)
    else:
        data = data.view(torch.int32)
    if scale.dtype == torch.float8_e4m3fn:
        scale = scale.view(torch.uint8)
    return data, scale, gscale


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: object,
           w3: object, w2: object) -> tuple[int, int, int, int, int, int]:
    """Validate the inputs; returns ``(T, D, I, E, k, fmt)``."""
    if x.dim() != 2 or x.dtype not in runtime.FLOAT_DTYPES or not x.is_contiguous():
        raise MoeKernelError(f"moe: x must be a contiguous [T, D] bf16/fp16/fp32 tensor, got "
                             f"{x.dtype} {tuple(x.shape)} contiguous={x.is_contiguous()}")
    T, D = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype not in (torch.int64, torch.int32) \
            or not topk_ids.is_contiguous():
        raise MoeKernelError(f"moe: topk_ids must be a contiguous int64 [T={T}, k] tensor, got "
                             f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32 \
            or not topk_weights.is_contiguous():
        raise MoeKernelError(f"moe: topk_weights must be a contiguous fp32 {tuple(topk_ids.shape)} "
                             f"tensor, got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    fmt = _format_code(w1)
    if type(w3) is not type(w1) or type(w2) is not type(w1):
        raise MoeKernelError(f"moe: w1, w3, w2 must share one format, got {type(w1).__name__}, "
                             f"{type(w3).__name__}, {type(w2).__name__}")
    if not (w1.is_stacked and w3.is_stacked and w2.is_stacked):
        raise MoeKernelError("moe: w1, w3, w2 must be stacked [E, N, K] weights")
    E, I, Dw = w1.shape
    if w3.shape != (E, I, D) or Dw != D or w2.shape != (E, D, I):
        raise MoeKernelError(f"moe: expert shapes w1 {w1.shape}, w3 {w3.shape}, w2 {w2.shape} do not "
                             f"match [E, I, D] / [E, D, I] with D = {D} (x)")
    if {_format_code(w) for w in (w1, w3, w2)} != {fmt}:
        raise MoeKernelError("moe: w1, w3, w2 FP8 scales differ in dtype (fp32 vs e8m0)")
    if fmt >= FormatCode.MXFP4 and (D % 8 or I % 8):
        raise MoeKernelError(f"moe: FP4 experts need D and I divisible by 8 (int32 words of codes), "
                             f"got D={D}, I={I}")
    for t, what in ((topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
        if t.device != x.device:
            raise MoeKernelError(f"moe: {what} on {t.device}, x on {x.device}")
    for w, name in ((w1, "w1"), (w3, "w3"), (w2, "w2")):
        if w.device != x.device:
            raise MoeKernelError(f"moe: expert weights {name} on {w.device}, x on {x.device}")
    if T * k * max(D, I) >= 2 ** 31:
        raise MoeKernelError(f"moe: T*k*max(D, I) = {T * k * max(D, I)} overflows 32-bit offsets")
    return T, D, I, E, k, fmt


def _shared_operands(shared: tuple, x: torch.Tensor, D: int, I: int) -> tuple[int, int, tuple] | None:
    """``(format code, I_S, ((data, scale, global) of w1, w3, w2))`` of the shared expert when the
    decode kernels can run it as one more expert, else None (it then runs through the ops)."""
    sw1, sw3, sw2 = shared
    if not all(hasattr(w, "kernel_operands") and not w.is_stacked and type(w) is type(sw1) for w in shared):
        return None
    Is = sw1.shape[0]
    if sw1.shape != (Is, D) or sw3.shape != (Is, D) or sw2.shape != (D, Is) or Is > I:
        return None
    if any(w.device != x.device for w in shared):
        return None
    try:
        codes = {_format_code(w) for w in shared}
        tensors = tuple(_weight_tensors(w, name) for w, name in zip(shared, ("shared w1", "shared w3", "shared w2")))
    except MoeKernelError:
        return None
    if len(codes) != 1 or (min(codes) >= FormatCode.MXFP4 and Is % 8):
        return None
    return int(codes.pop()), Is, tensors


def _shared_expert(x: torch.Tensor, shared: tuple, limit: float, act_quant: bool, pow2: bool) -> torch.Tensor:
    """The shared expert through the dispatched ops (:func:`dsv4.ops.reference.shared_expert`'s
    composition, on the linear kernels): the prefill path, and weights the decode kernels do not take."""
    from .. import linear, swiglu
    w1, w3, w2 = shared
    g = linear(x, w1, act_quant, pow2, torch.float32)
    u = linear(x, w3, act_quant, pow2, torch.float32)
    h = swiglu(g, u, limit).to(x.dtype)
    return linear(h, w2, act_quant, pow2, torch.float32).to(x.dtype)


def moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: object,
               w3: object, w2: object, limit: float, act_quant: bool = False,
               pow2: bool = True, shared: tuple | None = None) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.moe` for MXFP4 / NVFP4 / FP8-block experts; the
    shared expert runs inside the decode kernels (one more expert of weight 1 for every token)."""
    T, D, I, E, k, fmt = _check(x, topk_ids, topk_weights, w1, w3, w2)
    d1, s1, g1 = _weight_tensors(w1, "w1")     # may refuse: before anything is allocated
    d3, s3, g3 = _weight_tensors(w3, "w3")
    d2, s2, g2 = _weight_tensors(w2, "w2")
    P = T * k
    exact = _exact_dequantized(fmt, pow2, x.dtype)
    # (the MXFP4 bound was measured with act-quant only)
    decode = P <= (min(DECODE_MAX_PAIRS, MXFP4_DECODE_MAX_PAIRS) if act_quant and exact else DECODE_MAX_PAIRS)
    fused = _shared_operands(shared, x, D, I) if shared is not None and decode and P and T <= SHARED_FUSED_MAX_TOKENS \
        else None
    if P == 0:
        out = runtime.empty((T, D), x.dtype, x.device).zero_()
        return out if shared is None else out + _shared_expert(x, shared, limit, act_quant, pow2)
    out = runtime.empty((T, D), x.dtype, x.device)
    g1, g3, g2 = (g if g is not None else topk_weights for g in (g1, g3, g2))   # unused placeholders
    qdot = bool(act_quant) and not decode and not exact
    # the MXFP4 grouped GEMM on dequantized operands: larger tiles once experts average a full one
    mx_plain = not decode and not qdot and fmt == FormatCode.MXFP4
    BM, path = tiles(P, E, decode, mx_plain)
    fp8 = fmt < FormatCode.MXFP4
    q_dtype = torch.float8_e4m3fn if fp8 else torch.float16
    cfg = CONFIGS[path]
    w13, w2cfg = cfg["w13"], cfg["w2"]
    if fp8:
        w13, w2cfg = (w13[0], 128, *w13[2:]), (w2cfg[0], 128, *w2cfg[2:])
    # (decode with the shared expert at one width: the pairs' and the shared rows of h share a
    # buffer, so ĥ is rounded in one launch, moe_decode._rounded_h)
    h_all = runtime.empty((P + T, I), x.dtype, x.device) if fused is not None and fused[1] == I else None
    L = Launch(fmt=int(fmt), T=T, D=D, I=I, E=E, k=k, P=P, BM=BM, w13=w13, w2=w2cfg, wt=cfg.get("wt", False),
               xdt=runtime.tl_dtype(x.dtype), qdot=qdot, act_quant=bool(act_quant), pow2=bool(pow2),
               q_dtype=q_dtype, limit=float(limit), x=x,
               xin=quantized(x, act_quant, pow2, qdot, q_dtype),
               ids=topk_ids, rw=topk_weights, weights=((d1, s1, g1), (d3, s3, g3), (d2, s2, g2)),
               h=h_all[:P] if h_all is not None else runtime.empty((P, I), x.dtype, x.device),
               y=runtime.empty((P, D), torch.float32, x.device),
               out=out, mx_bf16=mx_plain and x.dtype == torch.bfloat16 and _scales_fit_bf16((w1, w3, w2)))
    if fused is not None:
        fmt_s, I_s, tensors = fused
        tensors = tuple((d, s, g if g is not None else topk_weights) for d, s, g in tensors)
        L.shared = SharedLaunch(fmt=fmt_s, I=I_s, weights=tensors,
                                h=h_all[P:] if h_all is not None else runtime.empty((T, I_s), x.dtype, x.device),
                                y=runtime.empty((T, D), torch.float32, x.device), h_all=h_all)
    (moe_decode if decode else moe_grouped).run(L)
    if shared is not None and fused is None:
        out = out + _shared_expert(x, shared, limit, act_quant, pow2)
    return out


REGISTRATIONS = [("moe", Mxfp4Weight, moe_triton), ("moe", Nvfp4Weight, moe_triton),
                 ("moe", Fp8BlockWeight, moe_triton)]
