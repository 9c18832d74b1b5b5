import sys, torch
sys.path.insert(0, ".")
import tests.test_triton_moe as T
from dsv4.ops.triton import moe as M, runtime
from dsv4.ops import reference as ref
g = T.PRO
E, Tn = 64, 2048
w1, w3 = (T._weights("mxfp4", E, g["I"], g["D"], s) for s in (1, 3))
w2 = T._weights("mxfp4", E, g["D"], g["I"], 2)
x = (torch.randn(Tn, g["D"], device="cuda") * 2).bfloat16()
ids, rw = T._routing(Tn, g["k"], E, 7)
exp = ref.moe(x, ids, rw, w1, w3, w2, 10.0, True, True).float()
tiles = M.tiles
for label, w13, w2c in [("A w2 (128,64,8,4,4)", (64, 128, 8, 3, 3), (128, 64, 8, 4, 4)),
                        ("B w2 (128,64,8,3,3)", (64, 128, 8, 3, 3), (128, 64, 8, 3, 3)),
                        ("C w2 (128,128,8,3,3)", (64, 128, 8, 3, 3), (128, 128, 8, 3, 3)),
                        ("D w13 (64,128,8,3,3) w2 A, BT 128", (64, 128, 8, 3, 3), (128, 64, 8, 4, 4))]:
    bt = 128 if "BT 128" in label else 256
    M.CONFIGS["grouped_mxfp4_wide"] = dict(w13=w13, w2=w2c, wt=(True, True))
    M.tiles = lambda P, E, dec, mx, _b=bt: (_b, "grouped_mxfp4_wide") if mx and not dec else tiles(P, E, dec, mx)
    for rep in range(2):
        with runtime.poisoned():
            got = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True).float()
        bad = ~torch.isfinite(got)
        cols = bad.any(0).nonzero().flatten()
        rows = bad.any(1).nonzero().flatten()
        ok = torch.isfinite(exp).all(1) & ~bad.any(1)
        rel = float((got[ok] - exp[ok]).norm() / exp[ok].norm())
        print(label, "rep", rep, "nonfinite", int(bad.sum()), "rows", rows.numel(), "cols", (int(cols.min()), int(cols.max())) if cols.numel() else None, "rel", rel, flush=True)
