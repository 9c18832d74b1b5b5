"""Bit-level tests of the weight formats (DSV4_FACTS section 4) and the reference linear.

Expected values of hand-built tensors are decoded here from the bit definitions with Python
arithmetic, independently of dsv4's lookup tables.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.ops import reference
from dsv4.weights.formats import (
    Bf16Weight, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, WeightFormatError, e8m0_to_float,
    float_to_e8m0, pack_fp4, round_to_e2m1, unpack_fp4,
)

NAME = "layers.3.ffn.experts.7.w1.weight"
HAS_F4 = hasattr(torch, "float4_e2m1fn_x2")


def e2m1_value(code: int) -> float:
    """Decode a 4-bit e2m1 code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return sign * mag


def e4m3_value(byte: int) -> float:
    """Decode an e4m3fn byte (bias 7, subnormals, no inf; 0x7F/0xFF NaN)."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m * 2.0**-9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))


def bytes_to(values: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(dtype)


def expected_fp4(packed: list[list[int]], scale_of) -> torch.Tensor:
    """Dequantize packed rows by hand: element 2j in the low nibble of byte j."""
    rows = []
    for n, row in enumerate(packed):
        vals = []
        for j, b in enumerate(row):
            for k, code in ((2 * j, b & 0xF), (2 * j + 1, b >> 4)):
                vals.append(e2m1_value(code) * scale_of(n, k))
        rows.append(vals)
    return torch.tensor(rows, dtype=torch.float64).float()


def half_step_fp4(mag: torch.Tensor) -> torch.Tensor:
    """Half the e2m1 grid step around |v| (values past 6 saturate; step 2 there)."""
    return torch.where(mag <= 2, 0.25, torch.where(mag <= 4, 0.5, 1.0))


# ----------------------------------------------------------------------------- FP4 helpers

def test_unpack_fp4_known_byte_low_nibble_first() -> None:
    v = unpack_fp4(torch.tensor([0x9A, 0x70, 0x0F], dtype=torch.uint8))
    assert v.dtype == torch.float32
    assert v.tolist() == [-1.0, -0.5, 0.0, 6.0, -6.0, 0.0]


def test_unpack_fp4_all_bytes_and_spellings() -> None:
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = [e2m1_value(c) for b in range(256) for c in (b & 0xF, b >> 4)]
    assert unpack_fp4(allb).tolist() == want
    assert unpack_fp4(allb.view(torch.int8)).tolist() == want
    if HAS_F4:
        assert unpack_fp4(allb.view(torch.float4_e2m1fn_x2)).tolist() == want
    with pytest.raises(WeightFormatError, match="float32"):
        unpack_fp4(torch.zeros(4))


def test_pack_fp4_roundtrip_and_errors() -> None:
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 64)
    assert torch.equal(pack_fp4(unpack_fp4(allb)), allb)
    assert pack_fp4(torch.tensor([-1.0, -0.5])).tolist() == [0x9A]
    with pytest.raises(WeightFormatError, match="even"):
        pack_fp4(torch.zeros(3))
    with pytest.raises(WeightFormatError, match="grid"):
        pack_fp4(torch.tensor([0.7, 1.0]))


def test_round_to_e2m1_ties_to_even_code_and_saturation() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.24, 0.26, 2.6, 7.0, 1e9,
                      -0.75, -5.0, -0.1])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 3.0, 6.0, 6.0, -1.0, -4.0, -0.0]
    got = round_to_e2m1(x)
    assert got.tolist() == want
    assert torch.signbit(got[-1])


# ----------------------------------------------------------------------------- e8m0

def test_e8m0_edge_values() -> None:
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    got = e8m0_to_float(codes)
    assert got.dtype == torch.float32 and got[:-1].tolist() == want and math.isnan(got[-1])
    assert e8m0_to_float(codes.view(torch.float8_e8m0fnu))[:-1].tolist() == want
    assert float_to_e8m0(torch.tensor(want)).tolist() == [0, 1, 126, 127, 128, 254]
    for bad in (3.0, 0.0, -2.0, math.inf, 2.0**-128):
        with pytest.raises(WeightFormatError, match="powers of two"):
            float_to_e8m0(torch.tensor([bad]))


# ----------------------------------------------------------------------------- MXFP4

def test_mxfp4_hand_built_exact() -> None:
    # N=3, K=64: two scale blocks per row; codes 0 (2^-127), 127, 128, 254 (2^127), 100.
    row0 = [0x9A, 0x21] + [0x73] * 14 + [0x5C] * 16
    row1 = [0x10, 0x32] * 8 + [0xF8] * 16
    row2 = [0x31, 0xB2] * 16  # magnitudes <= 1.5 so that 2^127 stays finite in fp32
    packed = [row0, row1, row2]
    codes = [[127, 128], [0, 100], [254, 1]]
    want = expected_fp4(packed, lambda n, k: 2.0 ** (codes[n][k // 32] - 127))
    w = Mxfp4Weight(torch.tensor(packed, dtype=torch.uint8),
                    torch.tensor(codes, dtype=torch.uint8), name=NAME)
    assert w.shape == (3, 64) and w.out_features == 3 and w.in_features == 64
    assert w.nbytes == 3 * 32 + 3 * 2 and w.dtype_name == "mxfp4"
    got = w.dequantize(torch.float32)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert got[0, :4].tolist() == [-1.0, -0.5, 0.5, 1.0]
    assert got[1, 0].item() == 0.0 and got[1, 1].item() == 0.5 * 2.0**-127
    # every accepted spelling gives the same bits
    alt = Mxfp4Weight(torch.tensor(packed, dtype=torch.uint8).view(torch.int8),
                      torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert torch.equal(alt.dequantize(torch.float32), want)
    if HAS_F4:
        f4 = Mxfp4Weight(bytes_to(packed, torch.float4_e2m1fn_x2),
                         torch.tensor(codes, dtype=torch.uint8))
        assert torch.equal(f4.dequantize(torch.float32), want)
    assert torch.equal(w.dequantize_rows(1, 3, torch.float32), want[1:3])
    assert w.dequantize().dtype == torch.bfloat16


def test_mxfp4_quantize_error_bound() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 256, generator=g) * torch.logspace(-3, 2, 48)[:, None]
    w = Mxfp4Weight.quantize(x, name=NAME)
    deq = w.dequantize(torch.float32)
    amax = x.view(48, 8, 32).abs().amax(-1)
    want_exp = torch.tensor([[math.ceil(math.log2(a / 6)) for a in r] for r in amax.tolist()])
    assert torch.equal(w.scale.long() - 127, want_exp)
    s = e8m0_to_float(w.scale).repeat_interleave(32, -1)
    assert ((deq - x).abs() <= half_step_fp4(x.abs() / s) * s).all()
    assert (deq - x).abs().max() > 0  # really quantized


# ----------------------------------------------------------------------------- NVFP4

def test_nvfp4_hand_built_exact_with_e4m3_edges() -> None:
    # N=2, K=64: 4 block scales per row incl. 448 (0x7E), min subnormal 2^-9 (0x01), max
    # subnormal 7*2^-9 (0x07), min normal 2^-6 (0x08), 1.0 (0x38), 0 (0x00), 1.125 (0x39),
    # 0.5 (0x30).
    packed = [[0x9A, 0x21, 0x73, 0x5C] * 8, [0x7F, 0x08, 0xE1, 0x46] * 8]
    bs_bytes = [[0x7E, 0x01, 0x07, 0x08], [0x38, 0x00, 0x39, 0x30]]
    gscale = 0.375
    want = expected_fp4(packed, lambda n, k: e4m3_value(bs_bytes[n][k // 16]) * gscale)
    w = Nvfp4Weight(torch.tensor(packed, dtype=torch.uint8),
                    bytes_to(bs_bytes, torch.float8_e4m3fn), torch.tensor(gscale),
                    torch.tensor([123.0]), name=NAME)
    got = w.dequantize(torch.float32)
    assert torch.equal(got, want)
    assert got[0, 0].item() == -1.0 * 448 * 0.375  # low nibble of 0x9A, block scale 448
    assert got[0, 16].item() == -2.0**-9 * 0.375  # first element of the subnormal block
    assert w.shape == (2, 64) and w.input_scale.item() == 123.0  # input_scale: kept, unused
    assert w.nbytes == 2 * 32 + 2 * 4 + 4 + 4


def test_nvfp4_quantize_error_bound() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * 3
    w = Nvfp4Weight.quantize(x, name=NAME)
    amax = x.abs().max()
    assert w.global_scale.item() == (amax / (6 * 448)).item()
    blk_amax = x.view(64, 8, 16).abs().amax(-1)
    assert torch.equal(w.block_scale.float(),
                       (blk_amax / (6 * w.global_scale)).to(torch.float8_e4m3fn).float())
    s = w.block_scale.float().repeat_interleave(16, -1) * w.global_scale
    deq = w.dequantize(torch.float32)
    assert ((deq - x).abs() <= half_step_fp4(x.abs() / s) * s * (1 + 1e-6)).all()
    assert w.input_scale is None


# ----------------------------------------------------------------------------- FP8 block

def _fp8_bytes(n: int, k: int, seed: int) -> torch.Tensor:
    b = torch.randint(0, 256, (n, k), generator=torch.Generator().manual_seed(seed))
    b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    b[0, :4] = torch.tensor([0x7E, 0x01, 0x80, 0xFE])  # 448, 2^-9, -0, -448
    return b.to(torch.uint8)


def _fp8_expected(b: torch.Tensor, scale_vals: list[list[float]]) -> torch.Tensor:
    lut = torch.tensor([e4m3_value(i) for i in range(256)], dtype=torch.float64)
    n_idx = torch.arange(b.shape[0])[:, None] // 128
    k_idx = torch.arange(b.shape[1])[None, :] // 128
    s = torch.tensor(scale_vals, dtype=torch.float64)[n_idx, k_idx]
    return (lut[b.long()] * s).float()


@pytest.mark.parametrize("scale_kind", ["fp32", "ue8m0_u8", "ue8m0_f8"])
def test_fp8_block_hand_built_ragged_edges(scale_kind: str) -> None:
    b = _fp8_bytes(200, 300, seed=2)  # 2 x 3 blocks, last row/col blocks ragged
    if scale_kind == "fp32":
        vals = [[0.5, 3.0, 0.375], [1.5, 0.25, 6.0]]
        scale = torch.tensor(vals, dtype=torch.float32)
    else:
        codes = [[127, 130, 0], [254 - 120, 120, 131]]
        vals = [[2.0 ** (c - 127) for c in r] for r in codes]
        scale = torch.tensor(codes, dtype=torch.uint8)
        scale = scale.view(torch.float8_e8m0fnu) if scale_kind == "ue8m0_f8" else scale
    w = Fp8BlockWeight(b.view(torch.float8_e4m3fn), scale, name=NAME)
    want = _fp8_expected(b, vals)
    got = w.dequantize(torch.float32)
    assert torch.equal(got, want)
    assert got[0, :3].tolist() == [448 * vals[0][0], 2.0**-9 * vals[0][0], 0.0]
    assert got[199, 299].item() == e4m3_value(int(b[199, 299])) * vals[1][2]
    assert torch.equal(w.dequantize_rows(100, 150, torch.float32), want[100:150])  # spans blocks
    assert w.scale_ue8m0 == (scale_kind != "fp32")
    assert w.nbytes == 200 * 300 + 6 * (4 if scale_kind == "fp32" else 1)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_block_quantize_error_bound(ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 300, generator=g) * torch.tensor([[0.01, 1.0, 50.0]]).repeat_interleave(
        100, -1)[:, :300]
    w = Fp8BlockWeight.quantize(x, ue8m0=ue8m0, name=NAME)
    blocks = torch.nn.functional.pad(x, (0, 84, 0, 56)).view(2, 128, 3, 128).abs().amax((1, 3))
    if ue8m0:
        s = e8m0_to_float(w.scale)
        assert ((s >= blocks / 448) & (s < 2 * blocks / 448)).all()
        assert w.dtype_name == "fp8_e4m3_block_ue8m0"
    else:
        s = w.scale
        assert torch.equal(s, blocks / 448)
    s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    deq = w.dequantize(torch.float32)
    bound = torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * s_full) * (1 + 1e-6)
    assert ((deq - x).abs() <= bound).all()
    assert (deq - x).abs().max() > 0


def test_power_of_two_scales_are_not_rounded_up_past_exact() -> None:
    # amax / 6 (MXFP4) and amax / 448 (FP8 ue8m0) exactly 2^0 and 2^-3: ceil(log2) is exact.
    x = torch.zeros(2, 128)
    x[0, 0], x[1, 40] = 6.0, 0.75
    mx = Mxfp4Weight.quantize(x)
    assert mx.scale[0, 0].item() == 127 and mx.scale[1, 1].item() == 124
    assert torch.equal(mx.dequantize(torch.float32), x)
    f8 = Fp8BlockWeight.quantize(torch.full((4, 4), 448.0 / 8), ue8m0=True)
    assert f8.scale.tolist() == [[124]] and f8.dequantize(torch.float32).eq(56.0).all()


def test_all_zero_blocks_quantize_to_zero() -> None:
    x = torch.zeros(4, 64)
    for w in (Fp8BlockWeight.quantize(x), Fp8BlockWeight.quantize(x, ue8m0=True),
              Mxfp4Weight.quantize(x), Nvfp4Weight.quantize(x)):
        assert torch.equal(w.dequantize(torch.float32), x)


# ----------------------------------------------------------------------------- validation

E4M3 = torch.float8_e4m3fn
FP8_W = torch.zeros(4, 8, dtype=E4M3)  # one 128x128 block -> scale [1, 1]
FP4_W = torch.zeros(4, 32, dtype=torch.uint8)  # K = 64: MXFP4 scale [4, 2], NVFP4 [4, 4]
NV_BS = torch.ones(4, 4).to(E4M3)
ONE = torch.tensor(1.0)


def fp8(weight: torch.Tensor, scale: torch.Tensor) -> Fp8BlockWeight:
    return Fp8BlockWeight(weight, scale, name=NAME)


def mx(packed: torch.Tensor, scale: torch.Tensor) -> Mxfp4Weight:
    return Mxfp4Weight(packed, scale, name=NAME)


def nv(block_scale: torch.Tensor, gs: torch.Tensor, inp: torch.Tensor | None = None,
       packed: torch.Tensor = FP4_W) -> Nvfp4Weight:
    return Nvfp4Weight(packed, block_scale, gs, inp, name=NAME)


# case -> (builder that must raise, regex the message must match)
BAD_CASES = {
    "fp8 weight bf16": (lambda: fp8(torch.zeros(4, 8), torch.ones(1, 1)), "float8_e4m3fn"),
    "fp8 weight 1-D": (lambda: fp8(torch.zeros(8, dtype=E4M3), torch.ones(1)), "2-D"),
    "fp8 scale bf16": (lambda: fp8(FP8_W, torch.ones(1, 1, dtype=torch.bfloat16)), "bfloat16"),
    "fp8 scale shape": (lambda: fp8(torch.zeros(200, 300, dtype=E4M3), torch.ones(1, 3)),
                        r"expected \(2, 3\)"),
    "fp8 scale nan": (lambda: fp8(FP8_W, torch.tensor([[math.nan]])), "NaN or Inf"),
    "fp8 scale inf": (lambda: fp8(FP8_W, torch.tensor([[math.inf]])), "NaN or Inf"),
    "fp8 scale negative": (lambda: fp8(FP8_W, torch.tensor([[-1.0]])), "negative"),
    "fp8 scale e8m0 255": (lambda: fp8(FP8_W, torch.tensor([[255]], dtype=torch.uint8)), "255"),
    "mx packed float": (lambda: mx(torch.zeros(4, 32), torch.zeros(4, 2, dtype=torch.uint8)),
                        "float32"),
    "mx scale float": (lambda: mx(FP4_W, torch.ones(4, 2)), "float8_e8m0fnu"),
    "mx scale shape": (lambda: mx(FP4_W, torch.zeros(4, 4, dtype=torch.uint8)),
                       r"expected \(4, 2\)"),
    "mx scale 255": (lambda: mx(FP4_W, torch.full((4, 2), 255, dtype=torch.uint8)), "NaN"),
    "mx odd K": (lambda: Mxfp4Weight.quantize(torch.randn(4, 33), name=NAME), "even K"),
    "nv block fp32": (lambda: nv(torch.ones(4, 4), ONE), "float8_e4m3fn"),
    "nv block shape": (lambda: nv(torch.ones(4, 2).to(E4M3), ONE), r"expected \(4, 4\)"),
    "nv block nan": (lambda: nv(torch.full((4, 4), 0x7F, dtype=torch.uint8).view(E4M3), ONE),
                     "NaN"),
    "nv global nan": (lambda: nv(NV_BS, torch.tensor(math.nan)), "global scale contains NaN"),
    "nv global inf": (lambda: nv(NV_BS, torch.tensor(math.inf)), "NaN or Inf"),
    "nv global fp64": (lambda: nv(NV_BS, torch.tensor(1.0, dtype=torch.float64)), "float64"),
    "nv input inf": (lambda: nv(NV_BS, ONE, torch.tensor(math.inf)), "input scale"),
    "nv odd K": (lambda: Nvfp4Weight.quantize(torch.randn(4, 31), name=NAME), "even K"),
    "bf16 got fp8": (lambda: Bf16Weight(FP8_W, name=NAME), "Fp8BlockWeight"),
    "quantize nan": (lambda: Fp8BlockWeight.quantize(torch.tensor([[math.nan, 1.0]]), name=NAME),
                     "NaN"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_validation_errors_name_the_tensor(case: str) -> None:
    build, what = BAD_CASES[case]
    with pytest.raises(WeightFormatError, match=what) as info:
        build()
    assert str(info.value).startswith(NAME + ":")
    assert isinstance(info.value, ValueError)


# ----------------------------------------------------------------------------- stacked experts

QUANTIZERS = {
    "bf16": lambda x: Bf16Weight.quantize(x),
    "fp8": lambda x: Fp8BlockWeight.quantize(x),
    "fp8_ue8m0": lambda x: Fp8BlockWeight.quantize(x, ue8m0=True),
    "mxfp4": lambda x: Mxfp4Weight.quantize(x),
    "nvfp4": lambda x: Nvfp4Weight.quantize(x, input_scale=0.5),
}


@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_stacked_experts(fmt: str) -> None:
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(136, 96, generator=g) * (e + 1) for e in range(3)]
    ws = [QUANTIZERS[fmt](x) for x in xs]
    st = type(ws[0]).stack(ws, name="layers.2.ffn.experts.w1")
    assert st.shape == (3, 136, 96) and st.num_experts == 3 and st.is_stacked
    assert st.out_features == 136 and st.in_features == 96
    assert st.nbytes == sum(w.nbytes for w in ws)
    deq = st.dequantize(torch.float32)
    for e, w in enumerate(ws):
        assert torch.equal(st.expert(e).dequantize(torch.float32), w.dequantize(torch.float32))
        assert torch.equal(deq[e], w.dequantize(torch.float32))
        assert st.expert(e).shape == (136, 96)
    direct = QUANTIZERS[fmt](torch.stack(xs))  # 3-D quantize == per-expert quantize
    assert torch.equal(direct.dequantize(torch.float32), deq)
    assert torch.equal(st.dequantize_rows(5, 70, torch.float32), deq[:, 5:70])
    assert torch.equal(st.to("cpu").dequantize(torch.float32), deq)
    with pytest.raises(WeightFormatError, match="out of range"):
        st.expert(3)
    with pytest.raises(WeightFormatError, match="stacked"):
        ws[0].expert(0)
    with pytest.raises(WeightFormatError, match="shape"):
        type(ws[0]).stack([ws[0], QUANTIZERS[fmt](torch.randn(8, 96))], name="x")


def test_nvfp4_stacked_constructor_broadcasts_scalar_scales() -> None:
    packed = torch.zeros(2, 4, 16, dtype=torch.uint8)
    bs = torch.ones(2, 4, 2).to(torch.float8_e4m3fn)
    w = Nvfp4Weight(packed, bs, torch.tensor([2.0]))
    assert w.global_scale.shape == (2,) and w.expert(1).global_scale.shape == ()
    w2 = Nvfp4Weight(packed, bs, torch.tensor([1.0, 2.0]))
    assert w2.expert(1).global_scale.item() == 2.0
    with pytest.raises(WeightFormatError, match="global scale"):
        Nvfp4Weight(packed, bs, torch.tensor([1.0, 2.0, 3.0]), name=NAME)


# ----------------------------------------------------------------------------- reference linear

@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_reference_linear_matches_dequantized_matmul(fmt: str) -> None:
    g = torch.Generator().manual_seed(5)
    w = QUANTIZERS[fmt](torch.randn(300, 160, generator=g))
    w = w.weight if fmt == "bf16" else w
    x = torch.randn(2, 3, 160, generator=g)
    dense = w.float() if fmt == "bf16" else w.dequantize(torch.float32)
    y = reference.linear(x, w)
    assert y.shape == (2, 3, 300) and y.dtype == x.dtype
    torch.testing.assert_close(y, x @ dense.T, rtol=1e-5, atol=1e-5)
    yb = reference.linear(x.bfloat16(), w)
    assert yb.dtype == torch.bfloat16
    want = x.bfloat16().float() @ dense.T   # weight dequantized to bf16, bf16 result: bf16-level error
    torch.testing.assert_close(yb.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
    y32 = reference.linear(x.bfloat16(), w, out_dtype=torch.float32)   # fp32 accumulation and result
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, x.bfloat16().float() @ dense.bfloat16().float().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_dequantize_equals_row_dequantize(fmt: str) -> None:
    """The whole-weight path (broadcast tiles) and the row path agree bit for bit, ragged too."""
    g = torch.Generator().manual_seed(9)
    for shape in ((256, 384), (300, 160), (2, 130, 96)):
        w = QUANTIZERS[fmt](torch.randn(*shape, generator=g))
        for dt in (torch.float32, torch.bfloat16):
            assert torch.equal(w.dequantize(dt), w.dequantize_rows(0, w.out_features, dt)), (shape, dt)


@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_select_experts_and_tensors_round_trip(fmt: str) -> None:
    g = torch.Generator().manual_seed(6)
    w = QUANTIZERS[fmt](torch.randn(4, 40, 64, generator=g))
    ids = torch.tensor([3, 0, 3])
    sel = w.select_experts(ids)
    assert sel.shape == (3, 40, 64)
    for i, e in enumerate(ids.tolist()):
        assert torch.equal(sel.expert(i).dequantize(torch.float32), w.expert(e).dequantize(torch.float32))
    again = w.with_tensors({k: t.clone() for k, t in w.tensors().items()})
    assert type(again) is type(w) and torch.equal(again.dequantize(torch.float32), w.dequantize(torch.float32))
    assert torch.equal(w.slice_experts(1, 3).dequantize(torch.float32), w.dequantize(torch.float32)[1:3])


def test_reference_linear_shape_mismatch_names_the_weight() -> None:
    q = Mxfp4Weight.quantize(torch.randn(6, 64), name=NAME)
    with pytest.raises(ValueError) as info:
        reference.linear(torch.randn(4, 32), q)
    msg = str(info.value)
    assert "(4, 32)" in msg and "(6, 64)" in msg and NAME in msg
    with pytest.raises(ValueError, match=r"\(6, 8\)"):
        reference.linear(torch.randn(4, 7), torch.randn(6, 8))


def test_kernel_operands_name_the_format_and_its_stored_tensors() -> None:
    """What a kernel reads of each format: its FormatCode and the stored tensors themselves (no copy)."""
    from dsv4.weights.formats import Bf16Weight, FormatCode
    w = torch.randn(130, 256, generator=torch.Generator().manual_seed(0))
    fp8, fp8e = Fp8BlockWeight.quantize(w), Fp8BlockWeight.quantize(w, ue8m0=True)
    mx, nv, bf = Mxfp4Weight.quantize(w), Nvfp4Weight.quantize(w), Bf16Weight.quantize(w)
    want = {fp8: (FormatCode.FP8_F32, fp8.weight, fp8.scale, None),
            fp8e: (FormatCode.FP8_UE8M0, fp8e.weight, fp8e.scale, None),
            mx: (FormatCode.MXFP4, mx.packed, mx.scale, None),
            nv: (FormatCode.NVFP4, nv.packed, nv.block_scale, nv.global_scale),
            bf: (FormatCode.BF16, bf.weight, None, None)}
    for weight, (code, *tensors) in want.items():
        got = weight.kernel_operands()
        assert got[0] is code, type(weight).__name__
        assert all(a is b for a, b in zip(got[1:], tensors, strict=True)), type(weight).__name__
    assert fp8e.scale.dtype == torch.uint8 and fp8.scale.dtype == torch.float32
