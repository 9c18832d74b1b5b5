"""ModelConfig: the DeepSeek-V4 geometry, parsed from a checkpoint's ``config.json``.

Accepts the HF field names, DeepSeek's official short names (``dim``, ``n_layers``, ...) and the
legacy forms (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``); see DSV4_FACTS
section 1. Anything unknown or inconsistent raises :class:`ConfigError` naming the field: an engine
that silently defaults a field of a 300 GB model produces plausible garbage.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import Dsv4Error

LAYER_KINDS = ("sliding", "csa", "hca")

# HF `layer_types` spelling -> our layer kind.
_HF_LAYER_TYPES = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_HF_MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
SCALE_FMTS = (None, "ue8m0", "fp32")


class ConfigError(Dsv4Error, ValueError):
    """A config.json field is missing, unknown or inconsistent. The message names the field."""


@dataclass
class YarnConfig:
    """YaRN scaling of the compressed layers' RoPE (no mscale on cos/sin in DeepSeek-V4)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass
class ModelConfig:
    """The geometry of one DeepSeek-V4 network. Field names follow HF where one exists."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    #: per layer: "sliding" (window only), "csa" (compressed sparse), "hca" (heavily compressed)
    layer_kinds: list[str] = field(default_factory=list)
    #: per layer compression ratio m (0 for sliding layers)
    compress_ratios: list[int] = field(default_factory=list)
    #: per layer True where the MoE routes by token id (`tid2eid`)
    hash_layers: list[bool] = field(default_factory=list)
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = field(default_factory=YarnConfig)
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    #: layer kind and ratio of the MTP block (the last entry of a length n+1 `compress_ratios`)
    mtp_layer_kind: str = "sliding"
    mtp_compress_ratio: int = 0
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    #: quantization facts read from config.json, kept for the loader to cross-check
    quantization_config: dict | None = None
    expert_dtype: str | None = None
    #: FP8 scale format of the release (`ue8m0`: power-of-two scales, as every DeepSeek release);
    #: also the scale format of the simulated FP8 KV cache and activation quantization
    scale_fmt: str | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.layer_kinds:
            self.layer_kinds = ["sliding"] * n
        if not self.compress_ratios:
            default = {"sliding": 0, "csa": 4, "hca": 128}
            self.compress_ratios = [default[k] for k in self.layer_kinds]
        if not self.hash_layers:
            self.hash_layers = [i < 3 for i in range(n)]
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first inconsistent field."""
        n = self.num_hidden_layers
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "sliding_window", "hc_mult", "hc_sinkhorn_iters")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field `{name}` must be a positive integer, got {value!r}")
        for name, values in (("layer_kinds", self.layer_kinds), ("compress_ratios", self.compress_ratios),
                             ("hash_layers", self.hash_layers)):
            if len(values) != n:
                raise ConfigError(f"config field `{name}` has {len(values)} entries but "
                                  f"`num_hidden_layers` is {n}")
        for i, (kind, ratio) in enumerate(zip(self.layer_kinds, self.compress_ratios)):
            _check_kind(f"layer_kinds[{i}]", kind, ratio)
        _check_kind("mtp_layer_kind", self.mtp_layer_kind, self.mtp_compress_ratio)
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"config field `o_groups` ({self.o_groups}) must divide "
                              f"`num_attention_heads` ({self.num_attention_heads})")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise ConfigError(f"config field `qk_rope_head_dim` ({self.qk_rope_head_dim}) must be even and "
                              f"within `head_dim` ({self.head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"config field `num_experts_per_tok` ({self.num_experts_per_tok}) exceeds "
                              f"`n_routed_experts` ({self.n_routed_experts})")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"config field `scoring_func` is {self.scoring_func!r}; "
                              f"supported: {', '.join(SCORING_FUNCS)}")
        if self.n_shared_experts not in (0, 1):
            raise ConfigError(f"config field `n_shared_experts` must be 0 or 1, got {self.n_shared_experts}")
        if "csa" in self.layer_kinds + [self.mtp_layer_kind]:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise ConfigError(f"config field `{name}` must be a positive integer, got {value!r}")
            if self.index_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
                raise ConfigError(f"config field `index_head_dim` ({self.index_head_dim}) must be even and "
                                  f">= `qk_rope_head_dim` ({self.qk_rope_head_dim})")
            if self.index_head_dim & (self.index_head_dim - 1):
                raise ConfigError(f"config field `index_head_dim` ({self.index_head_dim}) must be a power of "
                                  "two (the indexer applies a Walsh-Hadamard rotation over it)")
        if self.rms_norm_eps <= 0 or self.hc_eps <= 0:
            raise ConfigError("config fields `rms_norm_eps` and `hc_eps` must be positive")
        if self.scale_fmt not in SCALE_FMTS:
            raise ConfigError(f"config field `scale_fmt` is {self.scale_fmt!r}; supported: ue8m0, fp32 or null")
        if self.yarn is not None and self.yarn.factor <= 0:
            raise ConfigError(f"config field `rope_scaling.factor` must be positive, got {self.yarn.factor}")

    # ------------------------------------------------------------------ derived
    @property
    def kv_scale_pow2(self) -> bool:
        """Power-of-two (ue8m0) scales for the simulated FP8 KV cache and activation quantization:
        what `scale_fmt` says, and ue8m0 (every release's setting) when the config is silent."""
        return self.scale_fmt in (None, "ue8m0")

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    def layer_kind(self, layer: int) -> str:
        """Kind of layer ``layer``; ``layer == num_hidden_layers`` is the MTP block."""
        return self.mtp_layer_kind if layer >= self.num_hidden_layers else self.layer_kinds[layer]

    def layer_ratio(self, layer: int) -> int:
        return self.mtp_compress_ratio if layer >= self.num_hidden_layers else self.compress_ratios[layer]

    def with_layers(self, n: int) -> "ModelConfig":
        """The same geometry with the first ``n`` layers (benchmarks with random weights)."""
        return dataclasses.replace(self, num_hidden_layers=n, layer_kinds=self.layer_kinds[:n],
                                   compress_ratios=self.compress_ratios[:n], hash_layers=self.hash_layers[:n])

    def to_dict(self) -> dict[str, Any]:
        """HF-style config.json content that :meth:`from_dict` reads back to an equal config."""
        d = dataclasses.asdict(self)
        kinds = {v: k for k, v in _HF_LAYER_TYPES.items()}
        d["model_type"] = "deepseek_v4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["layer_types"] = [kinds[k] for k in d.pop("layer_kinds")]
        d["compress_ratios"] = d.pop("compress_ratios") + (
            [d.pop("mtp_compress_ratio")] if self.num_nextn_predict_layers else [])
        d.pop("mtp_compress_ratio", None)
        d.pop("mtp_layer_kind")
        d["compress_rates"] = {kinds[k]: r for k, r in zip(self.layer_kinds + [self.mtp_layer_kind],
                                                          self.compress_ratios + [self.mtp_compress_ratio])
                               if k != "sliding"}
        d["mlp_layer_types"] = ["hash_moe" if h else "moe" for h in d.pop("hash_layers")]
        yarn = d.pop("yarn")
        d["rope_scaling"] = None if yarn is None else {"type": "yarn", **yarn}
        for key in ("quantization_config", "expert_dtype", "scale_fmt"):
            if d[key] is None:
                d.pop(key)
        return d

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a config.json dict (HF, official or legacy field names)."""
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Parse a ``config.json`` (or the one in directory ``path``); errors name the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        raw = read_config_json(path)
        try:
            return _parse(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; a :class:`ConfigError` naming the file if there is none."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return raw


def _check_kind(name: str, kind: str, ratio: int) -> None:
    if kind not in LAYER_KINDS:
        raise ConfigError(f"config field `{name}` has unknown layer kind {kind!r}; known: {LAYER_KINDS}")
    if (kind == "sliding") != (ratio == 0) or ratio < 0:
        raise ConfigError(f"config field `{name}`: kind {kind!r} does not fit compress ratio {ratio}")
    if kind == "csa" and ratio < 2:
        raise ConfigError(f"config field `{name}`: CSA compress ratio must be >= 2, got {ratio}")


# Official short name -> HF name.
_ALIASES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
    "window_size": "sliding_window",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_eps": "rms_norm_eps",
    "n_mtp_layers": "num_nextn_predict_layers",
    "max_seq_len": "max_position_embeddings",
    "n_hash_layers": "num_hash_layers",
}

# Fields a config.json must give: they decide the tensor shapes and differ between releases
# (Flash vs Pro), so a default taken from another model would only fail later, on a shape. The
# rest (window 128, hc_mult 4, the indexer's 64 x 128 heads, ...) are DeepSeek-V4 constants.
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
             "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
             "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size")
_OFFICIAL_NAME = {hf: short for short, hf in _ALIASES.items()}

# Fields that describe training, HF plumbing or things we do not use; accepted and ignored.
_IGNORED = {
    "model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "hidden_act", "attention_bias", "mlp_bias", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "tie_word_embeddings",
    "pad_token_id", "num_key_value_heads", "norm_topk_prob", "auto_map", "max_batch_size",
    "kv_lora_rank", "inter_dim", "n_dense_layers",
    "n_expert_groups", "n_limited_groups", "topk_group", "n_group", "first_k_dense_replace",
    "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux", "topk_method",
    "qk_nope_head_dim", "v_head_dim", "intermediate_size", "num_local_experts", "mscale",
    "_name_or_path", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "rope_type", "bos_token", "eos_token", "attn_implementation", "_attn_implementation",
}


def _parse(raw: dict[str, Any]) -> ModelConfig:
    cfg: dict[str, Any] = {}
    source: dict[str, str] = {}  # HF name -> the raw key it came from
    for key, value in raw.items():
        hf = _ALIASES.get(key, key)
        if hf in cfg and cfg[hf] != value:
            raise ConfigError(f"config fields `{source[hf]}` and `{key}` disagree ({cfg[hf]!r} vs {value!r})")
        cfg[hf], source[hf] = value, key
    if "quantization_config" in cfg and "expert_dtype" not in cfg:
        qc = cfg["quantization_config"]
        if isinstance(qc, dict) and "expert_dtype" in qc:
            cfg["expert_dtype"] = qc["expert_dtype"]
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and qc.get("scale_fmt") is not None:
        if cfg.get("scale_fmt") not in (None, qc["scale_fmt"]):
            raise ConfigError(f"config fields `scale_fmt` ({cfg['scale_fmt']!r}) and "
                              f"`quantization_config.scale_fmt` ({qc['scale_fmt']!r}) disagree")
        cfg["scale_fmt"] = qc["scale_fmt"]

    yarn = _parse_yarn(cfg)
    factor = cfg.pop("partial_rotary_factor", None)
    if factor is not None:
        head_dim = cfg.get("head_dim", ModelConfig.head_dim)
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1 or not isinstance(head_dim, int):
            raise ConfigError(f"config field `partial_rotary_factor` must be in (0, 1], got {factor!r}")
        rope_dim = round(head_dim * factor)
        if cfg.setdefault("qk_rope_head_dim", rope_dim) != rope_dim:
            raise ConfigError(f"config fields `partial_rotary_factor` ({factor}) and `qk_rope_head_dim` "
                              f"({cfg['qk_rope_head_dim']}) disagree")
    missing = [name for name in _REQUIRED if name not in cfg]
    if missing:
        named = [f"`{m}`" + (f" (or `{_OFFICIAL_NAME[m]}`)" if m in _OFFICIAL_NAME else "") for m in missing]
        raise ConfigError(f"config is missing required field(s): {', '.join(named)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    out: dict[str, Any] = {}
    for name in fields - {"layer_kinds", "compress_ratios", "hash_layers", "yarn", "mtp_layer_kind",
                          "mtp_compress_ratio"}:
        if name in cfg:
            out[name] = cfg.pop(name)
    eos = out.get("eos_token_id")
    if isinstance(eos, list):
        out["eos_token_id"] = eos[0] if eos else 1
    n = out.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        raise ConfigError(f"config field `num_hidden_layers` (or `n_layers`) must be a positive integer, "
                          f"got {n!r}")
    n_mtp = out.get("num_nextn_predict_layers", 1)

    out.update(_parse_layer_kinds(cfg, n, n_mtp))
    out["hash_layers"] = _parse_hash_layers(cfg, n)
    out["yarn"] = yarn
    for name in ("hc_eps", "rms_norm_eps", "routed_scaling_factor", "swiglu_limit", "rope_theta",
                 "compress_rope_theta"):
        if name in out:
            if not isinstance(out[name], (int, float)) or isinstance(out[name], bool):
                raise ConfigError(f"config field `{name}` must be a number, got {out[name]!r}")
            out[name] = float(out[name])

    unknown = sorted(k for k in cfg if k not in _IGNORED)
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join('`' + k + '`' for k in unknown)}")
    try:
        return ModelConfig(**out)
    except TypeError as e:  # wrong type in a field used by __post_init__
        raise ConfigError(f"bad config value: {e}") from None


def _parse_layer_kinds(cfg: dict[str, Any], n: int, n_mtp: int) -> dict[str, Any]:
    """Per-layer kinds and ratios from `layer_types`+`compress_rates` or legacy `compress_ratios`."""
    rates = dict(cfg.pop("compress_rates", None) or {})
    for legacy, key in (("compress_rate_csa", "compressed_sparse_attention"),
                        ("compress_rate_hca", "heavily_compressed_attention")):
        if legacy in cfg:
            rates[key] = cfg.pop(legacy)
    csa_ratio = rates.get("compressed_sparse_attention", 4)
    hca_ratio = rates.get("heavily_compressed_attention", 128)
    layer_types = cfg.pop("layer_types", None)
    ratios = cfg.pop("compress_ratios", None)
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ConfigError("config field `layer_types` must be a list")
        kinds = []
        for i, t in enumerate(layer_types):
            if t not in _HF_LAYER_TYPES:
                raise ConfigError(f"config field `layer_types[{i}]` has unknown layer type {t!r}; "
                                  f"known: {sorted(_HF_LAYER_TYPES)}")
            kinds.append(_HF_LAYER_TYPES[t])
        by_kind = {"sliding": 0, "csa": csa_ratio, "hca": hca_ratio}
        layer_ratios = [by_kind[k] for k in kinds]
        if ratios is not None:  # both given: they must agree; an extra last ratio is the MTP layer's
            if not isinstance(ratios, list) or list(ratios[: len(kinds)]) != layer_ratios:
                raise ConfigError("config fields `layer_types` and `compress_ratios` disagree")
            for r in ratios[len(kinds):]:
                kinds.append("sliding" if r == 0 else "csa" if r == csa_ratio else "hca")
                layer_ratios.append(r)
    elif ratios is not None:
        if not isinstance(ratios, list) or not all(isinstance(r, int) and r >= 0 for r in ratios):
            raise ConfigError(f"config field `compress_ratios` must be a list of non-negative integers, "
                              f"got {ratios!r}")
        layer_ratios = list(ratios)
        kinds = ["sliding" if r == 0 else "csa" if r == csa_ratio else "hca" for r in layer_ratios]
    else:
        raise ConfigError("config needs `layer_types` (with `compress_rates`) or `compress_ratios` "
                          "to know each layer's attention kind")
    if len(kinds) not in (n, n + n_mtp) or (n_mtp == 0 and len(kinds) != n):
        raise ConfigError(f"config field `{'layer_types' if layer_types is not None else 'compress_ratios'}` "
                          f"has {len(kinds)} entries; expected `num_hidden_layers` ({n})"
                          + (f" or {n + n_mtp} (with the MTP layer)" if n_mtp else ""))
    mtp_kind, mtp_ratio = (kinds[n], layer_ratios[n]) if len(kinds) > n else ("sliding", 0)
    return {"layer_kinds": kinds[:n], "compress_ratios": layer_ratios[:n],
            "mtp_layer_kind": mtp_kind, "mtp_compress_ratio": mtp_ratio}


def _parse_hash_layers(cfg: dict[str, Any], n: int) -> list[bool]:
    mlp_types = cfg.pop("mlp_layer_types", None)
    n_hash = cfg.pop("num_hash_layers", None)
    if mlp_types is not None:
        if not isinstance(mlp_types, list) or len(mlp_types) < n:
            raise ConfigError(f"config field `mlp_layer_types` must list {n} entries")
        for i, t in enumerate(mlp_types[:n]):
            if t not in _HF_MLP_TYPES:
                raise ConfigError(f"config field `mlp_layer_types[{i}]` is {t!r}; known: {_HF_MLP_TYPES}")
        hashes = [t == "hash_moe" for t in mlp_types[:n]]
        if n_hash is not None and sum(hashes) != n_hash:
            raise ConfigError("config fields `mlp_layer_types` and `num_hash_layers` disagree")
        return hashes
    if n_hash is None:
        n_hash = 3
    if not isinstance(n_hash, int) or n_hash < 0:
        raise ConfigError(f"config field `num_hash_layers` must be a non-negative integer, got {n_hash!r}")
    return [i < n_hash for i in range(n)]


def _parse_yarn(cfg: dict[str, Any]) -> YarnConfig | None:
    """YaRN parameters of the compressed layers' RoPE.

    Sources, in order: ``rope_parameters`` as transformers >= 5.23 saves it (``{"main": {...},
    "compress": {...}}``, also giving both thetas, or a flat dict), ``rope_scaling`` (HF; an
    explicit ``null`` means no YaRN), the official ``rope_factor``/``original_seq_len``/``beta_*``.
    A config with none of them gets DeepSeek-V4's default YaRN.
    """
    params = cfg.pop("rope_parameters", None)
    has_scaling = "rope_scaling" in cfg
    scaling = cfg.pop("rope_scaling", None)
    official = {k: cfg.pop(k) for k in ("rope_factor", "original_seq_len", "beta_fast", "beta_slow")
                if k in cfg}
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError("config field `rope_parameters` must be an object")
        if isinstance(params.get("compress"), dict):
            main, compress = params.get("main") or {}, params["compress"]
            for key, sub, field_name in (("rope_theta", main, "rope_theta"),
                                         ("rope_theta", compress, "compress_rope_theta")):
                if key in sub:
                    cfg.setdefault(field_name, sub[key])
            scaling, has_scaling = compress, True
        elif scaling is None and params.get("rope_type", params.get("type")) is not None:
            scaling, has_scaling = params, True
    if has_scaling and scaling is None and not official:
        return None
    if scaling is None and not official:
        return YarnConfig()
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ConfigError("config field `rope_scaling` must be an object or null")
        kind = scaling.get("type", scaling.get("rope_type", "yarn"))
        if kind == "default":
            return None
        if kind != "yarn":
            raise ConfigError(f"config field `rope_scaling.type` is {kind!r}; only 'yarn' is supported")
        src = {"factor": scaling.get("factor"),
               "original_max_position_embeddings": scaling.get("original_max_position_embeddings"),
               "beta_fast": scaling.get("beta_fast"), "beta_slow": scaling.get("beta_slow")}
        if scaling.get("mscale") not in (None, 1, 1.0) or scaling.get("attention_factor") not in (None, 1, 1.0):
            raise ConfigError("config field `rope_scaling`: DeepSeek-V4 applies no mscale/attention_factor "
                              "to cos/sin; refusing a config that asks for one")
    else:
        src = {"factor": official.get("rope_factor"),
               "original_max_position_embeddings": official.get("original_seq_len"),
               "beta_fast": official.get("beta_fast"), "beta_slow": official.get("beta_slow")}
    defaults = YarnConfig()
    values = {k: (getattr(defaults, k) if v is None else v) for k, v in src.items()}
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"config field `rope_scaling.{k}` must be a number, got {v!r}")
    if values["factor"] <= 1:
        return None
    return YarnConfig(factor=float(values["factor"]),
                      original_max_position_embeddings=int(values["original_max_position_embeddings"]),
                      beta_fast=float(values["beta_fast"]), beta_slow=float(values["beta_slow"]))


# --------------------------------------------------------------------------- presets
def _alternating(n: int, first: list[str]) -> list[str]:
    rest = ["csa" if i % 2 == 0 else "hca" for i in range(max(0, n - len(first)))]
    return (first + rest)[:n]


def preset(name: str, num_layers: int | None = None) -> ModelConfig:
    """Named geometries: ``tiny`` (CPU, every layer kind), ``flash`` and ``pro`` (real shapes).

    ``num_layers`` overrides the layer count (benchmarks with random weights).

    The tiny geometry is sized so that its FP8-block tensors (128x128 blocks) split over 2
    tensor-parallel ranks: per rank, ``wq_b`` holds 4 heads x 32 = 128 rows, ``wo_a`` 2 groups x 64
    = 128 rows, ``wo_b`` 128 columns, and the shared expert 128 intermediate channels. A BF16 copy
    also splits over 4 (8 heads, 4 groups, 8 experts, 256 shared-expert channels and 512 vocab
    entries all divide by 4).
    """
    if name == "tiny":
        n = num_layers or 4
        kinds = (["sliding", "csa", "hca", "csa"] * n)[:n]
        ratio = {"sliding": 0, "csa": 4, "hca": 16}
        return ModelConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=n, num_attention_heads=8, head_dim=32,
            qk_rope_head_dim=16, q_lora_rank=32, o_groups=4, o_lora_rank=64, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=256, layer_kinds=kinds,
            compress_ratios=[ratio[k] for k in kinds], hash_layers=[i < 1 for i in range(n)],
            sliding_window=8, index_n_heads=4, index_head_dim=16, index_topk=4, hc_mult=4,
            hc_sinkhorn_iters=20, routed_scaling_factor=1.5, compress_rope_theta=160000.0,
            yarn=YarnConfig(factor=4.0, original_max_position_embeddings=64), num_nextn_predict_layers=1,
            mtp_layer_kind="sliding", mtp_compress_ratio=0, max_position_embeddings=65536)
    if name == "flash":
        n = num_layers or 43
        kinds = (["sliding", "sliding"] + ["csa", "hca"] * 20 + ["csa"])
        kinds = kinds[:n] if n <= 43 else _alternating(n, kinds)
        ratio = {"sliding": 0, "csa": 4, "hca": 128}
        return ModelConfig(layer_kinds=kinds, compress_ratios=[ratio[k] for k in kinds], num_hidden_layers=n,
                           hash_layers=[i < 3 for i in range(n)])
    if name == "pro":
        n = num_layers or 61
        kinds = ["hca", "hca"] + ["csa", "hca"] * 29 + ["csa"]
        kinds = kinds[:n] if n <= 61 else _alternating(n, kinds)
        ratio = {"sliding": 0, "csa": 4, "hca": 128}
        return ModelConfig(hidden_size=7168, num_hidden_layers=n, num_attention_heads=128, q_lora_rank=1536,
                           o_groups=16, n_routed_experts=384, moe_intermediate_size=3072, index_topk=1024,
                           routed_scaling_factor=2.5, layer_kinds=kinds,
                           compress_ratios=[ratio[k] for k in kinds], hash_layers=[i < 3 for i in range(n)])
    raise ConfigError(f"unknown preset {name!r}; known: tiny, flash, pro")
