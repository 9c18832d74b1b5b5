"""Registers and K-loop instruction mix of the decode kernels per batch-size class, on this machine
(no GPU needed): the engine's own wrappers (``moe_triton``, the linear ops) are called on CPU
tensors at Flash shapes under :mod:`bench.compile_sm90`'s stand-in sm_90 driver, so every kernel is
compiled exactly as a launch specializes it (aligned pointers, integer arguments by value, the
tiles the wrappers choose), and nothing runs.

    python bench/ptxas_regs.py              # registers: the MoE decode kernels, the FP8 decode GEMVs
    python bench/ptxas_regs.py --sass       # the K loops' SASS instruction mix (nvdisasm)
    python bench/ptxas_regs.py --prefill    # the prefill MoE's grouped GEMMs: registers and K-loop mix

A register cliff at one batch class shows as that class's experts streaming slower (fewer programs
in flight to hide memory latency): 6-10 tokens of top-6 (``PP = 64`` ids in the pair ranking) gave
the gate/up kernel 155 registers instead of 64 until the one-pair-a-program path stopped ranking.
(A hand-made compile without the launcher's specialization once reported 245-255 registers for the
FP8 GEMV, which uses 68-144: the reason this goes through the wrappers.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compile_sm90  # noqa: E402
from bench.kernel_cases.moe import _experts, fp8_weight  # noqa: E402

NVDISASM = Path(compile_sm90.triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
#: Flash: hidden size, expert width, top-k; the routed experts' count does not change a kernel's
#: specialization (a multiple of 16 either way), so a few stand in for 256
D, I, TOP_K, EXPERTS = 4096, 2048, 6, 16
#: Flash's FP8 decode GEMVs: (rows, K); wq_a and wkv run as one pair, wo_a as 8 groups
GEMVS = {"wq_a + wkv (a pair)": (1024, 4096), "wq_b": (32768, 1024), "wo_a (8 groups)": (8192, 4096),
         "wo_b": (4096, 8192)}


def compiled(call) -> dict[str, object]:
    """The kernels ``call()`` launches, compiled for sm_90 (not run): ``{kernel name: kernel}``."""
    start = len(compile_sm90.COMPILED)
    call()
    return {name: k for name, k in compile_sm90.COMPILED[start:]}


def registers(kernel) -> int:
    """The registers a thread of ``kernel`` uses (cuobjdump's resource usage)."""
    return int(re.search(r"REG:(\d+)", compile_sm90._usage(kernel.asm["cubin"])).group(1))


def moe_kernels(tokens: int) -> dict[str, object]:
    """The decode MoE's kernels at ``tokens`` tokens of top-6: MXFP4 experts, the FP8 shared expert
    in the same launches, act-quant."""
    from dsv4.ops.triton.moe import moe_triton
    g = torch.Generator().manual_seed(0)
    w1, w3, w2 = (_experts("mxfp4", EXPERTS, n, k, g, "cpu") for n, k in ((I, D), (I, D), (D, I)))
    shared = (fp8_weight(I, D, g, "cpu"), fp8_weight(I, D, g, "cpu"), fp8_weight(D, I, g, "cpu"))
    x = torch.randn(tokens, D, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, generator=g).argsort(-1)[:, :TOP_K].contiguous()
    rw = torch.rand(tokens, TOP_K, generator=g)
    return compiled(lambda: moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared))


def gemv_kernel(rows_m: int, name: str):
    """The FP8 decode GEMV of Flash's ``name`` at ``rows_m`` activation rows, act-quant."""
    from dsv4.ops.triton.linear import grouped_linear_triton, linear_pair_triton, linear_triton
    g = torch.Generator().manual_seed(1)
    rows, K = GEMVS[name]
    w = fp8_weight(rows, K, g, "cpu")
    if name.startswith("wq_a"):
        x = torch.randn(rows_m, K, generator=g).to(torch.bfloat16)
        call = lambda: linear_pair_triton(x, w, fp8_weight(512, K, g, "cpu"), True, True)  # noqa: E731
    elif name.startswith("wo_a"):
        x = torch.randn(rows_m, 8, K, generator=g).to(torch.bfloat16)
        call = lambda: grouped_linear_triton(x, w, 8)  # noqa: E731
    else:
        x = torch.randn(rows_m, K, generator=g).to(torch.bfloat16)
        call = lambda: linear_triton(x, w, True, True)  # noqa: E731
    return compiled(call)["_skinny_kernel"]


