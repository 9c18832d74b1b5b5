"""Unit tests for every public function of ``dsv4.ops.reference`` / ``dsv4.ops.numerics`` and for
the dispatch in ``dsv4.ops``.

Every expected value is computed independently of the function under test: naive Python loops
written from DSV4_FACTS section 2, hand-enumerated number grids, or an outside implementation
(transformers' YaRN, complex multiplication, a Kronecker-built Hadamard matrix).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4 import ops
from dsv4.config import YarnConfig
from dsv4.ops import numerics
from dsv4.ops import reference as ref
from dsv4.model.cache import RowStore


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)) * scale


def close(actual: torch.Tensor, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def softmax(vals: list[float]) -> list[float]:
    m = max(vals)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in vals]
    s = sum(e)
    return [v / s for v in e]


def swiglu_py(g: float, u: float, limit: float) -> float:
    if limit > 0:
        g, u = min(g, limit), max(-limit, min(u, limit))        # the gate is clamped above only
    return g * sigmoid(g) * u


def dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def sinkhorn_py(m: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    """One column normalisation, then ``iters - 1`` rounds of (row, column), eps in denominators."""
    n = len(m)

    def cols(m):
        sums = [sum(m[i][j] for i in range(n)) for j in range(n)]
        return [[m[i][j] / (sums[j] + eps) for j in range(n)] for i in range(n)]

    m = cols(m)
    for _ in range(iters - 1):
        m = cols([[v / (sum(row) + eps) for v in row] for row in m])
    return m


# ----------------------------------------------------------------------------- norms
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm(eps):
    x, w = randn(2, 3, 16, seed=1), randn(16, seed=2)
    out = ref.rms_norm(x, w, eps)
    exp = [[[w[i].item() * v / math.sqrt(sum(u * u for u in row) / 16 + eps) for i, v in enumerate(row)]
            for row in mat] for mat in x.tolist()]
    close(out, exp)
    assert out.dtype == torch.float32
    assert ref.rms_norm(x.bfloat16(), w, eps).dtype == torch.bfloat16


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm_unweighted(eps):
    x = randn(3, 4, 8, seed=3)
    out = ref.rms_norm_unweighted(x, eps)
    exp = [[[v / math.sqrt(sum(u * u for u in row) / 8 + eps) for v in row] for row in mat] for mat in x.tolist()]
    close(out, exp)
    assert ref.rms_norm_unweighted(x.bfloat16(), eps).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- RoPE
def test_rope_inv_freq_plain():
    out = ref.rope_inv_freq(16, 10000.0)
    close(out, [10000.0 ** (-2 * i / 16) for i in range(8)], rtol=1e-6)
    assert out.dtype == torch.float32
    # factor <= 1 means no YaRN
    close(ref.rope_inv_freq(16, 10000.0, YarnConfig(factor=1.0, original_max_position_embeddings=8)),
          [10000.0 ** (-2 * i / 16) for i in range(8)], rtol=1e-6)


@pytest.mark.parametrize("rd,theta,factor,orig,fast,slow", [
    (16, 10000.0, 4.0, 64, 32.0, 1.0),
    (64, 160000.0, 16.0, 65536, 32.0, 1.0),
    (32, 50000.0, 8.0, 2048, 16.0, 2.0),
])
def test_rope_inv_freq_yarn_matches_transformers(rd, theta, factor, orig, fast, slow):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    cfg = LlamaConfig(hidden_size=rd * 2, num_attention_heads=2, head_dim=rd,
                      max_position_embeddings=int(orig * factor),
                      rope_parameters=dict(rope_type="yarn", rope_theta=theta, factor=factor,
                                           original_max_position_embeddings=orig, beta_fast=fast,
                                           beta_slow=slow))
    hf, _ = _compute_yarn_parameters(cfg)
    yarn = YarnConfig(factor=factor, original_max_position_embeddings=orig, beta_fast=fast, beta_slow=slow)
    out = ref.rope_inv_freq(rd, theta, yarn)
    close(out, hf, rtol=1e-6, atol=0)
    plain = ref.rope_inv_freq(rd, theta)
    assert not torch.allclose(out, plain)                       # YaRN really changed something
    close(out[0], plain[0], rtol=1e-6)                          # highest frequency extrapolated
    close(out[-1], plain[-1] / factor, rtol=1e-6)               # lowest frequency interpolated


def test_rope_cos_sin():
    inv = torch.tensor([1.0, 0.3, 0.01, 1e-4])
    pos = torch.tensor([[0, 1, 7], [13, 40, 2]])
    cos, sin = ref.rope_cos_sin(pos, inv)
    assert cos.shape == sin.shape == (2, 3, 4) and cos.dtype == torch.float32
    close(cos, [[[math.cos(p * f) for f in inv.tolist()] for p in row] for row in pos.tolist()], atol=1e-5)
    close(sin, [[[math.sin(p * f) for f in inv.tolist()] for p in row] for row in pos.tolist()], atol=1e-5)


@pytest.mark.parametrize("hd,rd", [(12, 8), (8, 8)])
def test_apply_rope(hd, rd):
    x = randn(2, 3, 4, hd, seed=4)
    ang = randn(2, 3, 1, rd // 2, seed=5, scale=3.0)
    cos, sin = ang.cos(), ang.sin()
    out = ref.apply_rope(x, cos, sin)
    rot = torch.view_as_complex(x[..., -rd:].double().reshape(2, 3, 4, rd // 2, 2).contiguous())
    exp = torch.view_as_real(rot * torch.polar(torch.ones_like(ang.double()), ang.double())).flatten(-2)
    close(out[..., -rd:], exp, atol=1e-6)
    assert torch.equal(out[..., :-rd], x[..., :-rd])            # only the last rd dims change
    inv = ref.apply_rope(x, cos, sin, inverse=True)
    exp_inv = torch.view_as_real(rot * torch.polar(torch.ones_like(ang.double()), -ang.double())).flatten(-2)
    close(inv[..., -rd:], exp_inv, atol=1e-6)
    close(ref.apply_rope(out, cos, sin, inverse=True), x, atol=1e-6)   # inverse undoes forward
    assert ref.apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("n", [1, 2, 8, 32])
def test_hadamard(n):
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    hm = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(int(math.log2(n))):
        hm = torch.kron(h2, hm)
    hm = hm / math.sqrt(n)
    x, y = randn(3, n, seed=6), randn(3, n, seed=7)
    hx, hy = ref.hadamard(x), ref.hadamard(y)
    close(hx, x.double() @ hm, atol=1e-6)
    eye = ref.hadamard(torch.eye(n))
    close(eye @ eye.T, torch.eye(n), atol=1e-6)                 # orthonormal
    close((hx * hy).sum(-1), (x.double() * y.double()).sum(-1), atol=1e-5)  # preserves dot products
    assert ref.hadamard(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        ref.hadamard(torch.zeros(2, 12))                        # not a power of two


# ----------------------------------------------------------------------------- QAT simulation
def _e4m3_values() -> list[float]:
    vals = []
    for e in range(16):
        for m in range(8):
            if not (e == 15 and m == 7):                        # e4m3fn: only S.1111.111 is NaN
                vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals                                                 # sorted: index == code


E4M3 = _e4m3_values()
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest(v: float, grid: list[float]) -> float:
    """Nearest grid magnitude, ties to the even code, sign kept."""
    a = abs(v)
    i = min(range(len(grid)), key=lambda k: (abs(grid[k] - a), k % 2))
    return math.copysign(grid[i], v)


def fp8_expected(x: torch.Tensor, block: int, pow2: bool) -> tuple[list[float], list[float]]:
    """Per-row expected values and the per-element scale, for a 1-D ``x``."""
    out, scales = [], []
    for b0 in range(0, x.shape[0], block):
        blk = x[b0:b0 + block]
        amax = max(blk.abs().max().item(), 1e-4)
        if pow2:
            s = 2.0 ** math.ceil(math.log2(amax / 448.0))
            qs = [v / s for v in blk.tolist()]
        else:
            s32 = torch.tensor(amax, dtype=torch.float32) / 448.0
            s = s32.item()
            qs = [min(max(q, -448.0), 448.0) for q in (blk / s32).tolist()]
        out += [nearest(q, E4M3) * s for q in qs]
        scales += [s] * blk.shape[0]
    return out, scales


def test_fp8_sim_pow2_ragged():
    assert max(E4M3) == 448.0 and len(E4M3) == 127
    x = randn(2, 3, 150, seed=8, scale=5.0)
    x[0, 1, 128:] *= 1e-3                                       # ragged last block, much smaller
    x[1, 0, 64:128] = 0.0                                       # an all-zero block
    out = ref.fp8_sim(x, block=64, pow2=True)
    assert out.shape == x.shape and out.dtype == torch.float32
    grid = set(E4M3) | {-v for v in E4M3}
    for idx in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]:
        exp, scales = fp8_expected(x[idx], 64, True)
        close(out[idx], exp, rtol=1e-6, atol=0)
        for o, v, s in zip(out[idx].tolist(), x[idx].tolist(), scales):
            assert math.log2(s) == round(math.log2(s))          # power-of-two scale
            assert o / s in grid                                # an e4m3 value times the scale
            assert abs(o - v) <= max(abs(v) * 2 ** -4, s * 2 ** -10) * (1 + 1e-6)
    # the ragged block got its own scale: its small values keep ~3 mantissa bits
    small = x[0, 1, 128:]
    assert ((out[0, 1, 128:] - small).abs() <= small.abs() * 2 ** -4 + 1e-12).all()
    assert (out[1, 0, 64:128] == 0).all()
    assert ref.fp8_sim(x.bfloat16()).dtype == torch.bfloat16


def test_fp8_sim_non_pow2():
    x = randn(3, 100, seed=9, scale=2.0)
    out = ref.fp8_sim(x, block=32, pow2=False)
    for r in range(3):
        exp, _ = fp8_expected(x[r], 32, False)
        close(out[r], exp, rtol=1e-6, atol=0)
    # each block's amax maps to +-448 exactly, so it survives (up to fp32 rounding of amax/448*448)
    for b0 in range(0, 100, 32):
        blk, oblk = x[:, b0:b0 + 32], out[:, b0:b0 + 32]
        i = blk.abs().argmax(-1, keepdim=True)
        close(oblk.gather(-1, i), blk.gather(-1, i), rtol=1e-6)
    assert not torch.equal(out, ref.fp8_sim(x, block=32, pow2=True))


def test_round_e2m1_hand_cases():
    cases = {0.0: 0.0, 0.1: 0.0, 0.25: 0.0, 0.26: 0.5, 0.74: 0.5, 0.75: 1.0, 1.25: 1.0, 1.3: 1.5,
             1.75: 2.0, 2.5: 2.0, 2.6: 3.0, 3.5: 4.0, 4.9: 4.0, 5.0: 4.0, 5.1: 6.0, 6.0: 6.0, 7.0: 6.0,
             -0.75: -1.0, -1.25: -1.0, -2.5: -2.0, -3.5: -4.0, -5.0: -4.0, -5.5: -6.0, -100.0: -6.0}
    out = numerics.round_e2m1(torch.tensor(list(cases)))
    assert out.tolist() == list(cases.values())
    x = randn(500, seed=10, scale=2.5).clamp(-6, 6)
    out = numerics.round_e2m1(x)
    assert out.tolist() == [nearest(v, E2M1) for v in x.tolist()]


def test_fp4_sim():
    x = randn(3, 80, seed=11, scale=3.0)
    x[1, 64:] *= 1e-2                                           # ragged last block, own scale
    x[2, :32] *= 1e-7                                           # amax below 1e-4: floored at 6 * 2^-126 only
    out = ref.fp4_sim(x, block=32)
    grid = set(E2M1) | {-v for v in E2M1}
    for r in range(3):
        exp = []
        for b0 in range(0, 80, 32):
            blk = x[r, b0:b0 + 32].tolist()
            s = 2.0 ** math.ceil(math.log2(max(max(abs(v) for v in blk), 6 * 2.0 ** -126) / 6.0))
            exp += [nearest(v / s, E2M1) * s for v in blk]
            assert all(o / s in grid for o in out[r, b0:b0 + 32].tolist())
        close(out[r], exp, rtol=1e-6, atol=0)
    assert ref.fp4_sim(x.bfloat16()).dtype == torch.bfloat16


def test_pow2_ceil_is_exact_just_above_a_power_of_two():
    """2^ceil(log2 v) from the float's bits: exp2(ceil(log2(v))) in floating point lands one step
    low just above a power of two (DSV4_FACTS 2b)."""
    for k in (-20, -3, 0, 1, 7):
        p = 2.0 ** k
        above = torch.tensor([p], dtype=torch.float32).nextafter(torch.tensor([math.inf]))
        assert numerics.pow2_ceil(torch.tensor([p])).item() == p
        assert numerics.pow2_ceil(above).item() == 2 * p
        assert numerics.pow2_ceil(torch.tensor([1.5 * p])).item() == 2 * p
    v = torch.rand(1000, generator=gen(12)) * 1000 + 1e-3
    got = numerics.pow2_ceil(v).tolist()
    for a, b in zip(v.tolist(), got):
        m, e = math.frexp(a)                                    # a = m * 2^e, m in [0.5, 1)
        assert b == (a if m == 0.5 else 2.0 ** e)


def test_e2m1_codes_decode_and_pack_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = numerics.e2m1_decode(codes)
    assert values.tolist() == list(numerics.E2M1_VALUES)
    assert torch.equal(numerics.e2m1_codes(values)[values != 0], codes[values != 0])
    packed = numerics.pack_e2m1(codes)
    assert packed.tolist() == [c0 | (c1 << 4) for c0, c1 in zip(range(0, 16, 2), range(1, 16, 2))]
    assert torch.equal(numerics.unpack_e2m1(packed), codes)


def test_act_quant_sim_is_deepseeks_act_quant():
    """Blocks of 128, amax floored at 1e-4, power-of-two (ue8m0) or plain amax/448 scales."""
    x = randn(2, 300, seed=13, scale=4.0)
    x[1, 128:256] = 0.0
    for pow2 in (True, False):
        out = numerics.act_quant_sim(x, 128, pow2)
        for r in range(2):
            exp, _ = fp8_expected(x[r], 128, pow2)
            close(out[r], exp, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- mHC
def test_sinkhorn_hand_loop():
    m = torch.rand(3, 4, 4, generator=gen(12)) + 0.05
    for iters in (1, 2, 5):
        out = ref.sinkhorn(m, iters, 1e-3)
        close(out, [sinkhorn_py(mat, iters, 1e-3) for mat in m.tolist()])
    once = ref.sinkhorn(m, 1, 0.0)
    close(once.sum(-2), torch.ones(3, 4))                       # one column normalisation only
    assert not torch.allclose(once.sum(-1), torch.ones(3, 4), atol=1e-3)


def test_sinkhorn_approaches_doubly_stochastic():
    m = torch.softmax(randn(2, 4, 4, seed=13, scale=2.0), -1) + 1e-6
    out = ref.sinkhorn(m, 60, 1e-6)
    close(out.sum(-1), torch.ones(2, 4), atol=1e-4)
    close(out.sum(-2), torch.ones(2, 4), atol=1e-4)
    few = ref.sinkhorn(m, 2, 1e-6)
    assert (few.sum(-1) - 1).abs().max() > (out.sum(-1) - 1).abs().max()


def mhc_pre_py(h, fn, base, scale, iters, norm_eps, hc_eps):
    """Per-token loops over ``h [T, nc, D]`` from DSV4_FACTS section 2."""
    nc = len(h[0])
    ys, posts, combs = [], [], []
    for tok in h:
        x = [v for stream in tok for v in stream]
        r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + norm_eps)
        mix = [dot(x, row) * r for row in fn]
        pre = [sigmoid(mix[j] * scale[0] + base[j]) + hc_eps for j in range(nc)]
        post = [2 * sigmoid(mix[nc + j] * scale[1] + base[nc + j]) for j in range(nc)]
        comb = []
        for j in range(nc):
            logits = [mix[2 * nc + j * nc + k] * scale[2] + base[2 * nc + j * nc + k] for k in range(nc)]
            comb.append([p + hc_eps for p in softmax(logits)])
        comb = sinkhorn_py(comb, iters, hc_eps)
        ys.append([sum(pre[j] * tok[j][d] for j in range(nc)) for d in range(len(tok[0]))])
        posts.append(post)
        combs.append(comb)
    return ys, posts, combs


def test_mhc_pre():
    B, S, nc, D, iters = 2, 3, 4, 8, 5
    h = randn(B, S, nc, D, seed=14)
    fn = randn((2 + nc) * nc, nc * D, seed=15, scale=0.3)
    base, scale = randn((2 + nc) * nc, seed=16), torch.tensor([0.7, 1.3, 0.9])
    y, post, comb = ref.mhc_pre(h, fn, base, scale, iters, 1e-6, 1e-3)
    ey, ep, ec = mhc_pre_py(h.flatten(0, 1).tolist(), fn.tolist(), base.tolist(), scale.tolist(), iters, 1e-6, 1e-3)
    close(y, torch.tensor(ey).view(B, S, D), atol=1e-5)
    close(post, torch.tensor(ep).view(B, S, nc), atol=1e-6)
    close(comb, torch.tensor(ec).view(B, S, nc, nc), atol=1e-6)
    assert post.dtype == comb.dtype == torch.float32
    assert ref.mhc_pre(h.bfloat16(), fn, base, scale, iters, 1e-6, 1e-3)[0].dtype == torch.bfloat16


def test_mhc_pre_split_order():
    """With fn = 0 the sections are pure functions of base: pre, then post, then comb."""
    nc, D = 3, 4
    h = randn(1, nc, D, seed=17)
    base = torch.arange((2 + nc) * nc, dtype=torch.float32) * 0.1 - 0.7
    y, post, comb = ref.mhc_pre(h, torch.zeros((2 + nc) * nc, nc * D), base, torch.ones(3), 1, 1e-6, 0.0)
    pre = [sigmoid(b) for b in base[:nc].tolist()]
    close(y[0], [sum(pre[j] * h[0, j, d].item() for j in range(nc)) for d in range(D)])
    close(post[0], [2 * sigmoid(b) for b in base[nc:2 * nc].tolist()])
    raw = [softmax(base[2 * nc + j * nc: 2 * nc + (j + 1) * nc].tolist()) for j in range(nc)]
    close(comb[0], sinkhorn_py(raw, 1, 0.0))


def test_mhc_post_mixes_in_fp32():
    """The post/comb weights stay fp32 and the mix runs in fp32, cast once (DeepSeek's code)."""
    h, out = randn(2, 4, 16, seed=14).bfloat16(), randn(2, 16, seed=15).bfloat16()
    post, comb = torch.rand(2, 4, generator=gen(16)) * 2, torch.rand(2, 4, 4, generator=gen(17))
    got = ref.mhc_post(out, h, post, comb)
    exp = (post.double().unsqueeze(-1) * out.double().unsqueeze(-2)
           + comb.double().transpose(-1, -2) @ h.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exp.bfloat16().double(), rtol=0, atol=0)


def test_mhc_post_uses_comb_transposed():
    T, nc, D = 3, 4, 5
    out, h = randn(T, D, seed=18), randn(T, nc, D, seed=19)
    post, comb = torch.rand(T, nc, generator=gen(20)) * 2, torch.rand(T, nc, nc, generator=gen(21))
    res = ref.mhc_post(out, h, post, comb)
    exp = [[[post[t, k].item() * out[t, d].item() + sum(comb[t, j, k].item() * h[t, j, d].item() for j in range(nc))
             for d in range(D)] for k in range(nc)] for t in range(T)]
    close(res, exp, atol=1e-6)
    assert not torch.allclose(comb, comb.transpose(-1, -2))     # the direction matters in this test
    assert ref.mhc_post(out.bfloat16(), h.bfloat16(), post, comb).dtype == torch.bfloat16


def test_hc_head():
    T, nc, D = 4, 4, 6
    h = randn(T, nc, D, seed=22)
    fn, base, scale = randn(nc, nc * D, seed=23, scale=0.3), randn(nc, seed=24), torch.tensor([0.8])
    out = ref.hc_head(h, fn, base, scale, 1e-6, 1e-3)
    exp = []
    for tok in h.tolist():
        x = [v for s in tok for v in s]
        r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + 1e-6)
        pre = [sigmoid(dot(x, row) * r * 0.8 + b) + 1e-3 for row, b in zip(fn.tolist(), base.tolist())]
        exp.append([sum(pre[j] * tok[j][d] for j in range(nc)) for d in range(D)])
    close(out, exp, atol=1e-6)


