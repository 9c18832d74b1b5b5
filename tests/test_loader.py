"""Checkpoint loading: official / HF / sharded layouts load exactly; every corruption is a named error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4.config import ConfigError
from dsv4.engine.runner import Runner
from dsv4.weights.loader import INDEX_FILE, CheckpointError, load_model
from dsv4.weights.names import to_hf_state_dict

from conftest import parity_config, random_model
from dsv4.testing import prefill

# The HF names of the per-layer mHC scales end in `.scale` (`model.layers.{i}.attn_hc.scale`), which the
# loader takes for a quantization scale companion of a (nonexistent) `attn_hc.weight`.

PROMPT = [0, 17, 3, 99, 250, 4, 8, 15, 16, 23, 42, 108, 7, 1, 300, 5, 6, 77, 91, 12]  # > window, > ratios


# --------------------------------------------------------------------------- helpers

def write_checkpoint(directory: Path, config, files: dict[str, dict[str, torch.Tensor]],
                     index: dict[str, str] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / name))
    if index is not None:
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return directory


def shard(tensors: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    names = sorted(tensors)
    return [{k: tensors[k] for k in names[i::n]} for i in range(n)]


def load(path, **kw):
    return load_model(path, dtype=torch.float32, progress=False, **kw)


@pytest.fixture(scope="module")
def ref():
    """The reference model (with MTP), its official state dict and last-token prefill logits."""
    config = parity_config()
    model = random_model(config, with_mtp=True)
    state = {k: v.detach().clone() for k, v in model.official_state_dict().items()}
    logits = prefill(Runner(model, max_num_seqs=1, max_model_len=64), 0, PROMPT)
    return config, model, state, logits


@pytest.fixture(scope="module")
def ref_no_mtp(ref):
    config = parity_config()
    model = random_model(config, with_mtp=False, seed=1)
    state = {k: v.detach().clone() for k, v in model.official_state_dict().items()}
    assert not any(k.startswith("mtp.") for k in state)
    logits = prefill(Runner(model, max_num_seqs=1, max_model_len=64), 0, PROMPT)
    return config, model, state, logits


def assert_same(loaded, state: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
    got = loaded.official_state_dict()
    assert sorted(got) == sorted(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name
    out = prefill(Runner(loaded, max_num_seqs=1, max_model_len=64), 0, PROMPT)
    # the same weights, bit for bit (above); the logits agree to fp32 rounding (a CPU BLAS may pick
    # another summation order for another memory alignment)
    torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())


# --------------------------------------------------------------------------- layouts that load

def test_official_single_file_with_mtp(ref, tmp_path):
    config, _, state, logits = ref
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    model, report = load(path)
    assert hasattr(model, "mtp")
    assert report.tensors == len(state) and not report.notes
    assert report.bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert_same(model, state, logits)


def test_official_single_file_without_mtp_model(ref_no_mtp, tmp_path):
    config, _, state, logits = ref_no_mtp
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    model, report = load(path)
    assert not hasattr(model, "mtp")
    assert any("MTP" in n for n in report.notes), report.notes
    assert_same(model, state, logits)


def test_hf_named_file(ref, tmp_path):
    config, _, state, logits = ref
    hf = to_hf_state_dict(state, config.num_hidden_layers, config.n_routed_experts)
    assert not any(k.startswith(("layers.", "mtp.")) for k in hf)  # really renamed, mtp dropped
    path = write_checkpoint(tmp_path, config, {"model.safetensors": hf})
    model, report = load(path)
    assert any("MTP" in n for n in report.notes), report.notes
    assert not hasattr(model, "mtp")
    assert_same(model, {k: v for k, v in state.items() if not k.startswith("mtp.")}, logits)


def test_hf_named_sharded(ref, tmp_path):
    config, _, state, logits = ref
    hf = to_hf_state_dict(state, config.num_hidden_layers, config.n_routed_experts)
    parts = shard(hf, 2)
    files = {f"model-0000{i + 1}-of-00002.safetensors": p for i, p in enumerate(parts)}
    index = {k: f for f, p in files.items() for k in p}
    model, _ = load(write_checkpoint(tmp_path, config, files, index))
    assert_same(model, {k: v for k, v in state.items() if not k.startswith("mtp.")}, logits)


def test_sharded_with_index(ref, tmp_path):
    config, _, state, logits = ref
    parts = shard(state, 3)
    files = {f"model-0000{i + 1}-of-00003.safetensors": p for i, p in enumerate(parts)}
    index = {k: f for f, p in files.items() for k in p}
    path = write_checkpoint(tmp_path, config, files, index)
    # a stray safetensors file not named by the index must be ignored
    save_file({"junk": torch.zeros(2)}, str(path / "consolidated-old.safetensors"))
    model, report = load(path)
    assert report.tensors == len(state)
    assert_same(model, state, logits)


def test_sharded_without_index(ref, tmp_path):
    config, _, state, logits = ref
    parts = shard(state, 2)
    model, _ = load(write_checkpoint(tmp_path, config, {"a.safetensors": parts[0], "b.safetensors": parts[1]}))
    assert_same(model, state, logits)


def test_load_mtp_false_skips_mtp(ref, tmp_path):
    config, _, state, logits = ref
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    model, report = load(path, load_mtp=False)
    assert not hasattr(model, "mtp")
    assert report.tensors == sum(not k.startswith("mtp.") for k in state)
    assert not report.notes
    assert_same(model, {k: v for k, v in state.items() if not k.startswith("mtp.")}, logits)


def test_bf16_checkpoint_loads_as_float32(ref, tmp_path):
    config, _, state, _ = ref
    bf16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
    model, report = load(write_checkpoint(tmp_path, config, {"model.safetensors": bf16}))
    got = model.official_state_dict()
    for k, v in bf16.items():
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], v.to(state[k].dtype)), k
    assert report.groups["routed experts"] == {"bfloat16": 3 * 8 * 6}


# --------------------------------------------------------------------------- bad checkpoints

def _replace(name, make):
    def f(s):
        s[name] = make(s[name])
    return f


def _nan(t):
    t = t.clone()
    t.view(-1)[5] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t.view(-1)[0] = float("-inf")
    return t


def _tid(value):
    def make(t):
        t = t.clone()
        t[3, 1] = value
        return t
    return make


WKV = "layers.2.attn.wkv.weight"
TID = "layers.0.ffn.gate.tid2eid"
BAD_TENSORS = {  # name: (corruption, words the message must contain)
    "missing_tensor": (lambda s: s.pop(WKV), [WKV]),
    "missing_expert": (lambda s: s.pop("layers.4.ffn.experts.7.w2.weight"), ["layers.4.ffn.experts.7.w2.weight"]),
    "missing_one_mtp_tensor": (lambda s: s.pop("mtp.0.norm.weight"), ["mtp.0.norm.weight"]),
    "extra_tensor": (lambda s: s.__setitem__("layers.2.attn.bogus.weight", torch.zeros(3)),
                     ["model.safetensors", "layers.2.attn.bogus.weight"]),
    "extra_layer": (lambda s: s.__setitem__("layers.9.attn_norm.weight", torch.ones(64)),
                    ["model.safetensors", "layers.9.attn_norm.weight"]),
    "wrong_shape": (_replace(WKV, lambda t: torch.zeros(t.shape[1], t.shape[0])), ["model.safetensors", WKV]),
    "int_weight": (_replace(WKV, lambda t: t.to(torch.int32)), ["model.safetensors", WKV, "int32"]),
    "bool_weight": (_replace(WKV, lambda t: t > 0), ["model.safetensors", WKV, "bool"]),
    "fp8_without_scale": (_replace(WKV, lambda t: t.to(torch.float8_e4m3fn)), ["model.safetensors", WKV]),
    "float_tid2eid": (_replace(TID, lambda t: t.float()), ["model.safetensors", TID]),
    "nan": (_replace(WKV, _nan), ["model.safetensors", WKV, "NaN"]),
    "inf_in_norm": (_replace("norm.weight", _inf), ["model.safetensors", "norm.weight"]),
    "tid2eid_too_big": (_replace(TID, _tid(8)), ["model.safetensors", TID]),
    "tid2eid_negative": (_replace(TID, _tid(-1)), ["model.safetensors", TID]),
}


@pytest.mark.parametrize("name", sorted(BAD_TENSORS))
def test_bad_tensor_is_named(ref, tmp_path, name):
    config, _, state, _ = ref
    corrupt, words = BAD_TENSORS[name]
    s = dict(state)
    corrupt(s)
    path = write_checkpoint(tmp_path, config, {"model.safetensors": s})
    result = None
    with pytest.raises(CheckpointError) as info:
        result = load(path)
    assert result is None
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_bad_hf_tensor_is_named(ref, tmp_path):
    config, _, state, _ = ref
    hf = to_hf_state_dict(state, config.num_hidden_layers, config.n_routed_experts)
    hf["model.layers.1.mlp.experts.down_proj"] = torch.zeros(9, 64, 32)  # one expert too many
    path = write_checkpoint(tmp_path, config, {"model.safetensors": hf})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.experts\.down_proj"):
        load(path)


def with_fused_experts(state: dict[str, torch.Tensor], layer: int, n_experts: int) -> dict[str, torch.Tensor]:
    """Official names everywhere except layer ``layer``'s routed experts, fused the HF way."""
    p = f"layers.{layer}.ffn.experts"
    out = {k: v for k, v in state.items() if not k.startswith(p + ".")}
    out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([state[f"{p}.{e}.w1.weight"], state[f"{p}.{e}.w3.weight"]]) for e in range(n_experts)])
    out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
        [state[f"{p}.{e}.w2.weight"] for e in range(n_experts)])
    return out


