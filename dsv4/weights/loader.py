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

Tensor parallel (``parallel=``): each rank builds its own shard of the network and reads only its
slices of the files (:mod:`.sharding`; routed experts it does not own are never read), so no
process ever holds the whole model. The ranks compare notes after every file: an error on one rank
fails the load on all of them with that rank's message, and rank 0's progress bar advances only as
fast as the slowest rank.
"""

from __future__ import annotations

import json
import time

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import Dsv4Error
from ..model.transformer import Transformer
from ..parallel import SINGLE, ParallelGroup, ShardError
from ..progress import progress_bar
from .formats import Fp8BlockWeight, QuantWeight, WeightFormatError
from .names import (HF_FUSED_EXPERTS, hf_to_official, is_hf_name, official_state_dict, official_to_module,
                    split_hf_experts, stacked_expert_module)
from .quant_rules import check_quant_rules, read_quant_rules
from .serialize import build_weight, split_name
from .sharding import DiskTensor, RankSlicer, disk_tensor, read

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
    bytes: int = 0            # read by this rank
    seconds: float = 0.0
    groups: dict[str, dict[str, int]] = field(default_factory=dict)  # group -> {dtype: count}
    notes: list[str] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    rank_bytes: list[int] = field(default_factory=list)  # bytes read by each rank (tensor parallel)

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
        return (f"loaded {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB{self._ranks()} in "
                f"{self.seconds:.2f} s: {formats}{notes}")

    def _ranks(self) -> str:
        if self.world_size == 1:
            return ""
        if not self.rank_bytes:
            return f" on rank {self.rank} of {self.world_size}"
        return (f" on rank {self.rank} of {self.world_size} (per rank: "
                + ", ".join(f"{b / 2**20:.1f}" for b in self.rank_bytes) + " MiB)")

    def summary(self) -> str:
        lines = [f"loaded {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB{self._ranks()} in "
                 f"{self.seconds:.2f} s from {self.path}"]
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


def _index_shards(shards: list[Path]) -> tuple[dict[Path, dict[str, DiskTensor]], dict[str, dict[str, DiskTensor]]]:
    """Read only the headers: every tensor's dtype and shape per file, and for every weight stored
    with scale companions (official base name) its parts."""
    headers: dict[Path, dict[str, DiskTensor]] = {}
    parts: dict[str, dict[str, DiskTensor]] = {}
    for file in shards:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                headers[file] = {name: disk_tensor(handle, name, file) for name in handle.keys()}
        except Exception as e:  # truncated or not a safetensors file
            raise CheckpointError(f"cannot read {file}: {e}") from None
        for disk_name, disk in headers[file].items():
            split = split_name(_official_name(disk_name))
            if split is not None:
                parts.setdefault(split[0], {})[split[1]] = disk
    # a quantized group is a weight plus at least one companion (a lone `x.scale` is a parameter)
    return headers, {base: p for base, p in parts.items() if "weight" in p and len(p) > 1}


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
    """Reads this rank's part of each on-disk tensor (or only its header: a ``meta`` tensor of the
    slice's shape) and turns the stream into checked plain tensors and packed weights (names local
    to the rank: a routed expert under its local index).

    A routed expert goes straight into slice ``e`` of its projection's stacked buffer
    (:attr:`stacks`, allocated in the expert's format when the first expert of the projection
    arrives); ``plain`` / ``packed`` then hold a view of that slice under the expert's name, for
    the checks. No per-expert copy outlives its read, and nothing is stacked after loading."""

    def __init__(self, config: ModelConfig, expected: dict[str, torch.Tensor],
                 quantized: dict[str, dict[str, DiskTensor]], device: torch.device | str, load_mtp: bool,
                 report: LoadReport, slicer: RankSlicer, read_data: bool, bar, scan_fp8: bool = False):
        self.config, self.expected, self.quantized = config, expected, quantized
        self.device, self.load_mtp, self.report, self.scan_fp8 = device, load_mtp, report, scan_fp8
        self.slicer, self.read_data, self.bar = slicer, read_data, bar
        self.plain: dict[str, torch.Tensor] = {}
        self.packed: dict[str, QuantWeight] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.expected_parts: dict[str, set[str]] = {}
        self.origin: dict[str, str] = {}
        #: stacked routed-expert weights by module name (``layers.2.ffn.experts.w1``), filled slice by slice
        self.stacks: dict[str, object] = {}
        self.n_local_experts = slicer.expert_hi - slicer.expert_lo

    def _get(self, handle, disk_name: str, disk: DiskTensor, file: Path, index) -> torch.Tensor:
        """The tensor (or its rank's ``index`` slice): read, or a header-only ``meta`` tensor."""
        if not self.read_data:
            header = _header_tensor(handle, disk_name, file)
            return header if index is None else header[index]
        try:
            tensor = read(handle, disk_name, disk, index)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor `{disk_name}`: {e}") from None
        self.bar.update(tensor.numel() * tensor.element_size())
        return tensor

    def _index(self, weight_name: str, part: str, disk: DiskTensor, disk_name: str, file: Path,
               parts: dict[str, DiskTensor] | None = None):
        try:
            return self.slicer.index(weight_name, part, disk, disk_name, parts)
        except ShardError:
            raise
        except ValueError as e:
            raise CheckpointError(f"{file}: {e}") from None

    def add(self, handle, disk_name: str, disk: DiskTensor, file: Path) -> None:
        """Take this rank's slice of ``disk_name`` (nothing, for another rank's expert) and file it."""
        if HF_FUSED_EXPERTS.match(disk_name):
            if len(disk.shape) != 3 or disk.shape[0] != self.config.n_routed_experts:
                raise CheckpointError(f"{file}: fused expert tensor `{disk_name}` has shape "
                                      f"{disk.shape}; expected [{self.config.n_routed_experts}, N, K]")
            index = (self.slicer.expert_rows(),) if self.slicer.tp.parallel else None
            tensor = self._get(handle, disk_name, disk, file, index)   # this rank's experts, local 0..
            for name, t in split_hf_experts(disk_name, tensor).items():
                self._add_plain(name, t, file, disk_name)
            return
        name = _official_name(disk_name)
        if name.startswith("mtp.") and not self.load_mtp:
            return
        local = self.slicer.expert_name(name)
        if local is None:            # another rank's routed expert: never read
            return
        split, local_split = split_name(name), split_name(local)
        group_parts = self.quantized.get(split[0]) if split is not None else None
        if group_parts is not None:
            base, part = local_split
            index = self._index(f"{base}.weight", part, disk, disk_name, file, group_parts)
            group = self.pending.setdefault(base, {})
            self.expected_parts[base] = set(group_parts)
            if part in group:
                raise CheckpointError(f"{file}: tensor `{disk_name}` appears twice")
            group[part] = self._get(handle, disk_name, disk, file, index)
            if set(group) == set(group_parts):
                self._add_packed(base, self.pending.pop(base), file)
            return
        index = self._index(local, "weight", disk, disk_name, file)
        self._add_plain(local, self._get(handle, disk_name, disk, file, index), file, disk_name)

    def _claim(self, name: str, disk_name: str, file: Path) -> torch.Tensor:
        if name not in self.expected:
            raise CheckpointError(f"{file}: unexpected tensor `{disk_name}` (not part of this config's model)")
        if name in self.origin:
            raise CheckpointError(f"{file}: tensor `{name}` also appears in {self.origin[name]}")
        self.origin[name] = str(file)
        return self.expected[name]

    def _add_plain(self, name: str, t: torch.Tensor, file: Path, disk_name: str) -> None:
        expected = self._claim(name, disk_name, file)
        value = _check_tensor(name, t, expected, file, self.config.n_routed_experts)
        self.plain[name] = self._into_stack(name, value, file) if stacked_expert_module(name) else value.to(self.device)
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
            weight = weight.to(expected.dtype)
            self.plain[name] = self._into_stack(name, weight, file) if stacked_expert_module(name) else \
                weight.to(self.device)
            self.report.add(name, str(weight.dtype).replace("torch.", ""), weight.numel() * weight.element_size())
            return
        if self.scan_fp8 and isinstance(weight, Fp8BlockWeight) and _has_nan_fp8(weight.weight):
            raise CheckpointError(f"{file}: tensor `{name}` holds FP8 NaN codes (0x7F/0xFF)")
        self.packed[name] = self._into_stack(name, weight, file) if stacked_expert_module(name) else \
            weight.to(self.device)
        self.report.add(name, weight.dtype_name, weight.nbytes)

    def _into_stack(self, name: str, weight: object, file: Path) -> object:
        """Copy routed expert ``name``'s weight (a tensor or a packed weight) into its slice of the
        stacked buffer on the target device; returns the slice (a view, or a packed weight of views)."""
        key, (_, e) = stacked_expert_module(name), official_to_module(name)
        stack = self.stacks.get(key)
        if stack is None:     # the first expert of this projection: allocate all E of its format
            n = self.n_local_experts
            if isinstance(weight, torch.Tensor):
                stack = torch.empty((n, *weight.shape), dtype=weight.dtype, device=self.device)
            else:
                stack = weight._map(lambda t: torch.empty((n, *t.shape), dtype=t.dtype, device=self.device))
                stack.name = f"{key}.weight"
            self.stacks[key] = stack
        if _format_key(stack) != _format_key(weight):
            raise CheckpointError(f"{file}: routed expert tensor `{_global_name(name, self.slicer)}` is "
                                  f"{_format_name(weight)} but the other experts of `{key}` are {_format_name(stack)}: "
                                  "routed experts mix weight formats")
        if isinstance(weight, torch.Tensor):
            stack[e].copy_(weight)
            return stack[e]
        for attr in type(weight)._tensors:
            part = getattr(weight, attr)
            if part is not None:
                getattr(stack, attr)[e].copy_(part)
        return stack.expert(e)

    def finish(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            raise CheckpointError(f"tensor group `{base}` is incomplete: found {sorted(parts)}, "
                                  f"expected {sorted(self.expected_parts[base])}")


def _format_key(w: object) -> tuple:
    """What experts of one stack must share: the type, the format's attributes, each part's dtype."""
    if isinstance(w, torch.Tensor):
        return (torch.Tensor, w.dtype)
    parts = [getattr(w, k) for k in type(w)._tensors]
    return (type(w), *[getattr(w, k) for k in type(w)._attrs], *[None if t is None else t.dtype for t in parts])


def _format_name(w: object) -> str:
    return str(w.dtype).removeprefix("torch.") if isinstance(w, torch.Tensor) else w.dtype_name


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


@dataclass
class _Walk:
    """What a walk over a checkpoint found: the checked tensors and a model skeleton for them."""

    config: ModelConfig
    plain: dict[str, torch.Tensor]
    packed: dict[str, QuantWeight]
    stacks: dict[str, object]       # stacked routed-expert weights by module name
    skeleton: Transformer
    report: LoadReport


def _agree(tp: ParallelGroup, error: BaseException | None, what: str, payload: object = None) -> list:
    """Compare notes across the ranks after a load phase: if any rank failed, every rank raises (the
    failing one its own error, the others a :class:`CheckpointError` with its message); else returns
    every rank's ``payload``. World size 1 and layout-only groups just re-raise."""
    if not tp.connected:
        if error is not None:
            raise error
        return [payload]
    note = None if error is None else f"{type(error).__name__}: {error}"
    notes = tp.all_gather_object((note, payload))
    if error is not None:
        raise error
    for rank, (message, _) in enumerate(notes):
        if message is not None:
            raise CheckpointError(f"rank {rank} of {tp.world_size} failed while {what}: {message}")
    return [p for _, p in notes]


def _walk(path: str | Path, device: str | torch.device, dtype: torch.dtype, load_mtp: bool, read_data: bool,
          progress: bool, scan_fp8: bool = False, tp: ParallelGroup = SINGLE) -> _Walk:
    """Check every tensor this rank needs of the checkpoint at ``path`` against its config; tensors
    end up on ``device`` (``meta`` keeps nothing). Raises :class:`CheckpointError` / ``ConfigError``
    (on every rank when one fails)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = ModelConfig.from_file(path / "config.json")
    quant_rules = read_quant_rules(path, config)
    t0 = time.perf_counter()
    shards = list_shards(path)
    report = LoadReport(path=str(path), rank=tp.rank, world_size=tp.world_size)
    headers, quantized = _index_shards(shards)

    with torch.device("meta"):
        skeleton = Transformer(config, dtype, with_mtp=load_mtp, parallel=tp)
    expected = official_state_dict(skeleton.state_dict())    # by the checkpoint's names
    slicer = RankSlicer(tp, expected, config.n_routed_experts)
    total = sum(f.stat().st_size for f in shards)
    desc = "loading" if tp.world_size == 1 else f"loading ({tp.world_size} ranks)"
    with progress_bar(progress and read_data and tp.is_first, total=total, unit="B", unit_scale=True,
                      desc=desc) as bar:
        collect = _Collector(config, expected, quantized, device, load_mtp, report, slicer, read_data, bar, scan_fp8)
        for file in shards:
            error = None
            try:
                _read_file(file, headers[file], collect, report)
            except Exception as e:   # noqa: BLE001 -- every rank must hear of it before anyone raises
                error = e
            _agree(tp, error, f"reading {file.name}")
        bar.update(total - bar.n)
    error, walk = None, None
    try:
        walk = _finish(path, config, dtype, load_mtp, quant_rules, collect, expected, skeleton, tp, report)
    except Exception as e:  # noqa: BLE001
        error = e
    rank_bytes = _agree(tp, error, "checking the loaded tensors", report.bytes)
    report.rank_bytes = rank_bytes if tp.parallel and tp.connected else []
    report.seconds = time.perf_counter() - t0
    return walk


def _read_file(file: Path, header: dict[str, DiskTensor], collect: _Collector, report: LoadReport) -> None:
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # truncated or not a safetensors file (the header covers the file's size)
        raise CheckpointError(f"cannot read {file}: {e}") from None
    with handle:
        for disk_name in handle.keys():
            collect.add(handle, disk_name, header[disk_name], file)
            collect.bar.set_postfix(tensors=report.tensors, refresh=False)


def _finish(path: Path, config: ModelConfig, dtype: torch.dtype, load_mtp: bool, quant_rules, collect: _Collector,
            expected: dict[str, torch.Tensor], skeleton: Transformer, tp: ParallelGroup, report: LoadReport) -> _Walk:
    """Check that every tensor this rank needs arrived and agrees with the quantization config."""
    collect.finish()
    have = set(collect.plain) | set(collect.packed)
    missing = [n for n in expected if n not in have]
    mtp_missing = [n for n in missing if n.startswith("mtp.")]
    if load_mtp and mtp_missing and len(mtp_missing) == sum(n.startswith("mtp.") for n in expected):
        report.notes.append("checkpoint has no MTP tensors: loaded without the MTP block")
        missing = [n for n in missing if not n.startswith("mtp.")]
        with torch.device("meta"):
            skeleton = Transformer(config, dtype, with_mtp=False, parallel=tp)
    if missing:
        shown = ", ".join(f"`{_global_name(n, collect.slicer)}`" for n in missing[:8])
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint: {shown}"
                              + (" ..." if len(missing) > 8 else ""))
    check_quant_rules(quant_rules, collect.packed, collect.plain, config)
    return _Walk(config, collect.plain, collect.packed, collect.stacks, skeleton, report)


def _global_name(name: str, slicer: RankSlicer) -> str:
    """A local tensor name (routed expert under its local index) as the checkpoint spells it."""
    head, sep, tail = name.partition(".ffn.experts.")
    if not sep or not slicer.tp.parallel:
        return name
    e, rest = tail.split(".", 1)
    return f"{head}.ffn.experts.{int(e) + slicer.expert_lo}.{rest}"


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


def weight_bytes(path: str | Path, dtype: torch.dtype, *, load_mtp: bool = False, rank: int = 0,
                 world_size: int = 1) -> int:
    """Bytes the weights of ``path`` will take in memory on rank ``rank`` of ``world_size`` (from the
    headers, which are checked as :func:`load_model` checks them; no tensor data is read)."""
    tp = ParallelGroup.layout(rank, world_size) if world_size > 1 else SINGLE
    return _walk(path, "meta", dtype, load_mtp, read_data=False, progress=False, tp=tp).report.bytes


def load_model(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
               load_mtp: bool = True, progress: bool = True, parallel: ParallelGroup | None = None
               ) -> tuple[Transformer, LoadReport]:
    """Load ``path`` into a model on ``device`` with activations/linear weights in ``dtype``.

    Quantized weights (FP8 block, MXFP4, NVFP4) stay packed and are placed on ``device`` as is.
    ``load_mtp=False`` skips ``mtp.*`` tensors; a checkpoint without them loads with a note in the
    report (speculative decoding then is unavailable). The headers are checked first, so a
    mis-shaped or missing tensor in the last shard fails before any data is read. Raises
    :class:`CheckpointError` / :class:`~dsv4.config.ConfigError` naming the culprit; nothing
    partial is returned.

    ``parallel``: load this rank's shard (every rank of the group calls this together; ``device``
    defaults to the group's, else the CPU). A size that does not divide across the ranks, or a split
    that would cut a quantization block, is a :class:`~dsv4.parallel.ShardError` naming the tensor.
    """
    tp = parallel or SINGLE
    device = torch.device(device if device is not None else tp.device)
    _walk(path, "meta", dtype, load_mtp, read_data=False, progress=False, tp=tp)
    found = _walk(path, device, dtype, load_mtp, read_data=True, progress=progress, tp=tp)
    skeleton = found.skeleton
    plain = {official_to_module(n)[0]: t for n, t in found.plain.items() if not stacked_expert_module(n)}
    skeleton.load_state_dict(plain, strict=False, assign=True)
    for name, weight in found.packed.items():
        if not stacked_expert_module(name):
            skeleton.get_submodule(official_to_module(name)[0][: -len(".weight")]).set_weight(weight)
    for name, stack in found.stacks.items():      # routed experts: already in their stacked buffers
        skeleton.get_submodule(name).set_weight(stack)
    skeleton.init_rope(device)
    return skeleton.eval(), found.report
