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
out, loops = {}, {}
for tokens in (1, 4, 8, 16):
    k = ptxas_regs.moe_kernels(tokens)
    out[tokens] = [ptxas_regs.registers(k[n]) for n in ("_w13_decode_kernel", "_w2_decode_kernel")]
    if tokens < 16:
        loops[tokens] = ptxas_regs.loop_ops(k["_w13_decode_kernel"])
print(json.dumps({"regs": out, "loops": loops}))
"""


@pytest.fixture(scope="module")
def decode_moe() -> dict:
    """Registers of the decode MoE kernels (Flash: MXFP4 experts, FP8 shared expert, act-quant) at
    1 / 4 / 8 / 16 tokens of top-6, compiled through ``moe_triton`` as it launches them, and the
    opcodes of the gate/up kernel's K loop at 1 / 4 / 8."""
    return _probe(_PROBE, ("ptxas", "cuobjdump", "nvdisasm"))


def _probe(code: str, tools: tuple[str, ...]) -> object:
    """Run ``code`` (it prints one JSON line last) in a subprocess without the interpreter flag;
    skipped without Triton or its bundled ``tools``."""
    if _TRITON is None:
        pytest.skip("triton is not installed (pip install triton)")
    for tool in tools:
        if not os.path.exists(os.path.join(os.path.dirname(_TRITON.origin), "backends", "nvidia", "bin", tool)):
            pytest.skip(f"Triton's bundled {tool} is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_decode_moe_registers_do_not_depend_on_the_batch(decode_moe):
    """The decode MoE kernels take the same registers whatever the tokens of top-6 (the same tiles,
    ``moe.CONFIGS["gemv"]``): at 1 and 4 tokens (the shared expert inside them), at 8 and 16 (without
    it, ``moe.SHARED_FUSED_MAX_TOKENS``). Ranking the step's ids over 64 lanes once gave them 155 /
    92 registers at 6-10 tokens against 80 / 91 at 4, and those batches' experts streamed ~45% slower
    on an H100 (``bench/ptxas_regs.py`` prints the whole table)."""
    regs = decode_moe["regs"]
    assert regs["4"] == regs["1"] and regs["16"] == regs["8"], regs
    assert max(regs["1"] + regs["8"]) <= 128, regs


def test_decode_moe_gemv_loads_both_weights_before_decoding(decode_moe):
    """The gate/up GEMV's K loop (``moe_experts._gemm``, ``BM == 1``) issues W1's and W3's bytes
    before it decodes either, and converts no tile through shared memory. Loaded where each weight
    is used, each K step waited for W1, then W3; when the loop still rounded its activation, loading
    the weights before the rounding gave their tiles a layout converted through shared memory every
    step (``LDSM``; 912 instructions a step at one token, not 388)."""
    for tokens, ops in decode_moe["loops"].items():
        wide = [i for i, op in enumerate(ops) if op == "LDG"]
        decode = ops.index("HADD2")                       # the first e2m1 -> fp32 conversion
        assert len([i for i in wide if i < decode]) >= 2, (tokens, ops)
        assert "LDSM" not in ops, (tokens, len(ops))


_HAZARD_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench import compile_sm90, ptxas_regs, wgmma_hazards
compile_sm90._install()
out = []
def report(where, name, kernel):
    usage = dict(p.split(":") for p in compile_sm90._usage(kernel.asm["cubin"]).split())
    out.append([where, name, wgmma_hazards.hazards(ptxas_regs.sass(kernel)), int(usage.get("STACK", -1))])
wgmma_hazards.production(report)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def production_kernels() -> list:
    """``[where, name, hazards, stack bytes]`` of each production variant of :func:`bench.wgmma_hazards.production`
    (compiled once for the tests below)."""
    return _probe(_HAZARD_PROBE, ("ptxas", "nvdisasm", "cuobjdump"))


def test_prefill_moe_kernels_do_not_spill(production_kernels):
    """The MXFP4 prefill MoE's GEMMs at Flash's shapes keep everything in registers: the gate/up
    kernel once held both 64-row weight tiles in each warpgroup and spilled (44.7 M local-memory
    requests at 8192 tokens, ncu, results/2026-11-28f/call3_moe.txt); its stacked form does not."""
    spills = [f"{where} {name}: {stack} bytes of stack" for where, name, _found, stack in production_kernels
              if where.startswith("moe flash") and stack != 0]
    assert not spills, spills


def test_no_register_race_on_an_in_flight_mma(production_kernels):
    """Triton 3.6 (with its ptxas 12.8) pipelines an MMA whose left operand is computed in registers
    (the MoE's decoded weight tiles, the GEMV's dequantized FP8 weights) with waits that leave MMAs in
    flight, and ptxas may give the next K step's values the same registers: the MMA then reads the
    next tile (a different garbage each call; results/2026-11-28e/pro_nan.txt). The variants the
    engine runs that way, compiled as a launch specializes them at Flash's and the tiny model's shapes: no write to a
    register that an in-flight MMA reads (``bench/wgmma_hazards.py``; the hazard walk itself is tested
    in ``test_wgmma_hazard_walk``)."""
    seen = production_kernels
    assert len(seen) == 14, seen
    races = [f"{where} {name}: {found[0]}" for where, name, found, _stack in seen if found]
    assert not races, races


def test_wgmma_hazard_walk():
    """The walk of :func:`bench.wgmma_hazards.hazards` on hand-written SASS: a register an in-flight
    HGMMA reads, written at the loop's top before the wait that retires it, is a race; written after
    that wait, or with every MMA retired at the back edge, it is not."""
    from bench.wgmma_hazards import hazards

    def loop(top: str, tail_wait: int) -> str:
        return "\n".join([
            ".L_x_0:",
            f"        /*0000*/                   {top} ;",
            "        /*0010*/                   HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR16], R24, gsb0 ;",
            "        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
            "        /*0030*/                   HGMMA.64x256x16.F32.BF16 R24, R156, gdesc[UR16], R24, gsb0 ;",
            f"        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, {tail_wait:#x} ;",
            "        /*0050*/               @P6 BRA `(.L_x_0) ;"])
    assert hazards(loop("MOV R157, R219", 1))           # R156..R159 read by the MMA still in flight
    assert hazards(loop("LDS.128 R156, [R1]", 1))
    assert not hazards(loop("MOV R157, R219", 0))       # every MMA retired at the back edge
    assert not hazards(loop("MOV R160, R219", 1))       # no MMA reads R160
    assert not hazards(loop("STS [R156], R3", 1))       # a store reads R156, writes nothing