def test_hf_fused_experts_are_split(ref, tmp_path):
    config, _, state, logits = ref
    s = with_fused_experts(state, 1, config.n_routed_experts)
    model, report = load(write_checkpoint(tmp_path, config, {"model.safetensors": s}))
    assert report.tensors == len(state)
    assert_same(model, state, logits)


def test_hf_fused_experts_wrong_count(ref, tmp_path):
    config, _, state, _ = ref
    s = with_fused_experts(state, 1, config.n_routed_experts)
    s["model.layers.1.mlp.experts.down_proj"] = torch.cat([s["model.layers.1.mlp.experts.down_proj"]] * 2)[:9]
    path = write_checkpoint(tmp_path, config, {"model.safetensors": s})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.experts\.down_proj"):
        load(path)


@pytest.mark.parametrize("shape", [(8,), ()], ids=["1d", "0d"])
def test_hf_fused_experts_wrong_rank(ref, tmp_path, shape):
    config, _, state, _ = ref
    s = with_fused_experts(state, 0, config.n_routed_experts)
    s["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(shape)
    path = write_checkpoint(tmp_path, config, {"model.safetensors": s})
    with pytest.raises(CheckpointError, match="gate_up_proj"):
        load(path)


def test_overflow_on_cast_is_an_error(ref, tmp_path):
    config, _, state, _ = ref
    s = dict(state)
    t = s[WKV].clone()
    t[0, 0] = 1e6  # finite in fp32, inf in fp16
    s[WKV] = t
    path = write_checkpoint(tmp_path, config, {"model.safetensors": s})
    try:
        model, _ = load_model(path, dtype=torch.float16, progress=False)
    except CheckpointError as e:
        assert WKV in str(e)
        return
    assert torch.isfinite(model.state_dict()[WKV]).all(), "loaded an Inf weight without complaint"


def test_truncated_file(ref, tmp_path):
    config, _, state, _ = ref
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(path)
    f.write_bytes(data[:-1])  # one byte short
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(path)
    f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(path)


def test_truncated_second_shard(ref, tmp_path):
    config, _, state, _ = ref
    parts = shard(state, 2)
    files = {"model-00001-of-00002.safetensors": parts[0], "model-00002-of-00002.safetensors": parts[1]}
    path = write_checkpoint(tmp_path, config, files, {k: f for f, p in files.items() for k in p})
    f = path / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load(path)


def test_index_names_missing_shard(ref, tmp_path):
    config, _, state, _ = ref
    parts = shard(state, 2)
    files = {"model-00001-of-00002.safetensors": parts[0], "model-00002-of-00002.safetensors": parts[1]}
    path = write_checkpoint(tmp_path, config, files, {k: f for f, p in files.items() for k in p})
    os.remove(path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError) as info:
        load(path)
    assert "model-00002-of-00002.safetensors" in str(info.value) and INDEX_FILE in str(info.value)


def test_index_not_json(ref, tmp_path):
    config, _, state, _ = ref
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    (path / INDEX_FILE).write_text("{weight_map: ")
    with pytest.raises(CheckpointError, match=INDEX_FILE.replace(".", r"\.")):
        load(path)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))  # no weight_map
    with pytest.raises(CheckpointError, match=INDEX_FILE.replace(".", r"\.")):
        load(path)


