"""ncu driver (call 7): batch-1 decode kernels of a Flash layer: the MoE GEMV (MXFP4 experts, FP8 shared
expert in the same launches, act-quant) and the FP8 GEMV of wo_b (4096 x 8192, act-quant)."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.kernel_cases.moe import _experts, fp8_weight  # noqa: E402
from dsv4.ops.triton.linear import linear_triton  # noqa: E402
from dsv4.ops.triton.moe import moe_triton  # noqa: E402

E, D, I, K = 256, 4096, 2048, 6
g = torch.Generator().manual_seed(0)
dev = torch.device("cuda")
w1, w3, w2 = _experts("mxfp4", E, I, D, g, dev), _experts("mxfp4", E, I, D, g, dev), _experts("mxfp4", E, D, I, g, dev)
shared = (fp8_weight(I, D, g, dev), fp8_weight(I, D, g, dev), fp8_weight(D, I, g, dev))
x = torch.randn(1, D, generator=g).to(dev, torch.bfloat16)
ids = torch.rand(1, E, generator=g).argsort(-1)[:, :K].to(dev)
rw = torch.rand(1, K, generator=g).to(dev)
moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared)
wo_b = fp8_weight(4096, 8192, g, dev)
linear_triton(torch.randn(1, 8192, generator=g).to(dev, torch.bfloat16), wo_b, True, True)
torch.cuda.synchronize()
print("ok")
