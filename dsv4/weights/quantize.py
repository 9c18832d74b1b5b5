"""Offline quantization of a checkpoint into the released layouts (DSV4_FACTS section 4).

Which tensors are quantized is a *policy* (data below), in which format is a *layout*:

==========  ======================================================================================
policy      quantized linear weights
==========  ======================================================================================
``floor``   attention projections (``attn.wq_a/wq_b/wkv/wo_a/wo_b``), ``attn.indexer.wq_b`` (FP4-
            trained), routed experts, shared expert. Everything else stays exactly as in the source:
            ``head``, router ``ffn.gate``, compressor ``wkv/wgate`` (attention's and the indexer's),
            ``indexer.weights_proj``, MTP ``e_proj/h_proj``, the embedding, norms, ``hc_*``,
            ``attn_sink``, ``ape``, gate bias, ``tid2eid`` (the precision floor of section 4).
``all``     every 2-D linear weight (``head``, ``ffn.gate`` and the helpers too); never the
            embedding, 1-D tensors, ``hc_*`` mixing matrices or integer tables.
==========  ======================================================================================

A source that is already quantized (DeepSeek's FP8 + MXFP4 release, the embedded tiny model) is
fine: a weight the policy quantizes is dequantized and re-quantized to its target format (kept
bit for bit when it is already in exactly that format), and a weight the policy keeps stays in the
source's format, quantized or not. ``config.json`` then describes what was written.

Layout: routed experts in ``fmt`` (``nvfp4``, ``mxfp4`` or ``fp8``); the other quantized
linears in FP8 block (``dense_format="fp8"``: DeepSeek's FP8 + MXFP4 release, NVIDIA's
MIXED_PRECISION FP8 + NVFP4 export) or in ``fmt`` too (``dense_format="same"``). FP8-block scales
are power-of-two e8m0 (``scale_fmt="ue8m0"``, like DeepSeek's releases) or fp32. NVFP4 tensors
carry ModelOpt names (``weight_scale``, ``weight_scale_2``) and no ``input_scale``: this is
weight-only quantization without calibration, and an FP4 activation path must derive its scale
from the data anyway (section 4).

:func:`quantize_checkpoint` writes a complete checkpoint directory atomically (temporary
sibling, renamed when complete) and never replaces a directory it did not write
(:mod:`.output_dir`).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig, read_config_json
from ..devices import resolve_device
from ..errors import Dsv4Error
from ..model.transformer import Transformer
from ..progress import progress_bar
from .formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, QuantWeight, WeightFormatError
from .loader import INDEX_FILE, check_checkpoint, check_values, list_shards
from .names import is_hf_name
from .output_dir import (OUTPUT_MARKER, apply_umask_modes, check_destination, make_temp_sibling, replace_dir,
                         write_marker)
from .quant_options import DENSE_FORMATS, FORMATS, POLICIES, SCALE_FMTS
from .serialize import COMPANIONS, build_weight, split_name, weight_tensors

__all__ = [
    "FORMATS", "POLICIES", "DENSE_FORMATS", "SCALE_FMTS", "GROUPS", "FLOOR_GROUPS", "QuantizeError",
    "QuantSpec", "linear_group", "layout_of", "quantize_tensors", "quant_config_for", "quantize_checkpoint",
    "OUTPUT_MARKER",
]

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
DEFAULT_SHARD_BYTES = 4 * 2**30
FP8_BLOCK = 128
NVFP4_GROUP = 16

# Linear-weight groups (base name without ``.weight`` -> group); the first matching rule wins.
_GROUP_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), g) for p, g in (
    (r"^head$", "head"),
    (r"\.ffn\.experts\.\d+\.w[123]$", "routed_experts"),
    (r"\.ffn\.shared_experts\.w[123]$", "shared_expert"),
    (r"\.ffn\.gate$", "router"),
    (r"\.attn\.(indexer\.)?compressor\.(wkv|wgate)$", "helpers"),
    (r"\.attn\.indexer\.weights_proj$", "helpers"),
    (r"\.attn\.(indexer\.wq_b|wq_a|wq_b|wkv|wo_a|wo_b)$", "attention"),
    (r"^mtp\.\d+\.(e_proj|h_proj)$", "mtp_proj"),
))
#: every linear group; ``attention`` includes ``indexer.wq_b``, ``helpers`` are the compressor's
#: ``wkv/wgate`` (attention's and the indexer's) and ``indexer.weights_proj``.
GROUPS = ("attention", "routed_experts", "shared_expert", "head", "router", "helpers", "mtp_proj", "other")
#: groups the ``floor`` policy keeps as in the source (``other``: 2-D weights no rule knows).
FLOOR_GROUPS = frozenset({"head", "router", "helpers", "mtp_proj", "other"})


class QuantizeError(Dsv4Error, ValueError):
    """Bad quantization arguments, or a source tensor that cannot be quantized (message names it)."""


def linear_group(base: str) -> str:
    """Group of the linear weight ``base`` (``"layers.3.attn.wq_a"`` -> ``"attention"``)."""
    for pattern, group in _GROUP_RULES:
        if pattern.search(base):
            return group
    return "other"


@dataclass(frozen=True)
class QuantSpec:
    """One quantization layout; construction checks every field and names the bad flag."""

    fmt: str                                 #: routed experts: nvfp4, mxfp4 or fp8
    policy: str = "floor"                    #: floor or all (module doc)
    dense_format: str = "fp8"                #: other quantized linears: fp8 (block) or same (as fmt)
    scale_fmt: str = "ue8m0"                 #: FP8-block scales: ue8m0 or fp32
    only_groups: frozenset[str] | None = None  #: quantize only these linear groups (breakdowns)

    def __post_init__(self) -> None:
        for value, choices, flag in ((self.fmt, FORMATS, "--format"), (self.policy, POLICIES, "--policy"),
                                     (self.dense_format, DENSE_FORMATS, "--dense-format"),
                                     (self.scale_fmt, SCALE_FMTS, "--scale-fmt")):
            if value not in choices:
                raise QuantizeError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
        if self.only_groups is not None:
            object.__setattr__(self, "only_groups", frozenset(self.only_groups))
            unknown = sorted(self.only_groups - set(GROUPS))
            if unknown:
                raise QuantizeError(f"unknown tensor group(s) {unknown}; known: {', '.join(GROUPS)}")

    def target(self, base: str) -> str | None:
        """Format that the linear weight ``base`` gets; None keeps it as in the source."""
        group = linear_group(base)
        if base == "embed" or (self.policy == "floor" and group in FLOOR_GROUPS) or \
                (self.only_groups is not None and group not in self.only_groups):
            return None
        return self.fmt if group == "routed_experts" or self.dense_format == "same" else "fp8"


def check_args(fmt: str, policy: str, dense_format: str, scale_fmt: str) -> None:
    """Raise :class:`QuantizeError` naming the first bad argument."""
    QuantSpec(fmt, policy, dense_format, scale_fmt)


def _quantize_one(base: str, parts: dict[str, torch.Tensor], target: str, spec: QuantSpec,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """On-disk tensors of ``base`` in ``target``; a source already in that exact format is kept."""
    w = build_weight(base, parts)
    name, ue8m0 = f"{base}.weight", spec.scale_fmt == "ue8m0"
    if (isinstance(w, Fp8BlockWeight) and target == "fp8" and w.scale_ue8m0 == ue8m0 and w.block == FP8_BLOCK) \
            or (isinstance(w, Mxfp4Weight) and target == "mxfp4") or (isinstance(w, Nvfp4Weight) and target == "nvfp4"):
        return _named(base, parts)
    dense = w.to(device).dequantize(torch.float32) if isinstance(w, QuantWeight) else w.to(device)
    if target == "fp8":
        q: QuantWeight = Fp8BlockWeight.quantize(dense, ue8m0=ue8m0, block=FP8_BLOCK, name=name)
    elif target == "mxfp4":
        q = Mxfp4Weight.quantize(dense, name=name)
    else:
        q = Nvfp4Weight.quantize(dense, name=name)
    return {k: t.cpu() for k, t in weight_tensors(base, q).items()}


def _named(base: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"weight": t, "scale": s}`` -> ``{"base.weight": t, "base.scale": s}``."""
    return {f"{base}.{suffix}": t for suffix, t in parts.items()}


