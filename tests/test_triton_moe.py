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
    """The kernel modules, compiled (not interpreted) when CUDA is there even if another test
    module set TRITON_INTERPRET first (the device functions are decorated at import: reload them
    all, the parts before the modules that import them)."""
    from dsv4.ops.triton import moe as M
    from dsv4.ops.triton import moe_decode, moe_experts, moe_grouped, numerics
    if CUDA and "Interpreted" in type(moe_decode._w13_decode_kernel).__name__:
        os.environ.pop("TRITON_INTERPRET", None)
        for part in (numerics, moe_experts, moe_decode, moe_grouped):
            importlib.reload(part)
        M = importlib.reload(M)
    return M


M = _module()
from dsv4.ops.triton import moe_decode, moe_experts, moe_grouped, runtime  # noqa: E402

#: small tile configs for the interpreter: few programs, still several N tiles and K steps
SMALL = {"gemv": dict(w13=(32, 128, 4, 1, 1), w2=(64, 128, 4, 1, 1)),
         "grouped": dict(w13=(32, 128, 4, 1, 1), w2=(64, 128, 4, 1, 1)),
         "grouped_mxfp4": dict(w13=(32, 128, 4, 1, 2), w2=(64, 64, 4, 1, 2), wt=True),
         "grouped_mxfp4_few": dict(w13=(32, 128, 4, 1, 3), w2=(64, 128, 4, 1, 3)),
         "grouped_mxfp4_mid": dict(w13=(32, 128, 4, 1, 2), w2=(64, 128, 4, 1, 3), wt=True),
         "grouped_mxfp4_wide": dict(w13=(16, 128, 4, 1, 2), w2=(32, 64, 4, 1, 2), wt=True)}
