"""Triton kernels behind the :mod:`dsv4.ops` contracts (GPU fast path).

Each kernel module lists what it implements in ``REGISTRATIONS``: ``(op, weight format or None,
function)``; the function has exactly the signature of the op in :mod:`dsv4.ops` and computes what
its twin in :mod:`dsv4.ops.reference` computes (tested against it on fresh random inputs, on the
GPU at real shapes and on the CPU through Triton's interpreter, ``TRITON_INTERPRET=1``, at small
ones). A kernel that cannot handle its inputs raises; it never falls back to other numerics.

:func:`register_all` registers every module's kernels for a device type. ``dsv4.ops`` calls it
once for ``cuda`` the first time an op runs on a CUDA tensor (unless ``DSV4_KERNELS=0``);
tests call it for ``cpu`` under the interpreter.
"""

from __future__ import annotations

import importlib
import os

from .. import register

#: the modules that register kernels, imported in this order (the others hold their parts:
#: ``numerics`` the decoders and rounding, ``runtime`` buffers / counters / SM count, ``moe_*`` and
#: ``small_*`` the kernels those two gather)
MODULES: tuple[str, ...] = ("linear", "moe", "attention", "indexer", "small", "sampling")


def available() -> bool:
    """Triton is importable (it ships with PyTorch's CUDA builds; ``pip install triton`` on CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    return os.environ.get("DSV4_KERNELS", "1") not in ("0", "off", "false")


def fix_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int(array)``, which
    NumPy >= 2.4 refuses for its 1-element 1-d arrays, so any ``range()`` with run-time bounds fails
    in the interpreter (never on a GPU). Take the element instead. Idempotent; interpreter only."""
    from triton.runtime import interpreter
    if getattr(interpreter, "_dsv4_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = patched
    interpreter._dsv4_index_fix = True


def register_all(device_type: str = "cuda") -> list[tuple[str, object]]:
    """Register every kernel module's kernels for ``device_type``; returns ``(op, format)`` pairs."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        fix_interpreter()
    done = []
    off = {op.strip() for op in os.environ.get("DSV4_KERNELS_OFF", "").split(",") if op.strip()}
    for name in MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for op, fmt, fn in module.REGISTRATIONS:
            if op in off:       # DSV4_KERNELS_OFF=op,op: those ops run the reference (numerics bisection)
                continue
            register(op, device_type, fmt)(fn)
            done.append((op, fmt))
    return done
