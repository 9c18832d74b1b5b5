"""Loading quantized checkpoints: formats kept packed, experts stacked, and every bad input named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import parity_config, random_model
from dsv4.config import ConfigError
from dsv4.engine.runner import Runner
from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from dsv4.weights.loader import CheckpointError, load_model
from dsv4.weights.quantize import layout_of, quant_config_for, quantize_tensors
from dsv4.testing import prefill

EXPERT = "layers.2.ffn.experts.3.w1"
ATTN = "layers.1.attn.wq_a"


@pytest.fixture(scope="module")
def source():
    config = parity_config()
    model = random_model(config, torch.bfloat16, seed=4)
    return config, {k: v for k, v in model.official_state_dict().items()}


def _write(tmp_path, config, tensors, fmt, extra_config=None, hf_quant=True):
    updates, hf = quant_config_for(fmt, "floor", "fp8", "ue8m0", layout_of(tensors))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), **updates, **(extra_config or {})}))
    if hf is not None and hf_quant:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf))
    return tmp_path


def _quantized(source, fmt):
    config, state = source
    return config, quantize_tensors(state, config, fmt, policy="floor", dense_format="fp8")


@pytest.mark.parametrize("fmt, expert_type", [("mxfp4", Mxfp4Weight), ("nvfp4", Nvfp4Weight),
                                              ("fp8", Fp8BlockWeight)])
def test_formats_stay_packed_and_experts_are_stacked(source, tmp_path, fmt, expert_type):
    config, tensors = _quantized(source, fmt)
    model, report = load_model(_write(tmp_path, config, tensors, fmt), dtype=torch.float32, progress=False)
    moe = model.layers[2].ffn
    assert moe.stacked
    assert isinstance(moe.experts.w1.w, expert_type)
    assert isinstance(model.layers[1].attn.wq_a.w, Fp8BlockWeight)
    assert isinstance(model.head.w, torch.Tensor)                          # precision floor
    assert isinstance(model.layers[1].attn.indexer.weights_proj.w, torch.Tensor)
    stacked = moe.experts.w1.w
    assert stacked.shape == (config.n_routed_experts, config.moe_intermediate_size, config.hidden_size)
    # the packed tensors are module buffers under their on-disk names: .to(), state_dict() see them
    buffers = dict(moe.experts.w1.named_buffers())
    assert set(buffers) == set(stacked.tensors()) and "weight" in buffers
    assert all(buffers[k] is t for k, t in stacked.tensors().items())
    sd = model.state_dict()
    assert "layers.2.ffn.experts.w1.weight" in sd and "layers.1.attn.wq_a.scale" in sd
    official = model.official_state_dict()
    assert torch.equal(official["layers.2.ffn.experts.3.w1.weight"], tensors["layers.2.ffn.experts.3.w1.weight"])
    assert any(fmt in f or (fmt == "fp8" and "fp8" in f) for f in report.groups["routed experts"])
    logits = prefill(Runner(model, 1, 64, qat_sim=True), 0, list(range(2, 40)), all_logits=True)
    assert torch.isfinite(logits).all()


def _expect(tmp_path, config, tensors, fmt, match, error=CheckpointError, **kw):
    with pytest.raises(error, match=match):
        load_model(_write(tmp_path, config, tensors, fmt, **kw), dtype=torch.float32, progress=False)


def test_nan_in_fp8_scale_is_named(source, tmp_path):
    config, t = _quantized(source, "mxfp4")
    t[f"{ATTN}.scale"] = torch.full_like(t[f"{ATTN}.scale"].float(), float("nan"))
    _expect(tmp_path, config, t, "mxfp4", f"{ATTN}.weight.*(NaN|nan|finite)")


def test_mxfp4_scale_shape_mismatch_is_named(source, tmp_path):
    config, t = _quantized(source, "mxfp4")
    t[f"{EXPERT}.scale"] = t[f"{EXPERT}.scale"][:, :1]
    _expect(tmp_path, config, t, "mxfp4", f"{EXPERT}.weight.*scale")


def test_e8m0_nan_code_is_named(source, tmp_path):
    config, t = _quantized(source, "mxfp4")
    bits = t[f"{EXPERT}.scale"].view(torch.uint8).clone()
    bits[0, 0] = 255
    t[f"{EXPERT}.scale"] = bits
    _expect(tmp_path, config, t, "mxfp4", f"{EXPERT}.weight")


def test_fp8_weight_without_scale_is_named(source, tmp_path):
    config, t = _quantized(source, "mxfp4")
    del t[f"{ATTN}.scale"]
    _expect(tmp_path, config, t, "mxfp4", f"{ATTN}.weight.*scale")


def test_nvfp4_group_missing_block_scale_is_named(source, tmp_path):
    config, t = _quantized(source, "nvfp4")
    del t[f"{EXPERT}.weight_scale"]
    _expect(tmp_path, config, t, "nvfp4", f"{EXPERT}.weight.*weight_scale")


def test_packed_bytes_with_float_scale_are_refused(source, tmp_path):
    config, t = _quantized(source, "mxfp4")
    t[f"{EXPERT}.scale"] = torch.ones(t[f"{EXPERT}.scale"].shape, dtype=torch.float32)
    _expect(tmp_path, config, t, "mxfp4", f"{EXPERT}.weight.*e8m0")


def test_wrong_logical_shape_is_named(source, tmp_path):
    config, t = _quantized(source, "mxfp4")
    w, s = t[f"{EXPERT}.weight"], t[f"{EXPERT}.scale"]
    t[f"{EXPERT}.weight"] = torch.cat([w, w], dim=1)
    t[f"{EXPERT}.scale"] = torch.cat([s.view(torch.uint8)] * 2, dim=1)
    _expect(tmp_path, config, t, "mxfp4", f"{EXPERT}.weight.*logical shape")


def test_expert_dtype_contradiction_is_named(source, tmp_path):
    config, t = _quantized(source, "fp8")
    _expect(tmp_path, config, t, "fp8", "expert_dtype.*routed expert tensor", ConfigError,
            extra_config={"expert_dtype": "fp4"})


def test_excluded_module_stored_quantized_is_refused(source, tmp_path):
    config, t = _quantized(source, "nvfp4")
    hf = {"producer": {"name": "test"}, "quantization": {"quant_algo": "MIXED_PRECISION", "group_size": 16,
                                                          "exclude_modules": ["layers.1.attn.wq_a"]}}
    path = _write(tmp_path, config, t, "nvfp4", hf_quant=False)
    (path / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="layers.1.attn.wq_a.weight.*exclude_modules"):
        load_model(path, dtype=torch.float32, progress=False)


def test_unsupported_group_size_is_named(source, tmp_path):
    config, t = _quantized(source, "nvfp4")
    path = _write(tmp_path, config, t, "nvfp4", hf_quant=False)
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 32}}))
    with pytest.raises(ConfigError, match="group_size"):
        load_model(path, dtype=torch.float32, progress=False)


def test_truncated_quantized_file_is_named(source, tmp_path):
    config, t = _quantized(source, "nvfp4")
    path = _write(tmp_path, config, t, "nvfp4")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("packed_as", [torch.int8, getattr(torch, "float4_e2m1fn_x2", torch.int8)])
@pytest.mark.parametrize("e8m0_as_u8", [False, True])
def test_every_on_disk_spelling_of_the_same_bits_loads_the_same(source, tmp_path, fmt, packed_as, e8m0_as_u8):
    """Packed FP4 as U8/I8/F4 and e8m0 scales as F8_E8M0/U8 are the same bits: same model."""
    config, t = _quantized(source, fmt)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference, _ = load_model(_write(tmp_path / "a", config, t, fmt), dtype=torch.float32, progress=False)
    respelled = {}
    for name, v in t.items():
        if v.dtype == torch.uint8 and name.endswith(".weight"):
            v = v.view(packed_as)
        if e8m0_as_u8 and v.dtype == getattr(torch, "float8_e8m0fnu", None):
            v = v.view(torch.uint8)
        respelled[name] = v
    model, _ = load_model(_write(tmp_path / "b", config, respelled, fmt), dtype=torch.float32, progress=False)
    ids = list(range(2, 30))
    a = prefill(Runner(reference, 1, 32), 0, ids, all_logits=True)
    b = prefill(Runner(model, 1, 32), 0, ids, all_logits=True)
    assert torch.equal(a, b)


def test_routed_experts_mixing_formats_is_named(source, tmp_path):
    """Experts are written into one stacked buffer per projection as they are read: an expert in
    another format than the first is refused (from the headers, before any data is read), named."""
    config, t = _quantized(source, "mxfp4")
    _, fp8 = _quantized(source, "fp8")
    for part in ("weight", "scale"):
        t[f"{EXPERT}.{part}"] = fp8[f"{EXPERT}.{part}"]
    _expect(tmp_path, config, t, "mxfp4", rf"`{EXPERT}.weight` is fp8_e4m3_block.*mix weight formats")
