import torch
torch.manual_seed(0)
for (m, g, k, r) in ((8192, 8, 4096, 1024), (2048, 8, 4096, 1024), (600, 8, 4096, 1024), (8192, 16, 4096, 1024)):
    x = torch.randn(m, g, k, device="cuda").bfloat16(); w = torch.randn(g, r, k, device="cuda").bfloat16()
    a = torch.einsum("mgk,grk->mgr", x, w)
    out = torch.empty(m, g, r, dtype=torch.bfloat16, device="cuda")
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    print("bmm token-major vs einsum", (m, g, k, r), "equal:", torch.equal(a, out), flush=True)
