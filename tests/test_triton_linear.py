"""The quantized linear kernels (dsv4/ops/triton/linear.py) against their references.

CPU: through Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported) at
small ragged shapes (N, K not multiples of the tiles), every weight format, act_quant on (pow2 and
amax/448 scales) and off, both kernels (split-K decode GEMV, tiled GEMM), fp32/fp16 activations
(the interpreter mis-rounds bf16), outputs and workspaces poisoned with NaN. Two oracles: the
reference op (``dsv4.ops.reference``) and, for fp32 activations, the blockwise formula of
DSV4_FACTS 2b in float64 on ``numerics.fp8_quantize``'s q and scales: a single activation
quantized one e4m3 step off would show as ~1e-3 relative error; fp32 summation order as ~1e-6.

GPU (``-m gpu``): real DeepSeek-V4 shapes (Flash, Pro), bf16, decode batches and a prefill, the
grouped ``wo_a``, bit-determinism, and a CUDA-graph replay equal to eager.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from dsv4 import ops  # noqa: E402
from dsv4.ops import numerics  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import linear as lin  # noqa: E402
from dsv4.ops.triton import runtime  # noqa: E402
from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ("fp8", "fp8_ue8m0", "mxfp4", "nvfp4")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _poison():
    with runtime.poisoned():
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(fmt: str, n: int, k: int, seed: int, device: str = DEV) -> object:
    g = _gen(seed)
    # rows of different magnitude so the block scales differ
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    if fmt == "fp8":
        q = Fp8BlockWeight.quantize(w)
    elif fmt == "fp8_ue8m0":
        q = Fp8BlockWeight.quantize(w, ue8m0=True)
    elif fmt == "mxfp4":
        q = Mxfp4Weight.quantize(w)
    else:
        q = Nvfp4Weight.quantize(w)
    return q.to(device)


def _x(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32, device: str = DEV) -> torch.Tensor:
    g = _gen(seed)
    x = torch.randn(*shape, generator=g)
    x = x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))  # rows of very different scale
    x[..., 5] = 0.0
    return x.to(dtype).to(device)


def _spec(x: torch.Tensor, w: object, act_quant: bool, pow2: bool) -> torch.Tensor:
    """DSV4_FACTS 2b in float64: q and scales from numerics.fp8_quantize (the bits DeepSeek's
    act_quant produces), the dequantized weight, exact products."""
    wd = w.to("cpu").dequantize(torch.float32).double()
    xc = x.to("cpu").float()
    if act_quant:
        q, s = numerics.fp8_quantize(xc, 128, pow2)
        k = xc.shape[-1]
        pad = -k % 128
        qd = torch.nn.functional.pad(q.float(), (0, pad)).double().unflatten(-1, (-1, 128))
        xd = (qd * s.double().unsqueeze(-1)).flatten(-2)[..., :k]
    else:
        xd = xc.double()
    return xd @ wd.T


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(y: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(y).any(), "an output element was not written (NaN poison left)"
    err = _rel(y, want)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


# ----------------------------------------------------------------------------- CPU / interpreter
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("aq", ["off", "pow2", "amax"])
def test_linear_decode_fp32_exact(fmt, aq):
    """Split-K decode kernel, ragged N and K, a forced 3-way split: fp32 activations against the
    float64 spec (tight) and the reference op."""
    n, k = 150, 300 if fmt.startswith("fp8") else 298
    w = _weight(fmt, n, k, seed=1)
    x = _x((3, k), seed=2)
    act_quant, pow2 = aq != "off", aq == "pow2"
    cfg = dict(BN=64, MP=16, KSTEPS=1, SPLIT=3)
    y = lin.linear_triton(x, w, act_quant, pow2, torch.float32, _path="skinny", _config=cfg)
    _check(y, _spec(x, w, act_quant, pow2), 2e-6)
    _check(y, ref.linear(x, w, act_quant, pow2, torch.float32), 2e-6)
    y2 = lin.linear_triton(x, w, act_quant, pow2, torch.float32, _path="skinny", _config=cfg)
    assert torch.equal(y, y2), "split-K result is not deterministic"
    assert int(runtime.counters_if_allocated(torch.device(DEV), "linear").abs().sum()) == 0, "split counters not reset"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("aq", ["off", "pow2", "amax"])
def test_linear_prefill_fp32_exact(fmt, aq):
    """Tiled GEMM (M above the decode limit), ragged M, N, K."""
    n, k = 70, 300 if fmt.startswith("fp8") else 298
    w = _weight(fmt, n, k, seed=3)
    x = _x((2, 19, k), seed=4)
    act_quant, pow2 = aq != "off", aq == "pow2"
    y = lin.linear_triton(x, w, act_quant, pow2, torch.float32, _path="gemm", _config=dict(BM=32, BN=32))
    assert y.shape == (2, 19, n)
    _check(y, _spec(x.flatten(0, 1), w, act_quant, pow2).view(2, 19, n), 2e-6)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_quant", [False, True])
def test_linear_fp16_against_reference(fmt, act_quant):
    """fp16 activations and output, default dispatch by M (decode unsplit, then the GEMM)."""
    n, k = 96, 256
    w = _weight(fmt, n, k, seed=5)
    for m, seed in ((1, 6), (35, 7)):
        x = _x((m, k), seed=seed, dtype=torch.float16) * 0.05
        y = lin.linear_triton(x, w, act_quant, True)
        assert y.dtype == torch.float16
        _check(y, ref.linear(x, w, act_quant, True), 2e-3)


@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "fp8", "mxfp4", "nvfp4"])
def test_grouped_linear(fmt):
    g, r, k = 3, 40, 256
    w = _weight(fmt, g * r, k, seed=8)
    for m, path, cfg in ((2, "skinny", dict(BN=64, MP=16, KSTEPS=1, SPLIT=2)), (5, "gemm", dict(BM=32, BN=32))):
        x = _x((m, g, k), seed=9 + m)
        y = lin.grouped_linear_triton(x, w, g, _path=path, _config=cfg)
        _check(y, ref.grouped_linear(x, w, g), 2e-6)
    x = _x((1, 2, g, k), seed=12, dtype=torch.float16)
    y = lin.grouped_linear_triton(x, w, g)
    assert y.shape == (1, 2, g, r)
    _check(y, ref.grouped_linear(x, w, g), 2e-3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("aq", ["off", "pow2"])
def test_linear_pair(fmt, aq):
    """wq_a || wkv: one decode launch over two weights' row tiles (ragged row counts, a forced 3-way
    K split), and the prefill path (a GEMM each), against the two reference linears it replaces."""
    k = 300 if fmt.startswith("fp8") else 298
    w1, w2 = _weight(fmt, 150, k, seed=40), _weight(fmt, 70, k, seed=41)
    act_quant, pow2 = aq != "off", aq == "pow2"
    for m, cfg in ((3, dict(BN=64, MP=16, KSTEPS=1, SPLIT=3)), (3, None), (40, None)):
        x = _x((1, m, k), seed=42 + m)
        y1, y2 = lin.linear_pair_triton(x, w1, w2, act_quant, pow2, torch.float32, _config=cfg)
        r1, r2 = ref.linear_pair(x, w1, w2, act_quant, pow2, torch.float32)
        assert y1.shape == r1.shape == (1, m, 150) and y2.shape == r2.shape == (1, m, 70)
        _check(y1, _spec(x[0], w1, act_quant, pow2).unsqueeze(0), 2e-6)
        _check(y2, _spec(x[0], w2, act_quant, pow2).unsqueeze(0), 2e-6)
        _check(y1, r1, 2e-6)
        _check(y2, r2, 2e-6)
    assert int(runtime.counters_if_allocated(torch.device(DEV), "linear").abs().sum()) == 0, "split counters not reset"
    x16 = _x((1, 1, k), seed=45, dtype=torch.float16) * 0.05       # the model's call: activation dtype out
    for y, r in zip(lin.linear_pair_triton(x16, w1, w2, act_quant, pow2), ref.linear_pair(x16, w1, w2, act_quant, pow2)):
        assert y.dtype == torch.float16
        _check(y, r, 2e-3)
    # weights of two formats (or FP8 with fp32 and e8m0 scales): a launch each, the same results
    other = _weight({"fp8": "fp8_ue8m0", "fp8_ue8m0": "fp8"}.get(fmt, "fp8"), 70, k, seed=46)
    x32 = _x((1, 2, k), seed=47)
    for y, r in zip(lin.linear_pair_triton(x32, w1, other, act_quant, pow2, torch.float32),
                    ref.linear_pair(x32, w1, other, act_quant, pow2, torch.float32)):
        _check(y, r, 2e-6)


@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "mxfp4"])
def test_linear_pair_prefill_quantizes_its_input_once(monkeypatch, fmt):
    """The pair's prefill GEMMs share one quantized input: one act-quant launch, and each output the
    very bits of that weight's own linear."""
    k = 300 if fmt.startswith("fp8") else 298
    w1, w2 = _weight(fmt, 150, k, seed=48), _weight(fmt, 70, k, seed=49)
    x = _x((40, k), seed=50)
    calls = []
    quant = lin.act_quant_triton
    monkeypatch.setattr(lin, "act_quant_triton", lambda *a, **kw: calls.append(1) or quant(*a, **kw))
    y1, y2 = lin.linear_pair_triton(x, w1, w2, True, True, torch.float32)
    assert len(calls) == 1
    assert torch.equal(y1, lin.linear_triton(x, w1, True, True, torch.float32))
    assert torch.equal(y2, lin.linear_triton(x, w2, True, True, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_pair_plain(dtype):
    """A compressor's plain ``wkv`` || ``wgate`` (the BF16 precision floor; fp32/fp16 in the
    interpreter), fp32 out: one decode launch, never rounding the input even when asked (a plain
    weight's input is not quantized), against the two reference linears; the prefill runs them."""
    k = 300
    w1 = (torch.randn(150, k, generator=_gen(50)) / k ** 0.5).to(DEV, dtype)
    w2 = (torch.randn(70, k, generator=_gen(51)) / k ** 0.5).to(DEV, dtype)
    tol = 2e-6 if dtype == torch.float32 else 1e-3
    for m, cfg in ((3, dict(BN=64, MP=16, KSTEPS=1, SPLIT=3)), (1, None), (40, None)):
        x = _x((1, m, k), seed=52 + m, dtype=dtype)
        got = lin.linear_pair_triton(x, w1, w2, True, True, torch.float32, _config=cfg)
        for y, r in zip(got, ref.linear_pair(x, w1, w2, True, True, torch.float32)):
            assert y.dtype == torch.float32
            _check(y, r, tol)
        for y, w in zip(got, (w1, w2)):     # exact products, fp32 sums: the float64 product
            _check(y, (x.double() @ w.double().T).float(), tol)


@pytest.mark.parametrize("pow2", [True, False])
def test_act_quant_bit_identical(pow2):
    """The GEMM's activation quantizer gives numerics.fp8_quantize's q and scales bit for bit
    (tiny, huge, zero blocks, a ragged last block)."""
    k = 300
    x = _x((4, k), seed=13)
    x[1] *= 1e-6
    x[2] *= 1e4
    x[3, :128] = 0.0
    q, s = lin.act_quant_triton(x, pow2)
    q_ref, s_ref = numerics.fp8_quantize(x.cpu(), 128, pow2)
    assert torch.equal(q[:, :k].cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.cpu(), s_ref)
    assert not q[:, k:].float().any(), "padding past K must be zeros"
    # the FP4 GEMM's layouts: even elements then odd ones per 128 block, as q*s (pow2) or q
    mode = lin._A_SIM if pow2 else lin._A_QS
    v, s2 = lin.act_quant_triton(x, pow2, mode, torch.float32)
    pad = torch.nn.functional.pad(q_ref.float(), (0, 384 - k)).unflatten(-1, (3, 64, 2))
    want = pad.transpose(-1, -2).flatten(-2)  # [4, 3, 128]
    if pow2:
        want = want * s_ref.unsqueeze(-1)
    else:
        assert torch.equal(s2.cpu(), s_ref)
    assert torch.equal(v.cpu().view(4, 3, 128), want)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_ue8m0"])
@pytest.mark.parametrize("path", ["skinny", "gemm"])
def test_nan_e8m0_scale_gives_nan_like_the_reference(fmt, path):
    """An e8m0 scale byte of 255 is NaN (``numerics.e8m0_to_float``), so the rows it scales come
    out NaN as in the reference; the kernel used to decode it as +inf (positive weights times
    positive inputs: +inf). The formats refuse 255 at load; here it is written after construction."""
    n, k = 256, 128
    if fmt == "mxfp4":
        w = Mxfp4Weight(torch.full((n, k // 2), 0x22, dtype=torch.uint8),
                        torch.full((n, k // 32), 127, dtype=torch.uint8))
        w.scale[1, 0] = 255
        nan_rows = torch.arange(n) == 1
    else:
        w = Fp8BlockWeight(torch.full((n, k), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn),
                           torch.full((2, 1), 127, dtype=torch.uint8))
        w.scale[1, 0] = 255
        nan_rows = torch.arange(n) >= 128
    w = w.to(DEV)
    x = (torch.rand(3 if path == "skinny" else 40, k, generator=_gen(9)) + 0.5).to(DEV)
    y = lin.linear_triton(x, w, False, True, torch.float32, _path=path,
                          _config=dict(BN=64, MP=16, KSTEPS=1, SPLIT=1) if path == "skinny" else dict(BM=32, BN=32))
    want = ref.linear(x, w, False, True, torch.float32)
    assert torch.isnan(want[:, nan_rows]).all() and torch.isfinite(want[:, ~nan_rows]).all()
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    torch.testing.assert_close(y[:, ~nan_rows], want[:, ~nan_rows])


def test_dispatch_and_validation():
    """Registered for the three packed formats only; plain tensors stay on the reference; bad
    inputs raise a named error."""
    try:
        for op, fmt, fn in lin.REGISTRATIONS:
            ops.register(op, "cpu", fmt)(fn)
        assert ops.implementation("linear", torch.device("cpu"), Fp8BlockWeight) is lin.linear_triton
        assert ops.implementation("linear", torch.device("cpu"), torch.Tensor) is ref.linear
        w = _weight("mxfp4", 64, 128, seed=14, device="cpu")
        x = _x((2, 128), seed=15, device="cpu")
        _check(ops.linear(x, w, True, True, torch.float32), _spec(x, w, True, True), 2e-6)
    finally:
        for op, fmt, _ in lin.REGISTRATIONS:
            ops.unregister(op, "cpu", fmt)
    w = _weight("fp8", 64, 128, seed=16)
    with pytest.raises(lin.LinearKernelError, match="shape"):
        lin.linear_triton(_x((2, 100), seed=17), w)
    with pytest.raises(lin.LinearKernelError, match="dtype"):
        lin.linear_triton(_x((2, 128), seed=17).double(), w)
    with pytest.raises(lin.LinearKernelError, match="groups"):
        lin.grouped_linear_triton(_x((2, 3, 128), seed=17), w, 3)


@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_dequantize_is_the_weights_own(fmt, dtype):
    """One-pass FP8-block dequantization: ``Fp8BlockWeight.dequantize``'s bits, ragged N and K
    (bf16 on the GPU: the interpreter has no bf16 rounding)."""
    w = _weight(fmt, 150, 300, seed=35)
    got = lin.fp8_dequantize_triton(w, dtype)
    assert torch.equal(got.cpu(), w.dequantize(dtype).cpu())


def test_grouped_linear_from_prompt_sizes_is_the_reference_einsum(monkeypatch):
    """From GROUPED_DENSE_MIN_M rows on (not in the interpreter), FP8 ``wo_a`` in bf16 runs the
    reference's dequantize + einsum: the very bits of ``ref.grouped_linear``, and no kernel launches
    (run here on CPU tensors with the interpreter flag cleared: the path is torch only)."""
    monkeypatch.setattr(lin.runtime, "interpreting", lambda: False)
    monkeypatch.setattr(lin, "GROUPED_DENSE_MIN_M", 8)
    launched = []
    for kern in ("_skinny_kernel", "_gemm_kernel", "_gemm_w8a8_kernel", "_act_quant_kernel"):
        monkeypatch.setattr(lin, kern, _NoLaunch(kern, launched))
    monkeypatch.setattr(lin, "fp8_dequantize_triton", lambda w, dtype: w.dequantize(dtype))   # (no bf16 here)
    w = _weight("fp8_ue8m0", 3 * 64, 256, seed=33, device="cpu")
    x = _x((2, 5, 3, 256), seed=34, device="cpu").bfloat16()
    y = lin.grouped_linear_triton(x, w, 3)
    assert y.shape == (2, 5, 3, 64) and y.dtype == torch.bfloat16 and not launched
    assert torch.equal(y, ref.grouped_linear(x, w, 3))


def test_unsupported_inputs_run_the_reference(monkeypatch, capsys):
    """Every refusal is a KernelUnsupported raised before any launch: through the dispatch the call
    runs the reference instead (one stderr line), and DSV4_STRICT_KERNELS=1 makes it an error."""
    assert issubclass(lin.LinearKernelError, ops.KernelUnsupported)
    monkeypatch.delenv("DSV4_STRICT_KERNELS", raising=False)
    launched = []
    for kern in ("_skinny_kernel", "_gemm_kernel", "_gemm_w8a8_kernel", "_act_quant_kernel"):
        monkeypatch.setattr(lin, kern, _NoLaunch(kern, launched))
    w64 = Fp8BlockWeight.quantize(torch.randn(64, 256, generator=_gen(30)), block=64)
    w = _weight("mxfp4", 3 * 32, 256, seed=31, device="cpu")
    x = _x((2, 256), seed=32, device="cpu")
    cases = [("linear", (x, w64, True, True, torch.float32)),           # FP8 block 64
             ("linear", (x.double(), w, False, True, None)),            # fp64 activations
             ("linear", (x, w, False, True, torch.int32)),              # integer output
             ("grouped_linear", (x.view(2, 2, 128), w, 2))]             # K is not the weight's
    try:
        for op, fmt, fn in lin.REGISTRATIONS:
            ops.register(op, "cpu", fmt)(fn)
        for op, args in cases:
            with pytest.raises(lin.LinearKernelError):
                getattr(lin, f"{op}_triton")(*args)
            assert not launched, f"{op}: launched {launched} before refusing"
            try:
                want = getattr(ref, op)(*args)
            except (ValueError, RuntimeError) as e:  # the reference refuses too: the same error
                with pytest.raises(type(e)):
                    getattr(ops, op)(*args)
            else:
                assert torch.equal(getattr(ops, op)(*args), want)
            monkeypatch.setenv("DSV4_STRICT_KERNELS", "1")
            with pytest.raises(lin.LinearKernelError):
                getattr(ops, op)(*args)
            monkeypatch.delenv("DSV4_STRICT_KERNELS")
        assert "the reference runs it instead" in capsys.readouterr().err
    finally:
        for op, fmt, _ in lin.REGISTRATIONS:
            ops.unregister(op, "cpu", fmt)


class _NoLaunch:
    """Stands in for a kernel: records any launch."""

    def __init__(self, name: str, launched: list):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(self.name)
        return launch


# ----------------------------------------------------------------------------- GPU, real shapes
FLASH = dict(hidden=4096, heads=64, hd=512, q_lora=1024, groups=8, o_lora=1024, inter=2048)
PRO = dict(hidden=7168, heads=128, hd=512, q_lora=1536, groups=16, o_lora=1024, inter=3072)


def _shapes(g: dict) -> dict[str, tuple[int, int]]:
    return dict(wq_a=(g["q_lora"], g["hidden"]), wq_b=(g["heads"] * g["hd"], g["q_lora"]), wkv=(g["hd"], g["hidden"]),
                wo_b=(g["hidden"], g["groups"] * g["o_lora"]), w1=(g["inter"], g["hidden"]),
                w2=(g["hidden"], g["inter"]))


def _gpu_weight(fmt: str, n: int, k: int, seed: int) -> object:
    torch.manual_seed(seed)
    w = torch.randn(n, k, device="cuda") * 0.02
    return {"fp8": lambda: Fp8BlockWeight.quantize(w), "fp8_ue8m0": lambda: Fp8BlockWeight.quantize(w, ue8m0=True),
            "mxfp4": lambda: Mxfp4Weight.quantize(w), "nvfp4": lambda: Nvfp4Weight.quantize(w)}[fmt]()


def _gpu_tol(fmt: str, act_quant: bool) -> float:
    """fp32-output tolerance against the reference on the GPU. W8A8: Hopper's FP8 MMA sums the
    products of a 128 block at reduced precision (~1.3e-4 relative, what DeepGEMM and DeepSeek's
    kernels do too). NVFP4 with act_quant: the reference rounds w*bs*g to bf16, the kernel keeps
    w*bs exact and applies g to the fp32 sum (~2e-3). Otherwise exact products, fp32 sums."""
    if act_quant and fmt.startswith("fp8"):
        return 3e-4
    return 3e-3 if (act_quant and fmt == "nvfp4") else 2e-5


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("name", ["wq_a", "wq_b", "wkv", "wo_b", "w1", "w2"])
@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "mxfp4", "nvfp4"])
def test_gpu_linear_real_shapes(geo, name, fmt):
    n, k = _shapes(FLASH if geo == "flash" else PRO)[name]
    w = _gpu_weight(fmt, n, k, seed=20)
    for m in (1, 8, 32, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for act_quant in (True, False):
            y = lin.linear_triton(x, w, act_quant, True, torch.float32)
            want = ref.linear(x, w, act_quant, True, torch.float32)
            _check(y, want, _gpu_tol(fmt, act_quant))
            yb = lin.linear_triton(x, w, act_quant, True)
            assert yb.dtype == torch.bfloat16
            _check(yb, want, 8e-3)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("aq", ["pow2", "amax"])
@pytest.mark.parametrize("m", [1, 16, 4096])
def test_gpu_linear_fp8_fp32_scales(aq, m):
    """FP8 with fp32 block scales (the -Base checkpoints), both scale rules, against the float64
    spec (the reference rounds the dequantized weight to bf16, the kernel does not)."""
    w = _gpu_weight("fp8", 4096, 4096, seed=21)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    y = lin.linear_triton(x, w, True, aq == "pow2", torch.float32)
    _check(y, _spec(x, w, True, aq == "pow2"), _gpu_tol("fp8", True))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("m", [1, 8, 32, 512])
def test_gpu_grouped_wo_a(geo, m):
    g = FLASH if geo == "flash" else PRO
    k = g["heads"] * g["hd"] // g["groups"]
    w = _gpu_weight("fp8_ue8m0", g["groups"] * g["o_lora"], k, seed=22)
    x = torch.randn(m, g["groups"], k, device="cuda", dtype=torch.bfloat16)
    y = lin.grouped_linear_triton(x, w, g["groups"])
    _check(y, ref.grouped_linear(x, w, g["groups"]), 8e-3)
    if m >= lin.GROUPED_DENSE_MIN_M:        # the reference's dequantize + einsum: its very bits
        assert torch.equal(lin.fp8_dequantize_triton(w, torch.bfloat16), w.dequantize(torch.bfloat16))
        assert torch.equal(y, ref.grouped_linear(x, w, g["groups"]))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "fp8", "mxfp4", "nvfp4"])
def test_gpu_linear_pair_wq_a_wkv(geo, fmt):
    """wq_a || wkv in one decode launch at real shapes, against the two reference linears, bf16 and
    fp32 out; equal bit for bit under a CUDA graph replayed with new inputs."""
    shapes = _shapes(FLASH if geo == "flash" else PRO)
    w1, w2 = _gpu_weight(fmt, *shapes["wq_a"], seed=27), _gpu_weight(fmt, *shapes["wkv"], seed=28)
    k = shapes["wq_a"][1]
    for m in (1, 8, 32, 300):
        x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
        for act_quant in (True, False):
            want = ref.linear_pair(x, w1, w2, act_quant, True, torch.float32)
            # fp32 block scales with act-quant: the reference rounds the dequantized weight to bf16,
            # the kernel does not (as in test_gpu_linear_fp8_fp32_scales): the float64 spec is the oracle
            exact = [_spec(x[0], w, True, True).float().to("cuda").unsqueeze(0) for w in (w1, w2)] \
                if fmt == "fp8" and act_quant else want
            for y, r in zip(lin.linear_pair_triton(x, w1, w2, act_quant, True, torch.float32), exact):
                _check(y, r, _gpu_tol(fmt, act_quant))
            for y, r in zip(lin.linear_pair_triton(x, w1, w2, act_quant, True), want):
                assert y.dtype == torch.bfloat16
                _check(y, r, 8e-3)
    x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
    lin.linear_pair_triton(x, w1, w2, True, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = lin.linear_pair_triton(x, w1, w2, True, True)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        for a, b in zip(static, lin.linear_pair_triton(x, w1, w2, True, True)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("width", [1024, 256], ids=["csa-compressor", "indexer-compressor"])
def test_gpu_linear_pair_plain_compressor(width):
    """A compressor's BF16 wkv || wgate (Flash: 2 x 1024 rows for CSA, 2 x 256 for the indexer's,
    K = 4096), fp32 out, decode batches: one launch against the reference's two cuBLAS products;
    bit-equal under a CUDA graph replayed with new inputs."""
    torch.manual_seed(29)
    w1 = (torch.randn(width, 4096, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(width, 4096, device="cuda") * 0.02).bfloat16()
    for m in (1, 8, 32, 300):
        x = torch.randn(1, m, 4096, device="cuda", dtype=torch.bfloat16)
        for y, r in zip(lin.linear_pair_triton(x, w1, w2, False, True, torch.float32),
                        ref.linear_pair(x, w1, w2, False, True, torch.float32)):
            _check(y, r, 2e-5)
    x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    lin.linear_pair_triton(x, w1, w2, False, True, torch.float32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = lin.linear_pair_triton(x, w1, w2, False, True, torch.float32)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        for a, b in zip(static, lin.linear_pair_triton(x, w1, w2, False, True, torch.float32)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
def test_gpu_cuda_graph_and_determinism():
    """Replaying a captured graph (split-K decode, quantized prologue, grouped, GEMM) equals eager
    bit for bit, and eager is bit-deterministic."""
    wq_a = _gpu_weight("fp8_ue8m0", 1024, 4096, seed=23)
    wq_b = _gpu_weight("mxfp4", 32768, 1024, seed=24)
    wo_a = _gpu_weight("fp8_ue8m0", 8192, 4096, seed=25)
    nv = _gpu_weight("nvfp4", 4096, 2048, seed=26)
    xs = [torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for m in (1, 8, 32, 100)]
    xg = torch.randn(8, 8, 4096, device="cuda", dtype=torch.bfloat16)
    x2 = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        outs = [lin.linear_triton(x, wq_a, True, True) for x in xs]
        outs.append(lin.linear_triton(outs[1], wq_b, True, True, torch.float32))
        outs.append(lin.grouped_linear_triton(xg, wo_a, 8))
        outs.append(lin.linear_triton(x2, nv, True, True))
        outs.append(lin.linear_triton(x2, nv, False))
        return outs

    eager = step()
    again = step()
    for a, b in zip(eager, again):
        assert torch.equal(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
