"""Load a checkpoint directory (``config.json`` + safetensors) into a :class:`Transformer`.

Shards are read one at a time (single file, a sharded set with ``model.safetensors.index.json``,
or several files without an index), tensor names are mapped from HF to the official names, every
tensor is checked against what the model expects (name, shape, dtype kind), and only when the
whole checkpoint has checked out is the model materialised and returned: a failed load raises
:class:`CheckpointError` naming the file and tensor and leaves nothing half-initialised.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import Dsv4Error
from ..model.transformer import Transformer
from ..model.moe import MoE
from .formats import QuantWeight, WeightFormatError
from .names import HF_FUSED_EXPERTS, hf_to_official, is_hf_name, split_hf_experts
from .quant_rules import check_quant_rules, read_quant_rules
from .serialize import build_weight, split_name

INDEX_FILE = "model.safetensors.index.json"


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


def _check_tensor(name: str, t: torch.Tensor, expected: torch.Tensor, file: Path, n_experts: int
                  ) -> torch.Tensor:
    """Shape/dtype-kind check, then conversion to the parameter's dtype."""
    if tuple(t.shape) != tuple(expected.shape):
        raise CheckpointError(f"{file.name}: tensor `{name}` has shape {tuple(t.shape)}, "
                              f"the config implies {tuple(expected.shape)}")
    if expected.dtype.is_floating_point:
        if not t.dtype.is_floating_point or t.dtype.itemsize == 1:
            raise CheckpointError(f"{file.name}: tensor `{name}` has dtype {t.dtype}; expected a 16/32-bit float "
                                  "(quantized weights need their scale tensors)")
        t = t.to(expected.dtype)
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{file.name}: tensor `{name}` contains NaN or Inf "
                                  f"(after conversion to {expected.dtype})")
        return t
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise CheckpointError(f"{file.name}: tensor `{name}` has dtype {t.dtype}; expected integers")
    if name.endswith("tid2eid") and t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_experts):
        raise CheckpointError(f"{file.name}: tensor `{name}` routes to expert ids outside [0, {n_experts})")
    return t.to(expected.dtype)


class _Collector:
    """Turns the stream of on-disk tensors into checked plain tensors and packed weights."""

    def __init__(self, config: ModelConfig, expected: dict[str, torch.Tensor], quantized: dict[str, set[str]],
                 device: torch.device | str, load_mtp: bool, report: LoadReport):
        self.config, self.expected, self.quantized = config, expected, quantized
        self.device, self.load_mtp, self.report = device, load_mtp, report
        self.plain: dict[str, torch.Tensor] = {}
        self.packed: dict[str, QuantWeight] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.origin: dict[str, str] = {}

    def add(self, disk_name: str, tensor: torch.Tensor, file: Path) -> None:
        if HF_FUSED_EXPERTS.match(disk_name):
            if tensor.dim() != 3 or tensor.shape[0] != self.config.n_routed_experts:
                raise CheckpointError(f"{file.name}: fused expert tensor `{disk_name}` has shape "
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
                raise CheckpointError(f"{file.name}: tensor `{disk_name}` appears twice")
            group[part] = tensor
            if set(group) == self.quantized[base]:
                self._add_packed(base, self.pending.pop(base), file)
            return
        self._add_plain(name, tensor, file, disk_name)

    def _claim(self, name: str, disk_name: str, file: Path) -> torch.Tensor:
        if name not in self.expected:
            raise CheckpointError(f"{file.name}: unexpected tensor `{disk_name}` (not part of this config's model)")
        if name in self.origin:
            raise CheckpointError(f"{file.name}: tensor `{name}` also appears in {self.origin[name]}")
        self.origin[name] = file.name
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
            raise CheckpointError(f"{file.name}: {e}") from None
        if tuple(weight.shape) != tuple(expected.shape):
            raise CheckpointError(f"{file.name}: tensor `{name}` has logical shape {tuple(weight.shape)}, "
                                  f"the config implies {tuple(expected.shape)}")
        if isinstance(weight, torch.Tensor):
            self.plain[name] = weight.to(expected.dtype).to(self.device)
            self.report.add(name, str(weight.dtype).replace("torch.", ""), weight.numel() * weight.element_size())
            return
        self.packed[name] = weight.to(self.device)
        self.report.add(name, weight.dtype_name, weight.nbytes)

    def finish(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            raise CheckpointError(f"tensor group `{base}` is incomplete: found {sorted(parts)}, "
                                  f"expected {sorted(self.quantized[base])}")


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               load_mtp: bool = True, progress: bool = True) -> tuple[Transformer, LoadReport]:
    """Load ``path`` into a model on ``device`` with activations/linear weights in ``dtype``.

    Quantized weights (FP8 block, MXFP4, NVFP4) stay packed and are placed on ``device`` as is.
    ``load_mtp=False`` skips ``mtp.*`` tensors; a checkpoint without them loads with a note in the
    report (speculative decoding then is unavailable). Raises :class:`CheckpointError` /
    :class:`~dsv4.config.ConfigError` naming the culprit; nothing partial is returned.
    """
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
    collect = _Collector(config, expected, quantized, device, load_mtp, report)
    total = sum(f.stat().st_size for f in shards)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not progress, file=sys.stderr)
    for file in shards:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # truncated or not a safetensors file
            raise CheckpointError(f"cannot read {file}: {e}") from None
        with handle:
            for disk_name in handle.keys():
                try:
                    tensor = handle.get_tensor(disk_name)
                except Exception as e:
                    raise CheckpointError(f"{file.name}: cannot read tensor `{disk_name}`: {e}") from None
                bar.update(tensor.numel() * tensor.element_size())
                collect.add(disk_name, tensor, file)
                bar.set_postfix(tensors=report.tensors, refresh=False)
    bar.update(total - bar.n)
    bar.close()
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

    skeleton.load_state_dict(collect.plain, strict=False, assign=True)
    for name, weight in collect.packed.items():
        skeleton.get_submodule(name[: -len(".weight")]).set_weight(weight)
    for module in skeleton.modules():
        if isinstance(module, MoE):
            module.stack_experts()
    skeleton.init_rope(device)
    report.seconds = time.perf_counter() - t0
    return skeleton.eval(), report