# ----------------------------------------------------------------------------- attention
def _store(values: torch.Tensor) -> RowStore:
    """A plain row store holding ``values [slots, rows, dim]``."""
    st = RowStore.allocate("plain", values.shape[0], values.shape[1], values.shape[2], values.dtype, "cpu")
    st.data.copy_(values)
    return st


def _attention_py(q, keys_per_query, sink, scale):
    """Naive attention of one query (``q [H, hd]``) over a list of key=value rows, with a sink."""
    H, hd = q.shape
    out = torch.zeros(H, hd, dtype=torch.float64)
    for hh in range(H):
        logits = [dot(q[hh].tolist(), k.tolist()) * scale for k in keys_per_query]
        probs = softmax(logits + [sink[hh].item()])[:-1]        # the sink's value is zero
        for p, k in zip(probs, keys_per_query):
            out[hh] += p * k.double()
    return out


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_sparse_attention(kind):
    """Window ring + this forward's rows + compressed entries by index (CSA) or length (HCA),
    against a loop over the keys each query sees, positions computed from first principles."""
    B, S, H, hd, W, n_ent, scale = 2, 3, 2, 8, 4, 6, 8 ** -0.5
    slots_total = 3
    slots = torch.tensor([2, 0])
    start = torch.tensor([9, 2])                                # slot 2 wrapped its ring, slot 0 did not
    q, kv_new = randn(B, S, H, hd, seed=25), randn(B, S, hd, seed=26)
    ring_vals = randn(slots_total, W, hd, seed=27)
    ent_vals = randn(slots_total, n_ent + 1, hd, seed=28)
    sink = torch.tensor([0.5, -1.0])
    comp = dict()
    idx = torch.tensor([[[0, -1, 2], [1, 0, -1], [-1, -1, -1]],
                        [[0, 3, -1], [3, -1, 1], [2, 2, -1]]])   # -1 = none (a duplicate counts twice)
    length = torch.tensor([[2, 2, 3], [0, 1, 1]])
    if kind == "csa":
        comp = dict(comp=_store(ent_vals), comp_idx=idx)
    elif kind == "hca":
        comp = dict(comp=_store(ent_vals), comp_len=length, comp_bound=3)
    out = ref.sparse_attention(q, kv_new, _store(ring_vals), slots, start, W, sink, scale, **comp)
    for b in range(B):
        st, sl = start[b].item(), slots[b].item()
        for s in range(S):
            t = st + s
            keys = [ring_vals[sl, p % W] for p in range(max(0, t - W + 1), st)]   # stored before this call
            keys += [kv_new[b, j] for j in range(S) if st + j <= t and st + j > t - W]
            if kind == "csa":
                keys += [ent_vals[sl, i] for i in idx[b, s].tolist() if i >= 0]
            elif kind == "hca":
                keys += [ent_vals[sl, i] for i in range(length[b, s].item())]
            close(out[b, s], _attention_py(q[b, s], keys, sink, scale), atol=1e-6)
    bf = ref.sparse_attention(q.bfloat16(), kv_new.bfloat16(), _store(ring_vals.bfloat16()), slots, start, W,
                              sink, scale)
    assert bf.dtype == torch.bfloat16


