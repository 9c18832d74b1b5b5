"""ncu driver (call 2): one Flash MoE layer call at T tokens (E 256, MXFP4, act-quant, no shared expert) through
the W4A8 16-pair tiles, then through the bf16-dequantized ones."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.kernel_cases.moe import _experts  # noqa: E402
from dsv4.ops.triton import moe  # noqa: E402

T = int(sys.argv[1]) if len(sys.argv) > 1 else 32
E, D, I, K = 256, 4096, 2048, 6
g = torch.Generator().manual_seed(0)
dev = torch.device("cuda")
w1, w3, w2 = _experts("mxfp4", E, I, D, g, dev), _experts("mxfp4", E, I, D, g, dev), _experts("mxfp4", E, D, I, g, dev)
x = torch.randn(T, D, generator=g).to(dev, torch.bfloat16)
ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K].to(dev)
rw = torch.rand(T, K, generator=g).to(dev)
moe.DECODE_MAX_PAIRS = -1
a = moe.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)
moe.moe_w4a8.supported = lambda D, I: False
b = moe.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)
torch.cuda.synchronize()
print("max diff", (a.float() - b.float()).abs().max().item(), "of", b.float().abs().max().item())
