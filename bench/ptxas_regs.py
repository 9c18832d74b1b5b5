"""Registers and spills of the decode MoE kernels per batch-size class, from ptxas on this machine
(no GPU needed): Triton compiles for sm_90a here, and its bundled ptxas reports each kernel's
registers, the number that sets how many programs share an SM.

    python bench/ptxas_regs.py              # Flash geometry (MXFP4 experts, FP8 shared expert, act-quant)

A register cliff at one batch class shows as that class's experts streaming slower (fewer programs
in flight to hide memory latency): 6-10 tokens of top-6 (``PP = 64`` ids in the pair ranking) gave
the gate/up kernel 168 registers instead of 80 until the one-pair-a-program path stopped ranking.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.ops.triton.moe_decode import _w13_decode_kernel, _w2_decode_kernel  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)
#: argument types of the decode kernels as the engine launches them (bf16 activations, MXFP4 experts
#: as int32 words with e8m0 byte scales, the FP8 shared expert as bytes with e8m0 scales)
TYPES = {"x_ptr": "*bf16", "xq_ptr": "*bf16", "xs_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*fp32",
         "h_ptr": "*bf16", "cnt_ptr": "*i32", "ncnt": "i32", "w1_ptr": "*i32", "s1_ptr": "*u8", "g1_ptr": "*fp32",
         "w3_ptr": "*i32", "s3_ptr": "*u8", "g3_ptr": "*fp32", "P": "i32", "E": "i32", "limit": "fp32",
         "sh_ptr": "*bf16", "v1_ptr": "*u8", "t1_ptr": "*u8", "f1_ptr": "*fp32", "v3_ptr": "*u8", "t3_ptr": "*u8",
         "f3_ptr": "*fp32", "T": "i32", "hq_ptr": "*bf16", "hs_ptr": "*bf16", "y_ptr": "*fp32", "out_ptr": "*bf16",
         "w2_ptr": "*i32", "s2_ptr": "*u8", "g2_ptr": "*fp32", "shq_ptr": "*bf16", "shs_ptr": "*bf16",
         "ys_ptr": "*fp32", "v2_ptr": "*u8", "t2_ptr": "*u8", "f2_ptr": "*fp32"}


def ptxas_info(fn, constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> str:
    """ptxas's resource line (registers, spills) for ``fn`` compiled with ``constexprs``."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: TYPES.get(n, "constexpr") for n in names}
    k = triton.compile(ASTSource(fn, sig, constexprs), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    try:
        out = subprocess.run([PTXAS, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    lines = [ln.split("ptxas info    :")[-1].strip() for ln in out.stderr.splitlines()
             if "registers" in ln or "spill" in ln]
    return " | ".join(lines)


def main() -> None:
    common = dict(D=4096, I=2048, KTOP=6, FMT=2, BM=1, BK=256, XDT=tl.bfloat16, CDT=tl.bfloat16, QDOT=False,
                  SHARED=True, FMT_S=1, I_S=2048, BK_S=128, AQ=True, POW2=True, PIPE=1)
    print("Flash decode MoE (MXFP4 experts, FP8 shared expert, act-quant), sm_90a, 4 warps, 3 stages")
    for tokens in (1, 2, 4, 8, 16, 32):
        pp = max(triton.next_power_of_2(6 * tokens), 2)
        w13 = ptxas_info(_w13_decode_kernel, dict(common, BN=16, PP=pp, ZB=1, HAS_LIMIT=True))
        w2 = ptxas_info(_w2_decode_kernel, dict(common, BN=32, PP=pp, KP2=8))
        print(f"{tokens:3d} tokens (PP {pp:3d}): gate/up {w13.split('|')[-1].strip()}; down {w2.split('|')[-1].strip()}")


if __name__ == "__main__":
    main()
