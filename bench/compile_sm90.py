"""Compile the small-op Triton kernels for an H100 (sm_90) on a machine without a GPU.

    python bench/compile_sm90.py

A stand-in Triton driver reports an sm_90 target; every launch of the small-op wrappers (run on
CPU tensors at V4-Flash / V4-Pro decode shapes, bf16) only compiles (``warmup``) down to a cubin
with the ptxas Triton ships. It prints each kernel variant's registers, stack and local (spill)
bytes from ``cuobjdump``. Nothing runs: values are not checked here (the interpreter tests and
the GPU tests do that); this catches what fails to compile, and spills, before a device run.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import jit  # noqa: E402

COMPILED: list[tuple[str, object]] = []


class _Sm90Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _install() -> None:
    from dsv4.ops.triton import runtime
    importlib.import_module("triton.runtime.driver").driver.set_active(_Sm90Driver())
    runtime.sm_count = lambda device: 132             # the H100's grid heuristics, not the interpreter's
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel))
        return kernel
    jit.JITFunction.run = compile_only


def _exercise() -> None:
    from dsv4.engine.state import _compressor
    from dsv4.model.cache import RowStore
    from dsv4.ops.triton import small
    k = {op: fn for op, _, fn in small.REGISTRATIONS}
    bf, f32 = torch.bfloat16, torch.float32

    def rn(*s, dtype=bf):
        return torch.randn(*s).to(dtype)
    for D, H, ql, batches in ((4096, 64, 1024, (1, 32)), (7168, 128, 1536, (1,))):
        for T in batches:
            h = rn(T, 1, 4, D)
            k["mhc_pre_norm"](h, rn(24, 4 * D, dtype=f32), rn(24, dtype=f32), rn(3, dtype=f32), 20, 1e-6, 1e-6,
                              rn(D, dtype=f32), 1e-6)
            k["hc_head_norm"](h, rn(4, 4 * D, dtype=f32), rn(4, dtype=f32), rn(1, dtype=f32), 1e-6, 1e-6,
                              rn(D, dtype=f32), 1e-6)
            k["mhc_post"](rn(T, 1, D), h, rn(T, 1, 4, dtype=f32), rn(T, 1, 4, 4, dtype=f32))
            k["mhc_post_pre_norm"](rn(T, 1, D), h, rn(T, 1, 4, dtype=f32), rn(T, 1, 4, 4, dtype=f32),
                                   rn(24, 4 * D, dtype=f32), rn(24, dtype=f32), rn(3, dtype=f32), 20, 1e-6, 1e-6,
                                   rn(D, dtype=f32), 1e-6)
            for width in (D, ql):
                k["rms_norm"](rn(T, 1, width), rn(width, dtype=f32), 1e-6)
            cos, sin = rn(T, 1, 32, dtype=f32), rn(T, 1, 32, dtype=f32)
            q = rn(T, 1, H, 512)
            k["rope_qnorm"](q, cos.unsqueeze(2), sin.unsqueeze(2), 1e-6)
            k["apply_rope"](q, cos.unsqueeze(2), sin.unsqueeze(2), True)
            for layout in ("plain", "fp8"):
                ring = RowStore.allocate(layout, 4, 128, 512, bf, "cpu", rope_dim=64)
                k["q_kv_prepare"](rn(T, 1, ql), rn(ql, dtype=f32), 1e-6, rn(T, 1, 512), rn(512, dtype=f32), 1e-6, cos,
                                  sin, ring, torch.arange(T).unsqueeze(1) % 4, torch.zeros(T, 1, dtype=torch.long))
                k["q_kv_prepare"](rn(T, 1, ql), rn(ql, dtype=f32), 1e-6, rn(T, 1, 512), rn(512, dtype=f32), 1e-6, cos,
                                  sin, ring)
                k["store_rows"](ring, torch.arange(T).unsqueeze(1) % 4, torch.zeros(T, 1, dtype=torch.long),
                                rn(T, 1, 512))
            keys = RowStore.allocate("fp4", 4, 64, 128, bf, "cpu")
            k["store_rows"](keys, torch.arange(T).unsqueeze(1) % 4, torch.zeros(T, 1, dtype=torch.long),
                            rn(T, 1, 128, dtype=f32))
            qi = rn(T, 1, 64, 128)
            for fp4 in (True, False):
                k["queries_prepare"](q, cos.unsqueeze(2), sin.unsqueeze(2), 1e-6, qi, fp4)
            k["hadamard"](rn(T, 1, 128, dtype=f32))
            k["hadamard"](rn(T, 1, 16))
            k["swiglu"](rn(T, 2048, dtype=f32), rn(T, 2048, dtype=f32), 10.0)
            k["fp8_sim"](rn(T, D), 128, True)
            k["fp4_sim"](rn(T, 128), 32)
            k["compress_windows"](rn(T, 2, 4, 1024, dtype=f32), rn(T, 2, 4, 1024, dtype=f32),
                                  rn(T, 2, 4, 512, dtype=f32), rn(T, 2, 4, 512, dtype=f32))
            k["compress_windows"](rn(T, 1, 128, 512, dtype=f32), rn(T, 1, 128, 512, dtype=f32))
    for dim, ratio, overlap, layout, rotate in ((512, 4, True, "fp8", False), (512, 128, False, "fp8", False),
                                                (128, 4, True, "fp4", True), (512, 4, True, "plain", False)):
        width = 2 * dim if overlap else dim
        entries = RowStore.allocate(layout, 4, 65, dim, bf, "cpu", rope_dim=64 if layout == "fp8" else 0)
        st = _compressor(entries, 4, ratio, dim, overlap, "cpu")
        k["compressor_step"](rn(8, 1, width, dtype=f32), rn(8, 1, width, dtype=f32), rn(ratio, width, dtype=f32), st,
                             torch.arange(8) % 4, torch.arange(8).unsqueeze(1), torch.ones(dim), 1e-6,
                             rn(8, 1, 32, dtype=f32), rn(8, 1, 32, dtype=f32), rotate)
    sts = []
    for dim, layout in ((512, "fp8"), (128, "fp4")):     # a CSA layer's compressor and its indexer's, one launch
        entries = RowStore.allocate(layout, 4, 65, dim, bf, "cpu", rope_dim=64 if layout == "fp8" else 0)
        sts.append((rn(8, 1, 2 * dim, dtype=f32), rn(8, 1, 2 * dim, dtype=f32), rn(4, 2 * dim, dtype=f32),
                    _compressor(entries, 4, 4, dim, True, "cpu"), torch.ones(dim), 1e-6, layout == "fp4"))
    k["compressor_step_pair"](*sts[0], *sts[1], torch.arange(8) % 4, torch.arange(8).unsqueeze(1),
                              rn(8, 1, 32, dtype=f32), rn(8, 1, 32, dtype=f32))


def _usage(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if "REG:" in x), "")
    return " ".join(p for p in line.split() if p.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))


def main() -> None:
    _install()
    t0 = time.time()
    _exercise()
    seen: dict[tuple[str, str], object] = {}
    for name, kernel in COMPILED:
        seen.setdefault((name, kernel.hash), kernel)
    print(f"{len(seen)} kernel variants compiled for sm_90 in {time.time() - t0:.0f} s")
    for (name, _), kernel in sorted(seen.items(), key=lambda kv: kv[0][0]):
        print(f"{name:<26} warps={kernel.metadata.num_warps:<2} {_usage(kernel.asm['cubin'])}")


if __name__ == "__main__":
    main()