def _expected_names(config: ModelConfig) -> set[str]:
    with torch.device("meta"):
        return set(Transformer(config, torch.bfloat16, with_mtp=config.num_nextn_predict_layers > 0).official_state_dict())


def quantize_tensors(state: dict[str, torch.Tensor], config: ModelConfig, fmt: str, policy: str = "floor",
                     dense_format: str = "fp8", scale_fmt: str = "ue8m0",
                     only_groups: Collection[str] | None = None, device: str | torch.device = "cpu"
                     ) -> dict[str, torch.Tensor]:
    """Quantize an official-named state dict (BF16, or already quantized on-disk tensors).

    ``state`` holds on-disk tensors: a weight's companions (``.scale``, ``.weight_scale``, ...) must
    be in the same dict. Returns the on-disk tensors of the result (names and dtypes as
    :func:`~dsv4.weights.serialize.weight_tensors` writes them). Raises :class:`QuantizeError`
    naming the tensor on an unknown name or an unquantizable weight. ``only_groups`` restricts
    quantization to those linear groups; the math runs on ``device`` (results come back on the CPU).
    """
    spec = QuantSpec(fmt, policy, dense_format, scale_fmt, only_groups)  # type: ignore[arg-type]
    return _quantize_state(state, _expected_names(config), spec, torch.device(device))


