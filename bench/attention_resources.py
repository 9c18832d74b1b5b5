"""Compile the attention-family Triton kernels for sm_90 on a machine without a GPU, and print what
ptxas gives each launch config: registers, spill (stack) bytes, shared memory, tensor-core ops.

    python bench/attention_resources.py [--arch 90]

No kernel runs: Triton's driver is replaced by a stand-in that names the target, every launch in
``dsv4.ops.triton.attention`` and ``.indexer`` is turned into a compile (``warmup``), and the cubin is read with the
``cuobjdump`` bundled with Triton. The inputs are CPU tensors of the real DeepSeek-V4 shapes (the
same configs the GPU picks for them, with an H100's 132 SMs). A developer tool: it leans on Triton
internals (3.6) and is not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

COMPILED: list[tuple[str, tuple, dict, object]] = []


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


class _Driver:
    """Just enough of Triton's driver for compiling (never launching)."""

    utils = _Utils()

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)


def _compile_instead_of_launch() -> None:
    def getitem(self, grid):
        def go(*args, **kwargs):
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            COMPILED.append((self.fn.__name__, grid, kwargs, kernel))
            return kernel
        return go
    jit.JITFunction.__getitem__ = getitem


def resources(kernel) -> dict:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([bin_dir / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                           text=True).stdout
    sass = subprocess.run([bin_dir / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), smem_kb=kernel.metadata.shared / 1024,
                hmma=len(re.findall(r"\bHMMA\b", sass)), hgmma=len(re.findall(r"\bHGMMA\b", sass)),
                local=len(re.findall(r"\b(?:LDL|STL)\b", sass)))


def _calls():
    """(label, thunk) for every config the benchmark shapes launch."""
    from dsv4.model.cache import RowStore
    from dsv4.ops.triton import attention as ka
    from dsv4.ops.triton import indexer as ki
    dt = torch.bfloat16

    def store(layout, slots, rows, dim=512, rope=64):
        return RowStore.allocate(layout, slots, rows, dim, dt, "cpu", rope_dim=rope)

    for model, H, k in (("flash", 64, 512), ("pro", 128, 1024)):
        for B, S in ((1, 1), (8, 1), (32, 1), (1, 4096)):
            q, kv = torch.zeros(B, S, H, 512, dtype=dt), torch.zeros(B, S, 512, dtype=dt)
            ring, comp = store("fp8", B + 1, 128), store("fp8", B + 1, 2049)
            slots, start, sink = torch.arange(B), torch.full((B,), 8000), torch.zeros(H)
            yield (f"{model} csa B={B} S={S}", lambda: ka.sparse_attention_triton(
                q, kv, ring, slots, start, 128, sink, 0.04, comp, torch.zeros(B, S, k, dtype=torch.long)))
            yield (f"{model} hca B={B} S={S}", lambda: ka.sparse_attention_triton(
                q, kv, ring, slots, start, 128, sink, 0.04, comp, None, torch.zeros(B, S, dtype=torch.long), 64))
    for B, S, bound in ((1, 1, 2048), (32, 1, 16384), (1, 4096, 1024)):
        keys = store("fp4", B + 1, bound + 1, 128, 0)
        yield (f"indexer B={B} S={S} bound={bound}", lambda: ki.indexer_scores_triton(
            torch.zeros(B, S, 64, 128, dtype=dt), keys, torch.arange(B), torch.zeros(B, S, 64), bound))
    for n, k in ((2048, 512), (16384, 512), (4096, 1024)):
        yield (f"topk n={n} k={k}", lambda: ki.topk_indices_triton(torch.zeros(1, 1, n), k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    driver.set_active(_Driver(args.arch))
    _compile_instead_of_launch()
    from dsv4.ops.triton import runtime
    runtime.sm_count = lambda device: 132
    seen = set()
    for label, call in _calls():
        COMPILED.clear()
        call()
        for name, grid, kw, kernel in COMPILED:
            key = (name, tuple(sorted((k, str(v)) for k, v in kw.items())))
            if key in seen:
                continue
            seen.add(key)
            r = resources(kernel)
            cfg = " ".join(f"{k}={kw[k]}" for k in ("BH", "BN", "BPS", "SPLITS", "BC", "BQ", "CHUNK", "KP",
                                                     "num_warps", "num_stages") if k in kw)
            print(f"{label:<28} {name:<22} grid={str(grid):<14} {cfg:<48} regs={r['regs']:3d} "
                  f"stack={r['stack']:3d} smem={r['smem_kb']:6.1f}KB hmma={r['hmma']} hgmma={r['hgmma']} "
                  f"ldl/stl={r['local']}", flush=True)


if __name__ == "__main__":
    main()
