"""The interpreter's launch guard (tests/launch_guard.py) that every ``test_triton_*`` module runs
under: a read past a tensor's end sees NaN, writes reach the caller's tensors, and arguments that
share a storage still share it inside the launch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def _shifted_copy(x_ptr, y_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i + SHIFT, mask=i < n), mask=i < n)


def test_a_read_past_the_end_sees_nan_and_writes_come_back():
    x = torch.arange(8, dtype=torch.float32)
    y = torch.zeros(8)
    _shifted_copy[(1,)](x, y, 8, SHIFT=1, BLOCK=8)
    assert torch.equal(y[:7], x[1:])           # the writes reached y
    assert y[7].isnan()                        # element 8 of x is the guard band


def test_views_of_one_storage_stay_aliased():
    buf = torch.arange(16, dtype=torch.float32)
    src, dst = buf[:8], buf[8:]
    _shifted_copy[(1,)](src, dst, 8, SHIFT=0, BLOCK=8)
    assert torch.equal(buf[8:], torch.arange(8, dtype=torch.float32))
    # in place through two views: y[i] = x[i + 1] on the same storage reads real data, not a band
    _shifted_copy[(1,)](buf[:8], buf[:8], 7, SHIFT=1, BLOCK=8)
    assert not buf.isnan().any()
