"""Which device a command runs on: ``auto`` (a CUDA GPU when torch sees one), ``cpu``, ``cuda[:N]``.

Asking for a GPU that is not there is an error, never a silent fall-back to the CPU: a user who
typed ``--device cuda`` wants to know that their torch build or driver does not see the GPU.
"""

from __future__ import annotations

import torch

from .errors import DeviceError

AUTO = "auto"


def resolve_device(spec: str | torch.device) -> torch.device:
    """The ``torch.device`` for ``spec``; :class:`DeviceError` naming it when it is unusable."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec == AUTO:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise DeviceError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r} was asked for but torch sees no CUDA GPU "
                              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {spec!r} was asked for but torch sees only "
                              f"{torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type != "cpu":
        raise DeviceError(f"device {spec!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device
