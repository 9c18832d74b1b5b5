"""Compile the linear kernels for sm_90 without a GPU: frontend + MLIR + ptxas. Prints resources."""
import os, sys, re, itertools
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton
from triton.backends.compiler import GPUTarget
from dsv4.ops.triton import linear as L

TARGET = GPUTarget("cuda", 90, 32)

def sig_of(fn, types, consts):
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else types.get(name, "i32")
    return sig

NOT_DIV = {"M", "R", "R2", "TILES_PER_GROUP"}

def compile_(fn, types, consts, num_warps, num_stages, label, extra_consts=None):
    sig = sig_of(fn, types, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and n not in NOT_DIV}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        k = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:3000]}")
        return None
    md = k.metadata
    ptx = k.asm["ptx"]
    mma = sorted(set(re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx)))
    import subprocess, tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    info = " ".join(re.findall(r"(Used \d+ registers|\d+ bytes stack frame|\d+ bytes spill stores)", r.stderr))
    print(f"OK   {label}: shared={md.shared} {info} mma={mma[:2]}")
    return k

if __name__ == "__main__":
    which = sys.argv[1:] or ["skinny", "gemm", "quant"]
    wt = {0: "*fp8e4nv", 1: "*fp8e4nv", 2: "*u8", 3: "*u8"}
    st = {0: "*fp32", 1: "*u8", 2: "*u8", 3: "*fp8e4nv"}
    if "skinny" in which:
        for fmt, aq, split, mp in itertools.product([0, 1, 2, 3], [True, False], [1, 4], [16, 32]):
            if not aq and mp == 32: continue
            types = dict(x_ptr="*bf16", w_ptr=wt[fmt], s_ptr=st[fmt], g_ptr="*fp32", w2_ptr=wt[fmt], s2_ptr=st[fmt],
                         g2_ptr="*fp32", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", unit="fp32")
            consts = dict(FMT=fmt, ACT_QUANT=aq, POW2=True, OP_BF16=True, PREC=None, BN=128, MP=mp, KSTEPS=4, SPLIT=split,
                          PAIR=aq)     # the pair variant (wq_a || wkv) runs with act_quant
            compile_(L._skinny_kernel, types, consts, 4, 4, f"skinny fmt={fmt} aq={aq} split={split} MP={mp}")
    if "gemm" in which:
        for fmt, mode in [(1, 0), (2, 2), (2, 3), (3, 2), (2, 0), (3, 0)]:
            a = {0: "*bf16", 2: "*bf16", 3: "*bf16"}[mode]
            types = dict(a_ptr=a, sa_ptr="*fp32", w_ptr=wt[fmt], s_ptr=st[fmt], g_ptr="*fp32", out_ptr="*bf16")
            cfg = L._gemm_defaults(fmt)  # the shipped tiling
            consts = dict(FMT=fmt, A_MODE=mode, PREC=None, KB=32, BM=cfg["BM"], BN=cfg["BN"], GROUP_M=cfg["GROUP_M"])
            compile_(L._gemm_kernel, types, consts, cfg["num_warps"], cfg["num_stages"],
                     f"gemm fmt={fmt} mode={mode} BM={cfg['BM']}")
        for fmt in (0, 1):     # W8A8 (e4m3 activations)
            types = dict(a_ptr="*fp8e4nv", sa_ptr="*fp32", w_ptr=wt[fmt], s_ptr=st[fmt], out_ptr="*bf16")
            cfg = L._gemm_defaults(fmt)
            for acc in sorted({cfg["FP8_ACC"], 32}, key=str):
                consts = dict(FMT=fmt, KB=32, EVEN_K=True, FP8_ACC=acc, BM=cfg["BM"], BN=cfg["BN"], GROUP_M=cfg["GROUP_M"])
                compile_(L._gemm_w8a8_kernel, types, consts, cfg["num_warps"], cfg["num_stages"],
                         f"gemm w8a8 fmt={fmt} BM={cfg['BM']} FP8_ACC={acc}")
    if "quant" in which:
        for mode, q in [(1, "*fp8e4nv"), (2, "*bf16"), (3, "*bf16")]:
            types = dict(x_ptr="*bf16", q_ptr=q, s_ptr="*fp32")
            compile_(L._act_quant_kernel, types, dict(MODE=mode, POW2=True, NB=4), 4, 1, f"quant mode={mode}")
