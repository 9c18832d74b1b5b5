"""Out-of-bounds reads made visible in Triton's interpreter (kernel tests on CPU).

A masked load that reads past the end (or before the start) of a tensor reads whatever memory is
there: on the GPU that is usually another live buffer with finite values, so the bug shows only
when the neighbour happens to hold NaN (``mhc_post_pre_norm`` read the per-token weights of a stream
past the last token's row this way; NaN logits on an H100, months after the kernel landed).

Within :func:`guarded_launches`, every interpreted launch runs on copies of its tensors' storages
placed between two guard bands of 0xFF bytes (NaN in every float format we use: fp32, fp16, bf16,
e4m3; e8m0 255 is NaN too; -1 in integers). A kernel that lets such a read reach its result
produces NaN, which the tests' ``_close`` / ``_exact`` reject. Arguments that share a storage
share its copy (aliasing kept), and the copies are written back after the launch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

#: bytes of guard band before and after each storage (a multiple of every element size)
GUARD_BYTES = 4096


def _guarded(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    n = storage.nbytes()
    buf = torch.full((n + 2 * GUARD_BYTES,), 0xFF, dtype=torch.uint8)
    if n:
        buf[GUARD_BYTES:GUARD_BYTES + n].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    return buf.untyped_storage()


@contextlib.contextmanager
def guarded_launches() -> Iterator[None]:
    """Interpreted Triton launches in the block read their tensors between guard bands."""
    from triton.runtime import interpreter as I

    executor = I.GridExecutor
    init, restore = executor._init_args_hst, executor._restore_args_dev

    def init_guarded(self, args_dev, kwargs):
        copies: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

        def swap(arg):
            if isinstance(arg, tuple):
                return tuple(swap(a) for a in arg)
            if not isinstance(arg, torch.Tensor) or arg.device.type != "cpu":
                return arg
            st = arg.untyped_storage()
            key = st.data_ptr()
            if key not in copies:
                copies[key] = (st, _guarded(st))
            view = arg.new_empty(0)
            view.set_(copies[key][1], arg.storage_offset() + GUARD_BYTES // arg.element_size(), arg.size(),
                      arg.stride())
            return view

        self._guard_copies = copies
        return init(self, [swap(a) for a in args_dev], {k: swap(v) for k, v in kwargs.items()})

    def restore_guarded(self, args_dev, args_hst, kwargs, kwargs_hst):
        # (in place of the interpreter's copy-back, which would copy each guarded storage, guard
        # bands included, onto the smaller original)
        for orig, copy in getattr(self, "_guard_copies", {}).values():
            n = orig.nbytes()
            if n:
                torch.empty(0, dtype=torch.uint8).set_(orig).copy_(
                    torch.empty(0, dtype=torch.uint8).set_(copy)[GUARD_BYTES:GUARD_BYTES + n])

    executor._init_args_hst, executor._restore_args_dev = init_guarded, restore_guarded
    try:
        yield
    finally:
        executor._init_args_hst, executor._restore_args_dev = init, restore
