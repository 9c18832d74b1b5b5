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
sys.path.insert(0, sys.argv[1])
from bench import compile_sm90, ptxas_regs
compile_sm90._install()
out = {}
for tokens in (4, 8):
    k = ptxas_regs.moe_kernels(tokens)
    out[tokens] = [ptxas_regs.registers(k[n]) for n in ("_w13_decode_kernel", "_w2_decode_kernel")]
print(json.dumps({"regs": out}))
"""


def test_decode_moe_registers_do_not_depend_on_the_batch():
    """The decode MoE kernels (Flash: MXFP4 experts, FP8 shared expert, act-quant), compiled through
    ``moe_triton`` as it launches them, take the same registers for 4 and for 8 tokens of top-6.
    Ranking the step's ids over 64 lanes once gave them 155 / 92 registers at 6-10 tokens against
    80 / 91 at 4, and those batches' experts streamed ~45% slower on an H100 (``bench/ptxas_regs.py``
    prints the whole table)."""
    if _TRITON is None:
        pytest.skip("triton is not installed (pip install triton)")
    for tool in ("ptxas", "cuobjdump"):
        if not os.path.exists(os.path.join(os.path.dirname(_TRITON.origin), "backends", "nvidia", "bin", tool)):
            pytest.skip(f"Triton's bundled {tool} is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    regs = json.loads(done.stdout.strip().splitlines()[-1])["regs"]
    assert regs["8"] == regs["4"], regs
    assert max(regs["8"]) <= 128, regs