def test_sparse_attention_query_chunks_equal_one_pass(monkeypatch):
    B, S, H, hd, W = 1, 7, 2, 8, 4
    q, kv_new = randn(B, S, H, hd, seed=60), randn(B, S, hd, seed=61)
    ents = _store(randn(1, 9, hd, seed=62))
    idx = torch.randint(-1, 8, (B, S, 5), generator=gen(63))
    args = (q, kv_new, _store(randn(1, W, hd, seed=64)), torch.tensor([0]), torch.tensor([5]), W,
            torch.tensor([0.1, 0.2]), 0.3, ents, idx)
    one = ref.sparse_attention(*args)
    monkeypatch.setattr(ref, "ATTENTION_GATHER_ELEMENTS", 1)   # one query per chunk
    torch.testing.assert_close(ref.sparse_attention(*args), one, rtol=1e-6, atol=1e-6)


def test_compress_windows_hca():
    B, m, hd = 2, 4, 6
    kv, gate = randn(B, m, hd, seed=28), randn(B, m, hd, seed=29)
    out = ref.compress_windows(kv, gate)
    exp = [[dot(softmax([gate[b, i, c].item() for i in range(m)]), [kv[b, i, c].item() for i in range(m)])
            for c in range(hd)] for b in range(B)]
    close(out, exp)


