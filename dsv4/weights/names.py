"""Tensor names: our modules' names <-> DeepSeek's official checkpoint names <-> HF names.

Our modules carry the official names (``layers.3.attn.wq_a.weight``) with two exceptions, both
mapped here (:func:`official_to_module`, :func:`official_state_dict`):

- the mHC parameters live in a :class:`~dsv4.model.mhc.HyperConnection` module:
  ``layers.3.hc_attn.fn`` is the checkpoint's ``layers.3.hc_attn_fn`` (``hc_ffn_*``, ``hc_head_*``
  alike);
- the routed experts of a layer are one stacked weight per projection: slice ``e`` of
  ``layers.3.ffn.experts.w1.weight [E, I, D]`` is the checkpoint's ``layers.3.ffn.experts.{e}.w1.weight``
  (scale companions alike). The loader writes each expert straight into its slice.

HF checkpoints rename every tensor and fuse each layer's routed experts into
``mlp.experts.gate_up_proj [E, 2I, D]`` (w1 then w3) and ``mlp.experts.down_proj [E, D, I]``;
this module maps names both ways and splits/fuses the expert stacks. The tables are data.
"""

from __future__ import annotations

import re

import torch

# (official suffix inside ``layers.{i}.``, HF suffix inside ``model.layers.{i}.``)
_LAYER_NAMES = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
]
_TOP_NAMES = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
]
_HF_TO_OFFICIAL = {hf: off for off, hf in _LAYER_NAMES}
_OFFICIAL_TO_HF = {off: hf for off, hf in _LAYER_NAMES}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OFFICIAL_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


# ----------------------------------------------------------------------------- module <-> official
_HC_MODULE = re.compile(r"(^|\.)hc_(attn|ffn|head)\.(fn|base|scale)$")        # layers.3.hc_attn.fn
_HC_OFFICIAL = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")       # layers.3.hc_attn_fn
_EXPERT_OFFICIAL = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(\w+)$")      # ....experts.3.w1.weight
_EXPERT_MODULE = re.compile(r"^(.*\.experts)\.(w[123])\.(\w+)$")               # ....experts.w1.weight


def official_to_module(name: str) -> tuple[str, int | None]:
    """The module tensor an official tensor name lands in, and the routed expert's slice of it
    (None for every other tensor): ``layers.3.ffn.experts.5.w1.scale`` -> (``layers.3.ffn.experts.w1.scale``,
    5); ``layers.3.hc_attn_fn`` -> (``layers.3.hc_attn.fn``, None)."""
    match = _EXPERT_OFFICIAL.match(name)
    if match:
        head, e, proj, part = match.groups()
        return f"{head}.{proj}.{part}", int(e)
    return _HC_OFFICIAL.sub(r"\1hc_\2.\3", name), None


def module_to_official(name: str) -> str:
    """The official name of a module tensor other than a stacked routed-expert weight
    (``layers.3.hc_attn.fn`` -> ``layers.3.hc_attn_fn``; most names are the same)."""
    return _HC_MODULE.sub(r"\1hc_\2_\3", name)


def stacked_expert_module(name: str) -> str | None:
    """``layers.3.ffn.experts.5.w1.weight`` -> ``layers.3.ffn.experts.w1`` (the stacked Linear that
    holds expert 5's slice); None for a tensor that is not a routed expert's."""
    match = _EXPERT_OFFICIAL.match(name)
    return None if match is None else f"{match.group(1)}.{match.group(3)}"


def official_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module ``state_dict()`` under the checkpoint's official names: the mHC names renamed, each
    stacked routed-expert tensor as one view per expert. Order: the model's, with a layer's experts
    expert-major (``experts.0.w1``, ``experts.0.w2``, ``experts.0.w3``, ``experts.1.w1`` ...), the
    order of a checkpoint that holds them one by one."""
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, t in state.items():
        match = _EXPERT_MODULE.match(name)
        if match is None:
            out[module_to_official(name)] = t
            continue
        head = match.group(1)
        if head in done:
            continue
        done.add(head)
        group = [(m.group(2), m.group(3), v) for n, v in state.items()
                 if (m := _EXPERT_MODULE.match(n)) is not None and m.group(1) == head]
        for e in range(t.shape[0]):
            for proj, part, v in group:
                out[f"{head}.{e}.{proj}.{part}"] = v[e]
    return out


def is_hf_name(name: str) -> bool:
    return name.startswith("model.") or name == "lm_head.weight"


# transformers' `save_pretrained` writes its model back through the reverse of its conversion
# rules, which yields official names behind a "model." prefix except for these leftovers (and
# `attn.kv_norm` comes out as `attn.norm`, the reverse of its compressor `.norm.` rule).
_HF_SAVED_TOP = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                 "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_HF_SAVED_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")


def hf_to_official(name: str) -> str | None:
    """Official name of an HF tensor name (as in HF modules, or as `save_pretrained` writes it);
    None for fused expert stacks (see :func:`split_hf_experts`) and for names no rule knows."""
    for off, hf in _TOP_NAMES:
        if name == hf:
            return off
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _HF_TO_OFFICIAL:
        return f"layers.{match.group(1)}.{_HF_TO_OFFICIAL[match.group(2)]}"
    if name.startswith("model."):
        rest = name[len("model."):]
        if rest in _HF_SAVED_TOP:
            return _HF_SAVED_TOP[rest]
        if rest == "norm.weight" or rest.startswith(("layers.", "mtp.")):
            return _HF_SAVED_KV_NORM.sub(r"\1.kv_norm.weight", rest)
    return None


def official_to_hf(name: str) -> str | None:
    """HF name of an official tensor name (per-expert names have none: HF fuses them)."""
    for off, hf in _TOP_NAMES:
        if name == off:
            return hf
    match = _OFFICIAL_LAYER.match(name)
    if match and match.group(2) in _OFFICIAL_TO_HF:
        return f"model.layers.{match.group(1)}.{_OFFICIAL_TO_HF[match.group(2)]}"
    return None


def split_hf_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """``model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, D]`` -> per-expert ``w1``/``w3``;
    ``down_proj [E, D, I]`` -> per-expert ``w2`` (official names)."""
    match = HF_FUSED_EXPERTS.match(name)
    if match is None:
        raise KeyError(name)
    layer, which = match.groups()
    out = {}
    for e in range(tensor.shape[0]):
        prefix = f"layers.{layer}.ffn.experts.{e}"
        if which == "gate_up_proj":
            w1, w3 = tensor[e].chunk(2, dim=0)
            out[f"{prefix}.w1.weight"], out[f"{prefix}.w3.weight"] = w1, w3
        else:
            out[f"{prefix}.w2.weight"] = tensor[e]
    return out


def to_hf_state_dict(official: dict[str, torch.Tensor], n_layers: int, n_experts: int) -> dict[str, torch.Tensor]:
    """An HF-named state dict (experts fused) from an official one; ``mtp.*`` tensors are dropped."""
    out = {}
    for name, t in official.items():
        hf = official_to_hf(name)
        if hf is not None:
            out[hf] = t
    for i in range(n_layers):
        p = f"layers.{i}.ffn.experts"
        if f"{p}.0.w1.weight" not in official:
            continue
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([official[f"{p}.{e}.w1.weight"], official[f"{p}.{e}.w3.weight"]], 0)
             for e in range(n_experts)])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [official[f"{p}.{e}.w2.weight"] for e in range(n_experts)])
    return out
