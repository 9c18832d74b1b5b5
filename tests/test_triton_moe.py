"""The Triton MoE kernel (``dsv4.ops.triton.moe``) against ``dsv4.ops.reference.moe``.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
before Triton is imported), at small ragged shapes, fp16/fp32 activations (bf16 operands are
garbage in the interpreter). With CUDA the same tests run compiled on the GPU, and the ``gpu``
tests add DeepSeek-V4 Flash / Pro shapes in bf16 and a CUDA-graph replay.

Every buffer the wrapper allocates is poisoned (NaN, garbage counters) so an element the kernels
fail to write shows up.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from dsv4.ops import reference as ref  # noqa: E402
from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _module():
    """The kernel module, compiled (not interpreted) when CUDA is there even if another test
    module set TRITON_INTERPRET first."""
    from dsv4.ops.triton import moe as M
    if CUDA and "Interpreted" in type(M._w13_decode_kernel).__name__:
        os.environ.pop("TRITON_INTERPRET", None)
        M = importlib.reload(M)
    return M


M = _module()

#: small tile configs for the interpreter: few programs, still several N tiles and K steps
SMALL = {"gemv": dict(w13=(32, 128, 4, 1, 1), w2=(64, 128, 4, 1, 1)),
         "dot": dict(w13=(32, 128, 4, 1, 1), w2=(64, 128, 4, 1, 1)),
         "grouped": dict(w13=(32, 128, 4, 1, 1), w2=(64, 128, 4, 1, 1))}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every wrapper allocation starts as NaN (floats) or garbage (ints); small configs on CPU."""
    def empty(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point and dtype.itemsize > 1:
            t.fill_(float("nan"))
        elif dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)                  # e4m3 NaN
        else:
            t.fill_(12345)
        return t
    monkeypatch.setattr(M, "_empty", empty)
    if not CUDA:
        monkeypatch.setattr(M, "CONFIGS", SMALL)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(fmt: str, E: int, N: int, K: int, seed: int, dev: str = DEV):
    """A random stacked weight ``[E, N, K]`` of format ``fmt`` (random codes and plausible
    scales, built directly: quantizing is slow in CPU CI)."""
    g = _gen(seed)
    if fmt == "mxfp4":
        packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(117, 123, (E, N, (K + 31) // 32), generator=g, dtype=torch.uint8)
        return Mxfp4Weight(packed.to(dev), scale.to(dev))
    if fmt == "nvfp4":
        packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
        bs = (torch.rand(E, N, (K + 15) // 16, generator=g) * 1.5 + 0.05).to(torch.float8_e4m3fn)
        gs = torch.rand(E, generator=g) * 0.02 + 0.005
        return Nvfp4Weight(packed.to(dev), bs.to(dev), gs.to(dev))
    w = (torch.randn(E, N, K, generator=g) * 2).to(torch.float8_e4m3fn)
    nb = ((N + 127) // 128, (K + 127) // 128)
    if fmt == "fp8":                                           # fp32 block scales
        return Fp8BlockWeight(w.to(dev), (torch.rand(E, *nb, generator=g) * 0.01 + 0.002).to(dev))
    return Fp8BlockWeight(w.to(dev), torch.randint(117, 122, (E, *nb), generator=g,
                                                   dtype=torch.uint8).to(dev))   # e8m0 ("fp8e")


def _routing(T: int, k: int, E: int, seed: int, dev: str = DEV):
    """Random top-k ids with duplicates across tokens, a ``-1`` slot, a token with no expert,
    and a token holding one expert twice (when T allows)."""
    g = _gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T >= 3:
        ids[1, 0] = -1
        ids[2, :] = -1
    if T >= 4 and k >= 2:
        ids[3, 1] = ids[3, 0]
    w = torch.rand(T, k, generator=g) + 0.1
    return ids.to(dev), w.to(dev)


def _check(got: torch.Tensor, exp: torch.Tensor, tol: float) -> None:
    assert got.shape == exp.shape and got.dtype == exp.dtype
    got, exp = got.float().cpu(), exp.float().cpu()
    assert torch.isfinite(got).all(), "kernel left unwritten (NaN) or non-finite outputs"
    rel = (got - exp).norm() / exp.norm().clamp_min(1e-30)
    assert rel <= tol, f"relative error {rel:.3e} > {tol}"
    rows = (got - exp).norm(dim=1) / exp.norm(dim=1).clamp_min(1e-3 * exp.norm() / exp.shape[0] ** 0.5)
    assert rows.max() <= 10 * tol, f"row {int(rows.argmax())} relative error {rows.max():.3e}"


def _run(fmt, T, k, E, D, I, act, pow2=True, dtype=torch.float16, limit=1.5, seed=0):
    w1, w3 = (_weights(fmt, E, I, D, seed + s) for s in (1, 3))
    w2 = _weights(fmt, E, D, I, seed + 2)
    x = (torch.randn(T, D, generator=_gen(seed + 4)) * 2).to(dtype).to(DEV)
    ids, rw = _routing(T, k, E, seed + 5)
    got = M.moe_triton(x, ids, rw, w1, w3, w2, limit, act, pow2)
    exp = ref.moe(x, ids, rw, w1, w3, w2, limit, act, pow2)
    # exact formats match to fp32 summation order; rounding h to e4m3 turns tiny differences
    # (NVFP4 / fp32-scaled FP8 weights rounded to x.dtype in the reference) into rare e4m3 flips
    exact = fmt in ("mxfp4", "fp8e")
    _check(got, exp, (2e-3 if exact else 3e-3) if not act else (2e-3 if exact else 2e-2))
    return got, exp


# ----------------------------------------------------------------------------- CPU (interpreter) / GPU
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8e"])
@pytest.mark.parametrize("act", [True, False])
def test_one_token_gemv(fmt, act):
    """T = 1: the CUDA-core GEMV path (one program per expert and N tile), a repeated expert."""
    _run(fmt, 1, 3, 5, 256, 128, act)


@pytest.mark.parametrize("fmt,act", [("mxfp4", True), ("nvfp4", True), ("fp8e", True), ("fp8", True),
                                     ("mxfp4", False)])
def test_few_tokens_dot(fmt, act):
    """T = 4 (``-1`` slots, an empty token, one token with an expert twice, experts shared across
    tokens): chunks of up to 16 pairs per expert, ``tl.dot``; act-quant on the FP8 grid."""
    _run(fmt, 4, 2, 4, 256, 128, act)


def test_37_tokens_chunk_an_expert_twice():
    """T = 37 over 4 experts: ~18 pairs per expert, so each expert is split into two chunks."""
    _run("mxfp4", 37, 2, 4, 128, 128, True)


@pytest.mark.parametrize("fmt,act", [("fp8e", True), ("nvfp4", False)])
def test_grouped_prefill_path(monkeypatch, fmt, act):
    """Above DECODE_MAX_PAIRS: pairs sorted by expert on the device, grouped GEMM tiles, combine."""
    monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 8)
    _run(fmt, 37, 2, 4, 128, 128, act)


def test_ragged_tiny_model_shapes():
    """hidden 64, inter 32 (the tiny checkpoint's experts): partial K blocks and N tiles."""
    _run("mxfp4", 3, 2, 8, 64, 32, True)
    _run("nvfp4", 1, 2, 8, 64, 32, True)


def test_fp32_scale_rounding_and_no_limit():
    """act_quant with non-power-of-two scales (pow2=False), fp32 activations, no clamp."""
    _run("fp8", 3, 2, 4, 128, 128, True, pow2=False, dtype=torch.float32, limit=0.0)


def test_separate_combine_kernel(monkeypatch):
    monkeypatch.setattr(M, "FUSED_COMBINE", False)
    _run("mxfp4", 4, 2, 4, 128, 128, True)


def test_dispatch_registers_the_kernel():
    """``register_all`` makes ``dsv4.ops.moe`` pick the kernel for the three packed formats only."""
    import dsv4.ops as ops
    from dsv4.ops.triton import register_all
    register_all(DEV.split(":")[0])
    try:
        for cls in (Mxfp4Weight, Nvfp4Weight, Fp8BlockWeight):
            assert ops.implementation("moe", torch.device(DEV), cls) is M.moe_triton
        assert ops.implementation("moe", torch.device(DEV), torch.Tensor) is ref.moe
    finally:
        for cls in (Mxfp4Weight, Nvfp4Weight, Fp8BlockWeight):
            ops.unregister("moe", DEV.split(":")[0], cls)


def test_bad_inputs_raise_named_errors():
    w1, w3 = (_weights("mxfp4", 2, 32, 64, s) for s in (1, 2))
    w2 = _weights("mxfp4", 2, 64, 32, 3)
    x = torch.randn(2, 64, device=DEV).half()
    ids = torch.tensor([[0, 1], [1, -1]], device=DEV)
    rw = torch.rand(2, 2, device=DEV)
    with pytest.raises(M.MoeKernelError, match="topk_weights"):
        M.moe_triton(x, ids, rw.double(), w1, w3, w2, 1.0)
    with pytest.raises(M.MoeKernelError, match="x must be"):
        M.moe_triton(x.t().contiguous().t(), ids, rw, w1, w3, w2, 1.0)
    with pytest.raises(M.MoeKernelError, match="expert shapes"):
        M.moe_triton(x, ids, rw, w1, w3, w1, 1.0)
    with pytest.raises(M.MoeKernelError, match="share one format"):
        M.moe_triton(x, ids, rw, w1, _weights("nvfp4", 2, 32, 64, 4), w2, 1.0)
    with pytest.raises(M.MoeKernelError, match="no Triton kernel"):
        M.moe_triton(x, ids, rw, torch.randn(2, 32, 64), w3, w2, 1.0)


# ----------------------------------------------------------------------------- GPU, real shapes
FLASH = dict(E=256, D=4096, I=2048, k=6)
PRO = dict(E=384, D=7168, I=3072, k=6)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8e"])
@pytest.mark.parametrize("T", [1, 8, 32, 300])
def test_gpu_real_shapes_bf16(geo, fmt, T):
    g = FLASH if geo == "flash" else PRO
    E = g["E"] if T == 1 else 64               # all experts once (offsets past 2^31), else a subset
    if fmt == "fp8e" and geo == "pro" and T != 1:
        pytest.skip("covered by flash")
    w1, w3 = (_weights(fmt, E, g["I"], g["D"], s) for s in (1, 3))
    w2 = _weights(fmt, E, g["D"], g["I"], 2)
    x = (torch.randn(T, g["D"], device="cuda") * 2).bfloat16()
    ids, rw = _routing(T, g["k"], E, 7)
    if T == 1:
        ids[0, 1] = E - 1                      # the last expert: 64-bit offsets
    for act in (True, False):
        got = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, act)
        exp = ref.moe(x, ids, rw, w1, w3, w2, 10.0, act)
        _check(got, exp, 2e-2 if act else 1e-2)
        again = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, act)
        assert torch.equal(got, again), "not deterministic"


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8e"])
@pytest.mark.parametrize("T", [1, 8])
def test_gpu_cuda_graph_replay_equals_eager(fmt, T):
    g = FLASH
    E = 32
    w1, w3 = (_weights(fmt, E, g["I"], g["D"], s) for s in (1, 3))
    w2 = _weights(fmt, E, g["D"], g["I"], 2)
    x = (torch.randn(T, g["D"], device="cuda") * 2).bfloat16()
    ids, rw = _routing(T, g["k"], E, 9)
    eager = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                       # warm up (compile) off the capture
        M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new routing and activations in the same buffers: the graph reads them on the device
    ids2, rw2 = _routing(T, g["k"], E, 10)
    ids.copy_(ids2)
    rw.copy_(rw2)
    x.copy_((torch.randn(T, g["D"], device="cuda") * 2).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True))