#: the MXFP4 grouped paths: untransposed, transposed (64- and 128-pair tiles), transposed with fewer
#: weight rows a tile
MX_PATHS = ("grouped_mxfp4_few", "grouped_mxfp4_mid", "grouped_mxfp4", "grouped_mxfp4_wide")


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every wrapper allocation starts as NaN (floats, e4m3) or -1 (ints, the combine counters);
    small configs on CPU."""
    if not CUDA:
        monkeypatch.setattr(M, "CONFIGS", SMALL)
    with runtime.poisoned():
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(fmt: str, E: int, N: int, K: int, seed: int, dev: str = DEV):
    """A random stacked weight ``[E, N, K]`` of format ``fmt`` (random codes and plausible
    scales, built directly on ``dev``: quantizing is slow in CPU CI, and drawing gigabytes of
    real-shape codes on the host is slow on the GPU machine)."""
    g = torch.Generator(dev).manual_seed(seed)
    u8 = dict(generator=g, dtype=torch.uint8, device=dev)
    if fmt == "mxfp4":
        return Mxfp4Weight(torch.randint(0, 256, (E, N, K // 2), **u8), torch.randint(117, 123, (E, N, (K + 31) // 32), **u8))
    if fmt == "nvfp4":
        packed = torch.randint(0, 256, (E, N, K // 2), **u8)
        bs = (torch.rand(E, N, (K + 15) // 16, generator=g, device=dev) * 1.5 + 0.05).to(torch.float8_e4m3fn)
        gs = torch.rand(E, generator=g, device=dev) * 0.02 + 0.005
        return Nvfp4Weight(packed, bs, gs)
    # e4m3 codes of |v| < 8 (exponent field <= 9), either sign: drawn as bytes, no fp32 detour
    w = torch.randint(0, 80, (E, N, K), **u8) | (torch.randint(0, 2, (E, N, K), **u8) << 7)
    w = w.view(torch.float8_e4m3fn)
    nb = ((N + 127) // 128, (K + 127) // 128)
    if fmt == "fp8":                                           # fp32 block scales
        return Fp8BlockWeight(w, torch.rand(E, *nb, generator=g, device=dev) * 0.01 + 0.002)
    return Fp8BlockWeight(w, torch.randint(117, 122, (E, *nb), **u8))   # e8m0 ("fp8e")


def _routing(T: int, k: int, E: int, seed: int, dev: str = DEV):
    """Random top-k ids with duplicates across tokens, a ``-1`` slot, a token with no expert,
    and a token holding one expert twice (when T allows; at T <= 2 the last slot of token 0 is
    ``-1`` when k >= 3)."""
    g = _gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T <= 2 and k >= 3:
        ids[0, -1] = -1
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
    zero = (exp == 0).all(dim=1)                   # tokens with no expert (here): exact zeros
    assert (got[zero] == 0).all(), "a token with no expert got a nonzero output"
    if zero.all():
        return
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
FORMATS = ["mxfp4", "nvfp4", "fp8e", "fp8"]          # fp8e: e8m0 block scales, fp8: fp32 ones


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("path", ["gemv", "gemv4", "grouped"])
def test_every_format_path_and_act_quant(monkeypatch, fmt, act, path):
    """Every format x decode GEMV (one program per pair and N tile; T = 1 with a ``-1`` slot; T = 4
    with ``-1`` slots, an empty token, one token with an expert twice, experts shared across
    tokens) / prefill grouped GEMM
    (above DECODE_MAX_PAIRS: pairs sorted by expert on the device, tiles, combine) x act-quant
    on / off."""
    if path == "gemv":
        _run(fmt, 1, 3, 5, 256, 128, act)
    elif path == "gemv4":
        _run(fmt, 4, 2, 4, 256, 128, act)
    else:
        monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 8)
        _run(fmt, 37, 2, 4, 128, 128, act)


@pytest.mark.parametrize("T, grouped", [(16, False), (17, True)])
def test_mxfp4_decode_batches_above_16_tokens_take_the_grouped_tiles(monkeypatch, T, grouped):
    """MXFP4 experts with act-quant (the engine's QAT path), top-6, with the shared expert: up to 16
    tokens the decode kernels run, from 17 on the grouped 16-pair tiles (``moe.MXFP4_DECODE_MAX_PAIRS``);
    either way the reference's result."""
    ran = []
    for mod in (moe_decode, moe_grouped):
        monkeypatch.setattr(mod, "run", lambda L, _mod=mod, _run=mod.run: (ran.append(_mod), _run(L))[1])
    E, k, D, I = 8, 6, 128, 64
    w1, w3 = (_weights("mxfp4", E, I, D, s) for s in (1, 3))
    w2 = _weights("mxfp4", E, D, I, 2)
    x = (torch.randn(T, D, generator=_gen(4)) * 2).to(DEV)             # fp32 (bf16, as the engine runs, on the GPU)
    ids, rw = _routing(T, k, E, 5)
    shared = _shared("fp8e", I, D, 11)
    got = M.moe_triton(x, ids, rw, w1, w3, w2, 1.5, True, True, shared)
    assert ran == [moe_grouped if grouped else moe_decode]
    _check(got, ref.moe(x, ids, rw, w1, w3, w2, 1.5, True, True, shared), 2e-3)


def _shared(fmt: str, I: int, D: int, seed: int, dev: str = DEV) -> tuple:
    """A shared expert ``(w1, w3, w2)`` of 2-D weights in format ``fmt``."""
    return (_weights(fmt, 1, I, D, seed, dev).expert(0), _weights(fmt, 1, I, D, seed + 1, dev).expert(0),
            _weights(fmt, 1, D, I, seed + 2, dev).expert(0))


@pytest.mark.parametrize("fmt, sfmt, T, act", [("mxfp4", "fp8e", 1, True), ("mxfp4", "fp8e", 3, True),
                                               ("nvfp4", "fp8", 3, False), ("fp8e", "mxfp4", 1, False)])
def test_shared_expert_runs_in_the_decode_kernels(monkeypatch, fmt, sfmt, T, act):
    """The shared expert (its own format; full width, and half width as under expert parallel) is one
    more expert of the two decode launches: the same as the reference's routed sum plus shared
    output, with a ``-1`` slot and (T = 3) a token holding no routed expert, which gets the shared
    output alone. Nothing runs the shared expert outside the kernels. With act-quant, x is rounded
    by one launch, and h by one launch for the routed and shared rows together at full width (two
    at half width: the rows are not one buffer)."""
    monkeypatch.setattr(M, "_shared_expert", None)           # any call outside the kernels fails
    monkeypatch.setattr(M, "SHARED_FUSED_MAX_TOKENS", T)     # T = 3: the kernels' multi-token case
    rounded = []
    quant = moe_experts._quant_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(v, *args, **kw):
                rounded.append(tuple(v.shape))
                return quant[grid](v, *args, **kw)
            return launch
    monkeypatch.setattr(moe_experts, "_quant_kernel", Counted())
    E, k, D, I = 5, 3, 256, 128
    w1, w3 = (_weights(fmt, E, I, D, s) for s in (1, 3))
    w2 = _weights(fmt, E, D, I, 2)
    x = (torch.randn(T, D, generator=_gen(4)) * 2).half().to(DEV)
    ids, rw = _routing(T, k, E, 5)
    exact = fmt in ("mxfp4", "fp8e") and sfmt in ("mxfp4", "fp8e")
    for width in ((I, I // 2) if T == 1 else (I,)):
        shared = _shared(sfmt, width, D, 11)
        got = M.moe_triton(x, ids, rw, w1, w3, w2, 1.5, act, True, shared)
        exp = ref.moe(x, ids, rw, w1, w3, w2, 1.5, act, True, shared)
        _check(got, exp, 2e-3 if exact else (3e-3 if not act else 2e-2))
        if exact:
            assert (got == exp).float().mean() > 0.99
        full = [(T, D), (T * k + T, I)]
        assert rounded == ((full if width == I else [(T, D), (T * k, I), (T, width)]) if act else []), rounded
        rounded.clear()


@pytest.mark.parametrize("prefill", [True, False])
def test_shared_expert_outside_the_decode_kernels(monkeypatch, prefill):
    """Prefill (the grouped path), and decode above SHARED_FUSED_MAX_TOKENS: the shared expert runs
    through the ops and is added like the reference adds it."""
    if prefill:
        monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 4)
    T = 5
    assert T > M.SHARED_FUSED_MAX_TOKENS
    w1, w3 = (_weights("mxfp4", 4, 64, 128, s) for s in (1, 3))
    w2 = _weights("mxfp4", 4, 128, 64, 2)
    x = torch.randn(T, 128, generator=_gen(4)).half().to(DEV)
    ids, rw = _routing(T, 2, 4, 5)
    shared = _shared("fp8e", 64, 128, 11)
    _check(M.moe_triton(x, ids, rw, w1, w3, w2, 1.5, True, True, shared),
           ref.moe(x, ids, rw, w1, w3, w2, 1.5, True, True, shared), 2e-3)


def test_37_tokens_chunk_an_expert_twice():
    """T = 37 over 4 experts: ~18 pairs per expert, so each expert is split into two chunks."""
    _run("mxfp4", 37, 2, 4, 128, 128, True)


@pytest.mark.parametrize("T,prefill", [(1, False), (3, False), (5, True)])
@pytest.mark.parametrize("act", [True, False])
def test_no_token_holds_an_expert(monkeypatch, T, prefill, act):
    """Every id ``-1`` (an expert-parallel rank holding none of the picks): exact zeros out of every
    path, nothing left unwritten."""
    if prefill:
        monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 4)
    w1, w3 = (_weights("mxfp4", 4, 64, 128, s) for s in (1, 3))
    w2 = _weights("mxfp4", 4, 128, 64, 2)
    x = torch.randn(T, 128, generator=_gen(4)).half().to(DEV)
    ids = torch.full((T, 2), -1, dtype=torch.int64, device=DEV)
    rw = torch.rand(T, 2, generator=_gen(5)).to(DEV)
    got = M.moe_triton(x, ids, rw, w1, w3, w2, 1.5, act)
    assert torch.equal(got.cpu(), torch.zeros(T, 128, dtype=torch.float16))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("T", [1, 4, 12])
def test_expert_parallel_ranks_sum_to_the_whole(monkeypatch, fmt, T):
    """Expert parallel: rank ``r`` of ``N`` holds experts ``[r E/N, (r+1) E/N)`` under local ids
    ``0 .. E/N - 1`` and gets the other ranks' picks as ``-1``. Each rank's kernel output equals
    the reference on that rank's inputs, and (fp32 activations, so nothing is rounded per rank)
    the ranks' outputs sum to the reference over all ``E`` experts."""
    if T == 12:                                         # 36 pairs: the grouped (prefill) path
        monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 16)
    E, N, k, D, I = 8, 4, 3, 128, 64
    w1, w3 = (_weights(fmt, E, I, D, s) for s in (1, 3))
    w2 = _weights(fmt, E, D, I, 2)
    x = torch.randn(T, D, generator=_gen(4)).to(DEV)
    g = _gen(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    rw = (torch.rand(T, k, generator=g) + 0.1).to(DEV)
    total = torch.zeros(T, D)
    n = E // N
    for r in range(N):
        lo = r * n
        local = torch.where((ids >= lo) & (ids < lo + n), ids - lo, -1)
        ws = [w.slice_experts(lo, lo + n) for w in (w1, w3, w2)]
        got = M.moe_triton(x, local, rw, *ws, 1.5, True)
        _check(got, ref.moe(x, local, rw, *ws, 1.5, True), 2e-3 if fmt == "mxfp4" else 3e-3)
        total += got.cpu()
    _check(total, ref.moe(x, ids, rw, w1, w3, w2, 1.5, True).cpu(), 2e-3 if fmt == "mxfp4" else 3e-3)


def test_ragged_tiny_model_shapes():
    """hidden 64, inter 256 (the tiny checkpoint's experts), and inter 32: partial K blocks and N tiles."""
    _run("mxfp4", 3, 2, 8, 64, 256, True)
    _run("nvfp4", 1, 2, 8, 64, 256, True)
    _run("mxfp4", 3, 2, 8, 64, 32, True)
    _run("nvfp4", 1, 2, 8, 64, 32, True)


@pytest.mark.parametrize("pow2", [True, False])
def test_grouped_mxfp4_act_quant_on_dequantized_operands(monkeypatch, pow2):
    """Prefill, MXFP4, act-quant: with power-of-two scales the grouped GEMMs multiply the
    dequantized ``x̂`` and ``e2m1 * 2^(s-127)`` (exact in fp32 / bf16) in one dot per K tile; with
    fp32 scales they keep the e4m3 values and the scales on the partial sums. In fp32 both agree
    with the reference to summation order, far tighter than the shared tolerance."""
    monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 8)
    assert M._exact_dequantized(M.FormatCode.MXFP4, pow2, torch.float32) == pow2
    assert not M._exact_dequantized(M.FormatCode.MXFP4, True, torch.float16)
    assert not M._exact_dequantized(M.FormatCode.NVFP4, True, torch.bfloat16)
    got, exp = _run("mxfp4", 37, 2, 4, 256, 128, True, pow2=pow2, dtype=torch.float32)
    _check(got, exp, 1e-5)