def _quantize_state(state: dict[str, torch.Tensor], expected: set[str], spec: QuantSpec, device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """:func:`quantize_tensors` with the model's tensor names computed once by the caller."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        split = split_name(name)
        if split is None:
            _check_known(name, expected)
            out[name] = t
        else:
            grouped.setdefault(split[0], {})[split[1]] = t
    for base, parts in grouped.items():
        name = f"{base}.weight"
        _check_known(name, expected)
        w = parts.get("weight")
        target = spec.target(base) if w is not None and w.dim() == 2 else None
        if target is None:
            out.update(_named(base, parts))
            continue
        try:
            out.update(_quantize_one(base, parts, target, spec, device))
        except WeightFormatError as e:
            raise QuantizeError(f"cannot quantize `{name}` to {target}: {e}") from None
    return out


def _check_known(name: str, expected: set[str]) -> None:
    if name in expected:
        return
    if is_hf_name(name):
        raise QuantizeError(f"tensor `{name}` has an HF name; quantize reads official-named checkpoints only")
    raise QuantizeError(f"unexpected tensor `{name}` (not part of this config's model)")


# ----------------------------------------------------------------------------- config files

#: ModelOpt ``exclude_modules`` of the ``floor`` policy when the exact layout is not known.
FLOOR_EXCLUDE = ("head", "*.ffn.gate", "*.attn.compressor.wkv", "*.attn.compressor.wgate",
                 "*.attn.indexer.compressor.wkv", "*.attn.indexer.compressor.wgate",
                 "*.attn.indexer.weights_proj", "mtp.*.e_proj", "mtp.*.h_proj")


def layout_of(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Format of each 2-D linear weight among on-disk ``tensors``: base -> bf16/fp8/mxfp4/nvfp4.

    ``bf16`` stands for any unquantized float dtype. The embedding is not a linear weight.
    """
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".weight") or name == "embed.weight" or t.dim() != 2:
            continue
        base = name[: -len(".weight")]
        if f"{base}.weight_scale_2" in tensors:
            out[base] = "nvfp4"
        elif t.dtype == torch.float8_e4m3fn:
            out[base] = "fp8"
        elif t.dtype.is_floating_point and t.dtype.itemsize >= 2:
            out[base] = "bf16"
        else:
            out[base] = "mxfp4"
    return out


