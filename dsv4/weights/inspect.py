"""``dsv4 inspect``: a checkpoint's config, layer kinds, tensor formats, parameter count and bytes.

By default it reads only the config and the safetensors headers (no tensor data), so it is
instant on a several-hundred-GB checkpoint, and checks them as the loader would
(:func:`~dsv4.weights.loader.check_checkpoint`: names, shapes, dtypes, index, quantization
config). ``check="data"`` also reads every tensor (NaN/Inf values and scales, unreadable bytes);
``check=None`` skips checking.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path

from safetensors import safe_open

import torch

from ..config import ModelConfig
from ..engine.limits import format_bytes
from ..engine.state import state_layout
from .loader import CheckpointError, check_checkpoint, list_shards, tensor_group

CHECKS = ("headers", "data", None)

_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1,
          "I16": 2, "I32": 4, "I64": 8, "F4": 0.5, "BOOL": 1}


def _run_length(kinds: list[str]) -> str:
    """``sliding x2, csa, hca, ...`` compact form of the per-layer kinds."""
    parts, prev, count = [], None, 0
    for k in kinds + [None]:
        if k == prev:
            count += 1
            continue
        if prev is not None:
            parts.append(prev if count == 1 else f"{prev} x{count}")
        prev, count = k, 1
    return ", ".join(parts)


def check_line(path: Path, check: str | None) -> str:
    """Run the loader's checks at depth ``check``; one line saying what was checked (or raise)."""
    if check is None:
        return "check        skipped (--no-check)"
    check_checkpoint(path, read_data=check == "data", progress=check == "data")
    if check == "data":
        return "check        ok: headers and data (names, shapes, dtypes, index, quantization; values, scales)"
    return ("check        ok: names, shapes, dtypes, index and quantization match the config "
            "(headers only; --check-data also reads the values)")


def state_lines(config: ModelConfig, dtype: torch.dtype = torch.bfloat16, qat_sim: bool | None = None,
                budgets_gib: tuple[int, ...] = (80, 141)) -> list[str]:
    """Generation-state size per sequence by layer kind (:func:`~dsv4.engine.state.state_layout`),
    and the longest context one sequence can have in a few amounts of GPU memory.

    The state grows linearly with the context (CSA/HCA compressed entries, CSA indexer keys) on top
    of a fixed part (the sliding-window rings, the compressors' open windows). ``qat_sim`` (default:
    on for quantized releases, as ``--qat-sim auto``) stores K=V rows as FP8 + BF16 rope dims and
    indexer keys as FP4.
    """
    if qat_sim is None:
        qat_sim = config.quantization_config is not None or config.expert_dtype is not None
    layout = state_layout(config, dtype, qat_sim)
    per_token, fixed = sum(layout.per_token.values()), sum(layout.fixed.values())
    store = "FP8 K=V + FP4 indexer keys (QAT simulation)" if qat_sim else str(dtype).removeprefix("torch.")
    at = [(n, f"{n:,} positions") for n in (4096,) if n < config.max_position_embeddings]
    at.append((config.max_position_embeddings, f"{config.max_position_embeddings:,} (max_position_embeddings)"))
    sizes = ", ".join(f"{label}: {format_bytes(fixed + per_token * n)}" for n, label in at)
    fits = ", ".join(f"{g} GiB: {layout.max_context(g << 30):,} tokens" for g in budgets_gib)
    lines = [f"state        {format_bytes(per_token)} per token per sequence + {format_bytes(fixed)} fixed "
             f"({store}, all {config.num_hidden_layers} layers); {sizes}",
             f"             longest context of one sequence if the state alone had {fits}"]
    for kind, n in layout.layers.items():
        lines.append(f"             {kind:<8} x{n:<3} {layout.per_token[kind] / n:8.1f} B/token/layer, "
                     f"{format_bytes(layout.fixed[kind] / n)} fixed/layer")
    return lines


def describe(path: Path, check: str | None = "headers") -> str:
    """Human-readable summary of the checkpoint at ``path``, after checking it to depth ``check``
    (``headers``, ``data`` or None)."""
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    checked = check_line(path, check)
    config = ModelConfig.from_file(path / "config.json")
    shards = list_shards(path)
    dtypes: dict[str, Counter] = defaultdict(Counter)
    params: Counter = Counter()
    nbytes = 0.0
    n_tensors = 0
    for file in shards:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None
        with handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                dtype, shape = sl.get_dtype(), sl.get_shape()
                numel = math.prod(shape)
                group = tensor_group(name)
                dtypes[group][dtype] += 1
                params[group] += numel
                nbytes += numel * _BYTES.get(dtype, 1)
                n_tensors += 1
    c = config
    lines = [
        f"checkpoint   {path}",
        f"shards       {len(shards)} file(s), {n_tensors} tensors, {nbytes / 2**30:.3f} GiB",
        f"parameters   {sum(params.values()):,} stored values (packed FP4 bytes count as one value each)",
        f"geometry     hidden {c.hidden_size}, {c.num_hidden_layers} layers (+{c.num_nextn_predict_layers} MTP), "
        f"{c.num_attention_heads} heads x {c.head_dim} (rope {c.rope_dim}), q_lora {c.q_lora_rank}, "
        f"o_groups {c.o_groups} x {c.o_lora_rank}",
        f"moe          {c.n_routed_experts} experts, top-{c.num_experts_per_tok} ({c.scoring_func}, "
        f"scale {c.routed_scaling_factor}), width {c.moe_intermediate_size}, {sum(c.hash_layers)} hash layer(s)",
        f"attention    window {c.sliding_window}; layers: {_run_length(c.layer_kinds)}",
        f"             ratios: {sorted(set(r for r in c.compress_ratios if r))}; indexer {c.index_n_heads} heads x "
        f"{c.index_head_dim}, top-{c.index_topk}; MTP layer: {c.mtp_layer_kind}",
        f"vocab        {c.vocab_size} (bos {c.bos_token_id}, eos {c.eos_token_id})",
    ]
    if c.quantization_config or c.expert_dtype:
        lines.append(f"quantization {c.quantization_config or {}} expert_dtype={c.expert_dtype}")
    lines += state_lines(c)
    lines.append(checked)
    lines.append("tensors by group:")
    for group in sorted(params):
        kinds = ", ".join(f"{n} x {d}" for d, n in sorted(dtypes[group].items()))
        lines.append(f"  {group:<16} {params[group]:>14,}  {kinds}")
    return "\n".join(lines)