def test_grouped_mxfp4_tiles_by_pairs_an_expert(monkeypatch):
    """The dequantized MXFP4 grouped GEMMs take 16-pair tiles below 24 pairs an expert on
    average, else 64, transposed (128 from 64 on; 256 of fewer weight rows from 144 on). Each tile
    size against the reference (fp32), and the three against each other to summation order."""
    monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 8)
    assert M.tiles(2 * 37, 4, False, True) == (16, "grouped_mxfp4_few")
    assert M.tiles(2 * 70, 4, False, True) == (64, "grouped_mxfp4_mid")
    assert M.tiles(2 * 127, 4, False, True) == (64, "grouped_mxfp4_mid")
    assert M.tiles(2 * 128, 4, False, True) == (128, "grouped_mxfp4")
    assert M.tiles(2 * 256, 4, False, True) == (128, "grouped_mxfp4")
    assert M.tiles(2 * 287, 4, False, True) == (128, "grouped_mxfp4")
    assert M.tiles(2 * 288, 4, False, True) == (256, "grouped_mxfp4_wide")
    tiles, outs = M.tiles, []
    for bm in (16, 64, 128):
        monkeypatch.setattr(M, "tiles", lambda P, E, dec, mx, _b=bm: (_b, tiles(P, E, dec, mx)[1]))
        outs.append(_run("mxfp4", 70, 2, 4, 256, 128, True, dtype=torch.float32)[0])
    for o in outs[1:]:
        _check(o, outs[0], 1e-6)


