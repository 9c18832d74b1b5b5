"""The lightning indexer's prefill scores at a prompt's real shape: tile configs against each other
in one run (one GPU).

    python bench/indexer_tune.py [--tokens 8192]

``--tokens`` queries of one sequence (64 index heads of 128 dims, bf16, the head weights), FP4 keys
(e2m1 + e8m0 per 32, as the cache stores them) of one compressed entry per 4 tokens, the causal
visibility ``(s + 1) // 4``: what one CSA layer's indexer computes for one prompt step. For each
config (``indexer_scores_triton``'s ``_config``): the kernel's device time (torch.profiler, mean of
``--iters``), TFLOP/s over the visible (query, entry) pairs (``2 * 64 * 128`` each), and whether
the scores equal the default config's bit for bit.
"""

from __future__ import annotations

import argparse

import torch

from dsv4.model.cache import RowStore
from dsv4.ops.triton.indexer import indexer_scores_triton

#: (label, _config); None: the defaults
CASES = [
    ("the engine's (indexer.PREFILL_*)", None),
    ("before (BC 64, BQ 16, QS 2, w4 s2)", dict(BC=64, BQ=16, num_warps=4)),
    ("BC 128 w8", dict(BC=128, num_warps=8)),
    ("BC 128 w4", dict(BC=128)),
    ("BC 128 BQ 32 w8", dict(BC=128, BQ=32, num_warps=8)),
    ("BC 64 QS 4 w8", dict(QS=4, num_warps=8)),
    ("BC 128 QS 4 w8", dict(BC=128, QS=4, num_warps=8)),
    ("BC 64 BQ 32 w4", dict(BQ=32)),
    ("BC 128 w8 s3", dict(BC=128, num_warps=8, num_stages=3)),
    ("BC 256 w8", dict(BC=256, num_warps=8)),
    ("BC 256 w4", dict(BC=256)),
    ("BC 512 w8", dict(BC=512, num_warps=8)),
    ("BC 256 BQ 32 w8", dict(BC=256, BQ=32, num_warps=8)),
    ("BC 256 BQ 8 w8", dict(BC=256, BQ=8, num_warps=8)),
    ("BC 256 w8 s1", dict(BC=256, num_warps=8, num_stages=1)),
    ("BC 512 w8 BQ 32", dict(BC=512, BQ=32, num_warps=8)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cases", type=int, nargs="*", help="indices into CASES (default all; 0 always runs)")
    a = ap.parse_args()
    S, NI, dim = a.tokens, 64, 128
    bound = S // 4
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, S, NI, dim, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1, S, NI, device="cuda", generator=g) * (dim * NI) ** -0.5).bfloat16()
    store = RowStore.allocate("fp4", 2, bound, dim, torch.bfloat16, torch.device("cuda"))
    store.write(torch.tensor([[1]], device="cuda"), torch.arange(bound, device="cuda").unsqueeze(0),
                torch.randn(1, bound, dim, device="cuda", generator=g).bfloat16())
    slots = torch.tensor([1], device="cuda", dtype=torch.int32)
    visible = ((torch.arange(S, device="cuda") + 1) // 4).unsqueeze(0).to(torch.int32).contiguous()
    pairs = int(visible.sum())
    flops = 2 * pairs * NI * dim
    print(f"indexer prefill: {S} queries, {bound} entries, {pairs} visible pairs; {torch.cuda.get_device_name()}")
    base = None
    for i, (label, cfg) in enumerate(CASES):
        if a.cases and i and i not in a.cases:
            continue
        run = lambda: indexer_scores_triton(q, store, slots, w, bound, dim ** -0.5, visible, _config=cfg)  # noqa: E731
        try:
            out = run()
            torch.cuda.synchronize()
        except Exception as e:                                                      # noqa: BLE001
            print(f"{label:40s} failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.iters):
                run()
            torch.cuda.synchronize()
        us = sum(ev.device_time_total for ev in prof.key_averages() if "_indexer_kernel" in ev.key) / a.iters
        same = "-" if base is None else str(torch.equal(out, base))
        base = out if base is None else base
        print(f"{label:40s} {us / 1e3:8.3f} ms {flops / us / 1e6:7.1f} TF/s  equal {same}", flush=True)


if __name__ == "__main__":
    main()
