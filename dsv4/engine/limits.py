"""How big the generation state may be: checked from the config before anything is allocated.

The state is allocated once for ``max_num_seqs x max_model_len`` positions (DESIGN decision 3),
so a typo in ``--max-model-len`` can ask for gigabytes. Before the weights are read, the engine:

1. refuses a ``max_model_len`` beyond the model's ``max_position_embeddings`` (positions it was
   never trained for) and picks ``min(DEFAULT_MAX_MODEL_LEN, max_position_embeddings)`` when none
   is given;
2. computes the state's size (:func:`state_bytes`) and refuses one larger than the memory the
   device has free, naming both flags;
3. on a CUDA device, keeps weights + state + a working margin within ``gpu_memory_utilization`` of
   the GPU's total memory (vLLM's flag): :func:`size_state` derives the number of sequences from
   that share when none is given, and refuses a given one that does not fit in it. On the CPU the
   share is not applied (the state is checked against the free RAM only).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import UsageError
from .state import GenerationState

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 8               # sequences when none is given and the device cannot size them (CPU)
MAX_DERIVED_NUM_SEQS = 256             # at most this many when derived from memory (vLLM's default max_num_seqs)
# The prefix cache's default byte budget (--prefix-cache-gib): on a CUDA device this share of the
# engine's memory (gpu_memory_utilization x total), set aside before the state is sized; on the CPU a
# fixed size (its pages are only touched as they fill).
DEFAULT_PREFIX_CACHE_SHARE = 0.1
DEFAULT_CPU_PREFIX_CACHE_BYTES = 1 << 30
# Kept free within the share for what is not weights or state: one step's activations, the CUDA graph
# pool (592 MiB for 12 graphs of a Flash slice, bench/RESULTS.md) and Triton's workspaces.
WORKING_MARGIN_BYTES = 2 << 30


def check_positive(name: str, value: object) -> int:
    """``value`` if it is a positive int, else a :class:`UsageError` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")
    return value


def resolve_max_model_len(requested: int | None, config: ModelConfig) -> int:
    """Positions per sequence: ``requested`` (at most ``max_position_embeddings``) or the default."""
    limit = config.max_position_embeddings
    if requested is None:
        return min(DEFAULT_MAX_MODEL_LEN, limit)
    check_positive("max_model_len (--max-model-len)", requested)
    if requested > limit:
        raise UsageError(f"max_model_len (--max-model-len) {requested:,} exceeds the model's "
                         f"max_position_embeddings ({limit:,})")
    return requested


def state_bytes(config: ModelConfig, slots: int, context: int, dtype: torch.dtype, qat_sim: bool = False,
                include_mtp: bool = False) -> int:
    """Bytes of the generation state for ``slots`` sequences of ``context`` positions (plus the
    runner's scratch slot), stored as the QAT simulation says (FP8 K=V rows and FP4 indexer keys
    when on); ``include_mtp``: with the MTP block's layer (speculative decoding with MTP drafts).

    Computed by laying the state out on the ``meta`` device, so it is exact for whatever layout
    :class:`~dsv4.engine.state.GenerationState` has, and costs no memory.
    """
    return GenerationState(config, slots + 1, context, dtype, "meta", include_mtp=include_mtp, qat_sim=qat_sim).nbytes()