def test_tensor_duplicated_across_shards(ref, tmp_path):
    config, _, state, _ = ref
    parts = shard(state, 2)
    parts[1]["embed.weight"] = state["embed.weight"]
    parts[0]["embed.weight"] = state["embed.weight"]
    path = write_checkpoint(tmp_path, config, {"a.safetensors": parts[0], "b.safetensors": parts[1]})
    with pytest.raises(CheckpointError) as info:
        load(path)
    msg = str(info.value)
    assert "embed.weight" in msg and "a.safetensors" in msg and "b.safetensors" in msg


def test_hf_and_official_names_for_the_same_tensor(ref, tmp_path):
    config, _, state, _ = ref
    s = dict(state)
    s["model.norm.weight"] = state["norm.weight"].clone()  # the same tensor under both spellings
    path = write_checkpoint(tmp_path, config, {"model.safetensors": s})
    with pytest.raises(CheckpointError, match="norm.weight"):
        load(path)


def test_directory_without_safetensors(ref, tmp_path):
    config = ref[0]
    path = write_checkpoint(tmp_path, config, {})
    with pytest.raises(CheckpointError, match=str(path)):
        load(path)


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(CheckpointError, match="no-such-checkpoint"):
        load(missing)


def test_missing_config_json(ref, tmp_path):
    config, _, state, _ = ref
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    os.remove(path / "config.json")
    with pytest.raises(ConfigError, match="config.json"):
        load(path)


