import torch, sys
sys.path.insert(0, '.')
from dsv4.ops.triton import moe as M
from dsv4.weights.formats import Mxfp4Weight, Fp8BlockWeight
E, D, I, k, IS = 256, 4096, 2048, 6, 2048
def mx(E, N, K, seed):
    g = torch.Generator("cuda").manual_seed(seed); u8 = dict(generator=g, dtype=torch.uint8, device="cuda")
    return Mxfp4Weight(torch.randint(0, 256, (E, N, K // 2), **u8), torch.randint(117, 123, (E, N, K // 32), **u8))
def f8(N, K, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    w = (torch.randn(N, K, generator=g, device="cuda")).to(torch.float8_e4m3fn)
    return Fp8BlockWeight(w, torch.randint(117, 122, (N // 128, K // 128), generator=g, dtype=torch.uint8, device="cuda"))
w1, w3, w2 = mx(E, I, D, 1), mx(E, I, D, 3), mx(E, D, I, 2)
shared = (f8(IS, D, 4), f8(IS, D, 5), f8(D, IS, 6))
def ms(fn, it=20):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(it): fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in p.key_averages()) / it / 1e3
orig = M._shared_operands
for T in (1, 2, 4, 8, 16, 32):
    x = (torch.randn(T, D, device="cuda") * 2).bfloat16()
    ids = torch.rand(T, E, device="cuda").topk(k, dim=1).indices
    rw = torch.rand(T, k, device="cuda") + 0.1
    a = ms(lambda: M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True))
    b = ms(lambda: M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared))
    M._shared_operands = lambda *a_: None
    c = ms(lambda: M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared))
    M._shared_operands = orig
    print(f"T={T:3d} routed only {a:.3f} ms | shared fused {b:.3f} ms | shared by the linear ops {c:.3f} ms", flush=True)
