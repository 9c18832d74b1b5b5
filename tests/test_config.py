"""ModelConfig parsing: HF names, official short names, legacy forms, presets, round trip, errors."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from pathlib import Path

from dsv4.config import ConfigError, ModelConfig, YarnConfig, preset

from conftest import parity_config

# --------------------------------------------------------------------------- reference configs

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]  # 43 layers + the MTP entry (DSV4_FACTS section 1)
PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4, 0]  # 61 layers + the MTP entry


def flash_hf() -> dict:
    """V4-Flash as a released-style HF config.json (legacy `compress_ratios`, `num_hash_layers`)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
        "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "num_experts_per_tok": 6,
        "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_hash_layers": 3,
        "compress_ratios": list(FLASH_RATIOS), "sliding_window": 128, "index_n_heads": 64,
        "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128]},
        "expert_dtype": "fp4",
    }


def pro_official() -> dict:
    """V4-Pro in DeepSeek's official short names (inference/config.json style)."""
    return {
        "vocab_size": 129280, "dim": 7168, "n_layers": 61, "n_heads": 128, "head_dim": 512, "rope_head_dim": 64,
        "q_lora_rank": 1536, "o_groups": 16, "o_lora_rank": 1024, "n_routed_experts": 384,
        "n_shared_experts": 1, "n_activated_experts": 6, "moe_inter_dim": 3072, "n_hash_layers": 3,
        "compress_ratios": list(PRO_RATIOS), "window_size": 128, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 1024, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "score_func": "sqrtsoftplus",
        "route_scale": 2.5, "swiglu_limit": 10.0, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_factor": 16, "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1, "norm_eps": 1e-6,
        "n_mtp_layers": 1, "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    }


def small_hf() -> dict:
    """A small HF-style config with `layer_types` + `compress_rates` + `mlp_layer_types`."""
    return {
        "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 5,
        "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
        "sliding_window": 8, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 5,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
        "bos_token_id": 0, "eos_token_id": 1,
    }


# --------------------------------------------------------------------------- HF-style parsing

def test_layer_types_compress_rates_mlp_layer_types():
    c = ModelConfig.from_dict(small_hf())
    assert c.layer_kinds == ["sliding", "csa", "hca", "csa", "hca"]
    assert c.compress_ratios == [0, 4, 16, 4, 16]
    assert c.hash_layers == [True, True, False, False, False]
    assert c.num_hidden_layers == 5 and c.num_attention_heads == 4 and c.o_groups == 2
    assert c.yarn == YarnConfig(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0)
    assert c.mtp_layer_kind == "sliding" and c.mtp_compress_ratio == 0
    assert c == parity_config()


def test_compress_rates_change_the_ratios():
    raw = small_hf()
    raw["compress_rates"] = {"compressed_sparse_attention": 8, "heavily_compressed_attention": 64}
    c = ModelConfig.from_dict(raw)
    assert c.compress_ratios == [0, 8, 64, 8, 64]
    assert [c.layer_ratio(i) for i in range(5)] == [0, 8, 64, 8, 64]


def test_layer_types_with_extra_compress_ratio_gives_the_mtp_kind():
    raw = small_hf()
    raw["compress_ratios"] = [0, 4, 16, 4, 16, 4]
    c = ModelConfig.from_dict(raw)
    assert c.layer_kinds == ["sliding", "csa", "hca", "csa", "hca"]
    assert c.mtp_layer_kind == "csa" and c.mtp_compress_ratio == 4
    assert c.layer_kind(5) == "csa" and c.layer_ratio(5) == 4


def test_eos_token_id_list_takes_the_first():
    raw = small_hf()
    raw["eos_token_id"] = [7, 1]
    assert ModelConfig.from_dict(raw).eos_token_id == 7


# --------------------------------------------------------------------------- released geometries

def test_v4_flash_geometry():
    c = ModelConfig.from_dict(flash_hf())
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim) == \
        (4096, 43, 64, 512, 64)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (1024, 8, 1024)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == \
        (256, 6, 1, 2048)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps) == (4, 20, 1e-6)
    assert (c.scoring_func, c.routed_scaling_factor, c.swiglu_limit) == ("sqrtsoftplus", 1.5, 10.0)
    assert (c.rope_theta, c.compress_rope_theta) == (10000.0, 160000.0)
    assert c.yarn == YarnConfig(16.0, 65536, 32.0, 1.0)
    assert c.sliding_window == 128 and c.vocab_size == 129280 and (c.bos_token_id, c.eos_token_id) == (0, 1)
    # 43 layers: sliding x2, then csa/hca alternating, layer 42 csa; the 44th ratio (0) is the MTP block
    assert len(c.layer_kinds) == len(c.compress_ratios) == len(c.hash_layers) == 43
    assert c.layer_kinds[:4] == ["sliding", "sliding", "csa", "hca"]
    assert c.layer_kinds[42] == "csa" and c.layer_kinds[41] == "hca"
    assert c.compress_ratios == FLASH_RATIOS[:43]
    assert c.layer_kinds.count("csa") == 21 and c.layer_kinds.count("hca") == 20
    assert c.mtp_layer_kind == "sliding" and c.mtp_compress_ratio == 0 and c.num_nextn_predict_layers == 1
    assert c.hash_layers == [True] * 3 + [False] * 40
    assert c.expert_dtype == "fp4" and c.quantization_config["quant_method"] == "fp8"
    assert dataclasses.replace(c, quantization_config=None, expert_dtype=None, scale_fmt=None) == preset("flash")