@pytest.mark.parametrize("ptxas, safe", [("release 12.8, V12.8.93", True), ("release 13.3, V13.3.1", True),
                                         ("release 13.4, V13.4.2", True), ("release 12.4, V12.4.131", False),
                                         ("release 13.0, V13.0.48", False), ("no version here", False)])
def test_transposed_moe_only_with_a_ptxas_that_keeps_mma_registers(monkeypatch, ptxas, safe):
    """The transposed gate/up GEMM (a pipelined MMA with its left operand in registers) runs only
    where ptxas keeps those registers until the MMA retires: 13.3 on, or 12.8 (Triton 3.6's, whose
    variants CI checks); any other version gives the untransposed 64-pair tiles."""
    import triton.backends.nvidia.compiler as nv
    monkeypatch.setattr(M.runtime, "interpreting", lambda: False)
    monkeypatch.setattr(M.torch.cuda, "is_available", lambda: False)      # (a Blackwell GPU is always safe)
    monkeypatch.setattr(nv, "get_ptxas_version", lambda arch=80: f"Cuda compilation tools, {ptxas}")
    M.register_mma_safe.cache_clear()
    try:
        assert M.register_mma_safe() == safe
        want = (256, "grouped_mxfp4_wide") if safe else (64, "grouped_mxfp4_few")
        assert M.tiles(2 * 320, 4, False, True) == want
        assert M.tiles(2 * 60, 4, False, True) == (64, "grouped_mxfp4_mid" if safe else "grouped_mxfp4_few")
        assert M.tiles(2 * 40, 4, False, True) == (16, "grouped_mxfp4_few")
    finally:
        M.register_mma_safe.cache_clear()


@pytest.mark.parametrize("bt", [16, 32])
def test_grouped_mxfp4_weight_rows_on_the_mma_m_side(monkeypatch, bt):
    """The transposed grouped GEMMs (``moe_grouped._gemm_wt``: weight rows on the MMA's M side,
    a tile's pairs on its N side): against the reference in fp32 (experts with one, several and a
    ragged last tile; an N tail: I = 96 is no multiple of the 32-wide tile), and against the
    untransposed kernels to summation order."""
    monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 8)
    tiles = M.tiles
    outs = []
    # (not the 64-pair config: at these small tiles its kernels are the 128-pair config's gate/up GEMM and
    # the few-pairs config's down GEMM, both run here; the GPU tests run it at its own tiles)
    for path in (p for p in MX_PATHS if p != "grouped_mxfp4_mid"):
        monkeypatch.setattr(M, "tiles", lambda P, E, dec, mx, _p=path: (bt, _p) if mx else tiles(P, E, dec, mx))
        got, exp = _run("mxfp4", 41, 2, 4, 256, 96, True, dtype=torch.float32)
        _check(got, exp, 1e-5)
        outs.append(got)
    for o in outs[1:]:
        _check(o, outs[0], 1e-6)