def sass(k) -> str:
    """The SASS text of compiled kernel ``k`` (nvdisasm of its cubin)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        return subprocess.run([str(NVDISASM), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loop_ops(k) -> list[str]:
    """The opcodes (``FFMA``, ``LDG``, ``BAR`` ..., predicates and modifiers dropped) of compiled
    kernel ``k``'s longest loop in order: the span from a backward branch's target to the branch,
    by nvdisasm."""
    sass_lines = sass(k).splitlines()
    labels, best = {}, (0, 0)
    for i, ln in enumerate(sass_lines):
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    ops = []
    for ln in sass_lines[best[0]:best[1] + 1]:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            ops.append(m.group(1))
    return ops


def loop_mix(k) -> tuple[int, dict[str, int]]:
    """:func:`loop_ops` counted: the loop's instruction count and the count of each opcode, per
    iteration. The instructions a value of a K step costs, read on the CPU."""
    ops = loop_ops(k)
    mix: dict[str, int] = {}
    for op in ops:
        mix[op] = mix.get(op, 0) + 1
    return len(ops), dict(sorted(mix.items(), key=lambda kv: -kv[1]))


def sass_main() -> None:
    """The K loop's instruction mix of the decode MoE kernels and the FP8 GEMV at one token."""
    moe = moe_kernels(1)
    kernels = {"MoE gate/up (16 rows of W1 and W3 x 256 K a step, 64 values a thread)": moe["_w13_decode_kernel"],
               "MoE down (32 rows x 128 K a step, 32 values a thread)": moe["_w2_decode_kernel"],
               "FP8 GEMV wo_b (64 rows x 128 K a step, 64 values a thread)": gemv_kernel(1, "wo_b")}
    for name, k in kernels.items():
        n, mix = loop_mix(k)
        print(f"{name}: {n} instructions a K step; " + ", ".join(f"{op} {c}" for op, c in list(mix.items())[:14]))


def prefill_main() -> None:
    """The MXFP4 grouped GEMMs of a prefill step (act-quant, bf16): the transposed ones at 8192 tokens
    and the few-pairs-an-expert ones at 256 tokens over 128 experts; registers and the K loop's mix,
    with the tiles dequantized in bf16 (``moe.Launch.mx_bf16``) and through fp16 / fp32. Then the
    W8A8 GEMM (FP8 ``wo_b``, act-quant) at 4096 tokens."""
    from dsv4.ops.triton.linear import linear_triton
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 8192, generator=g).to(torch.bfloat16)
    k = compiled(lambda: linear_triton(x, fp8_weight(4096, 8192, g, "cpu"), True, True))["_gemm_w8a8_kernel"]
    n, mix = loop_mix(k)
    print(f"W8A8 GEMM (wo_b, 4096 tokens): {registers(k)} registers, {n} instructions a K step; "
          + ", ".join(f"{op} {c}" for op, c in list(mix.items())[:10]))
    from dsv4.ops.triton import moe as M
    from dsv4.ops.triton.moe import moe_triton
    fit = M._scales_fit_bf16
    for tokens, experts in ((8192, EXPERTS), (256, 128)):
        g = torch.Generator().manual_seed(0)
        w1, w3, w2 = (_experts("mxfp4", experts, n, k, g, "cpu") for n, k in ((I, D), (I, D), (D, I)))
        x = torch.randn(tokens, D, generator=g).to(torch.bfloat16)
        ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :TOP_K].contiguous()
        rw = torch.rand(tokens, TOP_K, generator=g)
        for decode in ("bf16", "fp32"):
            M._scales_fit_bf16 = fit if decode == "bf16" else (lambda weights: False)
            try:
                ks = compiled(lambda: moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True))
            finally:
                M._scales_fit_bf16 = fit
            for name, k in ks.items():
                if "wt_kernel" in name or "grouped_kernel" in name:
                    n, mix = loop_mix(k)
                    print(f"{tokens:5d} tokens, {experts} experts, {decode} decode: {name} {registers(k)} registers, "
                          f"{n} instructions a K step; " + ", ".join(f"{op} {c}" for op, c in list(mix.items())[:10]))


def main() -> None:
    from dsv4.ops.triton.moe import MXFP4_DECODE_MAX_PAIRS
    print("Flash decode MoE (MXFP4 experts, FP8 shared expert, act-quant), sm_90a, as the wrapper launches it")
    # (the decode kernels run up to MXFP4_DECODE_MAX_PAIRS pairs; above, the grouped tiles: --prefill)
    for tokens in (t for t in (1, 2, 4, 8, 16, 32) if t * TOP_K <= MXFP4_DECODE_MAX_PAIRS):
        k = moe_kernels(tokens)
        print(f"{tokens:3d} tokens: gate/up {registers(k['_w13_decode_kernel'])} registers, "
              f"down {registers(k['_w2_decode_kernel'])}; {compile_sm90._usage(k['_w2_decode_kernel'].asm['cubin'])}")
    print("Flash FP8 decode GEMVs (linear._skinny_kernel, act-quant, the rule's tiles), sm_90a")
    for rows_m in (1, 8, 32):
        for name in GEMVS:
            k = gemv_kernel(rows_m, name)
            print(f"  M {rows_m:2d} {name:20s} warps {k.metadata.num_warps}: {compile_sm90._usage(k.asm['cubin'])}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass", action="store_true", help="the K loops' SASS instruction mix instead of registers")
    ap.add_argument("--prefill", action="store_true", help="the prefill MoE's grouped GEMMs instead")
    args = ap.parse_args()
    compile_sm90._install()
    if args.prefill:
        prefill_main()
    elif args.sass:
        sass_main()
    else:
        main()
