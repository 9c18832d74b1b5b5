"""Decode attention's split and tile choice, searched by measurement (one GPU, one run).

    python bench/attn_split_tune.py [--contexts 8192 65536] [--batch 1 8 32]

For each decode case (Flash / Pro, sliding only, CSA top-k, HCA; the shapes of
``bench/kernel_cases/attention.py``) it times :func:`dsv4.ops.triton.attention.sparse_attention_triton`
in a CUDA graph with an L2 flush before each call (``bench/kernels.py``'s timing), once with the
rule in use and once for each forced ``(heads a program, splits)``: more splits fill more SMs, but
the last program of each query and head block merges every split's ``[heads, 512]`` fp32 partial
alone, so at batch 1 the rule's split count can cost more than it gains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases.attention import MODELS, _Context, attention_args  # noqa: E402
from bench.kernels import Env  # noqa: E402
from dsv4.ops.triton import attention as A  # noqa: E402


def forced(bh: int | None, splits: int | None):
    """Patch the attention module's tile rule and split rule; returns the restore closure."""
    cfg, spl = A._attn_config, A._splits

    def config(*a, **k):
        b, bn, w, s = cfg(*a, **k)
        return (bh or b), bn, w, s

    def splits_rule(n_blocks, base, target):
        if splits is None:
            return spl(n_blocks, base, target)
        bps = triton.cdiv(n_blocks, max(1, min(splits, n_blocks)))
        return triton.cdiv(n_blocks, bps), bps

    A._attn_config, A._splits = config, splits_rule
    return lambda: (setattr(A, "_attn_config", cfg), setattr(A, "_splits", spl))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--models", nargs="*", default=["flash", "pro"])
    ap.add_argument("--rule-only", action="store_true", help="time the rule in use only")
    args = ap.parse_args()
    env = Env("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {env.copy_gbs:.0f} GB/s")
    grid = [] if args.rule_only else [(bh, s) for bh in (16, 32) for s in (2, 3, 4, 6, 8, 12, 20, 40)]
    for ctx in args.contexts:
        c = _Context(ctx, max(args.batch), "cuda")
        for model in args.models:
            H, topk = MODELS[model]["H"], MODELS[model]["topk"]
            for kind in ("sliding", "csa", "hca"):
                for B in args.batch:
                    a, comp, n_keys = attention_args(c, "csa" if kind == "sliding" else kind, H, topk, B, 1, "cuda")
                    if kind == "sliding":
                        comp, n_keys = {}, min(128, ctx)
                    ref = A.sparse_attention_triton(*a, **comp).float()
                    n_blocks = triton.cdiv(128, 32) + (triton.cdiv(int(comp["comp_idx"].shape[-1]) if "comp_idx" in comp
                                                                   else int(comp.get("comp_bound", 0)), 32))
                    rule, _ = env.time(lambda: A.sparse_attention_triton(*a, **comp))
                    row = [f"{model} {kind:7s} ctx={ctx // 1024}k b={B:2d} ({n_keys:.0f} keys, {n_blocks} blocks): "
                           f"rule {rule * 1e6:6.1f} us"]
                    best = (rule, "rule")
                    for bh, s in grid:
                        if s > n_blocks or bh > H:
                            continue
                        restore = forced(bh, s)
                        try:
                            fn = lambda: A.sparse_attention_triton(*a, **comp)   # noqa: E731
                            err = (fn().float() - ref).abs().max().item()
                            t, _ = env.time(fn)
                        finally:
                            restore()
                        if err > 2e-2 * ref.abs().max().item():
                            row.append(f"bh{bh}/s{s} WRONG ({err:.2e})")
                            continue
                        row.append(f"bh{bh}/s{s} {t * 1e6:.1f}")
                        best = min(best, (t, f"bh{bh}/s{s}"))
                    print(" | ".join(row), flush=True)
                    print(f"   best {best[1]} {best[0] * 1e6:.1f} us ({rule / best[0]:.2f}x the rule)", flush=True)


if __name__ == "__main__":
    main()
