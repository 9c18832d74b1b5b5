"""Load a checkpoint directory (``config.json`` + safetensors) into a :class:`Transformer`.

Shards are read one at a time (single file, a sharded set with ``model.safetensors.index.json``,
or several files without an index), tensor names are mapped from HF to the official names, every
tensor is checked against what the model expects (name, shape, dtype kind), and only when the
whole checkpoint has checked out is the model materialised and returned: a failed load raises
:class:`CheckpointError` naming the file (its full path) and tensor and leaves nothing
half-initialised.

One walk over the checkpoint does every check, in two depths:

- headers only (:func:`check_checkpoint`, the first pass of :func:`load_model`, ``dsv4 inspect``,
  ``dsv4 quantize``): each tensor becomes a data-less ``meta`` tensor of its stored dtype and
  shape, and goes through the same checks and weight constructors as a loaded one; only the
  checks of values are skipped. Instant on a checkpoint of hundreds of GB.
- with data (:func:`load_model`, ``check_checkpoint(read_data=True)``): every tensor is read, so
  NaN/Inf values and scales, out-of-range expert tables and unreadable bytes are caught too.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import Dsv4Error
from ..model.transformer import Transformer
from ..progress import progress_bar
from .formats import Fp8BlockWeight, QuantWeight, WeightFormatError
from .names import HF_FUSED_EXPERTS, hf_to_official, is_hf_name, split_hf_experts
from .quant_rules import check_quant_rules, read_quant_rules
from .serialize import build_weight, split_name

INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype -> torch dtype (what a data-less header tensor is made of)
_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                  "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
if hasattr(torch, "float8_e8m0fnu"):
    _HEADER_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class CheckpointError(Dsv4Error, ValueError):
    """A checkpoint is missing, corrupt or does not match its config. The message names the culprit."""


@dataclass
class LoadReport:
    """What a load did: tensors and bytes per group, seconds, what was skipped."""

    path: str
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    groups: dict[str, dict[str, int]] = field(default_factory=dict)  # group -> {dtype: count}
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, fmt: str, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes
        counts = self.groups.setdefault(tensor_group(name), {})
        counts[fmt] = counts.get(fmt, 0) + 1

    def one_line(self) -> str:
        """``loaded N tensors, X MiB in T s: 120 x mxfp4, 45 x fp8_e4m3_block, ...``."""
        totals: dict[str, int] = {}
        for counts in self.groups.values():
            for fmt, n in counts.items():
                totals[fmt] = totals.get(fmt, 0) + n
        formats = ", ".join(f"{n} x {f}" for f, n in sorted(totals.items(), key=lambda kv: -kv[1]))
        notes = "".join(f"; {n}" for n in self.notes)
        return (f"loaded {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB in {self.seconds:.2f} s: "
                f"{formats}{notes}")

    def summary(self) -> str:
        lines = [f"loaded {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB in {self.seconds:.2f} s "
                 f"from {self.path}"]
        for group, counts in sorted(self.groups.items()):
            lines.append(f"  {group:<22} " + ", ".join(f"{n} x {d}" for d, n in sorted(counts.items())))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def tensor_group(name: str) -> str:
    """Coarse group of a tensor for reports: attention, compressor, indexer, experts, ..."""
    for key, group in ((".indexer.", "indexer"), (".compressor.", "compressor"), (".experts.", "routed experts"),
                       (".shared_experts.", "shared expert"), (".gate.", "router"), (".attn.", "attention"),
                       ("hc_", "mHC"), ("norm", "norms")):
        if key in name:
            return group
    if name.startswith("mtp."):
        return "mtp"
    return name.split(".")[0]


def list_shards(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, validated against the index if present."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) missing from {path}: {', '.join(missing)}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def _official_name(name: str) -> str:
    """Official name of an on-disk tensor name (HF names mapped; companions follow their weight)."""
    if not is_hf_name(name):
        return name
    mapped = hf_to_official(name)
    if mapped is not None:
        return mapped
    split = split_name(name)
    if split is not None and split[1] != "weight":
        mapped = hf_to_official(split[0] + ".weight")
        return name if mapped is None else mapped[: -len("weight")] + split[1]
    mapped = hf_to_official(name)
    return name if mapped is None else mapped


def _index_shards(shards: list[Path]) -> dict[str, set[str]]:
    """Read only the headers: for every weight stored with scale companions, the set of its parts."""
    parts: dict[str, set[str]] = {}
    for file in shards:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                names = list(handle.keys())
        except Exception as e:  # truncated or not a safetensors file
            raise CheckpointError(f"cannot read {file}: {e}") from None
        for disk_name in names:
            split = split_name(_official_name(disk_name))
            if split is not None:
                parts.setdefault(split[0], set()).add(split[1])
    # a quantized group is a weight plus at least one companion (a lone `x.scale` is a parameter)
    return {base: p for base, p in parts.items() if "weight" in p and len(p) > 1}


def check_values(name: str, t: torch.Tensor, file: Path, n_experts: int, note: str = "") -> None:
    """Refuse NaN/Inf in a 16/32/64-bit float tensor and expert ids outside ``[0, n_experts)`` in a
    ``tid2eid`` table. Nothing to check on the ``meta`` device (header-only checks)."""
    if t.is_meta:
        return
    if t.dtype.is_floating_point and t.dtype.itemsize > 1 and not torch.isfinite(t).all():
        raise CheckpointError(f"{file}: tensor `{name}` contains NaN or Inf{note}")
    if name.endswith("tid2eid") and t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_experts):
        raise CheckpointError(f"{file}: tensor `{name}` routes to expert ids outside [0, {n_experts})")


def _check_tensor(name: str, t: torch.Tensor, expected: torch.Tensor, file: Path, n_experts: int
                  ) -> torch.Tensor:
    """Shape/dtype-kind check, then conversion to the parameter's dtype; values (finite, expert ids
    in range) are checked when ``t`` has data (not on the ``meta`` device)."""
    if tuple(t.shape) != tuple(expected.shape):
        raise CheckpointError(f"{file}: tensor `{name}` has shape {tuple(t.shape)}, "
                              f"the config implies {tuple(expected.shape)}")
    if expected.dtype.is_floating_point:
        if not t.dtype.is_floating_point or t.dtype.itemsize == 1:
            raise CheckpointError(f"{file}: tensor `{name}` has dtype {t.dtype}; expected a 16/32-bit float "
                                  "(quantized weights need their scale tensors)")
        t = t.to(expected.dtype)
        check_values(name, t, file, n_experts, f" (after conversion to {expected.dtype})")
        return t
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise CheckpointError(f"{file}: tensor `{name}` has dtype {t.dtype}; expected integers")
    check_values(name, t, file, n_experts)
    return t.to(expected.dtype)


class _Collector:
    """Turns the stream of on-disk tensors into checked plain tensors and packed weights."""

    def __init__(self, config: ModelConfig, expected: dict[str, torch.Tensor], quantized: dict[str, set[str]],
                 device: torch.device | str, load_mtp: bool, report: LoadReport, scan_fp8: bool = False):
        self.config, self.expected, self.quantized = config, expected, quantized
        self.device, self.load_mtp, self.report, self.scan_fp8 = device, load_mtp, report, scan_fp8
        self.plain: dict[str, torch.Tensor] = {}
        self.packed: dict[str, QuantWeight] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.origin: dict[str, str] = {}

    def add(self, disk_name: str, tensor: torch.Tensor, file: Path) -> None:
        if HF_FUSED_EXPERTS.match(disk_name):
            if tensor.dim() != 3 or tensor.shape[0] != self.config.n_routed_experts:
                raise CheckpointError(f"{file}: fused expert tensor `{disk_name}` has shape "
                                      f"{tuple(tensor.shape)}; expected [{self.config.n_routed_experts}, N, K]")
            for name, t in split_hf_experts(disk_name, tensor).items():
                self._add_plain(name, t, file, disk_name)
            return
        name = _official_name(disk_name)
        if name.startswith("mtp.") and not self.load_mtp:
            return
        split = split_name(name)
        if split is not None and split[0] in self.quantized:
            base, part = split
            group = self.pending.setdefault(base, {})
            if part in group:
                raise CheckpointError(f"{file}: tensor `{disk_name}` appears twice")
            group[part] = tensor
            if set(group) == self.quantized[base]:
                self._add_packed(base, self.pending.pop(base), file)
            return
        self._add_plain(name, tensor, file, disk_name)

    def _claim(self, name: str, disk_name: str, file: Path) -> torch.Tensor:
        if name not in self.expected:
            raise CheckpointError(f"{file}: unexpected tensor `{disk_name}` (not part of this config's model)")
        if name in self.origin:
            raise CheckpointError(f"{file}: tensor `{name}` also appears in {self.origin[name]}")
        self.origin[name] = str(file)
        return self.expected[name]

    def _add_plain(self, name: str, t: torch.Tensor, file: Path, disk_name: str) -> None:
        expected = self._claim(name, disk_name, file)
        self.plain[name] = _check_tensor(name, t, expected, file, self.config.n_routed_experts).to(self.device)
        self.report.add(name, str(t.dtype).replace("torch.", ""), t.numel() * t.element_size())

    def _add_packed(self, base: str, parts: dict[str, torch.Tensor], file: Path) -> None:
        name = f"{base}.weight"
        expected = self._claim(name, name, file)
        try:
            weight = build_weight(base, parts)
        except WeightFormatError as e:
            raise CheckpointError(f"{file}: {e}") from None
        if tuple(weight.shape) != tuple(expected.shape):
            raise CheckpointError(f"{file}: tensor `{name}` has logical shape {tuple(weight.shape)}, "
                                  f"the config implies {tuple(expected.shape)}")
        if isinstance(weight, torch.Tensor):
            self.plain[name] = weight.to(expected.dtype).to(self.device)
            self.report.add(name, str(weight.dtype).replace("torch.", ""), weight.numel() * weight.element_size())
            return
        if self.scan_fp8 and isinstance(weight, Fp8BlockWeight) and _has_nan_fp8(weight.weight):
            raise CheckpointError(f"{file}: tensor `{name}` holds FP8 NaN codes (0x7F/0xFF)")
        self.packed[name] = weight.to(self.device)
        self.report.add(name, weight.dtype_name, weight.nbytes)

    def finish(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            raise CheckpointError(f"tensor group `{base}` is incomplete: found {sorted(parts)}, "
                                  f"expected {sorted(self.quantized[base])}")


def _has_nan_fp8(w: torch.Tensor) -> bool:
    """True when an e4m3 tensor holds a NaN code (all exponent and mantissa bits set)."""
    return bool(((w.view(torch.uint8) & 0x7F) == 0x7F).any())


def _header_tensor(handle, name: str, file: Path) -> torch.Tensor:
    """A data-less tensor with the stored dtype and shape of ``name``."""
    info = handle.get_slice(name)
    stored, shape = info.get_dtype(), list(info.get_shape())
    if stored == "F4" and hasattr(torch, "float4_e2m1fn_x2") and shape and shape[-1] % 2 == 0:
        # safetensors counts FP4 elements; torch's float4_e2m1fn_x2 holds two per element
        return torch.empty(shape[:-1] + [shape[-1] // 2], dtype=torch.float4_e2m1fn_x2, device="meta")
    dtype = _HEADER_DTYPES.get(stored)
    if dtype is None:
        raise CheckpointError(f"{file}: tensor `{name}` is stored as {info.get_dtype()}, a dtype no DeepSeek-V4 "
                              "tensor uses")
    return torch.empty(shape, dtype=dtype, device="meta")


def _tensors(shards: list[Path], read_data: bool, bar) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Every stored tensor as ``(file, name, tensor)``: read, or a header-only ``meta`` tensor."""
    for file in shards:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # truncated or not a safetensors file (the header covers the file's size)
            raise CheckpointError(f"cannot read {file}: {e}") from None
        with handle:
            for name in handle.keys():
                if not read_data:
                    yield file, name, _header_tensor(handle, name, file)
                    continue
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{file}: cannot read tensor `{name}`: {e}") from None
                bar.update(tensor.numel() * tensor.element_size())
                yield file, name, tensor