def test_fp32_scale_rounding_and_no_limit():
    """act_quant with non-power-of-two scales (pow2=False), fp32 activations, no clamp."""
    _run("fp8", 3, 2, 4, 128, 128, True, pow2=False, dtype=torch.float32, limit=0.0)


@pytest.mark.parametrize("T", [1, 4])
def test_nan_e8m0_scale_gives_nan_like_the_reference(T):
    """An MXFP4 scale byte of 255 is NaN (``numerics.e8m0_to_float``): the tokens routed to that
    expert come out NaN, as in the reference (the kernel used to build ``2^(s-127) * 2^14`` from the
    bits, which overflowed into the sign bit: a finite, wrong value). The formats refuse 255 at
    load; here it is written after construction."""
    E, D, I = 3, 64, 32
    w1, w3 = (_weights("mxfp4", E, I, D, s) for s in (1, 3))
    w2 = _weights("mxfp4", E, D, I, 2)
    w1.scale[0, 0, 0] = 255
    x = torch.randn(T, D, generator=_gen(4)).half().to(DEV)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 2]][:T], device=DEV)
    rw = torch.full((T, 2), 0.5, device=DEV)
    got = M.moe_triton(x, ids, rw, w1, w3, w2, 0.0).float().cpu()
    exp = ref.moe(x, ids, rw, w1, w3, w2, 0.0).float().cpu()
    hit = (ids.cpu() == 0).any(1)
    assert torch.isnan(exp[hit]).all() and torch.isfinite(exp[~hit]).all()
    assert torch.equal(torch.isnan(got), torch.isnan(exp))
    if (~hit).any():
        torch.testing.assert_close(got[~hit], exp[~hit], rtol=2e-3, atol=2e-3)


def test_mxfp4_bf16_decode_reads_the_scales_once_per_version():
    """The bf16 dequantization needs every scale byte <= 128: read once per weight, read again after
    the scale tensor changes in place (its version counter), never inside a graph capture."""
    ws = [_weights("mxfp4", 2, 32, 64, s) for s in (1, 2, 3)]
    assert M._scales_fit_bf16(ws)
    assert all(w._scale_max_seen[1] <= 128 for w in ws)
    ws[1].scale[1, 0, 0] = 129                  # a scale of 4: 2^(s-1) is no bf16
    assert not M._scales_fit_bf16(ws)
    ws[1].scale[1, 0, 0] = 128
    assert M._scales_fit_bf16(ws)


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


def _refusals():
    """``(what the message says, args)`` for every input the kernel refuses (checked on the CPU)."""
    def mx(E, N, K, s):
        return _weights("mxfp4", E, N, K, s, "cpu")
    w1, w3, w2 = mx(2, 32, 64, 1), mx(2, 32, 64, 2), mx(2, 64, 32, 3)
    x = torch.randn(2, 64).half()
    ids = torch.tensor([[0, 1], [1, -1]])
    rw = torch.rand(2, 2)
    f8, f8e = (_weights(f, 2, 32, 128, 1, "cpu") for f in ("fp8", "fp8e"))
    f8w2 = _weights("fp8", 2, 128, 32, 3, "cpu")
    x128 = torch.randn(2, 128).half()
    packed = torch.randint(0, 256, (2, 32, 64), dtype=torch.uint8)[..., :32]        # strided codes
    strided = Mxfp4Weight(packed, w1.scale)
    nv = _weights("nvfp4", 2, 32, 64, 1, "cpu")
    nv_f16 = Nvfp4Weight(nv.packed, nv.block_scale.view(torch.float8_e4m3fn), nv.global_scale)
    nv_f16.global_scale = nv.global_scale.half()
    fp8_64 = Fp8BlockWeight(f8.weight, torch.rand(2, 1, 2) * 0.01 + 0.002, block=64)
    ragged = [mx(2, 36, 64, 1), mx(2, 36, 64, 2), mx(2, 64, 36, 3)]        # I = 36: not words of 8
    return [
        ("x must be", (x.double(), ids, rw, w1, w3, w2)),
        ("x must be", (x.t().contiguous().t(), ids, rw, w1, w3, w2)),
        ("x must be", (x[None], ids, rw, w1, w3, w2)),
        ("topk_ids", (x, ids.short(), rw, w1, w3, w2)),
        ("topk_ids", (x, ids[:1], rw[:1], w1, w3, w2)),
        ("topk_ids", (x, ids.t().contiguous().t(), rw, w1, w3, w2)),
        ("topk_weights", (x, ids, rw.double(), w1, w3, w2)),
        ("topk_weights", (x, ids, rw[:, :1], w1, w3, w2)),
        ("no Triton kernel", (x, ids, rw, torch.randn(2, 32, 64), w3, w2)),
        ("share one format", (x, ids, rw, w1, nv, w2)),
        ("stacked", (x, ids, rw, w1.expert(0), w3.expert(0), w2.expert(0))),
        ("expert shapes", (x, ids, rw, w1, w3, w1)),
        ("expert shapes", (torch.randn(2, 32).half(), ids, rw, w1, w3, w2)),
        ("scales differ", (x128, ids, rw, f8, f8e, f8w2)),
        ("divisible by 8", (x, ids, rw, *ragged)),
        ("on meta", (x.to("meta"), ids, rw, w1, w3, w2)),
        ("FP8 block 64", (x128, ids, rw, fp8_64, fp8_64, f8w2)),
        ("global scale", (x, ids, rw, nv_f16, nv, _weights("nvfp4", 2, 64, 32, 3, "cpu"))),
        ("must be contiguous", (x, ids, rw, strided, w3, w2)),
    ]


