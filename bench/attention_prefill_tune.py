"""The sparse attention kernel on one prefill step at Flash / Pro shapes: tile configs against each
other, per layer kind (sliding window only, CSA top-k, HCA), in one run (one GPU).

    python bench/attention_prefill_tune.py [--tokens 8192] [--geo flash|pro]

bf16 queries, FP8 K=V stores (448 e4m3 dims with e8m0 scales per 64 + 64 bf16 rope dims), window
128, CSA ratio 4 with the geometry's top-k (random picks among the visible entries), HCA ratio 128,
one sequence from position 0. For each config ``(BH heads, BN keys, num_warps, num_stages)``: the
mean wall time of a call (CUDA events), its TFLOP/s (``4 * H * hd`` per visible key of each query)
and the output's relative difference from the first config's.
"""

from __future__ import annotations

import argparse

import torch

from dsv4.model.cache import RowStore
from dsv4.ops.triton import attention as ka

GEOS = {"flash": dict(H=64, topk=512), "pro": dict(H=128, topk=1024)}
#: configs of the prefill kernel (``attention._rows_config``), the first is the default
CONFIGS = [(64, 32, 8, 2), (64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 1), (64, 16, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2)]
W, HD, ROPE = 128, 512, 64


def _store(vals: torch.Tensor) -> RowStore:
    n_slots, rows, dim = vals.shape
    st = RowStore.allocate("fp8", n_slots, rows, dim, torch.bfloat16, vals.device, rope_dim=ROPE, pow2=True)
    st.write(torch.arange(n_slots, device=vals.device).view(-1, 1),
             torch.arange(rows, device=vals.device).view(1, -1), vals)
    return st


def _case(kind: str, H: int, topk: int, S: int):
    """Inputs of one attention call of a ``kind`` layer over a first chunk of ``S`` tokens, and the
    number of visible keys summed over the queries (for the FLOP count)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    t = torch.arange(S, device=dev)
    window_keys = int(torch.clamp(t + 1, max=W).sum())
    q = torch.randn(1, S, H, HD, device=dev, generator=g).bfloat16()
    kv_new = torch.randn(1, S, HD, device=dev, generator=g).bfloat16()
    ring = _store(torch.randn(1, W, HD, device=dev, generator=g))
    args = (q, kv_new, ring, torch.zeros(1, dtype=torch.long, device=dev),
            torch.zeros(1, dtype=torch.long, device=dev), W, torch.randn(H, device=dev, generator=g), HD ** -0.5)
    if kind == "sliding":
        return args, {}, window_keys
    ratio = 4 if kind == "csa" else 128
    n_ent = max(1, S // ratio)
    ents = _store(torch.randn(1, n_ent + 1, HD, device=dev, generator=g))
    visible = ((t + 1) // ratio).clamp(max=n_ent).view(1, S)
    if kind == "hca":
        return args, dict(comp=ents, comp_len=visible, comp_bound=n_ent), window_keys + int(visible.sum())
    k = min(topk, n_ent)
    scores = torch.rand(1, S, n_ent, device=dev, generator=g)
    scores = scores.masked_fill(torch.arange(n_ent, device=dev) >= visible.unsqueeze(-1), -1.0)
    idx = scores.topk(k, dim=-1).indices
    idx = torch.where(idx < visible.unsqueeze(-1), idx, -1)
    return args, dict(comp=ents, comp_idx=idx), window_keys + int(visible.clamp(max=k).sum())


def _time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--geo", choices=GEOS, default="flash")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--kinds", nargs="*", default=["sliding", "csa", "hca"], choices=["sliding", "csa", "hca"])
    ap.add_argument("--configs", nargs="*", default=None, metavar="BH,BN,WARPS,STAGES",
                    help="configs to time instead of CONFIGS (the first is the baseline of the differences)")
    a = ap.parse_args()
    g = GEOS[a.geo]
    H = g["H"]
    default = ka._rows_config
    print(f"{a.geo}: {a.tokens} tokens from position 0, H={H}, hd={HD}; {torch.cuda.get_device_name()}")
    for kind in a.kinds:
        args, comp, keys = _case(kind, H, g["topk"], a.tokens)
        flops = 4 * H * HD * keys
        first = None
        for cfg in [tuple(map(int, c.split(","))) for c in a.configs] if a.configs else CONFIGS:
            ka._rows_config = lambda *_a, _c=cfg: _c
            try:
                ms = _time(lambda: ka.sparse_attention_triton(*args, **comp), a.iters)
            except Exception as e:                                            # noqa: BLE001
                print(f"  {kind:8s} {str(cfg):18s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            out = ka.sparse_attention_triton(*args, **comp).float()
            diff = 0.0 if first is None else float((out - first).norm() / first.norm())
            first = out if first is None else first
            print(f"  {kind:8s} {str(cfg):18s} {ms:8.2f} ms {flops / ms / 1e9:7.1f} TFLOP/s  vs first {diff:.1e}",
                  flush=True)
    ka._rows_config = default


if __name__ == "__main__":
    main()
