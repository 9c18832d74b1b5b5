"""What a checkpoint says about its quantization, and the cross-check with the tensors found.

Sources: ``config.json``'s ``quantization_config`` (DeepSeek: ``quant_method: fp8``,
``weight_block_size``, ``scale_fmt``; ModelOpt: ``quant_method: modelopt``, ``quant_algo``) and
``expert_dtype``, and ModelOpt's ``hf_quant_config.json``. The tensors decide each weight's format
(:mod:`.serialize`); these rules only refuse checkpoints whose tensors contradict their config
(e.g. ``expert_dtype: fp4`` with FP8 experts, an excluded module stored quantized, a group size we
do not implement), with a message naming the field and the tensor.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, ModelConfig
from .formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, QuantWeight

_ALGOS = ("FP8", "NVFP4", "MIXED_PRECISION", "W4A8_NVFP4_FP8", "FP8_BLOCK")
_EXPERT_DTYPES = {"fp4": (Mxfp4Weight, Nvfp4Weight), "fp8": (Fp8BlockWeight,), "bf16": ()}


@dataclass
class QuantRules:
    method: str | None = None           # "fp8" (DeepSeek), "modelopt", or None (plain checkpoint)
    algo: str | None = None             # ModelOpt quant_algo
    expert_dtype: str | None = None     # "fp4" / "fp8" / "bf16"
    exclude: list[str] = field(default_factory=list)  # ModelOpt exclude_modules patterns


def _modelopt_section(path: Path) -> dict | None:
    file = path / "hf_quant_config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    section = data.get("quantization", data) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{file}: expected an object with a `quantization` section")
    return section


def read_quant_rules(path: Path, config: ModelConfig) -> QuantRules:
    """Parse and validate the quantization declarations of the checkpoint at ``path``."""
    qc = config.quantization_config or {}
    if not isinstance(qc, dict):
        raise ConfigError("config field `quantization_config` must be an object")
    rules = QuantRules(method=qc.get("quant_method"), expert_dtype=config.expert_dtype)
    modelopt = _modelopt_section(path)
    if modelopt is not None or rules.method == "modelopt":
        section = {**qc, **(modelopt or {})}
        rules.method = "modelopt"
        rules.algo = section.get("quant_algo")
        if rules.algo not in _ALGOS:
            raise ConfigError(f"quantization field `quant_algo` is {rules.algo!r}; supported: {_ALGOS}")
        group = section.get("group_size", 16)
        if rules.algo != "FP8" and group != 16:
            raise ConfigError(f"quantization field `group_size` is {group}; NVFP4 uses 16")
        exclude = section.get("exclude_modules", section.get("ignore", [])) or []
        if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
            raise ConfigError("quantization field `exclude_modules` must be a list of strings")
        rules.exclude = exclude
    elif rules.method is not None:
        if rules.method != "fp8":
            raise ConfigError(f"config field `quantization_config.quant_method` is {rules.method!r}; "
                              "supported: fp8 (DeepSeek releases), modelopt (NVIDIA)")
        block = qc.get("weight_block_size", [128, 128])
        if list(block) != [128, 128]:
            raise ConfigError(f"config field `quantization_config.weight_block_size` is {block}; "
                              "only [128, 128] is supported")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"config field `quantization_config.fmt` is {fmt!r}; only e4m3 is supported")
    if rules.expert_dtype is not None and rules.expert_dtype not in _EXPERT_DTYPES:
        raise ConfigError(f"config field `expert_dtype` is {rules.expert_dtype!r}; known: {list(_EXPERT_DTYPES)}")
    return rules


def _excluded(name: str, patterns: list[str]) -> bool:
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    return any(fnmatch.fnmatch(module, p) or fnmatch.fnmatch(name, p) for p in patterns)


def check_quant_rules(rules: QuantRules, packed: dict[str, QuantWeight], plain: dict, config: ModelConfig) -> None:
    """Refuse tensors that contradict the declared quantization (message names the tensor)."""
    for name, weight in packed.items():
        if rules.exclude and _excluded(name, rules.exclude):
            raise ConfigError(f"tensor `{name}` is stored as {weight.dtype_name} but matches "
                              "`exclude_modules` in the quantization config")
    if rules.expert_dtype in ("fp4", "fp8"):
        allowed = _EXPERT_DTYPES[rules.expert_dtype]
        for name, weight in list(packed.items()) + list(plain.items()):
            if ".experts." in name and name.endswith(".weight") and not isinstance(weight, allowed):
                kind = weight.dtype_name if isinstance(weight, QuantWeight) else str(weight.dtype)
                raise ConfigError(f"config field `expert_dtype` is {rules.expert_dtype!r} but routed expert "
                                  f"tensor `{name}` is {kind}")