def test_every_refusal_is_kernel_unsupported_before_any_launch(monkeypatch):
    """Each refused input raises ``KernelUnsupported`` (so the dispatch runs the reference) before
    any kernel is launched or buffer allocated."""
    import dsv4.ops as ops

    def launched(*a, **k):
        raise AssertionError("launched or allocated before refusing")
    for module in (M, moe_experts, moe_decode, moe_grouped):
        for name in dir(module):
            if name.endswith("_kernel"):
                monkeypatch.setattr(module, name, launched)
    monkeypatch.setattr(runtime, "empty", launched)
    for what, args in _refusals():
        with pytest.raises(ops.KernelUnsupported, match=what):
            M.moe_triton(*args, 1.5, True)


def test_refused_call_runs_the_reference_through_the_dispatch(monkeypatch):
    """``dsv4.ops.moe`` with the kernel registered: a refused call returns the reference's result;
    with ``DSV4_STRICT_KERNELS=1`` it raises."""
    import dsv4.ops as ops
    ops.register("moe", "cpu", Mxfp4Weight)(M.moe_triton)
    try:
        args = [a for what, a in _refusals() if what == "topk_ids"][2]        # strided ids
        args = (args[0].float(),) + args[1:]
        assert torch.equal(ops.moe(*args, 1.5, True), ref.moe(*args, 1.5, True))
        monkeypatch.setenv("DSV4_STRICT_KERNELS", "1")
        with pytest.raises(ops.KernelUnsupported):
            ops.moe(*args, 1.5, True)
    finally:
        ops.unregister("moe", "cpu", Mxfp4Weight)


def test_no_pairs_gives_zeros():
    """``k = 0`` (nothing routed): zeros, and no launch over an empty grid (the reference's
    ``view(T, 0, -1)`` cannot take ``k = 0``; the model never routes to none)."""
    w1, w3 = (_weights("mxfp4", 2, 32, 64, s) for s in (1, 3))
    w2 = _weights("mxfp4", 2, 64, 32, 2)
    x = torch.randn(3, 64).half().to(DEV)
    ids, rw = torch.zeros(3, 0, dtype=torch.int64, device=DEV), torch.zeros(3, 0, device=DEV)
    got = M.moe_triton(x, ids, rw, w1, w3, w2, 1.5)
    assert torch.equal(got.cpu(), torch.zeros(3, 64, dtype=torch.float16))


