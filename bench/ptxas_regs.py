"""Registers and spills of the decode kernels per batch-size class, from ptxas on this machine (no
GPU needed): Triton compiles for sm_90a here, and its bundled ptxas reports each kernel's registers,
the number that sets how many programs share an SM.

    python bench/ptxas_regs.py              # Flash geometry: the MoE decode kernels, the FP8 decode GEMVs

A register cliff at one batch class shows as that class's experts streaming slower (fewer programs
in flight to hide memory latency): 6-10 tokens of top-6 (``PP = 64`` ids in the pair ranking) gave
the gate/up kernel 168 registers instead of 80 until the one-pair-a-program path stopped ranking.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.ops.triton.linear import _skinny_config, _skinny_kernel  # noqa: E402
from dsv4.ops.triton.moe_decode import _w13_decode_kernel, _w2_decode_kernel  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
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
#: the decode GEMV's (linear._skinny_kernel) over FP8 weights with e8m0 scales
GEMV_TYPES = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "g_ptr": "*fp32", "w2_ptr": "*fp8e4nv",
              "s2_ptr": "*u8", "g2_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
              **{n: "i32" for n in ("M", "R", "R2", "K", "TILES_PER_GROUP", "stride_xm", "stride_xg", "stride_wn",
                               "stride_sn", "stride_om", "stride_og", "ws_stride_s", "ws_stride_m")}}
#: Flash's FP8 decode GEMVs: (rows, K)
GEMVS = {"wq_a + wkv (a pair)": (1024 + 512, 4096), "wq_b": (32768, 1024), "wo_a (8 groups)": (8192, 4096),
         "wo_b": (4096, 8192)}


def compile_as_launched(fn, constexprs: dict, num_warps: int = 4, num_stages: int = 3, types: dict = TYPES,
                        ints: dict | None = None):
    """``fn`` compiled for sm_90a as Triton's launcher specializes a real call: every pointer 16-byte
    aligned, and each integer argument named in ``ints`` by its value (1 becomes a constant, a
    multiple of 16 is marked divisible by 16), unless the kernel's ``do_not_specialize`` lists it.

    Without that specialization the compiler cannot prove a row is 16-byte aligned, loads one byte a
    thread per instruction, and ptxas reports registers no launch ever uses (the FP8 GEMV at 245
    instead of 69: the 2026-11-28 "register lead" was this artifact)."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "constexpr") for n in names}
    consts = dict(constexprs)
    fixed = {names[d] if isinstance(d, int) else d for d in getattr(fn, "do_not_specialize", ())}
    attrs = {}
    for i, n in enumerate(names):
        if sig[n] == "constexpr":
            continue
        v = (ints or {}).get(n)
        if sig[n].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v is not None and n not in fixed:
            if v == 1:
                sig[n], consts[n] = "constexpr", 1
            elif v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_info(fn, constexprs: dict, num_warps: int = 4, num_stages: int = 3, types: dict = TYPES,
               ints: dict | None = None) -> str:
    """ptxas's resource line (registers, spills) for ``fn`` compiled as launched
    (:func:`compile_as_launched`)."""
    k = compile_as_launched(fn, constexprs, num_warps, num_stages, types, ints)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    try:
        out = subprocess.run([PTXAS, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    lines = [ln.split("ptxas info    :")[-1].strip() for ln in out.stderr.splitlines()
             if "registers" in ln or "spill" in ln]
    return " | ".join(lines)


def loop_mix(k) -> tuple[int, dict[str, int]]:
    """SASS of compiled kernel ``k``'s longest loop (the span from a backward branch's target to the
    branch, by nvdisasm): its instruction count and the count of each opcode (``FFMA``, ``LOP3``,
    ``BAR`` ...), per iteration. The instructions a value of a K step costs, read on the CPU."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True).stdout.splitlines()
    finally:
        os.unlink(f.name)
    labels, best = {}, (0, 0)
    for i, ln in enumerate(sass):
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    mix: dict[str, int] = {}
    n = 0
    for ln in sass[best[0]:best[1] + 1]:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            op = m.group(1)
            mix[op] = mix.get(op, 0) + 1
            n += 1
    return n, dict(sorted(mix.items(), key=lambda kv: -kv[1]))


def moe_ints(tokens: int) -> dict:
    """The decode MoE kernels' integer arguments at ``tokens`` tokens of Flash (top-6 of 256)."""
    return dict(ncnt=tokens * 64, P=6 * tokens, E=256, T=tokens)


def gemv_ints(M: int, rows: int, K: int, BN: int, pair: bool) -> dict:
    """The decode GEMV's integer arguments for ``M`` rows of a ``[rows, K]`` weight."""
    return dict(M=M, R=rows, R2=0, K=K, TILES_PER_GROUP=-(-rows // BN), stride_xm=K, stride_xg=0 if pair else K,
                stride_wn=K, stride_sn=-(-K // 128), stride_om=rows, stride_og=rows, ws_stride_s=M * rows,
                ws_stride_m=rows)


def sass_main() -> None:
    """The K loop's instruction mix of the decode MoE kernels and the FP8 GEMV (``--sass``)."""
    common = dict(D=4096, I=2048, KTOP=6, FMT=2, BM=1, BK=256, XDT=tl.bfloat16, CDT=tl.bfloat16, QDOT=False,
                  SHARED=True, FMT_S=1, I_S=2048, BK_S=128, AQ=True, POW2=True, PIPE=1)
    kernels = {
        "MoE gate/up (16 rows of W1 and W3 x 256 K a step, 64 values a thread)":
            compile_as_launched(_w13_decode_kernel, dict(common, BN=16, PP=8, ZB=1, HAS_LIMIT=True),
                                ints=moe_ints(1)),
        "MoE down (32 rows x 256 K a step, 64 values a thread)":
            compile_as_launched(_w2_decode_kernel, dict(common, BN=32, PP=8, KP2=8), ints=moe_ints(1)),
        "FP8 GEMV wo_b (64 rows x 128 K a step, 64 values a thread)":
            compile_as_launched(_skinny_kernel, dict(FMT=1, ACT_QUANT=True, POW2=True, OP_BF16=True, PREC=None,
                                                     BN=64, MP=16, KSTEPS=16, SPLIT=4, PAIR=False),
                                4, 4, GEMV_TYPES, gemv_ints(1, 4096, 8192, 64, False)),
    }
    for name, k in kernels.items():
        n, mix = loop_mix(k)
        print(f"{name}: {n} instructions a K step; " + ", ".join(f"{op} {c}" for op, c in list(mix.items())[:14]))


def main() -> None:
    common = dict(D=4096, I=2048, KTOP=6, FMT=2, BM=1, BK=256, XDT=tl.bfloat16, CDT=tl.bfloat16, QDOT=False,
                  SHARED=True, FMT_S=1, I_S=2048, BK_S=128, AQ=True, POW2=True, PIPE=1)
    print("Flash decode MoE (MXFP4 experts, FP8 shared expert, act-quant), sm_90a, 4 warps, 3 stages")
    for tokens in (1, 2, 4, 8, 16, 32):
        pp = max(triton.next_power_of_2(6 * tokens), 2)
        w13 = ptxas_info(_w13_decode_kernel, dict(common, BN=16, PP=pp, ZB=1, HAS_LIMIT=True), ints=moe_ints(tokens))
        w2 = ptxas_info(_w2_decode_kernel, dict(common, BN=32, PP=pp, KP2=8), ints=moe_ints(tokens))
        print(f"{tokens:3d} tokens (PP {pp:3d}): gate/up {w13.split('|')[-1].strip()}; down {w2.split('|')[-1].strip()}")
    print("Flash FP8 decode GEMVs (linear._skinny_kernel, act-quant, the rule's tiles), sm_90a")
    for rows_m in (1, 8, 32):
        for name, (rows, K) in GEMVS.items():
            cfg = _skinny_config(rows_m, rows, K, 1.0 + 1 / 128, 132)
            c = dict(FMT=1, ACT_QUANT=True, POW2=True, OP_BF16=True, PREC=None, BN=cfg["BN"], MP=cfg["MP"],
                     KSTEPS=cfg["KSTEPS"], SPLIT=cfg["SPLIT"], PAIR="pair" in name)
            info = ptxas_info(_skinny_kernel, c, cfg.get("num_warps", 4), cfg.get("num_stages", 4), GEMV_TYPES,
                              gemv_ints(rows_m, rows, K, cfg["BN"], "pair" in name))
            spill = [p.strip() for p in info.split("|")[0].split(",") if "spill stores" in p]
            print(f"  M {rows_m:2d} {name:20s} BN {cfg['BN']:3d} MP {cfg['MP']} K steps {cfg['KSTEPS']:2d} "
                  f"split {cfg['SPLIT']:2d}: {info.split('|')[-1].strip()}; {spill[0] if spill else ''}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass", action="store_true", help="the K loops' SASS instruction mix instead of registers")
    if ap.parse_args().sass:
        sass_main()
    else:
        main()
