"""Try a few tilings of the linear kernels on the GPU (time and error vs the reference):

    python bench/tune_linear.py [prefill] [decode] [w8a8] [crossover]

``crossover``: the decode GEMV (``_skinny_kernel``) against the FP8 GEMM (its act-quant launch
included) at 4-32 rows on Flash's FP8 projections, each call in a CUDA graph on weights not in L2:
where ``linear.SKINNY_MAX_M`` should sit.

``w8a8``: the FP8 GEMM with e4m3 activations (``linear._gemm_w8a8_kernel``) on Flash's prefill
shapes at 8192 tokens, per tile config, against cuBLAS BF16 on the same shape.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import linear as lin  # noqa: E402
from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight  # noqa: E402


def bench(fn) -> float:
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def quant(fmt, w):
    return {"fp8": lambda: Fp8BlockWeight.quantize(w, ue8m0=True), "mxfp4": lambda: Mxfp4Weight.quantize(w),
            "nvfp4": lambda: Nvfp4Weight.quantize(w)}[fmt]()


def prefill() -> None:
    m, n, k = 4096, 4096, 8192
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wf = torch.randn(n, k, device="cuda") * 0.02
    dense = wf.bfloat16()
    tp = bench(lambda: F.linear(x, dense))
    print(f"cuBLAS bf16 {m}x{n}x{k}: {tp * 1e6:.0f} us {2 * m * n * k / tp / 1e12:.0f} TF/s")
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        w = quant(fmt, wf)
        want = ref.linear(x, w, True, True, torch.float32)
        q = lambda: lin.act_quant_triton(x, True, lin._A_FP8 if fmt == "fp8" else lin._A_SIM, torch.bfloat16)
        print(f"  act quant alone: {bench(q) * 1e6:.0f} us")
        cfgs = [dict(BM=128, BN=128, num_warps=8, num_stages=3, FP8_ACC=None),
                dict(BM=128, BN=128, num_warps=8, num_stages=3, FP8_ACC=32),
                dict(BM=128, BN=128, num_warps=8, num_stages=4, FP8_ACC=None),
                dict(BM=64, BN=128, num_warps=4, num_stages=4, FP8_ACC=32),
                dict(BM=64, BN=128, num_warps=4, num_stages=4, FP8_ACC=None),
                dict(BM=128, BN=64, num_warps=4, num_stages=4, FP8_ACC=None)]
        if fmt != "fp8":
            cfgs = [dict(BM=128, BN=128, num_warps=8, num_stages=4, FP8_ACC=None),
                    dict(BM=256, BN=128, num_warps=8, num_stages=3, FP8_ACC=None),
                    dict(BM=256, BN=64, num_warps=8, num_stages=4, FP8_ACC=None),
                    dict(BM=128, BN=128, num_warps=4, num_stages=3, FP8_ACC=None),
                    dict(BM=128, BN=64, num_warps=8, num_stages=4, FP8_ACC=None)]
        for cfg in cfgs:
            try:
                y = lin.linear_triton(x, w, True, True, torch.float32, _path="gemm", _config=cfg)
                t = bench(lambda: lin.linear_triton(x, w, True, True, _path="gemm", _config=cfg))
                print(f"{fmt:6} {cfg}: {t * 1e6:.0f} us {2 * m * n * k / t / 1e12:.0f} TF/s "
                      f"({100 * tp / t:.0f}% of cuBLAS bf16) err {rel(y, want):.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{fmt:6} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


def decode() -> None:
    for (n, k) in ((1024, 4096), (32768, 1024), (4096, 8192), (512, 4096)):
        torch.manual_seed(0)
        wf = torch.randn(n, k, device="cuda") * 0.02
        for fmt in ("fp8", "mxfp4"):
            ws = [quant(fmt, wf) for _ in range(max(1, (256 << 20) // (n * k)))]
            for m in (1, 32):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                base = lin._skinny_config(m, n, k, 1.0 if fmt == "fp8" else 0.5, 132)
                variants = [base]
                for bn in (64, 128):
                    for split in (1, 2, 4, 8, 16):
                        kb = -(-k // 128)
                        if split > kb:
                            continue
                        ks = -(-kb // split)
                        variants.append(dict(BN=bn, MP=base["MP"], KSTEPS=ks, SPLIT=-(-kb // ks)))
                res = []
                for cfg in variants:
                    i = [0]

                    def call(cfg=cfg):
                        i[0] = (i[0] + 1) % len(ws)
                        return lin.linear_triton(x, ws[i[0]], True, True, _path="skinny", _config=cfg)
                    t = bench(call)
                    res.append((t, cfg))
                wb = ws[0].nbytes
                best = min(res, key=lambda r: r[0])
                print(f"{fmt} {n}x{k} m={m}: default {res[0][0] * 1e6:.1f} us ({wb / res[0][0] / 1e9:.0f} GB/s) "
                      f"{res[0][1]}; best {best[0] * 1e6:.1f} us ({wb / best[0] / 1e9:.0f} GB/s) {best[1]}", flush=True)


#: Flash's dense projections with FP8 weights at a prefill step: (name, N, K)
FLASH_W8A8 = [("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("shared w1", 2048, 4096), ("shared w2", 4096, 2048),
              ("wq_a", 1024, 4096), ("indexer wq_b", 8192, 1024)]


def w8a8(m: int = 8192) -> None:
    cfgs = [lin._gemm_defaults(1)] + [dict(BM=bm, BN=bn, GROUP_M=8, num_warps=nw, num_stages=ns, FP8_ACC=None)
                                      for bm, bn, nw, ns in ((128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 5),
                                                             (64, 128, 4, 6), (128, 64, 4, 4), (64, 64, 4, 6),
                                                             (128, 128, 4, 4))]
    for name, n, k in FLASH_W8A8:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wf = torch.randn(n, k, device="cuda") * 0.02
        dense = wf.bfloat16()
        tp = bench(lambda: F.linear(x, dense))
        w = quant("fp8", wf)
        want = ref.linear(x, w, True, True, torch.float32)
        q = lin.act_quant_triton(x, True, lin._A_FP8)
        tq = bench(lambda: lin.act_quant_triton(x, True, lin._A_FP8))
        flops = 2 * m * n * k
        print(f"{name} {m}x{n}x{k}: cuBLAS bf16 {tp * 1e6:.0f} us {flops / tp / 1e12:.0f} TF/s; act quant {tq * 1e6:.0f} us",
              flush=True)
        for i, cfg in enumerate(cfgs):
            try:
                y = lin.linear_triton(x, w, True, True, torch.float32, _path="gemm", _config=cfg)
                t = bench(lambda: lin.linear_triton(x, w, True, True, _path="gemm", _config=cfg)) - tq
                print(f"  {'default' if i == 0 else cfg}: GEMM {t * 1e6:.0f} us {flops / t / 1e12:.0f} TF/s "
                      f"({100 * tp / t:.0f}% of cuBLAS bf16) err {rel(y, want):.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        del q


def crossover() -> None:
    print(f"{torch.cuda.get_device_name()}: us a call (CUDA graph, weights rotated past L2), act-quant, FP8 weights")
    print(f"{'projection':>14} {'N x K':>12} " + " ".join(f"{'M=' + str(m) + ' gemv/gemm':>20}" for m in CROSS_M))
    for name, n, k in FLASH_W8A8:
        torch.manual_seed(0)
        wf = torch.randn(n, k, device="cuda") * 0.02
        ws = [quant("fp8", wf) for _ in range(max(2, (512 << 20) // (n * k)))]
        cells = []
        for m in CROSS_M:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = ref.linear(x, ws[0], True, True, torch.float32)
            times = []
            for path in ("skinny", "gemm"):
                err = rel(lin.linear_triton(x, ws[0], True, True, torch.float32, _path=path), want)
                assert err < 1e-2, f"{name} M={m} {path}: error {err}"
                i = [0]

                def call(path=path):
                    i[0] = (i[0] + 1) % len(ws)
                    return lin.linear_triton(x, ws[i[0]], True, True, _path=path)
                times.append(tt.do_bench_cudagraph(call, rep=50) * 1e3)
            cells.append(f"{times[0]:9.1f}/{times[1]:<9.1f}" + ("<" if times[1] < times[0] else " "))
        print(f"{name:>14} {f'{n}x{k}':>12} " + " ".join(f"{c:>20}" for c in cells), flush=True)


CROSS_M = (4, 8, 16, 24, 32)       # the decode tile holds at most 32 rows


if __name__ == "__main__":
    which = sys.argv[1:] or ["prefill", "decode"]
    for w in which:
        globals()[w]()
