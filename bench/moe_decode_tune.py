"""Search the decode MoE's tiles (``moe.CONFIGS["gemv"]``: one pair a program, a CUDA-core GEMV) by
measurement, at the engine's shapes: Flash layer (256 MXFP4 experts, D 4096, I 2048, top-6), the
FP8 shared expert inside the same launches, act-quant on.

    python bench/moe_decode_tune.py                            # 1 / 4 / 8 / 16 tokens, the default grid
    python bench/moe_decode_tune.py --compile-only --part 3/8  # fill the Triton cache (run 8 at once)
    python bench/moe_decode_tune.py --path grouped             # the same tokens through the prefill's grouped
                                                               # tiles instead (16 pairs a tile, tensor cores)

A config is ``w13=(BN, BK, warps, stages, PIPE) w2=(...)`` (``PIPE``: the K loop's software
pipelining depth, 1 = none). Timing: a CUDA graph of ``ROTATE`` calls, each with its own random ids
(~6 / ~45 / ~140 distinct experts a call at 1 / 8 / 32 tokens), so no call finds its experts in
L2; ms a call and GB/s of the distinct experts' bytes (shared expert included), against the
device-copy bandwidth measured in the same run. The first config is main's (``moe.CONFIGS["gemv"]``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import time_graph, time_replay  # noqa: E402
from bench.kernel_cases.moe import _experts, fp8_weight  # noqa: E402

E, D, I, TOP_K = 256, 4096, 2048, 6
ROTATE = 8


def grid() -> list[tuple[tuple, tuple]]:
    """(w13, w2) configs: main's first (``moe.CONFIGS["gemv"]``), then each gate/up tile with each down
    tile (chosen apart: at one token the two grids' programs fill the machine differently). (A
    64-register cap, more programs resident a multiprocessor, was no faster at 1-8 tokens:
    results/2026-11-29/call2_tune.txt; the kernels no longer take one.)"""
    from dsv4.ops.triton.moe import CONFIGS
    out = [(CONFIGS["gemv"]["w13"], CONFIGS["gemv"]["w2"])]
    # (PIPE is 1: the GEMV's K loop orders its own loads, moe_experts._gemm; Triton's pipelining of
    # it was 2.1-2.3x slower, results/2026-11-28i/call10_gemv_pipe.txt)
    w13s = [(16, 256, 4, 3, 1), (32, 256, 4, 3, 1), (16, 512, 4, 3, 1)]
    w2s = [(32, 256, 4, 3, 1), (64, 256, 4, 3, 1), (16, 256, 4, 3, 1),
           (32, 128, 4, 3, 1), (64, 128, 4, 3, 1), (16, 512, 4, 3, 1), (32, 512, 4, 3, 1), (64, 256, 8, 3, 1)]
    for w13, w2 in itertools.product(w13s, w2s):
        if (w13, w2) not in out:
            out.append((w13, w2))
    return out


def grouped_grid() -> list[tuple[tuple, tuple] | tuple[tuple, tuple, bool]]:
    """``--path grouped``: (w13, w2[, wt]) configs of the few-pairs-an-expert grouped tiles
    (``moe.CONFIGS["grouped_mxfp4_few"]``, BM 16), main's first. ``wt``: the gate/up GEMM transposed
    (``moe_grouped._w13_wt_kernel``: ``2 BN`` decoded weight rows on the MMA's M side, from registers,
    the tile's 16 pairs its N side)."""
    from dsv4.ops.triton.moe import CONFIGS
    few = CONFIGS["grouped_mxfp4_few"]
    main = (few["w13"], few["w2"], few.get("wt", False))
    w2 = (128, 128, 4, 4, 3)
    # (5 on, transposed: slower than main's tiles at 8-32 tokens, H200, 2026-11-28, 477-565 vs 408 us at 8
    # tokens, results/2026-11-28h/call2_moe_grouped_wt.txt)
    return [main, ((32, 128, 4, 4, 3), (64, 128, 4, 4, 3)), ((64, 256, 4, 3, 3), (128, 256, 4, 3, 3)),
            ((32, 256, 4, 3, 3), (64, 256, 4, 3, 3)), ((64, 128, 4, 3, 1), (128, 128, 4, 3, 1)),
            ((32, 128, 4, 3, 3), w2, True), ((32, 64, 4, 4, 4), w2, True), ((32, 256, 4, 2, 2), w2, True),
            ((64, 128, 8, 3, 3), w2, True), ((64, 64, 8, 4, 4), w2, True), ((16, 128, 4, 3, 3), w2, True),
            # (11 on) untransposed, more bytes a program or deeper pipelines
            ((128, 128, 8, 3, 3), (128, 128, 4, 4, 3)), ((128, 128, 4, 4, 3), (128, 128, 4, 4, 3)),
            ((64, 128, 4, 5, 4), (128, 128, 4, 5, 4)), ((64, 64, 4, 6, 5), (128, 64, 4, 6, 5)),
            ((64, 128, 4, 4, 3), (256, 128, 8, 4, 3)), ((64, 128, 4, 4, 3), (64, 128, 4, 4, 3)),
            ((64, 128, 4, 4, 3), (128, 64, 4, 6, 5)), ((128, 64, 4, 6, 5), (128, 128, 4, 4, 3))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--compile-only", action="store_true", help="compile this part's configs, time nothing")
    ap.add_argument("--part", default="0/1", help="i/n: the i-th of n slices of the grid (with --compile-only)")
    ap.add_argument("--configs", type=int, nargs="*", help="indices into the grid (default: all)")
    ap.add_argument("--path", choices=["gemv", "grouped"], default="gemv",
                    help="gemv: the decode kernels (the engine's up to moe.DECODE_MAX_PAIRS pairs); grouped: "
                         "the prefill's grouped GEMMs forced at these sizes (the shared expert then runs "
                         "as its own GEMVs)")
    ap.add_argument("--max-pairs", type=int, help="run the decode kernels up to this many pairs (default: the "
                                                      "engine's moe.MXFP4_DECODE_MAX_PAIRS), to time them past it")
    ap.add_argument("--shared-fused-max", type=int,
                    help="tokens up to which the decode kernels run the shared expert (default: the engine's "
                         "moe.SHARED_FUSED_MAX_TOKENS; above, the linear ops run it)")
    args = ap.parse_args()
    from dsv4 import ops
    from dsv4.ops.triton import moe
    bound = args.max_pairs or min(moe.DECODE_MAX_PAIRS, moe.MXFP4_DECODE_MAX_PAIRS)
    if args.path == "gemv" and any(T * TOP_K > bound for T in args.tokens):
        # (the call would run the grouped tiles under the GEMV's configs)
        ap.error(f"--tokens {[T for T in args.tokens if T * TOP_K > bound]}: above {bound} pairs the engine runs "
                 f"the grouped tiles (moe.MXFP4_DECODE_MAX_PAIRS); pass --max-pairs to time the GEMV there, "
                 f"or --path grouped")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    w1, w3, w2 = _experts("mxfp4", E, I, D, g, dev), _experts("mxfp4", E, I, D, g, dev), _experts("mxfp4", E, D, I, g, dev)
    shared = (fp8_weight(I, D, g, dev), fp8_weight(I, D, g, dev), fp8_weight(D, I, g, dev))
    per_expert = (w1.nbytes + w3.nbytes + w2.nbytes) / E
    shared_bytes = sum(w.nbytes for w in shared)
    keys = ("gemv",) if args.path == "gemv" else ("grouped_mxfp4_few",)
    configs = grid() if args.path == "gemv" else grouped_grid()
    max_pairs, mx_max_pairs, shared_max = moe.DECODE_MAX_PAIRS, moe.MXFP4_DECODE_MAX_PAIRS, moe.SHARED_FUSED_MAX_TOKENS
    if args.shared_fused_max is not None:
        moe.SHARED_FUSED_MAX_TOKENS = args.shared_fused_max
    if args.path == "grouped":
        moe.DECODE_MAX_PAIRS = -1
    elif args.max_pairs:
        moe.DECODE_MAX_PAIRS = moe.MXFP4_DECODE_MAX_PAIRS = args.max_pairs
    idx = args.configs if args.configs else range(len(configs))
    if args.compile_only:
        i, n = (int(v) for v in args.part.split("/"))
        idx = [j for j in idx if j % n == i]
    if not args.compile_only:
        src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        gbs = 2 * src.numel() / time_replay(lambda: dst.copy_(src)) / 1e9    # as bench/mhc_bench.py measures it
        print(f"{torch.cuda.get_device_name()}: copy {gbs:.0f} GB/s; Flash MoE layer decode (MXFP4 experts, FP8 shared "
              f"expert, act-quant), graph of {ROTATE} calls with their own ids")
        print(f"{'#':>3} {'w13 (BN,BK,warps,stages,PIPE)':>30} {'w2':>22} " + " ".join(
            f"{'T=' + str(T) + ' us':>10} {'GB/s':>6}" for T in args.tokens) + f"  ({args.path})")
        src = dst = None
    inputs = {}
    for T in args.tokens:
        x = torch.randn(T, D, generator=g).to(dev, torch.bfloat16)
        calls = []
        distinct = 0
        for _ in range(ROTATE):
            ids = torch.rand(T, E, generator=g).argsort(-1)[:, :TOP_K].to(dev)
            rw = torch.rand(T, TOP_K, generator=g).to(dev)
            distinct += ids.unique().numel()
            calls.append((ids, rw))
        inputs[T] = (x, calls, (distinct * per_expert + ROTATE * shared_bytes) / ROTATE)
    ref_out = {}
    saved = {key: moe.CONFIGS[key] for key in keys}
    try:
        for j in idx:
            w13, w2c, *wt = configs[j]
            for key in keys:   # (the config at every size)
                moe.CONFIGS[key] = dict(w13=w13, w2=w2c, wt=bool(wt and wt[0]))
            cells = []
            for T in args.tokens:
                x, calls, nbytes = inputs[T]
                fns = [lambda ids=ids, rw=rw: ops.moe(x, ids, rw, w1, w3, w2, 10.0, True, True, shared)
                       for ids, rw in calls]
                try:
                    out = fns[0]()
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    cells.append(f"{'failed':>10} {type(e).__name__[:6]:>6}")
                    continue
                if T not in ref_out:
                    ref_out[T] = out.float()
                else:
                    diff = (out.float() - ref_out[T]).abs().max().item()
                    assert diff <= 2e-2 * ref_out[T].abs().max().item(), f"config {j} T={T}: differs by {diff}"
                if args.compile_only:
                    continue
                sec = time_graph(fns, 20) / ROTATE
                cells.append(f"{sec * 1e6:10.1f} {nbytes / sec / 1e9:6.0f}")
            if not args.compile_only:
                print(f"{j:3d} {str(w13) + (' wt' if wt and wt[0] else ''):>30} {str(w2c):>22} " + " ".join(cells),
                      flush=True)
    finally:
        moe.CONFIGS.update(saved)
        moe.DECODE_MAX_PAIRS, moe.MXFP4_DECODE_MAX_PAIRS = max_pairs, mx_max_pairs
        moe.SHARED_FUSED_MAX_TOKENS = shared_max


if __name__ == "__main__":
    main()