@dataclass
class _Walk:
    """What a walk over a checkpoint found: the checked tensors and a model skeleton for them."""

    config: ModelConfig
    plain: dict[str, torch.Tensor]
    packed: dict[str, QuantWeight]
    skeleton: Transformer
    report: LoadReport


def _walk(path: str | Path, device: str | torch.device, dtype: torch.dtype, load_mtp: bool, read_data: bool,
          progress: bool, scan_fp8: bool = False) -> _Walk:
    """Check every tensor of the checkpoint at ``path`` against its config; tensors end up on
    ``device`` (``meta`` keeps nothing). Raises :class:`CheckpointError` / ``ConfigError``."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = ModelConfig.from_file(path / "config.json")
    quant_rules = read_quant_rules(path, config)
    t0 = time.perf_counter()
    shards = list_shards(path)
    report = LoadReport(path=str(path))
    quantized = _index_shards(shards)

    with torch.device("meta"):
        skeleton = Transformer(config, dtype, with_mtp=load_mtp)
    expected = skeleton.state_dict()
    collect = _Collector(config, expected, quantized, device, load_mtp, report, scan_fp8)
    total = sum(f.stat().st_size for f in shards)
    with progress_bar(progress and read_data, total=total, unit="B", unit_scale=True, desc="loading") as bar:
        for file, name, tensor in _tensors(shards, read_data, bar):
            collect.add(name, tensor, file)
            bar.set_postfix(tensors=report.tensors, refresh=False)
        bar.update(total - bar.n)
    collect.finish()

    have = set(collect.plain) | set(collect.packed)
    missing = [n for n in expected if n not in have]
    mtp_missing = [n for n in missing if n.startswith("mtp.")]
    if load_mtp and mtp_missing and len(mtp_missing) == sum(n.startswith("mtp.") for n in expected):
        report.notes.append("checkpoint has no MTP tensors: loaded without the MTP block")
        missing = [n for n in missing if not n.startswith("mtp.")]
        with torch.device("meta"):
            skeleton = Transformer(config, dtype, with_mtp=False)
    if missing:
        shown = ", ".join(f"`{n}`" for n in missing[:8])
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint: {shown}"
                              + (" ..." if len(missing) > 8 else ""))
    check_quant_rules(quant_rules, collect.packed, collect.plain, config)
    report.seconds = time.perf_counter() - t0
    return _Walk(config, collect.plain, collect.packed, skeleton, report)


def check_checkpoint(path: str | Path, *, read_data: bool = False, load_mtp: bool = True,
                     progress: bool = False) -> LoadReport:
    """Check the checkpoint at ``path`` as :func:`load_model` would, without building a model.

    By default only the config, the index and the safetensors headers are read: every tensor's
    name, shape and dtype against the config, quantized groups complete and consistent with the
    quantization config, nothing missing, nothing extra, no file truncated. ``read_data=True``
    also reads every tensor (NaN/Inf values and scales, FP8 NaN codes, expert tables in range)
    and keeps none of them. Raises :class:`CheckpointError` / ``ConfigError`` naming the culprit.
    """
    return _walk(path, "meta", torch.float32, load_mtp, read_data, progress, scan_fp8=read_data).report


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               load_mtp: bool = True, progress: bool = True) -> tuple[Transformer, LoadReport]:
    """Load ``path`` into a model on ``device`` with activations/linear weights in ``dtype``.

    Quantized weights (FP8 block, MXFP4, NVFP4) stay packed and are placed on ``device`` as is.
    ``load_mtp=False`` skips ``mtp.*`` tensors; a checkpoint without them loads with a note in the
    report (speculative decoding then is unavailable). The headers are checked first, so a
    mis-shaped or missing tensor in the last shard fails before any data is read. Raises
    :class:`CheckpointError` / :class:`~dsv4.config.ConfigError` naming the culprit; nothing
    partial is returned.
    """
    _walk(path, "meta", dtype, load_mtp, read_data=False, progress=False)
    found = _walk(path, device, dtype, load_mtp, read_data=True, progress=progress)
    skeleton = found.skeleton
    skeleton.load_state_dict(found.plain, strict=False, assign=True)
    for name, weight in found.packed.items():
        skeleton.get_submodule(name[: -len(".weight")]).set_weight(weight)
    skeleton.stack_experts()
    skeleton.init_rope(device)
    return skeleton.eval(), found.report