def test_config_does_not_match_tensors(ref, tmp_path):
    config, _, state, _ = ref
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    raw = config.to_dict()
    raw["moe_intermediate_size"] = 48
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*experts"):
        load(path)


def test_bad_config_in_checkpoint(ref, tmp_path):
    config, _, state, _ = ref
    path = write_checkpoint(tmp_path, config, {"model.safetensors": state})
    raw = config.to_dict()
    raw["o_groups"] = 3
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load(path)
    assert "o_groups" in str(info.value) and "config.json" in str(info.value)


def test_module_names_map_to_the_checkpoint_names_both_ways(ref):
    """Two kinds of module tensor are not named as in the checkpoint: the mHC parameters (module
    ``hc_attn.fn``, checkpoint ``hc_attn_fn``) and the stacked routed experts (slice ``e`` of
    ``experts.w1.weight`` is ``experts.{e}.w1.weight``); names.py maps both, and nothing else."""
    from dsv4.weights.names import official_state_dict, official_to_module
    _, model, state, _ = ref
    module_state = model.state_dict()
    official = official_state_dict(module_state)
    assert set(official) == set(state)
    assert official_to_module("layers.2.hc_attn_fn") == ("layers.2.hc_attn.fn", None)
    assert official_to_module("hc_head_scale") == ("hc_head.scale", None)
    assert official_to_module("mtp.0.hc_head_base") == ("mtp.0.hc_head.base", None)
    assert official_to_module("layers.1.ffn.experts.5.w3.scale") == ("layers.1.ffn.experts.w3.scale", 5)
    assert official_to_module("layers.1.ffn.shared_experts.w3.weight") == ("layers.1.ffn.shared_experts.w3.weight", None)
    for name, t in official.items():
        module_name, e = official_to_module(name)
        stored = module_state[module_name]
        assert torch.equal(t, stored if e is None else stored[e]), name
    # the experts' views share the stacked weight's storage (saving copies nothing)
    stacked = module_state["layers.1.ffn.experts.w1.weight"]
    assert official["layers.1.ffn.experts.3.w1.weight"].data_ptr() == stacked[3].data_ptr()


def test_linears_own_their_multiplication_mode(ref):
    """The QAT simulation's input rounding is each Linear's own mode, set once by set_qat_sim (a
    forward with the other qat_sim switches it): on for the FP8/FP4-capable projections, never for
    the router, the head and the grouped wo_a."""
    from dsv4.model.common import Linear
    _, model, _, _ = ref
    never = {"head", "layers.0.ffn.gate", "layers.0.attn.wo_a"}
    try:
        model.set_qat_sim(True)
        modes = {n: m.act_quant for n, m in model.named_modules() if isinstance(m, Linear)}
        assert not any(modes[n] for n in never)
        assert modes["layers.0.attn.wq_a"] and modes["layers.1.ffn.experts.w1"] and modes["mtp.0.e_proj"]
        assert all(m.pow2 == model.config.kv_scale_pow2 for m in model.modules() if isinstance(m, Linear))
        model.context(torch.tensor([[1]]), torch.tensor([0]), torch.tensor([0]), False, 8)
        assert not any(m.act_quant for m in model.modules() if isinstance(m, Linear))
    finally:
        model.set_qat_sim(False)