def test_v4_pro_geometry_official_names():
    c = ModelConfig.from_dict(pro_official())
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim) == \
        (7168, 61, 128, 512, 64)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (1536, 16, 1024)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (384, 6, 3072)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 1024)
    assert c.routed_scaling_factor == 2.5 and c.scoring_func == "sqrtsoftplus" and c.rms_norm_eps == 1e-6
    assert c.sliding_window == 128 and c.num_nextn_predict_layers == 1
    assert c.layer_kinds[:4] == ["hca", "hca", "csa", "hca"] and c.layer_kinds[60] == "csa"
    assert c.compress_ratios == PRO_RATIOS[:61]
    assert c.mtp_layer_kind == "sliding" and c.mtp_compress_ratio == 0
    assert c.hash_layers == [True] * 3 + [False] * 58
    assert c.yarn == YarnConfig(16.0, 65536, 32.0, 1.0)
    assert c.expert_dtype == "fp4"
    assert c.scale_fmt == "ue8m0" and c.kv_scale_pow2
    assert dataclasses.replace(c, expert_dtype=None, scale_fmt=None) == preset("pro")


# --------------------------------------------------------------------------- official short names

OFFICIAL = [  # (official name, HF field, a value different from small_hf()'s)
    ("dim", "hidden_size", 128),
    ("n_layers", "num_hidden_layers", None),  # special: the per-layer lists must follow
    ("n_heads", "num_attention_heads", 8),
    ("rope_head_dim", "qk_rope_head_dim", 8),
    ("n_activated_experts", "num_experts_per_tok", 3),
    ("moe_inter_dim", "moe_intermediate_size", 48),
    ("window_size", "sliding_window", 16),
    ("score_func", "scoring_func", "sigmoid"),
    ("route_scale", "routed_scaling_factor", 2.5),
    ("norm_eps", "rms_norm_eps", 1e-5),
    ("n_mtp_layers", "num_nextn_predict_layers", 0),
]


@pytest.mark.parametrize("short,hf,value", OFFICIAL, ids=[o[0] for o in OFFICIAL])
def test_official_short_name(short, hf, value):
    raw = small_hf()
    if short == "n_layers":
        value = 3
        raw["layer_types"] = raw["layer_types"][:3]
        raw["mlp_layer_types"] = raw["mlp_layer_types"][:3]
    del raw[hf]
    raw[short] = value
    c = ModelConfig.from_dict(raw)
    assert getattr(c, hf) == value
    assert short not in dataclasses.asdict(c)


def test_official_short_name_agreeing_with_hf_name_is_fine():
    raw = small_hf()
    raw["dim"] = raw["hidden_size"]
    raw["n_heads"] = raw["num_attention_heads"]
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(small_hf())


def test_n_hash_layers_and_num_hash_layers():
    for key in ("n_hash_layers", "num_hash_layers"):
        raw = small_hf()
        del raw["mlp_layer_types"]
        raw[key] = 2
        assert ModelConfig.from_dict(raw).hash_layers == [True, True, False, False, False]
        raw[key] = 0
        assert ModelConfig.from_dict(raw).hash_layers == [False] * 5


def test_legacy_compress_ratios_alone():
    raw = small_hf()
    del raw["layer_types"], raw["compress_rates"]
    raw["compress_ratios"] = [0, 4, 128, 4, 128, 0]
    c = ModelConfig.from_dict(raw)
    assert c.layer_kinds == ["sliding", "csa", "hca", "csa", "hca"]
    assert c.compress_ratios == [0, 4, 128, 4, 128]
    assert c.mtp_layer_kind == "sliding"
    raw["compress_ratios"] = [0, 4, 128, 4, 128]  # without the MTP entry
    assert ModelConfig.from_dict(raw).compress_ratios == [0, 4, 128, 4, 128]


def test_rope_scaling_yarn_hf():
    raw = small_hf()
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 4096,
                           "beta_fast": 16, "beta_slow": 2}
    assert ModelConfig.from_dict(raw).yarn == YarnConfig(8.0, 4096, 16.0, 2.0)
    raw["rope_scaling"] = {"type": "default"}
    assert ModelConfig.from_dict(raw).yarn is None