def test_compress_windows_csa_overlap():
    B, m, hd = 2, 4, 5
    kv, gate = randn(B, m, 2 * hd, seed=30), randn(B, m, 2 * hd, seed=31)
    pkv, pgate = randn(B, m, hd, seed=32), randn(B, m, hd, seed=33)
    out = ref.compress_windows(kv, gate, pkv, pgate)
    exp = []
    for b in range(B):
        row = []
        for c in range(hd):
            logits = [pgate[b, i, c].item() for i in range(m)] + [gate[b, i, hd + c].item() for i in range(m)]
            vals = [pkv[b, i, c].item() for i in range(m)] + [kv[b, i, hd + c].item() for i in range(m)]
            row.append(dot(softmax(logits), vals))
        exp.append(row)
    close(out, exp)
    # the current window's a halves do not enter this entry
    kv2, gate2 = kv.clone(), gate.clone()
    kv2[..., :hd], gate2[..., :hd] = 100.0, 100.0
    close(ref.compress_windows(kv2, gate2, pkv, pgate), out)
    # a -inf previous gate (window 0) gives the a slots weight 0
    out0 = ref.compress_windows(kv, gate, pkv, torch.full_like(pgate, -math.inf))
    exp0 = [[dot(softmax([gate[b, i, hd + c].item() for i in range(m)]), [kv[b, i, hd + c].item() for i in range(m)])
             for c in range(hd)] for b in range(B)]
    close(out0, exp0)