def _exclude_patterns(layout: dict[str, str]) -> list[str]:
    """Unquantized linears as ModelOpt patterns: a layer index folds to ``*`` when no quantized
    module matches the folded pattern."""
    kept = {b for b, f in layout.items() if f == "bf16"}
    quantized = {re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", b) for b, f in layout.items() if f != "bf16"}
    out = set()
    for base in kept:
        folded = re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", base)
        out.add(base if folded in quantized else folded)
    return sorted(out)


_EXPERT_DTYPE = {"bf16": "bf16", "fp8": "fp8", "mxfp4": "fp4", "nvfp4": "fp4"}  # layout_of -> expert_dtype


def quant_config_for(fmt: str, policy: str = "floor", dense_format: str = "fp8", scale_fmt: str = "ue8m0",
                     layout: dict[str, str] | None = None) -> tuple[dict, dict | None]:
    """``(config.json updates, hf_quant_config.json content or None)`` for a quantized checkpoint.

    The updates are ``quantization_config`` and ``expert_dtype`` (``"fp4"`` / ``"fp8"`` / ``"bf16"``:
    the format the routed experts were written in, which is the source's when ``only_groups``
    leaves them out). FP8 and MXFP4 routed experts give DeepSeek's
    block-FP8 description; NVFP4 gives ModelOpt's: ``quant_algo`` ``NVFP4`` when every quantized
    linear is NVFP4 (``dense_format="same"``), else ``MIXED_PRECISION`` with ``moe_quant_algo:
    NVFP4`` and the FP8 block fields. ``layout`` (:func:`layout_of` of the written tensors) makes
    ``exclude_modules`` and ``expert_dtype`` exact; without it they follow from the policy.
    """
    check_args(fmt, policy, dense_format, scale_fmt)
    expert_dtype = "fp8" if fmt == "fp8" else "fp4"
    if layout is not None:  # what was written: experts left out (only_groups) keep the source's format
        written = {_EXPERT_DTYPE[f] for b, f in layout.items() if linear_group(b) == "routed_experts"}
        if written:
            expert_dtype = written.pop() if len(written) == 1 else None   # mixed: claim nothing
    fp8_desc = {"fmt": "e4m3", "scale_fmt": scale_fmt, "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                "activation_scheme": "dynamic"}
    if fmt != "nvfp4":
        qc = {"quant_method": "fp8", **fp8_desc}
        if fmt == "mxfp4" and dense_format == "same":
            qc["dense_dtype"] = "fp4"  # not a released layout: every quantized linear is MXFP4
        return {"quantization_config": qc, "expert_dtype": expert_dtype}, None
    if layout is not None:
        exclude = _exclude_patterns(layout)
    else:
        exclude = list(FLOOR_EXCLUDE) if policy == "floor" else []
    quant = {"quant_algo": "NVFP4" if dense_format == "same" else "MIXED_PRECISION",
             "kv_cache_quant_algo": None, "group_size": NVFP4_GROUP, "exclude_modules": exclude}
    if dense_format == "fp8":
        quant.update({"moe_quant_algo": "NVFP4", **fp8_desc})
    hf_quant = {"producer": {"name": "dsv4"}, "quantization": quant}
    return {"quantization_config": {"quant_method": "modelopt", **quant}, "expert_dtype": expert_dtype}, hf_quant


# ----------------------------------------------------------------------------- checkpoint

class _ShardWriter:
    """Collects output tensors into shards of at most ``max_bytes`` (one tensor may exceed it)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            size = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + size > self.max_bytes:
                self.flush()
            self.pending[name] = t.contiguous()
            self.pending_bytes += size
            self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.directory / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename the parts to ``model-0000i-of-0000N.safetensors`` and write the index."""
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (path, names) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _read_parts(base: str, names: dict[str, Path], handles: dict[Path, object]) -> dict[str, torch.Tensor]:
    """A weight's on-disk parts, each read from whichever shard holds it."""
    parts = {}
    for suffix in ("weight",) + COMPANIONS:
        full = f"{base}.{suffix}"
        if full in names:
            parts[suffix] = _get(handles[names[full]], full, names[full])
    return parts


def _get(handle: object, name: str, file: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(name)  # type: ignore[attr-defined]
    except Exception as e:  # corrupt shard
        raise QuantizeError(f"{file}: cannot read tensor `{name}`: {e}") from None


def _convert(src: Path, out_dir: Path, config: ModelConfig, spec: QuantSpec, progress: bool,
             max_shard_bytes: int, device: torch.device) -> dict[str, str]:
    """Quantize every source tensor into shards under ``out_dir``; returns the written layout."""
    shards = list_shards(src)
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}
        owner: dict[str, Path] = {}
        for file in shards:
            try:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as e:
                raise QuantizeError(f"cannot read {file}: {e}") from None
            for name in handles[file].keys():  # type: ignore[attr-defined]
                if name in owner:
                    raise QuantizeError(f"{file}: tensor `{name}` also appears in {owner[name].name}")
                owner[name] = file
        expected = _expected_names(config)
        writer = _ShardWriter(out_dir, max_shard_bytes)
        done: set[str] = set()
        layout: dict[str, str] = {}
        with progress_bar(progress, total=len(owner), unit="tensor", desc="quantizing") as bar:
            for name, file in owner.items():  # shard by shard, in file order
                if name in done:
                    continue
                split = split_name(name)
                state = ({name: _get(handles[file], name, file)} if split is None else
                         _named(split[0], _read_parts(split[0], owner, handles)))
                for part, tensor in state.items():  # what the headers cannot show: NaN/Inf, expert ids
                    check_values(part, tensor, owner[part], config.n_routed_experts)
                try:
                    written = _quantize_state(state, expected, spec, device)
                except (QuantizeError, WeightFormatError) as e:
                    raise QuantizeError(f"{file}: {e}") from None
                writer.add(written)
                layout.update(layout_of(written))
                done.update(state)
                bar.update(len(state))
        writer.finish()
    return layout


def quantize_checkpoint(src: Path, dst: Path, fmt: str, policy: str = "floor", dense_format: str = "fp8",
                        scale_fmt: str = "ue8m0", progress: bool = True, overwrite: bool = False,
                        only_groups: Collection[str] | None = None,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES, device: str | torch.device = "cpu") -> None:
    """Write a quantized copy of checkpoint ``src`` to the new directory ``dst``.

    Output: ``model-0000i-of-0000N.safetensors`` + index, ``config.json`` with
    ``quantization_config``/``expert_dtype``, ``hf_quant_config.json`` for NVFP4, the tokenizer
    files, and the :data:`OUTPUT_MARKER` file recording how it was made.

    The source is checked as the loader checks a checkpoint (headers up front, values as each
    tensor is read): a broken source gives an error naming the file and tensor, never broken
    output. Atomic: built in a temporary sibling of ``dst`` and renamed when complete; on any error
    the temporary directory is removed and ``dst`` is untouched. ``dst`` must be new, empty, or a
    previous dsv4 output (replaced only with ``overwrite``), and may neither hold ``src`` nor lie
    inside it.

    ``only_groups`` quantizes only those linear groups (see :data:`GROUPS`); ``device`` runs the
    quantization math (``auto``, ``cpu``, ``cuda``: far faster on a full-size model). Raises
    :class:`QuantizeError`, ``CheckpointError``, ``ConfigError`` or ``DeviceError`` naming the
    culprit.
    """
    src, dst = Path(src), Path(dst)
    spec = QuantSpec(fmt, policy, dense_format, scale_fmt, only_groups)  # type: ignore[arg-type]
    if not (src / "config.json").is_file():
        raise QuantizeError(f"{src} is not a checkpoint directory (no config.json)")
    check_destination(src, dst, overwrite, QuantizeError)
    dev = resolve_device(device)
    raw = read_config_json(src / "config.json")
    config = ModelConfig.from_file(src / "config.json")
    check_checkpoint(src)  # the loader's header checks: a broken source fails before anything is written
    tmp = make_temp_sibling(dst)
    try:
        layout = _convert(src, tmp, config, spec, progress, max_shard_bytes, dev)
        updates, hf_quant = quant_config_for(fmt, policy, dense_format, scale_fmt, layout)
        if only_groups is not None:
            updates["quantization_config"]["dsv4_only_groups"] = sorted(only_groups)
        raw.update(updates)
        if "scale_fmt" in raw:  # official configs repeat it at the top level
            raw["scale_fmt"] = scale_fmt
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        if hf_quant is not None:
            (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
        for fname in COPIED_FILES:
            if (src / fname).is_file():
                shutil.copy2(src / fname, tmp / fname)
        write_marker(tmp, tool="dsv4 quantize", source=str(src.resolve()), format=fmt, policy=policy,
                     dense_format=dense_format, scale_fmt=scale_fmt,
                     only_groups=sorted(only_groups) if only_groups is not None else None)
        apply_umask_modes(tmp)  # a checkpoint others share, not mkdtemp's private 0700
        check_destination(src, dst, overwrite, QuantizeError)  # again: minutes may have passed
        replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
