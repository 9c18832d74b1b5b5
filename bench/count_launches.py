"""Kernel launches of one decode step, per layer and per component, counted on CPU (no GPU needed).

    python bench/count_launches.py [--format fp8-mxfp4] [--batch 1] [--ops kernels|reference]

A random tiny model in a release layout (every layer kind: sliding, CSA, HCA; hash and top-k MoE;
BF16 activations) runs a short prefill, then one decode step (:meth:`Runner.decode_step`, the step
a CUDA graph captures) under ``torch.profiler``. Each block, and each component inside it, is
wrapped in a ``record_function`` region; a region's count is the number of *launching* ops in it:
aten ops with no aten op below them (what would become one GPU kernel each), leaving out the ones
that launch nothing (views, ``empty*``, ``detach``), plus one per Triton kernel launch.

``--ops kernels`` (default) registers every Triton kernel for the CPU and runs them in Triton's
interpreter (``TRITON_INTERPRET=1``; BF16 values come out wrong there, the launches do not), as
``dsv4`` does on a GPU. The counts do not depend on the geometry, so the model is the tiny one; a
cuBLAS matmul counts one (it may be two on a GPU: split-K with a separate reduction).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NO_LAUNCH = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::lift_fresh",
             "aten::resolve_conj", "aten::resolve_neg", "aten::_local_scalar_dense", "aten::item",
             "aten::set_", "aten::result_type", "aten::is_nonzero", "aten::size", "aten::stride", "aten::_unsafe_view",
             "aten::_reshape_alias", "aten::reshape", "aten::view_as", "aten::flatten", "aten::unflatten")

#: the components of a block, in order (the innermost region wins)
COMPONENTS = ("mhc_pre", "attention", "mhc_post", "router", "routed_experts", "shared_expert",
              "moe_glue", "other")


def _is_view(name: str) -> bool:
    import torch
    if not name.startswith("aten::"):
        return False
    packet = getattr(torch.ops.aten, name[6:], None)
    if packet is None:
        return False
    return any(getattr(packet, o).is_view for o in packet.overloads())


def _wrap(obj, meth: str, name: str) -> None:
    """Wrap ``obj.meth`` (an instance's attribute) in a ``record_function(name)`` region."""
    import torch
    orig = getattr(obj, meth)

    def fn(*a, **k):
        with torch.profiler.record_function(name):
            return orig(*a, **k)
    setattr(obj, meth, fn)


def _hooks(model) -> None:
    """Regions: each block (``layer:<kind>/<hash|topk>``) and its components (``mhc_pre`` includes the
    block's ``attn_norm`` / ``ffn_norm``: one op)."""
    for block in model.layers:
        moe = block.ffn
        _wrap(block, "forward", f"layer:{block.attn.kind}/{'hash' if moe.gate.is_hash else 'topk'}")
        for hc in (block.hc_attn, block.hc_ffn):
            for part in ("pre", "post"):
                if hasattr(hc, part):
                    _wrap(hc, part, f"c:mhc_{part}")
        _wrap(block.attn, "forward", "c:attention")
        _wrap(moe, "forward", "c:moe_glue")
        _wrap(moe.gate, "route", "c:router")
        _wrap(moe.experts, "forward", "c:routed_experts")
        if moe.shared_experts is not None:
            _wrap(moe.shared_experts, "forward", "c:shared_expert")


def count(prof, launches_of) -> dict:
    """{layer label: Counter{component: launches}} averaged over the layers of each label, and the
    kernels (Triton names, aten ops) per label."""
    out: dict[str, collections.Counter] = {}
    names: dict[str, collections.Counter] = {}
    n: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.name.startswith("layer:") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("layer:")):
            comp, kern = collections.Counter(), collections.Counter()
            _walk(e, "other", comp, kern, launches_of)
            label = e.name[6:]
            out.setdefault(label, collections.Counter()).update(comp)
            names.setdefault(label, collections.Counter()).update(kern)
            n[label] += 1
    return ({k: {c: v / n[k] for c, v in comp.items()} for k, comp in out.items()},
            {k: {c: v / n[k] for c, v in kern.items()} for k, kern in names.items()})


def _walk(e, comp: str, counter, kernels, launches_of) -> int:
    """Add ``e``'s launches to ``counter``; an op launches once unless something below it does."""
    if e.name.startswith("c:"):
        comp = e.name[2:]
    if e.name.startswith("triton::"):
        counter[comp] += 1
        kernels[f"{comp}: {e.name[8:]}"] += 1
        return 1
    below = sum(_walk(k, comp, counter, kernels, launches_of) for k in e.cpu_children)
    if below == 0 and launches_of(e.name):
        counter[comp] += 1
        kernels[f"{comp}: {e.name}"] += 1
        return 1
    return below


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="fp8-mxfp4", help="bf16, fp8-mxfp4 or fp8-nvfp4 (QAT simulation on unless bf16)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ops", default="kernels", choices=["kernels", "reference"])
    ap.add_argument("--list", action="store_true", help="also list every launch per layer kind")
    args = ap.parse_args()
    if args.ops == "kernels":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_num_threads(1)
    from dsv4.config import preset
    from dsv4.engine.runner import Runner
    from dsv4.random_weights import build_random_model
    from dsv4.testing import prefill

    config = preset("tiny", num_layers=4)
    model = build_random_model(config, args.format, "cpu")
    runner = Runner(model, max_num_seqs=args.batch, max_model_len=256, qat_sim=args.format != "bf16")
    for s in range(args.batch):
        prefill(runner, s, list(range(2, 2 + 9 + s)))     # on the reference: quick
    if args.ops == "kernels":
        _register_kernels()
    _hooks(model)
    cache: dict[str, int] = {}

    def launches_of(name: str) -> int:
        if name not in cache:
            cache[name] = 0 if (name in NO_LAUNCH or _is_view(name) or not name.startswith("aten::")) else 1
        return cache[name]

    slots = list(range(args.batch))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.decode_step(slots)
    table, kernels = count(prof, launches_of)
    kinds = sorted(table)
    print(f"launches per decode layer ({args.format}, batch {args.batch}, {args.ops} ops; "
          f"counted on CPU by bench/count_launches.py)")
    print(f"{'':<16}" + "".join(f"{k:>14}" for k in kinds))
    for c in COMPONENTS:
        if any(c in table[k] for k in kinds):
            print(f"{c:<16}" + "".join(f"{table[k].get(c, 0):>14.0f}" for k in kinds))
    mine = ("mhc_pre", "mhc_post", "router", "routed_experts", "shared_expert", "moe_glue")
    for name, sel in (("mHC + MoE side", lambda c: c in mine), ("total", lambda c: True)):
        print(f"{name:<16}" + "".join(f"{sum(v for c, v in table[k].items() if sel(c)):>14.0f}" for k in kinds))
    if args.list:
        for k in kinds:
            print(f"\n{k}:")
            for name, v in sorted(kernels[k].items(), key=lambda kv: COMPONENTS.index(kv[0].split(':')[0])):
                print(f"  {v:>3.0f}  {name}")


def _register_kernels() -> None:
    """Every Triton kernel registered for the CPU (interpreter), each launch a profiler region."""
    import torch
    from triton.runtime import interpreter

    from dsv4.ops import triton as kernels
    kernels.register_all("cpu")
    orig_call = interpreter.GridExecutor.__call__

    def call(self, *a, **k):
        with torch.profiler.record_function(f"triton::{self.fn.__name__}"):
            return orig_call(self, *a, **k)
    interpreter.GridExecutor.__call__ = call


if __name__ == "__main__":
    main()