def check_fraction(name: str, value: object) -> float:
    """``value`` if it is a number in (0, 1], else a :class:`UsageError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UsageError(f"{name} must be a fraction in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DeviceMemory:
    """What a device has: ``free`` for new allocations and ``total`` (None when unknown)."""

    free: int | None
    total: int | None


def device_memory(device: torch.device) -> DeviceMemory:
    """Free and total memory of ``device`` (a CUDA GPU's, or the host's RAM for the CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(int(free), int(total))
    return DeviceMemory(available_bytes(device), None)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new allocations on ``device`` (None when it cannot be told)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_state_fits(config: ModelConfig, slots: int, context: int, dtype: torch.dtype,
                     device: torch.device, qat_sim: bool = False, include_mtp: bool = False) -> int:
    """The state's size in bytes; a :class:`UsageError` when ``device`` has less memory free."""
    need = state_bytes(config, slots, context, dtype, qat_sim, include_mtp)
    free = available_bytes(device)
    if free is not None and need > free:
        raise UsageError(f"the generation state for max_num_seqs (--max-num-seqs) {slots} x max_model_len "
                         f"(--max-model-len) {context:,} needs {format_bytes(need)}, but only "
                         f"{format_bytes(free)} is free on {device}; lower one of them")
    return need


def size_state(config: ModelConfig, slots: int | None, context: int, dtype: torch.dtype, device: torch.device,
               qat_sim: bool, gpu_memory_utilization: float, weight_bytes: Callable[[], int],
               memory: DeviceMemory | None = None, reserve: int = 0, include_mtp: bool = False
               ) -> tuple[int, int]:
    """``(slots, state bytes)`` for ``context`` positions per sequence on ``device``.

    On a CUDA device the engine may use ``gpu_memory_utilization`` of the GPU's total memory (and no
    more than is free now): weights (``weight_bytes()``, read from the checkpoint's headers), the
    state and :data:`WORKING_MARGIN_BYTES` must fit in it. ``slots=None`` takes as many sequences as
    fit (at most :data:`MAX_DERIVED_NUM_SEQS`); a given ``slots`` whose state does not fit is a
    :class:`UsageError` naming the flags. Elsewhere ``slots=None`` is :data:`DEFAULT_MAX_NUM_SEQS`
    and the state is only checked against the free memory (:func:`check_state_fits`).
    ``memory`` overrides what the device reports (tests). ``reserve``: bytes of that share kept for
    the prefix cache; ``include_mtp`` counts the MTP block's state.
    """
    check_fraction("gpu_memory_utilization (--gpu-memory-utilization)", gpu_memory_utilization)
    if device.type != "cuda":
        slots = DEFAULT_MAX_NUM_SEQS if slots is None else slots
        return slots, check_state_fits(config, slots, context, dtype, device, qat_sim, include_mtp)
    memory = memory or device_memory(device)
    share = int(gpu_memory_utilization * memory.total)
    weights = weight_bytes()
    room = min(share, memory.free) - weights - WORKING_MARGIN_BYTES - reserve
    where = (f"{gpu_memory_utilization:g} (--gpu-memory-utilization) of {device}'s {format_bytes(memory.total)} "
             f"is {format_bytes(share)}" + (f", {format_bytes(memory.free)} of it free now" if memory.free < share
                                             else ""))
    layout = f"weights {format_bytes(weights)} + {format_bytes(WORKING_MARGIN_BYTES)} working margin" + (
        f" + {format_bytes(reserve)} prefix cache (--prefix-cache-gib)" if reserve else "")
    if slots is not None:
        need = state_bytes(config, slots, context, dtype, qat_sim, include_mtp)
        if need > room:
            raise UsageError(f"the generation state for max_num_seqs (--max-num-seqs) {slots} x max_model_len "
                             f"(--max-model-len) {context:,} needs {format_bytes(need)}, but {where}: {layout} "
                             f"leave {format_bytes(max(room, 0))}; lower one of them or raise "
                             "--gpu-memory-utilization")
        return slots, need

    def fits(n: int) -> bool:
        return state_bytes(config, n, context, dtype, qat_sim, include_mtp) <= room

    if not fits(1):
        one = state_bytes(config, 1, context, dtype, qat_sim, include_mtp)
        raise UsageError(f"not even one sequence fits: its state of max_model_len (--max-model-len) {context:,} "
                         f"needs {format_bytes(one)}, but {where}: {layout} leave {format_bytes(max(room, 0))}; "
                         "lower --max-model-len or raise --gpu-memory-utilization")
    lo, hi = 1, MAX_DERIVED_NUM_SEQS     # the largest n that fits, by bisection (the state grows with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo, state_bytes(config, lo, context, dtype, qat_sim, include_mtp)


def prefix_cache_budget(enabled: bool, gib: float | None, device: torch.device, gpu_memory_utilization: float,
                        memory: DeviceMemory | None = None) -> int:
    """The prefix cache's bytes: 0 when off; ``gib`` when given; else on a CUDA device
    :data:`DEFAULT_PREFIX_CACHE_SHARE` of ``gpu_memory_utilization`` of its memory, elsewhere
    :data:`DEFAULT_CPU_PREFIX_CACHE_BYTES`."""
    if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0):
        raise UsageError(f"prefix_cache_gib (--prefix-cache-gib) must be a positive number of GiB, got {gib!r}")
    if not enabled:
        return 0
    if gib is not None:
        return int(gib * 2**30)
    if device.type != "cuda":
        return DEFAULT_CPU_PREFIX_CACHE_BYTES
    memory = memory or device_memory(device)
    return int(DEFAULT_PREFIX_CACHE_SHARE * gpu_memory_utilization * memory.total)


def format_bytes(n: float) -> str:
    """``512`` -> ``512 B``, ``1536`` -> ``1.5 KiB``, up to GiB."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