def test_indexer_scores():
    B, S, nI, d, C = 2, 3, 4, 8, 5
    q, w = randn(B, S, nI, d, seed=34), randn(B, S, nI, seed=36)
    keys = randn(3, C + 1, d, seed=35)
    slots = torch.tensor([1, 2])
    out = ref.indexer_scores(q, _store(keys), slots, w, C)
    exp = [[[sum(w[b, s, hh].item() * max(0.0, dot(q[b, s, hh].tolist(), keys[slots[b], c].tolist()))
              for hh in range(nI)) for c in range(C)] for s in range(S)] for b in range(B)]
    close(out, exp, atol=1e-5)
    assert ref.indexer_scores(q, _store(keys), slots, w, 2).shape == (B, S, 2)   # reads only `bound` entries
    # the head weights' scale, and entries at or past a query's visible count masked to -inf
    visible = torch.tensor([[0, 2, 5], [1, 4, 3]])
    got = ref.indexer_scores(q, _store(keys), slots, w, C, 0.25, visible)
    exp = [[[-math.inf if c >= visible[b, s] else
             sum((w[b, s, hh].item() * 0.25) * max(0.0, dot(q[b, s, hh].tolist(), keys[slots[b], c].tolist()))
                 for hh in range(nI)) for c in range(C)] for s in range(S)] for b in range(B)]
    close(got, exp, atol=1e-5)