@pytest.mark.parametrize("experts,T,prefill", [("mxfp4", 1, False), ("fp8", 3, False), ("nvfp4", 9, True)])
def test_model_moe_layers_under_expert_parallel(monkeypatch, experts, T, prefill):
    """The model's MoE end to end under expert parallel: ``random_sharded`` builds the same network
    at world size 1 and as ranks 0 and 1 of 2 (4 of the 8 experts each, the shared expert split in
    two); its first two MoE layers (hash and top-k routed) call ``dsv4.ops.moe`` with local ids and ``-1``
    for the other rank's picks, the kernel takes every call (``DSV4_STRICT_KERNELS=1``: a refusal
    fails the test), and the ranks' partial outputs (what the all-reduce sums) add up to the
    single-process output, itself equal to the reference's."""
    import types

    import dsv4.ops as ops
    from conftest import tp_config
    from dsv4.random_weights import random_sharded
    from dsv4.model.moe import MoE
    from dsv4.parallel import SINGLE, ParallelGroup
    if prefill:
        monkeypatch.setattr(M, "DECODE_MAX_PAIRS", 8)
    monkeypatch.setenv("DSV4_STRICT_KERNELS", "1")
    config = tp_config()
    calls = []

    def kernel(x, ids, *rest):
        calls.append(ids.clone())
        return M.moe_triton(x, ids, *rest)

    def layers(world, rank):
        model = random_sharded(config, torch.float32, DEV, ParallelGroup.layout(rank, world) if world > 1 else None,
                               seed=1, experts=experts, dense="fp8").set_qat_sim(True)
        mods = [m for m in model.modules() if isinstance(m, MoE)][:2]
        assert mods[0].gate.is_hash and not mods[1].gate.is_hash
        for m in mods:
            m.tp = SINGLE            # the all-reduce is the sum over ranks below
        return mods

    g = _gen(6)
    x = torch.randn(1, T, config.hidden_size, generator=g).to(DEV)
    ctx = types.SimpleNamespace(token_ids=torch.randint(0, config.vocab_size, (1, T), generator=g).to(DEV),
                                qat_sim=True)
    fmt = type(layers(1, 0)[0].experts.w1.w)
    ops.register("moe", DEV.split(":")[0], fmt)(kernel)
    try:
        whole = layers(1, 0)
        ranks = [layers(2, r) for r in range(2)]
        assert all(r[0].experts.w1.w.shape[0] == config.n_routed_experts // 2 for r in ranks)
        for i, layer in enumerate(whole):
            n = len(calls)
            got = layer(x, ctx)
            with ops.reference_only():
                _check(got[0], layer(x, ctx)[0], 2e-3 if experts == "mxfp4" else 3e-3)
            parts = [r[i](x, ctx) for r in ranks]
            assert len(calls) == n + 3, "the kernel was not called for every rank"
            local = calls[-2:]
            assert all(((c >= -1) & (c < config.n_routed_experts // 2)).all() for c in local)
            assert ((local[0] >= 0) != (local[1] >= 0)).all()          # each pick on exactly one rank
            _check(parts[0][0] + parts[1][0], got[0], 1e-4)
    finally:
        ops.unregister("moe", DEV.split(":")[0], fmt)


# ----------------------------------------------------------------------------- GPU, real shapes
FLASH = dict(E=256, D=4096, I=2048, k=6)
PRO = dict(E=384, D=7168, I=3072, k=6)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8e"])
@pytest.mark.parametrize("T", [1, 8, 32, 300, 2048])
def test_gpu_real_shapes_bf16(geo, fmt, T):
    """Real shapes, the shared expert (FP8, e8m0 scales, as released) beside the routed experts."""
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
    shared = _shared("fp8e", g["I"], g["D"], 21)
    for act in (True, False):
        got = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, act, True, shared)
        exp = ref.moe(x, ids, rw, w1, w3, w2, 10.0, act, True, shared)
        _check(got, exp, 2e-2 if act else 1e-2)
        again = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, act, True, shared)
        assert torch.equal(got, again), "not deterministic"


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("T, bt", [(300, 16), (300, 64), (2048, 64), (2048, 128), (2048, 256)])
def test_gpu_weight_rows_on_the_mma_m_side_real_shapes(monkeypatch, geo, T, bt):
    """The transposed MXFP4 grouped GEMMs at real shapes in bf16, act-quant: against the reference
    and, to bf16 rounding, against the untransposed kernels; deterministic. 256-pair tiles only fit
    the wide config's shared memory: it is compared with the 128-row config at 128-pair tiles."""
    g = FLASH if geo == "flash" else PRO
    E = 64
    w1, w3 = (_weights("mxfp4", E, g["I"], g["D"], s) for s in (1, 3))
    w2 = _weights("mxfp4", E, g["D"], g["I"], 2)
    x = (torch.randn(T, g["D"], device="cuda") * 2).bfloat16()
    ids, rw = _routing(T, g["k"], E, 7)
    exp = ref.moe(x, ids, rw, w1, w3, w2, 10.0, True, True)
    tiles, outs = M.tiles, []
    runs = [(path, bt) for path in MX_PATHS] if bt < 256 else [("grouped_mxfp4_wide", 256), ("grouped_mxfp4", 128)]
    for path, b in runs:
        monkeypatch.setattr(M, "tiles", lambda P, E, dec, mx, _p=path, _b=b: (_b, _p) if mx else tiles(P, E, dec, mx))
        got = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)
        _check(got, exp, 2e-2)
        assert torch.equal(got, M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)), "not deterministic"
        outs.append(got)
    for o in outs[1:]:
        _check(o, outs[0], 1e-2)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("path, bt", [("grouped_mxfp4_few", 16), ("grouped_mxfp4_few", 64), ("grouped_mxfp4_mid", 64),
                                      ("grouped_mxfp4", 128), ("grouped_mxfp4_wide", 256)])
