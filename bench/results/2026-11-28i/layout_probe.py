"""Probe (call 4): does the decode-size MoE's weight layout bound its bandwidth? The down GEMM of a Flash
MoE layer (256 MXFP4 experts [4096, 2048], 16-pair tiles on FP8 tensor cores, moe_w4a8's product) at
T tokens, reading each program's weight bytes either as stored (row-major: each K step takes 64 bytes
from each of BN rows 1 KB apart) or as if tile-contiguous (each program's BN x 64 bytes of a K step one
block, its steps one after another: what a load-time repack would give). Same bytes, same
instructions; the tile-contiguous outputs are garbage (timing only)."""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.kernel_cases import time_graph  # noqa: E402
from bench.kernel_cases.moe import _experts  # noqa: E402
from dsv4.ops.triton.moe_grouped import _expert_tiles, _tile_rows  # noqa: E402
from dsv4.ops.triton.numerics import e2m1x2_to_e4m3, e8m0_to_f32  # noqa: E402


@triton.jit
def _probe_kernel(hq_ptr, hs_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, y_ptr, w_ptr, s_ptr,
                  D: tl.constexpr, I: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, PIPE: tl.constexpr,
                  CONTIG: tl.constexpr, BK: tl.constexpr):
    e, rows, valid = _tile_rows(order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BT)
    if e >= 0:
        pid_n = tl.program_id(1)
        n = pid_n * BN + tl.arange(0, BN)
        e64 = e.to(tl.int64)
        base = w_ptr.to(tl.pointer_type(tl.uint8)) + e64 * (D * (I // 2))
        sbase = s_ptr + e64 * (D * (I // 32)) + n * (I // 32)
        acc = tl.zeros((BN, BT), tl.float32)
        for k0 in tl.range(0, I, BK, num_stages=PIPE):
            blk = tl.zeros((BN, BT), tl.float32)
            for g in tl.static_range(BK // 32):
                kg = k0 + g * 32
                j = tl.arange(0, 16)
                if CONTIG:   # [D / BN programs][I / BK steps][BN rows][BK / 2 bytes]
                    off = pid_n * (BN * (I // 2)) + (k0 // BK) * (BN * (BK // 2)) + tl.arange(0, BN)[:, None] * (BK // 2) \
                        + (g * 16 + j)[None, :]
                else:
                    off = n[:, None] * (I // 2) + (kg // 2 + j)[None, :]
                b = tl.load(base + off)
                lo, hi = e2m1x2_to_e4m3(b, True)
                w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, 32)).to(tl.float8e4nv, bitcast=True)
                q = tl.load(hq_ptr + rows[:, None] * I + (kg + tl.arange(0, 32))[None, :], mask=valid[:, None], other=0.0)
                blk += tl.dot(w, tl.trans(q)) * e8m0_to_f32(tl.load(sbase + kg // 32))[:, None]
            acc += blk * tl.load(hs_ptr + rows * (I // 128) + k0 // 128, mask=valid, other=0.0)[None, :]
        tl.store(y_ptr + rows[None, :].to(tl.int64) * D + n[:, None], acc, mask=valid[None, :])


def main() -> None:
    E, D, I, K, BT, ROT = 256, 4096, 2048, 6, 16, 8
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    w = _experts("mxfp4", E, D, I, g, dev)
    data, scale = w.kernel_operands()[1].view(torch.int32), w.kernel_operands()[2]
    per_expert = data[0].numel() * 4 + scale[0].numel()
    print(f"{torch.cuda.get_device_name()}: down GEMM of a Flash MoE layer, W4A8 16-pair tiles, graph of {ROT} calls")
    for T in (1, 8, 32):
        calls, distinct = [], 0
        cases = []
        for _ in range(ROT):
            ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K].to(dev)
            distinct += ids.unique().numel()
            order, te, r0, r1 = _expert_tiles(ids.view(-1), E, BT)
            P = T * K
            hq = (torch.randn(P, I, device=dev)).to(torch.float8_e4m3fn)
            hs = torch.rand(P, I // 128, device=dev)
            y = torch.empty(P, D, device=dev)
            cases.append((hq, hs, order, te, r0, r1, y))
        nbytes = distinct / ROT * per_expert
        for bn, bk, pipe in ((128, 128, 3), (128, 256, 3), (64, 128, 3)):
            for contig in (False, True):
                fns = [lambda c=c, contig=contig, bn=bn, bk=bk, pipe=pipe: _probe_kernel[(c[3].numel(), D // bn)](
                    c[0], c[1], c[2], c[3], c[4], c[5], c[6], data, scale, D=D, I=I, BT=BT, BN=bn, PIPE=pipe,
                    CONTIG=contig, BK=bk, num_warps=4, num_stages=pipe) for c in cases]
                fns[0]()
                sec = time_graph(fns, 20) / ROT
                print(f"T={T:3d} BN {bn:3d} BK {bk} {'tile-contiguous' if contig else 'row-major      '}: "
                      f"{sec * 1e6:8.1f} us {nbytes / sec / 1e9:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