def test_topk_indices_breaks_exact_ties_by_lowest_index():
    """The picks of the k largest (ties to the lowest index, -0 ties +0, -inf last), listed in
    ascending index order; picks at or past the row's limit -1, at the end of the list."""
    scores = torch.tensor([[0.0, 2.0, -0.0, 2.0, -math.inf, 0.0, -1.0, 2.0]])
    assert ref.topk_indices(scores, 8).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert ref.topk_indices(scores, 4).tolist() == [[0, 1, 3, 7]]
    assert ref.topk_indices(scores, 5).tolist() == [[0, 1, 2, 3, 7]]           # -0 ties +0: the lower index
    assert ref.topk_indices(scores, 4, torch.tensor([4])).tolist() == [[0, 1, 3, -1]]   # picks >= limit -> -1
    x = torch.randn(4, 50, generator=gen(38)).round()          # many exact ties
    got = ref.topk_indices(x, 20)
    for r in range(4):
        picked = sorted(range(50), key=lambda i: (-x[r, i].item(), i))[:20]
        assert got[r].tolist() == sorted(picked)


# ----------------------------------------------------------------------------- MoE
def test_router_scores():
    logits = randn(3, 6, seed=37, scale=3.0)
    rows = logits.tolist()
    close(ref.router_scores(logits, "sqrtsoftplus"), [[math.sqrt(math.log1p(math.exp(v))) for v in r] for r in rows])
    close(ref.router_scores(logits, "sigmoid"), [[sigmoid(v) for v in r] for r in rows])
    close(ref.router_scores(logits, "softmax"), [softmax(r) for r in rows])
    assert ref.router_scores(logits.bfloat16(), "sigmoid").dtype == torch.float32
    with pytest.raises(ValueError):
        ref.router_scores(logits, "relu")


def test_route_hash_ids():
    scores = torch.rand(4, 8, generator=gen(38)) + 0.1
    fixed = torch.tensor([[0, 5], [7, 1], [3, 3], [2, 6]], dtype=torch.int32)
    w, ids = ref.route(scores, 2, bias=torch.full((8,), 100.0), fixed_ids=fixed, scale=2.5)
    assert ids.dtype == torch.int64 and ids.tolist() == fixed.tolist()
    exp = []
    for t, (a, b) in enumerate(fixed.tolist()):
        sa, sb = scores[t, a].item(), scores[t, b].item()
        exp.append([2.5 * sa / (sa + sb), 2.5 * sb / (sa + sb)])
    close(w, exp)


