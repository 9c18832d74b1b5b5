"""Races on Hopper's asynchronous MMA, found in the compiled kernels (SASS) on a machine without a GPU.

    python bench/wgmma_hazards.py [--only moe linear small indexer attention production]

An ``HGMMA`` / ``QGMMA`` (wgmma) whose A operand is a register fragment (Triton's ``tl.dot`` with
the left operand computed in registers, as the MoE's decoded weight tiles are) reads those registers
while it runs: PTX makes writing them before a ``wgmma.wait_group`` that covers the instruction
undefined behaviour. Triton 3.6 pipelines such dots with waits that leave some in flight
(``WARPGROUP.DEPBAR.LE gsb0, N``) and ptxas may give the next K step's decoded values the same
registers, so an MMA can read the next tile's weights: a different garbage on every call, shown at one
shape and hidden at another by the timing alone (results/2026-11-28e/pro_nan.txt).

:func:`hazards` walks every loop of a kernel's SASS twice in program order, keeping the MMAs in
flight (their A registers), draining them at each ``WARPGROUP.DEPBAR.LE``, and reports a write to a
register an in-flight MMA reads. The scan compiles the engine's tensor-core kernels through their own
wrappers on CPU tensors at Flash and Pro shapes (:mod:`bench.compile_sm90`'s stand-in sm_90 driver:
each variant exactly as a launch specializes it; nothing runs) and prints one line a kernel variant.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_OP = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);")
#: opcodes whose first operand is not a register they write
_NO_WRITE = ("ST", "BAR", "BRA", "DEPBAR", "WARPGROUP", "WARPSYNC", "RED", "ATOM", "EXIT", "RET", "CALL",
             "NOP", "MEMBAR", "ISETP", "FSETP", "HSETP", "DSETP", "PLOP3", "LDGSTS", "LDGDEPBAR", "SYNCS",
             "UTMA", "BSSY", "BSYNC", "FENCE", "CCTL", "ERRBAR", "VOTEU", "R2UR", "ELECT", "REDUX", "U", "S2UR")
_MMA = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")


def _instructions(sass: str) -> list[tuple[str, str]]:
    out = []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            out.append(("LABEL", label.group(1)))
            continue
        m = _OP.search(line)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def _registers(token: str, n: int) -> set[int]:
    m = re.match(r"R(\d+)\b", token.strip())
    return set(range(int(m.group(1)), int(m.group(1)) + n)) if m else set()


def hazards(sass: str) -> list[str]:
    """The writes to a register an in-flight wgmma reads as its A operand, one line per loop that has
    one (the first such write), for the SASS text of one kernel (``nvdisasm -c``)."""
    ins = _instructions(sass)
    labels = {arg: i for i, (op, arg) in enumerate(ins) if op == "LABEL"}
    found = []
    for end, (op, args) in enumerate(ins):
        back = re.search(r"BRA\s*`\((\.L_x_\d+)\)", f"{op} {args}")
        if not back or labels.get(back.group(1), end + 1) > end:
            continue
        body = ins[labels[back.group(1)] + 1:end + 1]
        if not any(o.startswith(_MMA) for o, _ in body):
            continue
        flight: list[set[int]] = []
        hit = None
        for lap in (0, 1):                      # the first lap only fills the in-flight set at the back edge
            for o, a in body:
                if o.startswith(_MMA):
                    parts = [p.strip() for p in a.split(",")]
                    flight.append(_registers(parts[1], 4) if len(parts) > 1 else set())
                elif o.startswith("WARPGROUP.DEPBAR"):
                    n = int(re.search(r"0x([0-9a-f]+)", a).group(1), 16)
                    flight = flight[len(flight) - n:] if n else []
                elif lap and o != "LABEL" and not o.startswith(_NO_WRITE) and flight:
                    width = 4 if ".128" in o else 2 if ".64" in o else 1
                    clash = _registers(a.split(",")[0], width) & set().union(*flight)
                    if clash:
                        hit = f"loop {back.group(1)}: '{o} {a}' writes R{sorted(clash)} while an MMA reading it may run"
                        break
            if hit:
                found.append(hit)
                break
    return found


GEOS = {"flash": (4096, 2048), "pro": (7168, 3072), "tiny": (64, 256)}
#: the MXFP4 prefill paths: (label, moe.CONFIGS key, pairs a tile)
MX_PATHS = [("few 16", "grouped_mxfp4_few", 16), ("few 64", "grouped_mxfp4_few", 64),
            ("transposed 64", "grouped_mxfp4_mid", 64), ("transposed 128", "grouped_mxfp4", 128),
            ("wide 256", "grouped_mxfp4_wide", 256)]


def _moe_kernels(D: int, I: int, fmt: str, key: str | None = None, bt: int | None = None) -> dict:
    """The prefill MoE's kernels compiled for 2048 tokens of top-6 over 16 experts of ``fmt`` at
    hidden ``D`` / expert width ``I``; with ``key``, MXFP4 on that moe.CONFIGS path at ``bt`` pairs
    a tile."""
    import torch

    from bench.kernel_cases.moe import _experts
    from bench.ptxas_regs import compiled
    from dsv4.ops.triton import moe as M
    g = torch.Generator().manual_seed(0)
    E, T, k = 16, 2048, 6
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :k].contiguous()
    rw = torch.rand(T, k, generator=g)
    w1, w3, w2 = (_experts(fmt, E, n, kk, g, "cpu") for n, kk in ((I, D), (I, D), (D, I)))
    tiles = M.tiles
    if key:
        M.tiles = lambda P, E, dec, mx: (bt, key) if mx and not dec else tiles(P, E, dec, mx)
    try:
        return compiled(lambda: M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True))
    finally:
        M.tiles = tiles


def scan_moe(report) -> None:
    """The prefill MoE's grouped GEMMs: every MXFP4 path's tiles, and the NVFP4 (QDOT) ones."""
    for geo, (D, I) in GEOS.items():
        for fmt in ("mxfp4", "nvfp4"):
            for label, key, bt in (MX_PATHS if fmt == "mxfp4" else [("qdot", None, None)]):
                for name, kern in _moe_kernels(D, I, fmt, key, bt).items():
                    if name.startswith(("_w13", "_w2")):
                        report(f"moe {geo} {fmt} {label}", name, kern)


def scan_linear(report) -> None:
    """The dense projections' prefill GEMMs and decode GEMVs, FP8 / MXFP4 / NVFP4 / plain, with and
    without act-quant, and the pair (``wq_a`` || ``wkv``)."""
    import torch

    from bench.kernel_cases.moe import fp8_weight
    from bench.ptxas_regs import compiled
    from dsv4.ops.triton import linear as lin
    from dsv4.weights.formats import Mxfp4Weight, Nvfp4Weight
    g = torch.Generator().manual_seed(1)
    N, K = 4096, 4096
    weights = {"fp8": fp8_weight(N, K, g, "cpu"),
               "mxfp4": Mxfp4Weight(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g),
                                    torch.randint(117, 123, (N, K // 32), dtype=torch.uint8, generator=g)),
               "nvfp4": Nvfp4Weight(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g),
                                    (torch.rand(N, K // 16, generator=g) + 0.1).to(torch.float8_e4m3fn),
                                    torch.tensor(0.01)),
               "plain": torch.randn(N, K, generator=g).to(torch.bfloat16)}
    for M in (1, 16, 4096):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        for fmt, w in weights.items():
            for aq in (True, False):
                if fmt == "plain":
                    call = (lambda _x=x, _w=w: lin.linear_pair_triton(_x.unsqueeze(0), _w, _w, False, True))
                else:
                    call = (lambda _x=x, _w=w, _a=aq: lin.linear_triton(_x, _w, _a, True))
                try:
                    ks = compiled(call)
                except Exception as e:                                   # noqa: BLE001 (refused: reported)
                    print(f"linear {fmt} M {M} aq {aq}: not compiled ({type(e).__name__}: {str(e)[:80]})")
                    continue
                for name, kern in ks.items():
                    report(f"linear {fmt} M {M} act-quant {aq}", name, kern)


def scan_small(report) -> None:
    """The small ops at decode shapes (:func:`bench.compile_sm90._exercise`: mHC, quantization, ...)."""
    from bench import compile_sm90
    start = len(compile_sm90.COMPILED)
    compile_sm90._exercise()
    for name, kern in compile_sm90.COMPILED[start:]:
        report("small ops", name, kern)


def scan_indexer(report) -> None:
    """The indexer's scores, decode and prefill, FP4 keys."""
    import torch

    from bench.ptxas_regs import compiled
    from dsv4.model.cache import RowStore
    from dsv4.ops.triton.indexer import indexer_scores_triton
    for S in (1, 2048):
        bound = max(S // 4, 64)
        q = torch.randn(1, S, 64, 128).to(torch.bfloat16)
        w = torch.randn(1, S, 64).to(torch.bfloat16)
        store = RowStore.allocate("fp4", 2, bound, 128, torch.bfloat16, torch.device("cpu"))
        slots = torch.tensor([1], dtype=torch.int32)
        vis = ((torch.arange(S) + 1) // 4).clamp(max=bound).unsqueeze(0).to(torch.int32).contiguous()
        ks = compiled(lambda: indexer_scores_triton(q, store, slots, w, bound, 0.1, vis))
        for name, kern in ks.items():
            report(f"indexer S {S}", name, kern)


def scan_attention(report) -> None:
    """Sparse attention at Flash's shapes (64 heads of 512, FP8 K=V rows with a 64-wide rope part):
    sliding, CSA (top-k entries) and HCA (every entry), decode (split keys) and prefill (rows)."""
    import torch

    from bench.ptxas_regs import compiled
    from dsv4.model.cache import RowStore
    from dsv4.ops.triton.attention import sparse_attention_triton
    g = torch.Generator().manual_seed(3)
    H, hd, W, topk = 64, 512, 128, 512
    for S in (1, 512):
        B = 1
        ctx = 8192
        start = torch.tensor([ctx - S])
        slots = torch.tensor([1])
        ring = RowStore.allocate("fp8", 2, W, hd, torch.bfloat16, "cpu", rope_dim=64)
        t = start.view(-1, 1) + torch.arange(S)
        ang = t.float().unsqueeze(-1) * torch.rand(32, generator=g)
        rope = dict(cos=ang.cos(), sin=ang.sin())
        q = torch.randn(B, S, H, hd, generator=g).to(torch.bfloat16)
        kv = torch.randn(B, S, hd, generator=g).to(torch.bfloat16)
        sink = torch.randn(H, generator=g)
        for kind, ratio in (("sliding", 0), ("csa", 4), ("hca", 128)):
            comp = {}
            if ratio:
                n_ent = ctx // ratio
                ents = RowStore.allocate("fp8", 2, n_ent + 1, hd, torch.bfloat16, "cpu", rope_dim=64)
                visible = ((t + 1) // ratio).clamp(max=n_ent)
                if kind == "csa":
                    idx = torch.randint(0, n_ent, (B, S, min(topk, n_ent)), generator=g)
                    comp = dict(comp=ents, comp_idx=torch.where(idx < visible.unsqueeze(-1), idx, -1))
                else:
                    comp = dict(comp=ents, comp_len=visible, comp_bound=n_ent)
            ks = compiled(lambda: sparse_attention_triton(q, kv, ring, slots, start, W, sink, hd ** -0.5, **comp,
                                                          **rope))
            for name, kern in ks.items():
                report(f"attention {kind} S {S}", name, kern)


def production(report, geos: tuple[str, ...] = ("flash", "tiny")) -> None:
    """The variants the engine runs with a register-operand MMA in a pipelined loop: the MXFP4
    prefill MoE's transposed paths (64-, 128- and 256-pair tiles) and the FP8 decode GEMV without act-quant
    (``tests/test_kernel_registers.py`` checks these on every CI run)."""
    import torch

    from bench.kernel_cases.moe import fp8_weight
    from bench.ptxas_regs import compiled
    from dsv4.ops.triton import linear as lin
    for geo in geos:
        D, I = GEOS[geo]
        for label, key, bt in MX_PATHS[2:]:
            ks = _moe_kernels(D, I, "mxfp4", key, bt)
            for name in ("_w13_wt_kernel", "_w2_grouped_kernel"):
                report(f"moe {geo} mxfp4 {label}", name, ks[name])
        g = torch.Generator().manual_seed(1)
        xs = torch.randn(1, D, generator=g).to(torch.bfloat16)
        ks = compiled(lambda: lin.linear_triton(xs, fp8_weight(I, D, g, "cpu"), False, True))
        report(f"linear {geo} fp8 M 1 weight-only", "_skinny_kernel", ks["_skinny_kernel"])


SCANS = {"moe": scan_moe, "linear": scan_linear, "small": scan_small, "indexer": scan_indexer,
         "attention": scan_attention, "production": production}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=SCANS, nargs="*")
    a = ap.parse_args()
    from bench import compile_sm90
    from bench.ptxas_regs import sass
    compile_sm90._install()
    bad = 0

    def report(where: str, name: str, kernel) -> None:
        nonlocal bad
        text = sass(kernel)
        mma = sum(text.count(m) for m in _MMA)
        found = hazards(text)
        bad += bool(found)
        usage = compile_sm90._usage(kernel.asm["cubin"])          # registers, stack (spills) per thread
        print(f"{where:36s} {name:28s} {mma:4d} MMA  {usage:38s} {'RACE: ' + found[0] if found else 'ok'}",
              flush=True)
    for key in a.only or SCANS:
        SCANS[key](report)
    print(f"{bad} kernel variant(s) with a register race on an in-flight MMA")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