def test_rope_official_names():
    raw = small_hf()
    del raw["rope_scaling"]
    raw.update(rope_factor=8, original_seq_len=4096, beta_fast=16, beta_slow=2)
    assert ModelConfig.from_dict(raw).yarn == YarnConfig(8.0, 4096, 16.0, 2.0)


def test_rope_parameters_from_transformers_save_pretrained():
    raw = small_hf()
    del raw["rope_scaling"]
    # exactly what DeepseekV4Config(...).save_pretrained() writes in transformers 5.23.0
    raw["partial_rotary_factor"] = 0.5
    raw["rope_parameters"] = {
        "main": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
        "compress": {"attention_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0,
                     "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5,
                     "rope_theta": 160000.0, "rope_type": "yarn"}}
    assert ModelConfig.from_dict(raw).yarn == YarnConfig(4.0, 64, 32.0, 1.0)


# --------------------------------------------------------------------------- presets

def test_preset_tiny_covers_every_kind():
    c = preset("tiny")
    assert set(c.layer_kinds) == {"sliding", "csa", "hca"}
    assert any(c.hash_layers) and not all(c.hash_layers)
    assert c.num_nextn_predict_layers >= 1
    assert c.layer_kind(c.num_hidden_layers) in ("sliding", "csa", "hca")
    c.validate()


def test_preset_flash_num_layers():
    c = preset("flash", num_layers=5)
    assert c.num_hidden_layers == 5
    assert c.layer_kinds == ["sliding", "sliding", "csa", "hca", "csa"]
    assert c.compress_ratios == [0, 0, 4, 128, 4]
    assert c.hash_layers == [True, True, True, False, False]
    assert c.hidden_size == 4096 and c.n_routed_experts == 256
    assert preset("pro", num_layers=3).layer_kinds == ["hca", "hca", "csa"]
    assert preset("tiny", num_layers=2).num_hidden_layers == 2


def test_preset_unknown():
    with pytest.raises(ConfigError, match="nope"):
        preset("nope")


# --------------------------------------------------------------------------- round trip

