"""The small-op Triton kernels (dsv4/ops/triton/small*.py) against their references.

CPU: through Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported)
at small, odd shapes with fp32/fp16 activations (the interpreter mis-rounds bf16), outputs
poisoned with NaN so every element must be written. GPU (``-m gpu``): real DeepSeek-V4 shapes,
bf16, and a CUDA-graph replay equal to eager.

Also on CPU: a tiny model (every layer kind) decodes with every small kernel and the fused-op
model's fused decode path (``dsv4.ops.fused``) and matches the reference decode.

Bit-exact where the reference is elementwise fp32 arithmetic (RoPE, the FP8/FP4 round trips, the
mHC post mix in the interpreter); where the reference reduces (norm statistics, the mHC
projection, softmaxes, Hadamard) the sums run in another order: tolerances of a few fp32 ulps
of the statistic, i.e. at most one step of the output dtype.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from dsv4.model.cache import RowStore  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import runtime, small  # noqa: E402
from dsv4.testing import decode, prefill

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = {op: fn for op, _, fn in small.REGISTRATIONS}


@pytest.fixture(autouse=True)
def _poison():
    with runtime.poisoned():
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0, device=DEV) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(device)


def _ulps(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0 ** -22, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]


def _close(out: torch.Tensor, want: torch.Tensor, steps: float = 1.0) -> None:
    """Equal up to ``steps`` steps of the output dtype, relative to the element plus its row's
    largest element (a rotation can cancel), and no NaN / unwritten element."""
    assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, want.shape, out.dtype, want.dtype)
    assert not out.isnan().any(), "unwritten (NaN) elements"
    o, w = out.double(), want.double()
    tol = steps * _ulps(out.dtype) * (w.abs() + w.abs().amax(-1, keepdim=True)) + 1e-30
    bad = (o - w).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off; worst {(o - w).abs().max().item():.3g}"


def _exact(out: torch.Tensor, want: torch.Tensor) -> None:
    assert out.shape == want.shape and out.dtype == want.dtype
    assert not out.isnan().any(), "unwritten (NaN) elements"
    assert torch.equal(out, want), f"max diff {(out.double() - want.double()).abs().max().item():.3g}"


# ----------------------------------------------------------------------------- norms / rope
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 96), (1, 37), (2, 130)])
def test_rms_norm(dtype, shape):
    x = _randn(*shape, seed=1, dtype=dtype, scale=3.0)
    w = _randn(shape[-1], seed=2)
    _close(KERNELS["rms_norm"](x, w, 1e-6), ref.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_unweighted(dtype):
    x = _randn(2, 3, 5, 72, seed=3, dtype=dtype, scale=2.0)
    _close(KERNELS["rms_norm_unweighted"](x, 1e-6), ref.rms_norm_unweighted(x, 1e-6))


def _rope_tables(lead: tuple[int, ...], rd2: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(*lead, rd2, generator=_gen(seed)) * 50
    return ang.cos().to(DEV), ang.sin().to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_bit_exact(dtype, inverse):
    x = _randn(2, 3, 5, 40, seed=4, dtype=dtype)          # [B, S, H, hd], rd = 12
    cos, sin = _rope_tables((2, 3), 6, seed=5)
    cos_h, sin_h = cos.unsqueeze(2), sin.unsqueeze(2)
    _exact(KERNELS["apply_rope"](x, cos_h, sin_h, inverse), ref.apply_rope(x, cos_h, sin_h, inverse))
    kv = _randn(2, 3, 40, seed=6, dtype=dtype)
    _exact(KERNELS["apply_rope"](kv, cos, sin, inverse), ref.apply_rope(kv, cos, sin, inverse))
    # a broadcast that is not over trailing dims, and a non-contiguous input
    c1, s1 = _rope_tables((3,), 6, seed=7)            # [3, 6] against rows [2, 3]
    xt = _randn(3, 2, 40, seed=8, dtype=dtype).transpose(0, 1)
    _exact(KERNELS["apply_rope"](xt, c1, s1), ref.apply_rope(xt, c1, s1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_qnorm(dtype):
    q = _randn(2, 1, 6, 48, seed=9, dtype=dtype, scale=4.0)
    cos, sin = _rope_tables((2, 1), 8, seed=10)
    cos_h, sin_h = cos.unsqueeze(2), sin.unsqueeze(2)
    want = ref.rope_qnorm(q, cos_h, sin_h, 1e-6)
    _close(KERNELS["rope_qnorm"](q, cos_h, sin_h, 1e-6), want)


@pytest.mark.parametrize("layout, pow2", [("plain", True), ("fp8", True), ("fp8", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("strided", [False, True], ids=["apart", "one-buffer"])
def test_q_kv_prepare(layout, pow2, dtype, strided):
    """q_norm and the K=V path in one launch (two program rows), against rms_norm and the K=V
    composition; ``one-buffer``: both inputs are column slices of one ``[..., ql + hd]`` buffer,
    as ``linear_pair`` returns them. With indices (a decode step) the K=V rows are also written
    to the store: exactly what store_rows writes for them, nothing else touched."""
    hd, rd, ql = 160, 32, 96                             # nope 128: two FP8 blocks of 64; q rows ragged
    if strided:
        buf = _randn(3, 2, ql + hd, seed=11, dtype=dtype, scale=5.0)
        qa, kv = buf[..., :ql], buf[..., ql:]
    else:
        qa, kv = _randn(3, 2, ql, seed=10, dtype=dtype, scale=3.0), _randn(3, 2, hd, seed=11, dtype=dtype, scale=5.0)
    qw, w = _randn(ql, seed=9), _randn(hd, seed=12)
    cos, sin = _rope_tables((3, 2), rd // 2, seed=13)
    store = RowStore.allocate(layout, 2, 4, hd, dtype, DEV, rope_dim=rd, pow2=pow2)
    want_q, want = ref.q_kv_prepare(qa, qw, 1e-6, kv, w, 1e-5, cos, sin, store)
    got_q, out = KERNELS["q_kv_prepare"](qa, qw, 1e-6, kv, w, 1e-5, cos, sin, store)
    _close(got_q, want_q)
    _close(got_q, ref.rms_norm(qa, qw, 1e-6))
    _close(out, want, steps=1.0 if layout == "plain" else 16.0)   # an ulp of the norm can move an FP8 step
    exact_rows = (out == want).all(-1).float().mean()
    assert exact_rows > 0.8, f"only {exact_rows:.2f} of rows bit-exact"
    # a decode step's window store in the same launch
    a = RowStore.allocate(layout, 4, 5, hd, dtype, DEV, rope_dim=rd, pow2=pow2)
    b = RowStore.allocate(layout, 4, 5, hd, dtype, DEV, rope_dim=rd, pow2=pow2)
    _fill(a, 14)
    _fill(b, 14)
    slots, rows_ = torch.tensor([[3, 3], [0, 1], [2, 0]], device=DEV), torch.tensor([[4, 0], [2, 2], [1, 3]], device=DEV)
    stored_q, stored = KERNELS["q_kv_prepare"](qa, qw, 1e-6, kv, w, 1e-5, cos, sin, b, slots, rows_)
    assert torch.equal(stored, out) and torch.equal(stored_q, got_q)
    ref.store_rows(a, slots, rows_, out)
    for ta, tb in zip(a.tensors(), b.tensors()):
        assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
    spec = RowStore.allocate(layout, 4, 5, hd, dtype, DEV, rope_dim=rd, pow2=pow2)     # the spec: round trip,
    _fill(spec, 14)                                                                    # then store_rows
    assert torch.equal(ref.q_kv_prepare(qa, qw, 1e-6, kv, w, 1e-5, cos, sin, spec, slots, rows_)[1], want)
    ref.store_rows(a, slots, rows_, want)
    for ta, tb in zip(a.tensors(), spec.tensors()):
        assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))


# ----------------------------------------------------------------------------- mHC
def _mixer(nc: int, D: int, n_mix: int, n_scale: int, seed: int):
    fn = _randn(n_mix, nc * D, seed=seed, scale=0.1)
    base = _randn(n_mix, seed=seed + 1, scale=0.5)
    scale = _randn(n_scale, seed=seed + 2, scale=0.5) + 1.0
    return fn, base, scale


@pytest.mark.parametrize("dtype, lead, nc, D, iters", [
    (torch.float32, (2, 3), 4, 40, 20), (torch.float16, (1,), 4, 160, 20), (torch.float32, (2,), 3, 33, 20),
    (torch.float16, (17,), 4, 24, 2),        # 17 tokens: two token blocks (few iterations: interpreter time)
    (torch.float16, (260,), 4, 24, 2)])      # a prompt: the projection on tensor cores (fn in three fp16 parts)
def test_mhc_pre_norm(dtype, lead, nc, D, iters):
    """mHC pre and the block's RMSNorm against the composition of the references: two launches, or
    one for up to ONE_LAUNCH_MAX_TOKENS tokens (the last split finalizes; its counter re-armed)."""
    h = _randn(*lead, nc, D, seed=20, dtype=dtype, scale=2.0)
    fn, base, scale = _mixer(nc, D, (2 + nc) * nc, 3, seed=21)
    w = _randn(D, seed=19)
    want = ref.rms_norm(ref.mhc_pre(h, fn, base, scale, iters, 1e-6, 1e-6)[0], w, 1e-5), \
        *ref.mhc_pre(h, fn, base, scale, iters, 1e-6, 1e-6)[1:]
    got = KERNELS["mhc_pre_norm"](h, fn, base, scale, iters, 1e-6, 1e-6, w, 1e-5)
    _close(got[0], want[0], steps=1.0 if dtype != torch.float32 else 16.0)
    _close(got[1], want[1], steps=16.0)
    _close(got[2], want[2], steps=64.0)
    if math.prod(lead) <= small.small_mhc.ONE_LAUNCH_MAX_TOKENS:
        assert runtime.counters_if_allocated(h.device, "mhc")[0].item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hc_head_norm(dtype):
    nc, D = 4, 72
    h = _randn(3, 2, nc, D, seed=22, dtype=dtype, scale=2.0)
    fn, base, scale = _mixer(nc, D, nc, 1, seed=23)
    w = _randn(D, seed=24)

    def want(x):
        return ref.rms_norm(ref.hc_head(x, fn, base, scale, 1e-6, 1e-6), w, 1e-6)
    steps = 1.0 if dtype != torch.float32 else 16.0
    _close(KERNELS["hc_head_norm"](h, fn, base, scale, 1e-6, 1e-6, w, 1e-6), want(h), steps=steps)
    # strided views, as the model's last-position logits pass them (3 tokens; 2 tokens: one launch)
    for hs in (h[:, -1:], h[0]):
        _close(KERNELS["hc_head_norm"](hs, fn, base, scale, 1e-6, 1e-6, w, 1e-6), want(hs), steps=steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead, nc, D", [((2, 3), 4, 40), ((5,), 3, 600)])
def test_mhc_post(dtype, lead, nc, D):
    out = _randn(*lead, D, seed=24, dtype=dtype)
    h = _randn(*lead, nc, D, seed=25, dtype=dtype)
    post = _randn(*lead, nc, seed=26).sigmoid() * 2
    comb = _randn(*lead, nc, nc, seed=27).softmax(-1)
    _close(KERNELS["mhc_post"](out, h, post, comb), ref.mhc_post(out, h, post, comb), steps=4.0)


@pytest.mark.parametrize("dtype, lead, nc, D, iters", [
    (torch.float32, (2, 1), 4, 40, 20), (torch.float16, (1,), 4, 160, 20), (torch.float32, (2,), 3, 33, 20),
    (torch.float16, (17,), 4, 24, 2),        # 17 tokens: the two-launch path over two token blocks
    (torch.float16, (2,), 4, 256, 20), (torch.float32, (3,), 4, 128, 2),    # tiles within a stream (V4's D)
    (torch.float16, (260,), 4, 24, 2)])      # a prompt: mhc_post, then mhc_pre_norm on tensor cores
def test_mhc_post_pre_norm(dtype, lead, nc, D, iters):
    """An mHC post and the next mixer's pre + norm in one op: the streams equal the mhc_post kernel's
    bit for bit and the rest equals the mhc_pre_norm kernel's on them (the same arithmetic); against
    the references: the streams close to mhc_post's, the rest to mhc_pre_norm's of those streams
    (an fp16 step in a stream moves the mix more than the pre's own tolerance)."""
    out = _randn(*lead, D, seed=28, dtype=dtype, scale=2.0)
    h = _randn(*lead, nc, D, seed=29, dtype=dtype, scale=2.0)
    post = _randn(*lead, nc, seed=30).sigmoid() * 2
    comb = _randn(*lead, nc, nc, seed=31).softmax(-1)
    fn, base, scale = _mixer(nc, D, (2 + nc) * nc, 3, seed=32)
    w = _randn(D, seed=33)
    got = KERNELS["mhc_post_pre_norm"](out, h, post, comb, fn, base, scale, iters, 1e-6, 1e-6, w, 1e-5)
    h_next = KERNELS["mhc_post"](out, h, post, comb)
    _exact(got[0], h_next)
    for a, b in zip(got[1:], KERNELS["mhc_pre_norm"](h_next, fn, base, scale, iters, 1e-6, 1e-6, w, 1e-5)):
        _exact(a, b)
    _close(got[0], ref.mhc_post_pre_norm(out, h, post, comb, fn, base, scale, iters, 1e-6, 1e-6, w, 1e-5)[0],
           steps=4.0)
    want = (None, *ref.mhc_pre_norm(got[0], fn, base, scale, iters, 1e-6, 1e-6, w, 1e-5))
    _close(got[1], want[1], steps=1.0 if dtype != torch.float32 else 16.0)
    _close(got[2], want[2], steps=16.0)
    _close(got[3], want[3], steps=64.0)
    if math.prod(lead) <= small.small_mhc.ONE_LAUNCH_MAX_TOKENS:
        assert runtime.counters_if_allocated(h.device, "mhc")[0].item() == 0


# ----------------------------------------------------------------------------- FP8 / FP4 / stores
def _hard_values(*shape, seed: int, dtype) -> torch.Tensor:
    """Random values with the awkward cases mixed in: zeros, -0, exact powers of two, e4m3/e2m1
    ties, tiny blocks (amax floors), huge values."""
    g = _gen(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    pick = torch.randint(0, 8, shape, generator=g)
    x = torch.where(pick == 0, torch.zeros_like(x), x)
    x = torch.where(pick == 1, -torch.zeros_like(x), x)
    x = torch.where(pick == 2, torch.exp2(torch.randint(-8, 8, shape, generator=g).float()), x)
    x = torch.where(pick == 3, (torch.randint(-60, 60, shape, generator=g).float() + 0.5) / 8, x)   # ties
    x[..., :7] = 1e-7 * torch.randn(*x.shape[:-1], 7, generator=g)   # a block below the floors
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block, pow2, shape", [(64, True, (3, 200)), (128, False, (2, 2, 300)), (48, True, (5, 96))])
def test_fp8_sim_bit_exact(dtype, block, pow2, shape):
    x = _hard_values(*shape, seed=30, dtype=dtype)
    _exact(KERNELS["fp8_sim"](x, block, pow2), ref.fp8_sim(x, block, pow2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 200), (4, 64)])
def test_fp4_sim_bit_exact(dtype, shape):
    x = _hard_values(*shape, seed=31, dtype=dtype)
    out, want = KERNELS["fp4_sim"](x, 32), ref.fp4_sim(x, 32)
    _exact(out, want)
    assert torch.equal(out.signbit(), want.signbit())


def _fill(store: RowStore, seed: int) -> None:
    g = _gen(seed)
    for t in store.tensors():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("layout, pow2, dtype, dim, rope", [
    ("plain", True, torch.float16, 40, 0), ("fp8", True, torch.float16, 160, 32), ("fp8", False, torch.float32, 100, 8),
    ("fp4", True, torch.float16, 96, 0), ("fp4", True, torch.float32, 40, 0)])
@pytest.mark.parametrize("lead", ["ring", "entries", "flat"])
def test_store_rows_bit_exact(layout, pow2, dtype, dim, rope, lead):
    a = RowStore.allocate(layout, 3, 6, dim, dtype, DEV, rope_dim=rope, pow2=pow2)
    b = RowStore.allocate(layout, 3, 6, dim, dtype, DEV, rope_dim=rope, pow2=pow2)
    _fill(a, 40)
    _fill(b, 40)
    if lead == "ring":           # [B, keep] rows of slots [B, 1]
        slots, rows_ = torch.tensor([[2], [0]]), torch.tensor([[1, 4], [5, 0]])
        values = _hard_values(2, 2, dim, seed=41, dtype=torch.float32)
    elif lead == "entries":      # a sink row written twice
        slots, rows_ = torch.tensor([[1]]), torch.tensor([[3, 5, 5]])
        values = _hard_values(1, 3, dim, seed=42, dtype=dtype)
        values[0, 2] = values[0, 1]
    else:
        slots, rows_ = torch.tensor([0, 2, 1]), torch.tensor([2, 2, 0])
        values = _hard_values(3, dim, seed=43, dtype=dtype)
    slots, rows_ = slots.to(DEV), rows_.to(DEV)
    ref.store_rows(a, slots, rows_, values)
    KERNELS["store_rows"](b, slots, rows_, values)
    for ta, tb in zip(a.tensors(), b.tensors()):
        assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))