def test_route_topk_bias_selects_only():
    T, E, k, scale = 5, 8, 3, 1.5
    scores = torch.rand(T, E, generator=gen(39)) + 0.1
    bias = torch.zeros(E)
    bias[[1, 4]] = 2.0                                          # force experts 1 and 4 in
    w, ids = ref.route(scores, k, bias=bias, scale=scale)
    changed = False
    for t in range(T):
        s = scores[t].tolist()
        sel = sorted(range(E), key=lambda e: -(s[e] + bias[e].item()))[:k]
        plain = sorted(range(E), key=lambda e: -s[e])[:k]
        changed |= set(sel) != set(plain)
        total = sum(s[e] for e in sel)
        got = sorted(zip(ids[t].tolist(), w[t].tolist()))
        assert [e for e, _ in got] == sorted(sel)
        close(torch.tensor([x for _, x in got]), [scale * s[e] / total for e in sorted(sel)])
    assert changed                                              # the bias changed the selection
    close(w.sum(-1), torch.full((T,), scale))
    w0, ids0 = ref.route(scores, k)                             # no bias: plain top-k
    for t in range(T):
        assert set(ids0[t].tolist()) == set(sorted(range(E), key=lambda e: -scores[t, e].item())[:k])
    close(w0.sum(-1), torch.ones(T))


@pytest.mark.parametrize("limit", [3.0, 0.0])
def test_swiglu(limit):
    g, u = randn(4, 16, seed=40, scale=5.0), randn(4, 16, seed=41, scale=5.0)
    assert (g > 3).any() and (g < -3).any() and (u.abs() > 3).any()
    exp = [[swiglu_py(a, b, limit) for a, b in zip(gr, ur)] for gr, ur in zip(g.tolist(), u.tolist())]
    close(ref.swiglu(g, u, limit), exp, atol=1e-5)


# ----------------------------------------------------------------------------- ops dispatch
def test_linear():
    x, w = randn(2, 3, 5, seed=42), randn(4, 5, seed=43).bfloat16()
    out = ops.linear(x, w.float())
    assert out.dtype == torch.float32
    wl = w.float().tolist()
    close(out, [[[dot(r, wr) for wr in wl] for r in mat] for mat in x.tolist()], atol=1e-5)


def test_grouped_linear():
    G, r, K = 3, 2, 4
    x, w = randn(2, 5, G, K, seed=44), randn(G * r, K, seed=45)
    out = ops.grouped_linear(x, w, G)
    exp = [[[[dot(x[a, b, g].tolist(), w[g * r + i].tolist()) for i in range(r)] for g in range(G)]
            for b in range(5)] for a in range(2)]
    close(out, exp, atol=1e-5)


def _experts(E, D, inter, seed, scale=0.8):
    """Stacked plain expert weights ``w1, w3 [E, I, D]``, ``w2 [E, D, I]``."""
    return (randn(E, inter, D, seed=seed, scale=scale), randn(E, inter, D, seed=seed + 1, scale=scale),
            randn(E, D, inter, seed=seed + 2, scale=scale))


def _moe_py(x, ids, weights, w1, w3, w2, limit):
    exp = []
    for t in range(x.shape[0]):
        xt, acc = x[t].tolist(), [0.0] * x.shape[1]
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            if e < 0:
                continue
            hidden = [swiglu_py(dot(xt, a), dot(xt, b), limit) * weights[t, j].item()
                      for a, b in zip(w1[e].tolist(), w3[e].tolist())]
            acc = [c + v for c, v in zip(acc, [dot(hidden, r) for r in w2[e].tolist()])]
        exp.append(acc)
    return exp


def test_moe():
    T, D, inter, E, k, limit = 6, 8, 6, 5, 2, 1.5
    w1, w3, w2 = _experts(E, D, inter, 100)
    x = randn(T, D, seed=46, scale=2.0)
    ids = torch.stack([torch.randperm(E, generator=gen(200 + t))[:k] for t in range(T)])
    ids[2, 1] = -1                                              # no expert (another rank's)
    weights = torch.rand(T, k, generator=gen(47))
    out = ref.moe(x, ids, weights, w1, w3, w2, limit)
    close(out, _moe_py(x, ids, weights, w1, w3, w2, limit), atol=1e-5)
    assert ref.moe(x.bfloat16(), ids, weights, w1, w3, w2, limit).dtype == torch.bfloat16