ROUND_TRIP = {
    "tiny": lambda: preset("tiny"),
    "flash": lambda: preset("flash"),
    "pro": lambda: preset("pro"),
    "flash5": lambda: preset("flash", num_layers=5),
    "parity": lambda: parity_config(),
    "no_mtp": lambda: parity_config(num_nextn_predict_layers=0),
    "mtp_csa": lambda: parity_config(mtp_layer_kind="csa", mtp_compress_ratio=4),
    "mtp_hca": lambda: parity_config(mtp_layer_kind="hca", mtp_compress_ratio=16),
    "sigmoid": lambda: parity_config(scoring_func="sigmoid", routed_scaling_factor=2.5, rms_norm_eps=1e-5),
    "quantized": lambda: parity_config(quantization_config={"quant_method": "fp8"}, expert_dtype="fp4"),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_to_dict_from_dict_round_trip(name, tmp_path):
    c = ROUND_TRIP[name]()
    d = json.loads(json.dumps(c.to_dict()))  # through real JSON
    assert ModelConfig.from_dict(d) == c
    (tmp_path / "config.json").write_text(json.dumps(c.to_dict()))
    assert ModelConfig.from_file(tmp_path) == c


def test_round_trip_without_yarn():
    c = parity_config(yarn=None)
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


# --------------------------------------------------------------------------- errors

def _set(**kv):
    def f(raw):
        raw.update(kv)
    return f


def _del(*keys):
    def f(raw):
        for k in keys:
            del raw[k]
    return f


def _layer_type(i, value):
    def f(raw):
        raw["layer_types"][i] = value
    return f


BAD = {  # name: (mutation of small_hf(), words the message must contain)
    "unknown_layer_type": (_layer_type(1, "full_attention"), ["layer_types[1]", "full_attention"]),
    "layer_types_too_long": (lambda r: r["layer_types"].extend(["sliding_attention"] * 3), ["layer_types", "8"]),
    "layer_types_too_short": (lambda r: r["layer_types"].pop(), ["layer_types"]),
    "compress_ratios_wrong_length": (
        lambda r: (r.pop("layer_types"), r.update(compress_ratios=[0, 4, 16])), ["compress_ratios"]),
    "compress_ratios_not_ints": (
        lambda r: (r.pop("layer_types"), r.update(compress_ratios=[0, "4", 16, 4, 16])), ["compress_ratios"]),
    "layer_types_vs_compress_ratios": (_set(compress_ratios=[0, 4, 4, 4, 16]),
                                       ["layer_types", "compress_ratios"]),
    "no_layer_kinds": (_del("layer_types"), ["layer_types", "compress_ratios"]),
    "mlp_layer_types_short": (lambda r: r["mlp_layer_types"].pop(), ["mlp_layer_types"]),
    "mlp_layer_type_unknown": (lambda r: r["mlp_layer_types"].__setitem__(2, "dense"), ["mlp_layer_types[2]"]),
    "mlp_vs_num_hash_layers": (_set(num_hash_layers=3), ["mlp_layer_types", "num_hash_layers"]),
    "heads_not_divisible_by_o_groups": (_set(o_groups=3), ["o_groups", "num_attention_heads"]),
    "unknown_field": (_set(frobnication_level=3), ["frobnication_level"]),
    "aliases_disagree_hf_first": (_set(dim=128), ["dim", "hidden_size"]),
    "bad_scoring_func": (_set(scoring_func="relu"), ["scoring_func", "relu"]),
    "bad_score_func": (lambda r: (r.pop("scoring_func"), r.update(score_func="tanh")), ["scoring_func", "tanh"]),
    "hidden_size_zero": (_set(hidden_size=0), ["hidden_size"]),
    "heads_negative": (_set(num_attention_heads=-4), ["num_attention_heads"]),
    "experts_zero": (_set(n_routed_experts=0), ["n_routed_experts"]),
    "moe_width_zero": (_set(moe_intermediate_size=0), ["moe_intermediate_size"]),
    "vocab_zero": (_set(vocab_size=0), ["vocab_size"]),
    "window_zero": (_set(sliding_window=0), ["sliding_window"]),
    "layers_zero": (_set(num_hidden_layers=0), ["num_hidden_layers"]),
    "layers_missing": (_del("num_hidden_layers"), ["num_hidden_layers"]),
    "hidden_size_missing": (_del("hidden_size"), ["missing", "hidden_size", "dim"]),
    "vocab_size_missing": (_del("vocab_size"), ["missing", "vocab_size"]),
    "two_missing": (_del("moe_intermediate_size", "n_routed_experts"), ["moe_intermediate_size", "n_routed_experts"]),
    "rope_dim_missing": (_del("qk_rope_head_dim"), ["qk_rope_head_dim", "rope_head_dim"]),
    "hidden_size_string": (_set(hidden_size="64"), ["hidden_size"]),
    "hidden_size_float": (_set(hidden_size=64.0), ["hidden_size"]),
    "top_k_over_experts": (_set(num_experts_per_tok=9), ["num_experts_per_tok", "n_routed_experts"]),
    "rope_dim_odd": (_set(qk_rope_head_dim=15), ["qk_rope_head_dim"]),
    "rope_dim_over_head_dim": (_set(qk_rope_head_dim=64), ["qk_rope_head_dim"]),
    "index_head_dim_not_pow2": (_set(index_head_dim=24), ["index_head_dim"]),
    "rope_scaling_linear": (_set(rope_scaling={"type": "linear", "factor": 2}), ["rope_scaling"]),
    "rope_factor_string": (_set(rope_scaling={"type": "yarn", "factor": "x"}), ["rope_scaling.factor"]),
    "mtp_entries_without_mtp": (_set(num_nextn_predict_layers=0, compress_ratios=[0, 4, 16, 4, 16, 0]),
                                ["layer_types"]),
    "rms_norm_eps_zero": (_set(rms_norm_eps=0), ["rms_norm_eps"]),
    "rope_theta_string": (_set(rope_theta="big"), ["rope_theta"]),
    "shared_experts_two": (_set(n_shared_experts=2), ["n_shared_experts"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_names_the_field(name):
    mutate, words = BAD[name]
    raw = copy.deepcopy(small_hf())
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw)
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)


def test_aliases_disagree_short_name_first_names_both():
    raw = small_hf()
    del raw["hidden_size"]
    raw = {"dim": 128, **raw, "hidden_size": 64}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw)
    assert "`dim`" in str(info.value) and "`hidden_size`" in str(info.value)


def test_bad_value_in_file_names_file_and_field(tmp_path):
    raw = small_hf()
    raw["o_groups"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(tmp_path / "config.json")
    assert str(tmp_path / "config.json") in str(info.value) and "o_groups" in str(info.value)


def test_non_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{'hidden_size': 64,}")
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value) and "JSON" in str(info.value)


def test_json_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_file(tmp_path)


def test_binary_config_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00\x81binary")
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    with pytest.raises(ConfigError, match="nowhere"):
        ModelConfig.from_file(tmp_path / "nowhere" / "config.json")


def test_config_saved_by_transformers_parses_to_the_same_geometry(tmp_path):
    pytest.importorskip("transformers", minversion="5.23", reason="needs transformers>=5.23")
    import dataclasses
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_oracle import hf_config

    c = parity_config()
    hf_config(c).save_pretrained(tmp_path)
    parsed = ModelConfig.from_file(tmp_path)
    assert dataclasses.replace(parsed, num_nextn_predict_layers=c.num_nextn_predict_layers) == c