def test_gpu_grouped_mxfp4_tiles_repeat_bit_for_bit(monkeypatch, geo, path, bt):
    """Every production tile config of the MXFP4 grouped GEMMs, 12 calls on fresh NaN-poisoned buffers
    at each geometry: finite and the same bits every time. (The wide config's down GEMM at BK 64 gave
    a different garbage each call at Pro's shapes and none at Flash's, with the same compiled IR:
    results/2026-11-28e/pro_nan.txt; a race of that kind shows here.)"""
    g = FLASH if geo == "flash" else PRO
    E = 32
    w1, w3 = (_weights("mxfp4", E, g["I"], g["D"], s) for s in (1, 3))
    w2 = _weights("mxfp4", E, g["D"], g["I"], 2)
    x = (torch.randn(2048, g["D"], device="cuda") * 2).bfloat16()
    ids, rw = _routing(2048, g["k"], E, 9)
    tiles = M.tiles
    monkeypatch.setattr(M, "tiles", lambda P, E, dec, mx: (bt, path) if mx else tiles(P, E, dec, mx))
    first = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)
    _check(first, ref.moe(x, ids, rw, w1, w3, w2, 10.0, True, True), 2e-2)
    for _ in range(11):
        assert torch.equal(M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True), first), "a call differed"


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("path", MX_PATHS)
@pytest.mark.parametrize("T", [300, 2048])
def test_gpu_mxfp4_bf16_decode_equals_the_general_one(monkeypatch, path, T):
    """The grouped MXFP4 GEMMs with their tiles dequantized in bf16 (every scale <= 128: here every
    byte 2..128) give the very bits of the general
    fp16 -> fp32 decode (the same exact operands reach the same MMAs), and match the reference; a
    scale byte above 128 takes the general decode. (Bytes from 2: below, the general decode's fp32
    products are subnormal; the bf16 ones are checked there by ``test_gpu_numerics``.)"""
    D, I, E, k = 4096, 2048, 16, 6
    w1, w3 = (_weights("mxfp4", E, I, D, s) for s in (1, 3))
    w2 = _weights("mxfp4", E, D, I, 2)
    g = torch.Generator("cuda").manual_seed(5)
    for w in (w1, w3, w2):
        w.scale.copy_(torch.randint(112, 126, w.scale.shape, generator=g, device="cuda", dtype=torch.uint8))
        w.scale.view(-1)[:127] = torch.arange(2, 129, device="cuda", dtype=torch.uint8)
    x = (torch.randn(T, D, device="cuda") * 2).bfloat16()
    ids, rw = _routing(T, k, E, 7)
    tiles = M.tiles
    monkeypatch.setattr(M, "tiles", lambda P, E, dec, mx: (64 if path == "grouped_mxfp4" else 16, path) if mx
                        else tiles(P, E, dec, mx))
    assert M._scales_fit_bf16((w1, w3, w2))
    fast = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)
    with monkeypatch.context() as m:
        m.setattr(M, "_scales_fit_bf16", lambda weights: False)
        general = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)
    assert torch.equal(fast, general)
    _check(fast, ref.moe(x, ids, rw, w1, w3, w2, 10.0, True, True), 2e-2)
    w2.scale.view(-1)[7] = 131
    assert not M._scales_fit_bf16((w1, w3, w2))
    _check(M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True), ref.moe(x, ids, rw, w1, w3, w2, 10.0, True, True),
           2e-2)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8e"])
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("with_shared", [True, False])
def test_gpu_cuda_graph_replay_equals_eager(fmt, T, with_shared):
    g = FLASH
    E = 32
    w1, w3 = (_weights(fmt, E, g["I"], g["D"], s) for s in (1, 3))
    w2 = _weights(fmt, E, g["D"], g["I"], 2)
    x = (torch.randn(T, g["D"], device="cuda") * 2).bfloat16()
    ids, rw = _routing(T, g["k"], E, 9)
    shared = _shared("fp8e", g["I"], g["D"], 21) if with_shared else None
    eager = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                       # warm up (compile) off the capture
        M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared)
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
    assert torch.equal(out, M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True, shared))


@pytest.mark.parametrize("P, E, BM, drop", [(1, 4, 16, 0.0), (37, 4, 16, 0.2), (300, 8, 64, 0.0), (1500, 256, 16, 0.1),
                                            (700, 384, 128, 0.0)])
def test_expert_tiles_kernels_equal_the_torch_composition(P, E, BM, drop):
    """The two sorting kernels give the stable order by expert (``-1`` ids first) and the tiles of
    the torch composition they replaced, the unused tail included, whatever the buffers held."""
    g = torch.Generator().manual_seed(P + E)
    ids = torch.randint(0, E, (P,), generator=g)
    ids[torch.rand(P, generator=g) < drop] = -1
    ids = ids.to(DEV)
    with runtime.poisoned():
        got = moe_grouped._expert_tiles(ids, E, BM)
    want = moe_grouped.expert_tiles_reference(ids, E, BM)
    for name, a, b in zip(("order", "tile_e", "tile_r0", "tile_r1"), got, want, strict=True):
        assert torch.equal(a.long().cpu(), b.long().cpu()), name