# ----------------------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 128), (2, 32), (3, 16), (2, 2)])
def test_hadamard(dtype, shape):
    x = _randn(*shape, seed=50, dtype=dtype)
    _close(KERNELS["hadamard"](x), ref.hadamard(x), steps=2.0 if dtype != torch.float32 else 64.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("d, rd", [(64, 32), (16, 8)])
def test_queries_prepare(dtype, fp4, d, rd):
    """A CSA layer's queries in one launch: the attention's (rope_qnorm) and the indexer's (RoPE,
    Hadamard, FP4 under QAT), each against its reference op."""
    x = _randn(2, 3, 4, d, seed=51, dtype=dtype, scale=3.0)   # [B, S, nI, d]
    q = _randn(2, 3, 5, 2 * d + 8, seed=53, dtype=dtype, scale=2.0)   # [B, S, H, hd]
    cos, sin = _rope_tables((2, 3), rd // 2, seed=52)
    cos_h, sin_h = cos.unsqueeze(2), sin.unsqueeze(2)
    got_q, out = KERNELS["queries_prepare"](q, cos_h, sin_h, 1e-6, x, fp4)
    want_q, want = ref.queries_prepare(q, cos_h, sin_h, 1e-6, x, fp4)
    assert torch.equal(want_q, ref.rope_qnorm(q, cos_h, sin_h, 1e-6))
    _close(got_q, want_q)
    assert torch.equal(want, ref.rope_hadamard(x, cos_h, sin_h, fp4))
    if not fp4:
        _close(out, want, steps=2.0 if dtype != torch.float32 else 64.0)
        return
    # FP4 steps are coarse: an ulp of the rotation may flip a value sitting on a rounding boundary
    same = (out == want).float().mean()
    assert not out.isnan().any() and same > 0.99, f"{same:.4f} equal"
    step = want.abs().amax(-1, keepdim=True) / 6 * 2   # the largest e2m1 step of a block (2 in units of scale)
    assert ((out - want).abs() <= step).all()


# ----------------------------------------------------------------------------- compressor pooling, SwiGLU
@pytest.mark.parametrize("overlap, m, hd", [(False, 4, 24), (True, 4, 20), (False, 16, 8)])
def test_compress_windows(overlap, m, hd):
    width = 2 * hd if overlap else hd
    kv = _randn(2, 3, m, width, seed=60)
    gate = _randn(2, 3, m, width, seed=61, scale=3.0)
    prev_kv = prev_gate = None
    if overlap:
        prev_kv = _randn(2, 3, m, hd, seed=62)
        prev_gate = _randn(2, 3, m, hd, seed=63, scale=3.0)
        prev_gate[0, 0] = float("-inf")                  # the first window has no previous one
    want = ref.compress_windows(kv, gate, prev_kv, prev_gate)
    _close(KERNELS["compress_windows"](kv, gate, prev_kv, prev_gate), want, steps=16.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("limit", [0.0, 2.5])
def test_swiglu(dtype, limit):
    g = _randn(3, 1100, seed=64, dtype=dtype, scale=3.0)
    u = _randn(3, 1100, seed=65, dtype=dtype, scale=3.0)
    _close(KERNELS["swiglu"](g, u, limit), ref.swiglu(g, u, limit), steps=1.0 if dtype != torch.float32 else 8.0)


# ----------------------------------------------------------------------------- compressor decode step
def _compressor_case(overlap: bool, ratio: int, dim: int, layout: str, dtype, seed: int):
    from dsv4.engine.state import _compressor
    from dsv4.model.compressor import Compressor
    hidden, slots = 24, 3
    torch.manual_seed(seed)
    comp = Compressor(hidden, dim, ratio, overlap, 1e-6, dtype).to(DEV)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=_gen(seed + p.numel())) * 0.5)
        comp.norm.weight.add_(1.0)
    rope = 16 if layout == "fp8" else 0
    entries = RowStore.allocate(layout, slots, 64 // ratio + 1, dim, dtype, DEV, rope_dim=rope)
    return comp, _compressor(entries, slots, ratio, dim, overlap, DEV), hidden


def _clone_state(st):
    import copy
    out = copy.copy(st)
    out.entries = copy.copy(st.entries)
    for name in ("data", "scale", "rope"):
        t = getattr(st.entries, name)
        setattr(out.entries, name, None if t is None else t.clone())
    for name in ("win_kv", "win_gate", "prev_kv", "prev_gate", "log_kv", "log_gate"):
        t = getattr(st, name)
        setattr(out, name, None if t is None else t.clone())
    return out


def _states_equal(a, b, exact: bool, window_exact: bool = True) -> None:
    """Window state and every entry row but the sink (never read) equal (or close)."""
    for name in ("win_kv", "win_gate", "prev_kv", "prev_gate"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is None:
            continue
        if window_exact:
            assert torch.equal(ta, tb), name
        else:
            assert torch.equal(ta.isinf(), tb.isinf()), name
            fin = ta.isfinite()
            _close(torch.where(fin, tb, 0.0), torch.where(fin, ta, 0.0), steps=64.0)
    for ta, tb in zip(a.entries.tensors(), b.entries.tensors()):
        ta, tb = ta[:, :-1], tb[:, :-1]
        if exact or ta.dtype == torch.uint8 or ta.dtype == torch.float8_e4m3fn:
            same = (ta.view(torch.uint8) == tb.view(torch.uint8)).float().mean()
            assert same >= (1.0 if exact else 0.99), f"{same:.4f} of entry bytes equal"
        else:
            _close(tb, ta, steps=64.0)


def _decode_run(comp, state, hidden, rotate, steps, step_fn, seed, chunk: bool | int = False):
    """``steps`` tokens on slots 2 and 0 (different positions) by ``step_fn``: one at a time
    (decode), all in one chunk (the batched prefill path) with ``chunk=True``, or in chunks of
    ``chunk`` tokens (verify steps, short prompt chunks)."""
    from types import SimpleNamespace
    from dsv4.ops import reference as r
    inv = r.rope_inv_freq(16, 10000.0).to(DEV)
    start = torch.tensor([5, 2], device=DEV)
    slots = torch.tensor([2, 0], device=DEV)
    xs = [_randn(2, 1, hidden, seed=seed + t, dtype=comp.wkv.w.dtype) for t in range(steps)]
    if chunk is True:
        groups = [(0, torch.cat(xs, 1))]
    elif chunk:
        groups = [(t0, torch.cat(xs[t0:t0 + chunk], 1)) for t0 in range(0, steps, chunk)]
    else:
        groups = list(enumerate(xs))
    for t0, x in groups:
        pos = start.unsqueeze(1) + t0 + torch.arange(x.shape[1], device=DEV)
        ctx = SimpleNamespace(slots=slots, start=start + t0, positions=pos, qat_sim=False, pow2=True)
        step_fn(comp, state, x, ctx, inv, rotate)


def _step_module(comp, state, x, ctx, inv, rotate):
    from dsv4.ops import reference as r

    from dsv4.model.compressor import store_entries
    entries, pos = comp(x, ctx, state)
    cos, sin = r.rope_cos_sin(pos, inv)
    e = r.apply_rope(entries, cos, sin)
    store_entries(state, ctx, r.hadamard(e) if rotate else e, pos)


def _step_fused(impl):
    def run(comp, state, x, ctx, inv, rotate):
        from dsv4.ops import reference as r
        f32 = torch.float32
        kv = r.linear(x, comp.wkv.w, out_dtype=f32)
        gate = r.linear(x, comp.wgate.w, out_dtype=f32)
        cos, sin = r.rope_cos_sin(ctx.positions // comp.ratio * comp.ratio, inv)
        visible = impl(kv, gate, comp.ape, state, ctx.slots, ctx.positions, comp.norm.weight, comp.norm.eps, cos, sin,
                       rotate)
        _exact(visible, (ctx.positions + 1) // comp.ratio)          # the entries each query sees now
    return run


@pytest.mark.parametrize("overlap, ratio, dim, layout, rotate", [
    (True, 4, 32, "plain", True), (False, 8, 48, "fp8", False), (True, 4, 32, "fp4", True)])
def test_compressor_step_reference_equals_module(overlap, ratio, dim, layout, rotate):
    """The fused op's spec, token by token, equals the batched compressor fed the same tokens as
    one chunk (CPU, reference vs reference; matmuls of other shapes may sum in another order)."""
    comp, state, hidden = _compressor_case(overlap, ratio, dim, layout, torch.float32, seed=70)
    other = _clone_state(state)
    _decode_run(comp, state, hidden, rotate, 11, _step_module, seed=71, chunk=True)
    _decode_run(comp, other, hidden, rotate, 11, _step_fused(ref.compressor_step), seed=71)
    _states_equal(state, other, exact=False, window_exact=False)


@pytest.mark.parametrize("overlap, ratio, dim, layout, rotate, dtype", [
    (True, 4, 64, "fp4", True, torch.float16), (False, 8, 64, "fp8", False, torch.float16),
    (True, 4, 32, "plain", False, torch.float32)])
def test_compressor_step(overlap, ratio, dim, layout, rotate, dtype):
    comp, state, hidden = _compressor_case(overlap, ratio, dim, layout, dtype, seed=72)
    other = _clone_state(state)
    steps = 2 * ratio + 1                                  # two windows close
    _decode_run(comp, state, hidden, rotate, steps, _step_fused(ref.compressor_step), seed=73)
    _decode_run(comp, other, hidden, rotate, steps, _step_fused(KERNELS["compressor_step"]), seed=73)
    _states_equal(state, other, exact=False)


@pytest.mark.parametrize("overlap, ratio, dim, layout, rotate, dtype, long", [
    (True, 4, 64, "fp4", True, torch.float16, False), (False, 8, 64, "fp8", False, torch.float32, False),
    (True, 4, 32, "plain", False, torch.float32, False),
    (True, 4, 32, "fp8", False, torch.float32, True), (False, 8, 64, "fp4", True, torch.float32, True)])
def test_compressor_step_tokens(overlap, ratio, dim, layout, rotate, dtype, long):
    """A row's few new tokens (a verify step, a short chunk) stepped in order in one launch, chunk
    after chunk: against the reference stepping them, and against what it replaces, the batched
    chunk path (Compressor.forward, RoPE, the entry store); the rows logged for the rollback equal.
    ``long``: prompt chunks of 20 tokens (longer than the log; on the GPU chunks of up to
    compressor.KERNEL_STEP_TOKENS take this path), several windows closing in each."""
    comp, state, hidden = _compressor_case(overlap, ratio, dim, layout, dtype, seed=77)
    state.enable_log(8)
    stepped, kernel = _clone_state(state), _clone_state(state)
    steps, chunk = 2 * ratio + 2, ratio // 2 + 3                       # two windows close, chunks of >= 2
    if long:
        steps, chunk = 5 * ratio + 3, 20
    _decode_run(comp, state, hidden, rotate, steps, _step_module, seed=78, chunk=chunk)
    _decode_run(comp, stepped, hidden, rotate, steps, _step_fused(ref.compressor_step), seed=78, chunk=chunk)
    _decode_run(comp, kernel, hidden, rotate, steps, _step_fused(KERNELS["compressor_step"]), seed=78, chunk=chunk)
    _states_equal(stepped, kernel, exact=False)
    _states_equal(state, kernel, exact=False, window_exact=False)
    for name in ("log_kv", "log_gate"):
        _exact(getattr(kernel, name), getattr(state, name))
        _exact(getattr(stepped, name), getattr(state, name))


@pytest.mark.parametrize("chunk", [False, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compressor_step_pair(dtype, chunk):
    """A CSA layer's KV compressor (fp8 entries, no rotation) and its indexer's (fp4 keys, Hadamard)
    stepped in one launch, token by token (or three tokens a launch) over two closing windows,
    against the reference's two compressor_step calls; the shared window RoPE is the layer's."""
    comp, state, hidden = _compressor_case(True, 4, 48, "fp8", dtype, seed=74)
    icomp, istate, _ = _compressor_case(True, 4, 32, "fp4", dtype, seed=75)
    states = [(state, istate), (_clone_state(state), _clone_state(istate))]

    def run(impl, st):
        def step(_, __, x, ctx, inv, rotate):
            from dsv4.ops import reference as r
            f32 = torch.float32
            cos, sin = r.rope_cos_sin(ctx.positions // 4 * 4, inv)
            args = [(r.linear(x, c.wkv.w, out_dtype=f32), r.linear(x, c.wgate.w, out_dtype=f32), c.ape, s_,
                     c.norm.weight, c.norm.eps, rot) for c, s_, rot in ((comp, st[0], False), (icomp, st[1], True))]
            _exact(impl(*args[0], *args[1], ctx.slots, ctx.positions, cos, sin), (ctx.positions + 1) // 4)
        return step
    _decode_run(comp, None, hidden, False, 9, run(ref.compressor_step_pair, states[0]), seed=76, chunk=chunk)
    _decode_run(comp, None, hidden, False, 9, run(KERNELS["compressor_step_pair"], states[1]), seed=76, chunk=chunk)
    for a, b in zip(*states):
        _states_equal(a, b, exact=False)


# ----------------------------------------------------------------------------- MoE router
def _router_inputs(T: int, E: int, D: int, k: int, seed: int, device=DEV, dtype=torch.float32, big: bool = True):
    """Activations, a gate weight (logits ~ N(0, 9)), a selection bias, a hash table and token ids."""
    x = _randn(T, D, seed=seed, device="cpu")
    weight = _randn(E, D, seed=seed + 3, scale=3.0 / D ** 0.5, device="cpu")
    if big:     # softplus's linear branch (sigmoid would tie such logits at 1)
        weight[0] = x[0] * (21.0 / x[0].square().sum())
    tid2eid = torch.stack([torch.randperm(E, generator=_gen(seed + v))[:k] for v in range(40)]).int()
    tokens = torch.randint(0, 40, (T,), generator=_gen(seed + 1))
    bias = _randn(E, seed=seed + 2, scale=0.5, device="cpu")
    return x.to(dtype).to(device), weight.to(dtype).to(device), bias.to(device), tid2eid.to(device), tokens.to(device)


def _router_equal(got, want, steps: float = 8.0) -> None:
    assert got[1].dtype == torch.int64 and torch.equal(got[1], want[1]), (got[1], want[1])
    _close(got[0], want[0], steps=steps)


@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("T, E, D, k, dtype", [(1, 16, 64, 2, torch.float32), (5, 24, 200, 6, torch.float16),
                                               (3, 200, 96, 6, torch.float32), (11, 24, 64, 6, torch.float32)])
def test_router(func, T, E, D, k, dtype):
    """Gate projection + scores + top-k (with and without the selection bias) and the hash lookup: one
    kernel for a few tokens (split over experts and K, the last program routes), the projection
    then a kernel for more (11 tokens)."""
    x, weight, bias, tid2eid, tokens = _router_inputs(T, E, D, k, seed=170, dtype=dtype, big=func == "sqrtsoftplus")
    for kw in (dict(bias=bias), dict(), dict(tid2eid=tid2eid, token_ids=tokens)):
        _router_equal(KERNELS["router"](x, weight, func, k, scale=1.5, **kw),
                      ref.router(x, weight, func, k, scale=1.5, **kw))
    if T <= small.small_router.GATE_MAX_TOKENS:     # the tile counter and each expert tile's, re-armed
        n = 1 + -(-E // small.small_router._GATE_BE)
        assert torch.equal(runtime.counters_if_allocated(x.device, "router")[:n].cpu(), torch.zeros(n, dtype=torch.int32))


@pytest.mark.parametrize("func", ["sqrtsoftplus", "softmax"])
def test_router_a_token_routes_the_same_bits_in_any_batch(func):
    """The decode kernel routes a batch's rows at once (one block of 1-8 rows): each token's weights
    and picks equal, bit for bit, what routing it alone gives (fp32, with the selection bias)."""
    T, E, D, k = 7, 40, 160, 6
    x, weight, bias, _, _ = _router_inputs(T, E, D, k, seed=176, big=func == "sqrtsoftplus")
    w_all, ids_all = KERNELS["router"](x, weight, func, k, bias=bias, scale=1.5)
    for t in range(T):
        w_one, ids_one = KERNELS["router"](x[t:t + 1], weight, func, k, bias=bias, scale=1.5)
        assert torch.equal(ids_one[0], ids_all[t]) and torch.equal(w_one[0], w_all[t]), t


# ============================================================================= GPU: real shapes, bf16, graphs
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    """Marked ``gpu`` (``pytest -m gpu``) and skipped without CUDA."""
    return pytest.mark.gpu(_needs_cuda(fn))

#: the GPU tests' device and activation dtype (a dry run of their logic can set "cpu", float16)
GDEV, GDT = "cuda", torch.bfloat16
#: (hidden, heads, q_lora) of V4-Flash and V4-Pro
GEOMETRY = {"flash": (4096, 64, 1024), "pro": (7168, 128, 1536)}


def _g(*shape, seed: int, scale: float = 1.0, dtype=None) -> torch.Tensor:
    return _randn(*shape, seed=seed, scale=scale, dtype=dtype or GDT, device=GDEV)


@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("batch", [1, 8, 32, 300, 4096])      # (from 17 tokens: the projection on tensor cores)
@gpu
def test_gpu_mhc(geo, batch):
    D = GEOMETRY[geo][0]
    h = _g(batch, 1, 4, D, seed=100, scale=2.0)
    fn = _g(24, 4 * D, seed=101, scale=0.02, dtype=torch.float32)
    base = _g(24, seed=102, scale=0.5, dtype=torch.float32)
    scale = _g(3, seed=103, scale=0.5, dtype=torch.float32) + 1
    w = _g(D, seed=108, dtype=torch.float32)
    want = ref.mhc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)
    got = KERNELS["mhc_pre_norm"](h, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-6)
    _close(got[0], ref.rms_norm(want[0], w, 1e-6), steps=1.0)
    _close(got[1], want[1], steps=64.0)
    _close(got[2], want[2], steps=256.0)
    out = _g(batch, 1, D, seed=104)
    _close(KERNELS["mhc_post"](out, h, want[1], want[2]), ref.mhc_post(out, h, want[1], want[2]), steps=1.0)
    hf = _g(4, D * 4, seed=105, scale=0.02, dtype=torch.float32)
    hb, hs = _g(4, seed=106, dtype=torch.float32), _g(1, seed=107, dtype=torch.float32)
    _close(KERNELS["hc_head_norm"](h, hf, hb, hs, 1e-6, 1e-6, w, 1e-6),
           ref.rms_norm(ref.hc_head(h, hf, hb, hs, 1e-6, 1e-6), w, 1e-6), steps=1.0)


def test_mhc_post_pre_norm_reads_no_weight_past_the_last_token(monkeypatch):
    """129 tokens over 8 SMs: the projection splits K = 1024 three ways of 384, so the last split's
    last tile lies wholly past K (stream 4 of 4). Its post / comb weights must not be read: here the
    memory after the last token's weights is NaN, which a read put into that token's mix (found on
    an H100 as NaN logits for the last token of a 129-token chunk)."""
    monkeypatch.setattr(runtime, "sm_count", lambda device: 8)
    T, nc, D = 129, 4, 256
    out = _randn(1, T, D, seed=34, scale=2.0)
    h = _randn(1, T, nc, D, seed=35, scale=2.0)
    # post and comb as views at the front of NaN storage (contiguous: the kernel reads them in place)
    post_s = torch.full((T * nc + 64,), float("nan"), device=DEV)
    comb_s = torch.full((T * nc * nc + 64,), float("nan"), device=DEV)
    post = post_s[:T * nc].view(1, T, nc).copy_(_randn(1, T, nc, seed=36).sigmoid() * 2)
    comb = comb_s[:T * nc * nc].view(1, T, nc, nc).copy_(_randn(1, T, nc, nc, seed=37).softmax(-1))
    fn, base, scale = _mixer(nc, D, (2 + nc) * nc, 3, seed=38)
    w = _randn(D, seed=39)
    with runtime.poisoned():
        got = KERNELS["mhc_post_pre_norm"](out, h, post, comb, fn, base, scale, 2, 1e-6, 1e-6, w, 1e-5)
        h_next = KERNELS["mhc_post"](out, h, post, comb)
        want = KERNELS["mhc_pre_norm"](h_next, fn, base, scale, 2, 1e-6, 1e-6, w, 1e-5)
    _exact(got[0], h_next)
    for a, b in zip(got[1:], want):
        assert torch.isfinite(a).all()
        _exact(a, b)


@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("batch", [1, 2, 8, 32])
@gpu
def test_gpu_mhc_post_pre_norm(geo, batch):
    """A block's attention post and MoE pre + norm in one op at V4's widths (one launch up to
    ONE_LAUNCH_MAX_TOKENS tokens, two above): equal to the mhc_post kernel then the mhc_pre_norm
    kernel bit for bit, close to the references; replayed in a CUDA graph, equal to eager."""
    D = GEOMETRY[geo][0]
    out, h = _g(batch, 1, D, seed=190, scale=2.0), _g(batch, 1, 4, D, seed=191, scale=2.0)
    post = _g(batch, 1, 4, seed=192, dtype=torch.float32).sigmoid() * 2
    comb = _g(batch, 1, 4, 4, seed=193, dtype=torch.float32).softmax(-1)
    fn = _g(24, 4 * D, seed=194, scale=0.02, dtype=torch.float32)
    base = _g(24, seed=195, scale=0.5, dtype=torch.float32)
    scale = _g(3, seed=196, scale=0.5, dtype=torch.float32) + 1
    w = _g(D, seed=197, dtype=torch.float32)

    def step():
        return KERNELS["mhc_post_pre_norm"](out, h, post, comb, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-6)
    eager = step()
    h_next = KERNELS["mhc_post"](out, h, post, comb)
    assert torch.equal(eager[0], h_next)
    for a, b in zip(eager[1:], KERNELS["mhc_pre_norm"](h_next, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-6)):
        assert torch.equal(a, b)
    _close(eager[0], ref.mhc_post(out, h, post, comb), steps=1.0)
    want = ref.mhc_pre_norm(eager[0], fn, base, scale, 20, 1e-6, 1e-6, w, 1e-6)
    _close(eager[1], want[0], steps=1.0)
    _close(eager[2], want[1], steps=64.0)
    _close(eager[3], want[2], steps=256.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in outs:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("batch", [1, 32])
@gpu
def test_gpu_norms_rope(geo, batch):
    D, H, ql = GEOMETRY[geo]
    for width in (D, ql, 512):
        x, w = _g(batch, 1, width, seed=110, scale=3.0), _g(width, seed=111, dtype=torch.float32)
        _close(KERNELS["rms_norm"](x, w, 1e-6), ref.rms_norm(x, w, 1e-6), steps=1.0)
    ang = torch.rand(batch, 1, 32, generator=_gen(112), device="cpu").to(GDEV) * 1000
    cos, sin = ang.cos(), ang.sin()
    q = _g(batch, 1, H, 512, seed=113, scale=2.0)
    ch, sh = cos.unsqueeze(2), sin.unsqueeze(2)
    _close(KERNELS["rope_qnorm"](q, ch, sh, 1e-6), ref.rope_qnorm(q, ch, sh, 1e-6), steps=1.0)
    _exact(KERNELS["apply_rope"](q, ch, sh, True), ref.apply_rope(q, ch, sh, True))
    # q_norm and the K=V path on wq_a || wkv's output (column slices of one buffer), one launch
    buf = _g(batch, 1, ql + 512, seed=114, scale=3.0)
    qa, kv = buf[..., :ql], buf[..., ql:]
    qw, kw = _g(ql, seed=116, dtype=torch.float32), _g(512, seed=115, dtype=torch.float32)
    for layout in ("plain", "fp8"):
        ring = RowStore.allocate(layout, 33, 128, 512, GDT, GDEV, rope_dim=64)
        want_q, want = ref.q_kv_prepare(qa, qw, 1e-6, kv, kw, 1e-6, cos, sin, ring)
        got_q, got = KERNELS["q_kv_prepare"](qa, qw, 1e-6, kv, kw, 1e-6, cos, sin, ring)
        _close(got_q, want_q, steps=1.0)
        assert (got == want).float().mean() > 0.999
        _close(got, want, steps=16.0)
        # the decode step's ring store in the same launch: exactly store_rows of its output
        slots = torch.randperm(33, device=GDEV)[:batch].unsqueeze(1)
        rows_ = torch.randint(0, 128, (batch, 1), device=GDEV)
        other = RowStore.allocate(layout, 33, 128, 512, GDT, GDEV, rope_dim=64)
        for ta, tb in zip(ring.tensors(), other.tensors()):
            tb.copy_(ta)
        stored_q, stored = KERNELS["q_kv_prepare"](qa, qw, 1e-6, kv, kw, 1e-6, cos, sin, ring, slots, rows_)
        assert torch.equal(stored, got) and torch.equal(stored_q, got_q)
        ref.store_rows(other, slots, rows_, got)
        for ta, tb in zip(ring.tensors(), other.tensors()):
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))


@pytest.mark.parametrize("batch", [1, 8, 32])
@gpu
def test_gpu_quant_and_stores(batch):
    x = _g(batch, 4096, seed=120, scale=5.0)
    _exact(KERNELS["fp8_sim"](x, 128, True), ref.fp8_sim(x, 128, True))
    _exact(KERNELS["fp8_sim"](x, 64, False), ref.fp8_sim(x, 64, False))
    qi = _g(batch, 1, 64, 128, seed=121)
    _exact(KERNELS["fp4_sim"](qi, 32), ref.fp4_sim(qi, 32))
    for layout, dim, rope in (("fp8", 512, 64), ("fp4", 128, 0), ("plain", 512, 0)):
        a = RowStore.allocate(layout, 33, 130, dim, GDT, GDEV, rope_dim=rope)
        b = RowStore.allocate(layout, 33, 130, dim, GDT, GDEV, rope_dim=rope)
        slots = torch.randperm(33, generator=_gen(122))[:batch].to(GDEV).unsqueeze(1)
        rows_ = torch.randint(0, 130, (batch, 1), generator=_gen(123)).to(GDEV)
        v = _g(batch, 1, dim, seed=124, scale=4.0, dtype=torch.float32 if layout == "fp4" else GDT)
        ref.store_rows(a, slots, rows_, v)
        KERNELS["store_rows"](b, slots, rows_, v)
        for ta, tb in zip(a.tensors(), b.tensors()):
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), layout
    ang = torch.rand(batch, 1, 32, generator=_gen(125)).to(GDEV) * 1000
    ch, sh = ang.cos().unsqueeze(2), ang.sin().unsqueeze(2)
    q = _g(batch, 1, 64, 512, seed=128, scale=2.0)             # Flash's attention queries beside the indexer's
    for fp4 in (False, True):
        got_q, got = KERNELS["queries_prepare"](q, ch, sh, 1e-6, qi, fp4)
        want_q, want = ref.queries_prepare(q, ch, sh, 1e-6, qi, fp4)
        _close(got_q, want_q, steps=1.0)
        if fp4:
            assert (got == want).float().mean() > 0.99
        else:
            _close(got, want, steps=1.0)
    g, u = _g(batch, 2048, seed=126, scale=4.0, dtype=torch.float32), _g(batch, 2048, seed=127, scale=4.0,
                                                                           dtype=torch.float32)
    _close(KERNELS["swiglu"](g, u, 10.0), ref.swiglu(g, u, 10.0), steps=8.0)


@pytest.mark.parametrize("batch", [1, 32])
@gpu
def test_gpu_compress_windows(batch):
    f32 = torch.float32
    kv, gate = _g(batch, 2, 4, 1024, seed=130, dtype=f32), _g(batch, 2, 4, 1024, seed=131, scale=3.0, dtype=f32)
    pk, pg = _g(batch, 2, 4, 512, seed=132, dtype=f32), _g(batch, 2, 4, 512, seed=133, scale=3.0, dtype=f32)
    _close(KERNELS["compress_windows"](kv, gate, pk, pg), ref.compress_windows(kv, gate, pk, pg), steps=64.0)
    kv, gate = _g(batch, 1, 128, 512, seed=134, dtype=f32), _g(batch, 1, 128, 512, seed=135, scale=3.0, dtype=f32)
    _close(KERNELS["compress_windows"](kv, gate), ref.compress_windows(kv, gate), steps=64.0)


def _gpu_compressor(dim, ratio, overlap, layout, slots, seed):
    from dsv4.engine.state import _compressor
    width = 2 * dim if overlap else dim
    entries = RowStore.allocate(layout, slots, 4096 // ratio + 1, dim, GDT, GDEV,
                                rope_dim=64 if layout == "fp8" else 0)
    st = _compressor(entries, slots, ratio, dim, overlap, GDEV)
    st.win_kv.normal_(generator=torch.Generator(GDEV).manual_seed(seed))
    st.win_gate.normal_(generator=torch.Generator(GDEV).manual_seed(seed + 1))
    if overlap:
        st.prev_kv.normal_(generator=torch.Generator(GDEV).manual_seed(seed + 2))
        st.prev_gate.normal_(generator=torch.Generator(GDEV).manual_seed(seed + 3))
    return st, width


@pytest.mark.parametrize("dim, ratio, overlap, layout, rotate", [
    (512, 4, True, "fp8", False), (128, 4, True, "fp4", True), (512, 128, False, "fp8", False)])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("tokens", [1, 4, 40])
@gpu
def test_gpu_compressor_step(dim, ratio, overlap, layout, rotate, batch, tokens):
    """A decode step (1 token a row), a verify step (4 tokens a row, stepped in order, logged for
    the rollback) or a short prompt chunk (40 tokens, longer than the log) against the reference."""
    a, width = _gpu_compressor(dim, ratio, overlap, layout, 33, seed=140)
    if tokens > 1:
        a.enable_log(8)
    b = _clone_state(a)
    slots = torch.randperm(33, generator=_gen(141))[:batch].to(GDEV)
    pos = torch.randint(0, 4000, (batch, 1), generator=_gen(142)).to(GDEV)
    pos[::2] = (pos[::2] // ratio) * ratio + ratio - 1               # half of the rows close a window
    pos = pos + torch.arange(tokens, device=GDEV)                     # [batch, tokens]
    kv = _g(batch, tokens, width, seed=143, dtype=torch.float32)
    gate = _g(batch, tokens, width, seed=144, dtype=torch.float32)
    ape, w = _g(ratio, width, seed=145, dtype=torch.float32), _g(dim, seed=146, dtype=torch.float32) + 1
    ang = (pos // ratio * ratio).float().unsqueeze(-1) * torch.rand(32, generator=_gen(147)).to(GDEV)
    cos, sin = ang.cos(), ang.sin()                                   # [batch, tokens, 32]
    want = ref.compressor_step(kv, gate, ape, a, slots, pos, w, 1e-6, cos, sin, rotate)
    _exact(KERNELS["compressor_step"](kv, gate, ape, b, slots, pos, w, 1e-6, cos, sin, rotate), want)
    _states_equal(a, b, exact=False)
    if tokens > 1:
        _exact(b.log_kv, a.log_kv)
        _exact(b.log_gate, a.log_gate)


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("tokens", [1, 4, 40])
@gpu
def test_gpu_compressor_step_pair(batch, tokens):
    """Flash's CSA step: the KV compressor (512, fp8 entries) and the indexer's (128, fp4 keys,
    Hadamard) in one launch against the reference's two steps, at 1 token a row (decode) or 4
    (verify); then replayed in a CUDA graph."""
    a, width = _gpu_compressor(512, 4, True, "fp8", 33, seed=170)
    ia, iwidth = _gpu_compressor(128, 4, True, "fp4", 33, seed=171)
    b, ib = _clone_state(a), _clone_state(ia)
    slots = torch.randperm(33, generator=_gen(172))[:batch].to(GDEV)
    pos = torch.randint(0, 4000, (batch, 1), generator=_gen(173)).to(GDEV)
    pos[::2] = (pos[::2] // 4) * 4 + 3                                # half of the rows close a window
    pos = pos + torch.arange(tokens, device=GDEV)                     # [batch, tokens]
    f32 = torch.float32
    kv, gate = _g(batch, tokens, width, seed=174, dtype=f32), _g(batch, tokens, width, seed=175, dtype=f32)
    ikv, igate = _g(batch, tokens, iwidth, seed=176, dtype=f32), _g(batch, tokens, iwidth, seed=177, dtype=f32)
    ape, w = _g(4, width, seed=178, dtype=torch.float32), _g(512, seed=179, dtype=torch.float32) + 1
    iape, iw = _g(4, iwidth, seed=180, dtype=torch.float32), _g(128, seed=181, dtype=torch.float32) + 1
    ang = (pos // 4 * 4).float().unsqueeze(-1) * torch.rand(32, generator=_gen(182)).to(GDEV)
    cos, sin = ang.cos(), ang.sin()                                   # [batch, tokens, 32]

    def args(s1, s2):
        return (kv, gate, ape, s1, w, 1e-6, False, ikv, igate, iape, s2, iw, 1e-6, True, slots, pos, cos, sin)
    want = ref.compressor_step_pair(*args(a, ia))
    saved = [_clone_state(b), _clone_state(ib)]
    _exact(KERNELS["compressor_step_pair"](*args(b, ib)), want)
    _states_equal(a, b, exact=False)
    _states_equal(ia, ib, exact=False)
    after = [_clone_state(b), _clone_state(ib)]
    c, ic = saved
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        visible = KERNELS["compressor_step_pair"](*args(c, ic))
    visible.fill_(-1)
    c2, ic2 = _clone_state(saved[0]), _clone_state(saved[1])
    for st, src in ((c, c2), (ic, ic2)):             # back to the state before the step, then replay
        for name in ("win_kv", "win_gate", "prev_kv", "prev_gate"):
            getattr(st, name).copy_(getattr(src, name))
        for t, u in zip(st.entries.tensors(), src.entries.tensors()):
            t.copy_(u)
    graph.replay()
    torch.cuda.synchronize()
    _states_equal(after[0], c, exact=True)
    _states_equal(after[1], ic, exact=True)
    _exact(visible, want)


@pytest.mark.parametrize("geo", ["flash", "pro"])
@pytest.mark.parametrize("batch", [1, 8, 32])
@gpu
def test_gpu_router(geo, batch):
    """The router kernel at V4's expert counts (top-6 of 256 / 384), also replayed in a CUDA graph."""
    E = {"flash": 256, "pro": 384}[geo]
    D = GEOMETRY[geo][0]
    x, weight, bias, tid2eid, tokens = _router_inputs(batch, E, D, 6, seed=175, device=GDEV, dtype=GDT)
    cases = (dict(bias=bias), dict(tid2eid=tid2eid, token_ids=tokens))
    eager = [KERNELS["router"](x, weight, "sqrtsoftplus", 6, scale=1.5, **kw) for kw in cases]
    for got, kw in zip(eager, cases):
        _router_equal(got, ref.router(x, weight, "sqrtsoftplus", 6, scale=1.5, **kw), steps=64.0)   # 4096 products
        if batch > small.small_router.GATE_MAX_TOKENS:
            continue        # (more tokens: the projection by the linear op, not the decode kernel)
        # the batch's last token routed alone: the same bits (the decode kernel's rows are independent)
        alone = KERNELS["router"](x[-1:], weight, "sqrtsoftplus", 6, scale=1.5,
                                  **{k: (v[-1:] if k == "token_ids" else v) for k, v in kw.items()})
        assert torch.equal(alone[1][0], got[1][-1]) and torch.equal(alone[0][0], got[0][-1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [KERNELS["router"](x, weight, "sqrtsoftplus", 6, scale=1.5, **kw) for kw in cases]
    for got in outs:
        for t in got:
            t.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, eager):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@gpu
def test_gpu_graph_replay_equals_eager():
    """A decode layer's small ops captured in one CUDA graph replay to exactly the eager results."""
    D, H, batch = 4096, 64, 8
    h = _g(batch, 1, 4, D, seed=150)
    fn, base = _g(24, 4 * D, seed=151, scale=0.02, dtype=torch.float32), _g(24, seed=152, dtype=torch.float32)
    scale = _g(3, seed=153, dtype=torch.float32)
    q, kv = _g(batch, 1, H, 512, seed=154), _g(batch, 1, 512, seed=155)
    kw = _g(512, seed=156, dtype=torch.float32)
    ang = torch.rand(batch, 1, 32, generator=_gen(157)).to(GDEV) * 100
    cos, sin = ang.cos(), ang.sin()
    ring = RowStore.allocate("fp8", batch, 128, 512, GDT, GDEV, rope_dim=64)
    st, width = _gpu_compressor(512, 4, True, "fp8", batch, seed=158)
    slots = torch.arange(batch, device=GDEV)
    pos = torch.arange(batch, device=GDEV).unsqueeze(1) * 3 + 3
    ckv, cg = _g(batch, 1, width, seed=159, dtype=torch.float32), _g(batch, 1, width, seed=160, dtype=torch.float32)
    ape = _g(4, width, seed=161, dtype=torch.float32)

    def step():
        y, post, comb = KERNELS["mhc_pre_norm"](h, fn, base, scale, 20, 1e-6, 1e-6, kw[:1].expand(D).contiguous(), 1e-6)
        qq = KERNELS["rope_qnorm"](q, cos.unsqueeze(2), sin.unsqueeze(2), 1e-6)
        _, k = KERNELS["q_kv_prepare"](q[:, :, 0], kw, 1e-6, kv, kw, 1e-6, cos, sin, ring, slots.unsqueeze(1),
                                       pos % 128)
        KERNELS["compressor_step"](ckv, cg, ape, st, slots, pos, kw, 1e-6, cos, sin, False)
        one = KERNELS["mhc_pre_norm"](h[:1], fn, base, scale, 20, 1e-6, 1e-6, kw[:1].expand(D).contiguous(), 1e-6)
        return [KERNELS["mhc_post"](y, h, post, comb), qq, k, *one]      # (one token: one launch)

    saved = [t.clone() for t in ring.tensors() + st.entries.tensors() + [st.win_kv, st.win_gate, st.prev_kv,
                                                                           st.prev_gate]]
    live = ring.tensors() + st.entries.tensors() + [st.win_kv, st.win_gate, st.prev_kv, st.prev_gate]
    eager = step()
    after = [t.clone() for t in live]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                                       # warm-up (compiles) outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for t, s in zip(live, saved):
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, eager):
        assert torch.equal(a, b)
    for a, b in zip(live, after):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


# ----------------------------------------------------------------------------- the whole decode step
@pytest.mark.parametrize("qat", [False, True])
def test_decode_with_small_kernels_equals_reference(qat, monkeypatch):
    """A tiny model (every layer kind) decodes with every small-op kernel (interpreter) and the
    fused ops switched in by the proposed model edits: logits and the generation state match the
    reference decode."""
    from conftest import parity_config, random_model
    from dsv4 import ops
    from dsv4.engine.runner import Runner

    kinds = ["sliding", "csa", "hca"]
    config = parity_config(num_hidden_layers=3, layer_kinds=kinds, compress_ratios=[0, 4, 16],
                           hash_layers=[True, False, False])
    model = random_model(config, seed=5).to(DEV)
    runners = [Runner(model, max_num_seqs=2, max_model_len=64, qat_sim=qat) for _ in range(2)]
    with ops.reference_only():
        for r in runners:
            prefill(r, 0, list(range(2, 17)))
            prefill(r, 1, list(range(3, 9)))
    for op, _, fn in small.REGISTRATIONS:
        monkeypatch.setitem(ops._KERNELS, (op, DEV, None), fn)
    for step in range(2):                       # positions 15, 16 and 6, 7: CSA and HCA windows close
        ids = torch.tensor([7 + step, 11 + step])
        with ops.reference_only():
            want = decode(runners[0], [0, 1], ids)
        got = decode(runners[1], [0, 1], ids)
        torch.testing.assert_close(got, want, rtol=1e-4 if qat else 1e-5, atol=1e-4 if qat else 1e-5)
    for a, b in zip(runners[0].state.layers, runners[1].state.layers):
        for comp in ("compressor", "indexer"):
            if getattr(a, comp) is not None:
                _states_equal(getattr(a, comp), getattr(b, comp), exact=False, window_exact=False)
        for ta, tb in zip(a.ring.tensors(), b.ring.tensors()):
            if ta.dtype in (torch.uint8, torch.float8_e4m3fn):
                assert (ta.view(torch.uint8) == tb.view(torch.uint8)).float().mean() > 0.99
            else:
                _close(tb, ta, steps=64.0)