def test_moe_grouped_path_equals_gather_path(monkeypatch):
    T, D, inter, E, k = 40, 16, 8, 6, 3
    w1, w3, w2 = _experts(E, D, inter, 110)
    x = randn(T, D, seed=48)
    ids = torch.stack([torch.randperm(E, generator=gen(300 + t))[:k] for t in range(T)])
    ids[::7, 0] = -1
    weights = torch.rand(T, k, generator=gen(49))
    with ops.sync_free():                                       # capture-safe path: gather by index
        gather = ref.moe(x, ids, weights, w1, w3, w2, 2.0)
    grouped = ref.moe(x, ids, weights, w1, w3, w2, 2.0)        # eager path: tokens grouped by expert
    torch.testing.assert_close(grouped, gather, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(ref, "MOE_GATHER_BYTES", 1)            # gather one pair at a time
    with ops.sync_free():
        torch.testing.assert_close(ref.moe(x, ids, weights, w1, w3, w2, 2.0), gather, rtol=1e-6, atol=1e-6)


def test_moe_reads_only_the_selected_experts():
    """An unselected expert is never touched: its inf/NaN weights cannot reach any token."""
    w1, w3, w2 = _experts(3, 8, 4, 120)
    w2[2] = float("inf")
    w1[2] = float("nan")
    x = torch.randn(4, 8, generator=gen(50))
    ids = torch.tensor([[0, 1]] * 4)
    out = ref.moe(x, ids, torch.full((4, 2), 0.5), w1, w3, w2, 10.0)
    assert torch.isfinite(out).all()
    close(out, _moe_py(x, ids, torch.full((4, 2), 0.5), w1, w3, w2, 10.0), atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_moe_packed_experts_equal_their_dequantized_weights(fmt):
    from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
    quant = {"fp8": lambda w: Fp8BlockWeight.quantize(w, ue8m0=True), "mxfp4": Mxfp4Weight.quantize,
             "nvfp4": Nvfp4Weight.quantize}[fmt]
    w1, w3, w2 = (quant(w) for w in _experts(4, 64, 32, 130))
    x = randn(5, 64, seed=51)
    ids = torch.tensor([[0, 3], [3, 3], [1, 2], [2, -1], [0, 1]])
    weights = torch.rand(5, 2, generator=gen(52))
    got = ref.moe(x, ids, weights, w1, w3, w2, 3.0)
    dense = [w.dequantize(torch.float32) for w in (w1, w3, w2)]
    close(got, _moe_py(x, ids, weights, *dense, 3.0), atol=1e-4)


def _act_quant_py(row: list[float], pow2: bool = True) -> list[float]:
    """DeepSeek's act_quant of one row, values (blocks of 128, amax floor 1e-4)."""
    return fp8_expected(torch.tensor(row), 128, pow2)[0]


def test_linear_w8a8_is_the_blockwise_fp8_product():
    """QAT on: y = sum_kb (q . w) * s_x * s_w per 128-block, both operands on the FP8 grid."""
    from dsv4.weights.formats import Fp8BlockWeight
    x = randn(3, 256, seed=53, scale=3.0)
    w = Fp8BlockWeight.quantize(randn(130, 256, seed=54), ue8m0=True)
    got = ref.linear(x, w, act_quant=True)
    wd = w.dequantize(torch.float32).double()
    for r in range(3):
        xq = torch.tensor(_act_quant_py(x[r].tolist()), dtype=torch.float64)
        close(got[r], wd @ xq, rtol=1e-5, atol=1e-5)
    off = ref.linear(x, w)                                      # weight-only without the simulation
    close(off, x.double() @ wd.T, rtol=1e-5, atol=1e-4)
    assert not torch.equal(got, off)


def test_linear_act_quant_skips_plain_weights():
    x, w = randn(2, 256, seed=55), randn(8, 256, seed=56)
    assert torch.equal(ref.linear(x, w, act_quant=True), ref.linear(x, w))


def test_moe_act_quant_rounds_inputs_with_the_routing_weight_inside():
    from dsv4.weights.formats import Mxfp4Weight
    E, D, inter = 2, 128, 128
    w1, w3, w2 = (Mxfp4Weight.quantize(w) for w in _experts(E, D, inter, 140))
    x = randn(2, D, seed=57, scale=2.0)
    ids, weights = torch.tensor([[1, 0], [0, -1]]), torch.tensor([[0.3, 0.7], [1.2, 0.5]])
    got = ref.moe(x, ids, weights, w1, w3, w2, 10.0, act_quant=True)
    d1, d3, d2 = (w.dequantize(torch.float64) for w in (w1, w3, w2))
    for t in range(2):
        xq = torch.tensor(_act_quant_py(x[t].tolist()), dtype=torch.float64)
        acc = torch.zeros(D, dtype=torch.float64)
        for j in range(2):
            e = ids[t, j].item()
            if e < 0:
                continue
            g, u = d1[e] @ xq, d3[e] @ xq
            h = torch.tensor([swiglu_py(a, b, 10.0) * weights[t, j].item() for a, b in zip(g.tolist(), u.tolist())])
            acc += d2[e] @ torch.tensor(_act_quant_py(h.float().tolist()), dtype=torch.float64)
        close(got[t], acc, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- dispatch
def test_dispatch_is_keyed_by_device_and_format():
    """A kernel registered for one weight format runs only for that format; the others keep
    their reference; ``reference_only`` turns every kernel off."""
    from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight
    calls = []

    @ops.register("linear", "cpu", Mxfp4Weight)
    def fake(x, w, act_quant, pow2, out_dtype):
        calls.append(type(w).__name__)
        return torch.zeros(*x.shape[:-1], w.shape[0])
    try:
        x = randn(2, 64, seed=58)
        mx = Mxfp4Weight.quantize(randn(4, 64, seed=59))
        f8 = Fp8BlockWeight.quantize(randn(4, 64, seed=59))
        assert torch.equal(ops.linear(x, mx), torch.zeros(2, 4)) and calls == ["Mxfp4Weight"]
        close(ops.linear(x, f8), ref.linear(x, f8))
        close(ops.linear(x, randn(4, 64, seed=60)), ref.linear(x, randn(4, 64, seed=60)))
        with ops.reference_only():
            close(ops.linear(x, mx), ref.linear(x, mx))
        assert calls == ["Mxfp4Weight"]
        with pytest.raises(ValueError, match="format"):
            ops.register("moe", "cpu")
        with pytest.raises(ValueError, match="unknown op"):
            ops.register("nope", "cpu")
    finally:
        ops.unregister("linear", "cpu", Mxfp4Weight)
    assert ops.implementation("linear", torch.device("cpu"), Mxfp4Weight) is ref.linear
