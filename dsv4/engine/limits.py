"""How big the generation state may be: checked from the config before anything is allocated.

The state is allocated once for ``max_num_seqs x max_model_len`` positions (DESIGN decision 3),
so a typo in ``--max-model-len`` can ask for gigabytes. Before the weights are read, the engine:

1. refuses a ``max_model_len`` beyond the model's ``max_position_embeddings`` (positions it was
   never trained for) and picks ``min(DEFAULT_MAX_MODEL_LEN, max_position_embeddings)`` when none
   is given;
2. computes the state's size (:func:`state_bytes`) and refuses one larger than the memory the
   device has free, naming both flags.
"""

from __future__ import annotations

import os

import torch

from ..config import ModelConfig
from ..errors import UsageError
from .state import GenerationState

DEFAULT_MAX_MODEL_LEN = 4096


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


def state_bytes(config: ModelConfig, slots: int, context: int, dtype: torch.dtype, qat_sim: bool = False) -> int:
    """Bytes of the generation state for ``slots`` sequences of ``context`` positions (plus the
    runner's scratch slot), stored as the QAT simulation says (FP8 K=V rows and FP4 indexer keys
    when on).

    Computed by laying the state out on the ``meta`` device, so it is exact for whatever layout
    :class:`~dsv4.engine.state.GenerationState` has, and costs no memory.
    """
    return GenerationState(config, slots + 1, context, dtype, "meta", qat_sim=qat_sim).nbytes()


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
                     device: torch.device, qat_sim: bool = False) -> int:
    """The state's size in bytes; a :class:`UsageError` when ``device`` has less memory free."""
    need = state_bytes(config, slots, context, dtype, qat_sim)
    free = available_bytes(device)
    if free is not None and need > free:
        raise UsageError(f"the generation state for max_num_seqs (--max-num-seqs) {slots} x max_model_len "
                         f"(--max-model-len) {context:,} needs {format_bytes(need)}, but only "
                         f"{format_bytes(free)} is free on {device}; lower one of them")
    return need


def format_bytes(n: float) -> str:
    """``512`` -> ``512 B``, ``1536`` -> ``1.5 KiB``, up to GiB."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
