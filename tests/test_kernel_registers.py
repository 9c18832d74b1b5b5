"""Kernel registers from ptxas, on any machine: Triton compiles for sm_90a without a GPU and its
bundled ptxas reports each kernel's registers, which set how many programs share an SM. A register
cliff at one batch size shows on an H100 only as that batch running slower, so it is checked here.

Compiled in a subprocess: the kernel tests of this suite run Triton's interpreter
(``TRITON_INTERPRET=1``, set at their import), under which a kernel cannot be compiled. This module
never imports triton itself: imported before that variable is set, it would make those tests'
kernels compile-mode functions that the interpreter cannot call.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_TRITON = importlib.util.find_spec("triton")

_PROBE = """
import json, sys
import triton.language as tl
sys.path.insert(0, sys.argv[1])
from bench import ptxas_regs
from dsv4.ops.triton.moe_decode import _w13_decode_kernel, _w2_decode_kernel
common = dict(D=4096, I=2048, KTOP=6, FMT=2, BM=1, BK=256, XDT=tl.bfloat16, CDT=tl.bfloat16, QDOT=False,
              SHARED=True, FMT_S=1, I_S=2048, BK_S=128, AQ=True, POW2=True, PIPE=1)
out = {}
for tokens, pp in ((1, 8), (8, 64)):
    ints = ptxas_regs.moe_ints(tokens)
    w13 = ptxas_regs.ptxas_info(_w13_decode_kernel, dict(common, BN=16, PP=pp, ZB=1, HAS_LIMIT=True), ints=ints)
    w2 = ptxas_regs.ptxas_info(_w2_decode_kernel, dict(common, BN=32, PP=pp, KP2=8), ints=ints)
    out[pp] = [int(w.split("Used ")[-1].split()[0]) for w in (w13, w2)]
print(json.dumps({"ptxas": ptxas_regs.PTXAS, "regs": out}))
"""


def test_decode_moe_registers_do_not_depend_on_the_batch():
    """The decode MoE kernels (Flash: MXFP4 experts, FP8 shared expert, act-quant) take the same
    registers for 1 and for 8 tokens of top-6. Ranking the step's ids over 64 lanes once gave them
    155 / 160 registers instead of 64 / 76 at 6-10 tokens (compiled as a launch
    specializes: aligned pointers, integer arguments by value), and those batches' experts streamed ~45%
    slower on an H100 (``bench/ptxas_regs.py`` prints the whole table)."""
    if _TRITON is None:
        pytest.skip("triton is not installed (pip install triton)")
    ptxas = os.path.join(os.path.dirname(_TRITON.origin), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    regs = json.loads(done.stdout.strip().splitlines()[-1])["regs"]
    assert regs["8"] == regs["64"], regs
    assert max(regs["8"]) <= 128, regs
