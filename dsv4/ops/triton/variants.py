"""How many specializations of each Triton kernel exist: the compiles a serving run must not do.

Triton compiles a kernel once per *specialization*: every ``tl.constexpr`` value, and for each
other argument its dtype, whether an integer is 1 or a multiple of 16 (unless the kernel lists it in
``do_not_specialize``) and whether a pointer is 16-byte aligned (unless it is in
``do_not_specialize_on_alignment``). A compile takes seconds on a GPU,
so a shape never seen before stalls the whole engine mid-serving. The runner's warm-up
(:meth:`dsv4.engine.runner.Runner.warm_up`) compiles what serving can reach, and the tests check,
through :func:`count`, that prompts of new lengths at new positions compile nothing more.

:func:`count` reads Triton's own per-device kernel caches on a GPU. Under the interpreter
(``TRITON_INTERPRET=1``) nothing is compiled, so :func:`record_interpreter` installs a hook that
computes the key the compiler would use (the same rules as above) and counts distinct keys.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import defaultdict

import torch

_SEEN: dict[str, set] = defaultdict(set)
_HOOKED = False
#: under the interpreter hook: run the kernel (True) or only record its key (tests that need the
#: keys of many large launches, with the values computed by the reference ops)
EXECUTE = True


def kernels() -> dict[str, object]:
    """Every ``@triton.jit`` kernel (launched from the host) of the kernel package, by name."""
    out = {}
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{__package__}.{info.name}")
        for attr, value in vars(module).items():
            if attr.endswith("_kernel") and hasattr(value, "fn"):
                out[attr] = value
    return out


def _int_class(value: int) -> str:
    return "1" if value == 1 else ("D16" if value % 16 == 0 else "N") + ("64" if abs(value) >= 2 ** 31 else "")


def _key(fn, args: tuple, kwargs: dict) -> tuple:
    """The specialization key Triton's compiler would use for this launch (see the module doc)."""
    sig = inspect.signature(fn.fn)
    params = sig.parameters
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    skip = set(fn.kwargs.get("do_not_specialize") or ())
    skip_align = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    parts = []
    for name, value in bound.arguments.items():
        if "constexpr" in str(params[name].annotation):
            parts.append((name, str(value)))
        elif isinstance(value, torch.Tensor):
            parts.append((name, str(value.dtype), name in skip_align or value.data_ptr() % 16 == 0))
        elif isinstance(value, bool):
            parts.append((name, value))
        elif isinstance(value, int):
            parts.append((name, "i64" if abs(value) >= 2 ** 31 else "i32") if name in skip
                         else (name, _int_class(value)))
        else:
            parts.append((name, type(value).__name__))
    parts.append(tuple(sorted((k, str(v)) for k, v in kwargs.items() if k not in params)))
    return tuple(parts)


def record_interpreter() -> None:
    """Under the interpreter: record each launch's specialization key (idempotent)."""
    global _HOOKED
    if _HOOKED:
        return
    from triton.runtime import interpreter

    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        _SEEN[self.fn.__name__].add(_key(self, args, kwargs))
        if not EXECUTE:
            return None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    _HOOKED = True


def count() -> dict[str, int]:
    """Specializations per kernel so far (compiled ones on a GPU; recorded keys under the
    interpreter, after :func:`record_interpreter`)."""
    out = {}
    for name, fn in kernels().items():
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            out[name] = sum(len(entry[0]) for entry in caches.values())
        else:
            out[name] = len(_SEEN.get(name, ()))
    return out


def snapshot() -> dict[str, set]:
    """The recorded keys of every kernel (interpreter only), for :func:`new_since`."""
    return {name: set(seen) for name, seen in _SEEN.items()}


def new_since(before: dict[str, set]) -> list[str]:
    """Each key recorded since ``before``, as the kernel's name and how it differs from the nearest
    earlier key of that kernel (``param: old -> new``)."""
    out = []
    for name, seen in _SEEN.items():
        old = before.get(name, set())
        for key in seen - old:
            if not old:
                out.append(f"{name}: first launch")
                continue
            near = min(old, key=lambda o: sum(a != b for a, b in zip(o, key)))
            diff = ", ".join(f"{b[0]}: {a[1:] if len(a) > 2 else a[-1]} -> {b[1:] if len(b) > 2 else b[-1]}"
                             for a, b in zip(near, key) if a != b)
            out.append(f"{name}: {diff}")
    return out


def total() -> int:
    return sum(count().values())
