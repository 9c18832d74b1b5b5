"""Kernel launches of one decode step, per layer and per component, counted on CPU.

    python bench/count_launches.py [--qat] [--batch 1] [--fused]

A random model with every layer kind (sliding, CSA, HCA; hash and top-k MoE) runs a few prefill
tokens, then one batched decode step under ``torch.profiler``. Each block, and each component
inside it (mHC, norms, attention projections, compressor, indexer, attention core, MoE), is
wrapped in a ``record_function`` region; the count of a region is the number of *launching* ops
in it: aten ops with no aten op below them (what would become one GPU kernel each), leaving out
the ones that launch nothing (views, ``empty*``, ``detach``), plus one per Triton kernel launch.

``--fused`` registers every Triton kernel for the CPU (run through Triton's
interpreter, ``TRITON_INTERPRET=1``), which the model's fused decode ops then use; the other hot ops
(linear, MoE, attention, indexer scores) run their kernels too and count under their op's name.
Geometry does not change the counts (no op count depends on sizes), so the model is small (the tiny
one, with index heads of 32 dims so that the indexer kernel takes them, the attention's
projections and the shared expert in FP8 blocks and the routed experts in MXFP4, as released). ``--list`` shows each layer
kind's launches in order. Per-forward work (RoPE tables, visible counts) lands on the first layer
that asks for it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NO_LAUNCH = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::detach_", "aten::resize_", "aten::lift_fresh",
             "aten::resolve_conj", "aten::resolve_neg", "aten::_local_scalar_dense", "aten::item",
             "aten::set_", "aten::result_type", "aten::is_nonzero", "aten::size", "aten::stride", "aten::_unsafe_view",
             "aten::_reshape_alias", "aten::reshape", "aten::view_as", "aten::flatten", "aten::unflatten")


def _is_view(name: str) -> bool:
    import torch
    if not name.startswith("aten::"):
        return False
    packet = getattr(torch.ops.aten, name[6:], None)
    if packet is None:
        return False
    return any(getattr(packet, o).is_view for o in packet.overloads())


#: ops owned by other kernel areas (linear, MoE, attention, indexer): counted apart
BIG_OPS = ("linear", "linear_pair", "grouped_linear", "moe", "sparse_attention", "indexer_scores", "topk_indices")
#: model components, innermost wins
COMPONENTS = ("mhc_pre", "mhc_post", "q_path", "kv_path", "kv_store", "compressor", "indexer", "attn_out", "router",
              "other")


def _wrap(owner, meth, label) -> None:
    import inspect

    import torch
    static = isinstance(inspect.getattr_static(owner, meth), staticmethod)
    orig = getattr(owner, meth)

    def fn(*a, **k):
        name = label(a[0]) if callable(label) else label
        with torch.profiler.record_function(name):
            return orig(*a, **k)
    setattr(owner, meth, staticmethod(fn) if static else fn)


def _hooks() -> None:
    """Wrap blocks, their parts and the big ops in record_function regions."""
    from dsv4 import ops
    from dsv4.model import attention, compressor, indexer, mhc, moe, transformer  # noqa: F401

    _wrap(transformer.Block, "forward", lambda b: f"layer:{b.attn.kind}")
    _wrap(mhc.HyperConnection, "pre", "c:mhc_pre")
    _wrap(mhc.HyperConnection, "post", "c:mhc_post")
    _wrap(attention.Attention, "_store_window", "c:kv_store")
    _wrap(compressor.Compressor, "forward", "c:compressor")
    _wrap(compressor.Compressor, "decode_step_with", "c:compressor")
    _wrap(indexer.Indexer, "forward", "c:indexer")
    _wrap(moe.MoE, "forward", "c:router")       # the experts (routed and shared) are the moe op
    from dsv4.ops import fused
    for op in BIG_OPS:
        mod = fused if hasattr(fused, op) else ops      # the model looks them up there at each call
        if not hasattr(getattr(mod, op), "_counted"):
            _wrap(mod, op, f"op:{op}")
            getattr(mod, op)._counted = True


def count(prof, launches_of) -> tuple[dict, dict]:
    """({layer kind: Counter{label: launches}} averaged over the layers of each kind,
    {layer kind: [(label, launching op)] of its first layer, in order})."""
    out: dict[str, collections.Counter] = {}
    seq: dict[str, list] = {}
    n: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.name.startswith("layer:") and e.cpu_parent is None or e.name.startswith("layer:") and \
                not e.cpu_parent.name.startswith("layer:"):
            comp, order = collections.Counter(), []
            _walk(e, "other", None, comp, launches_of, order)
            out.setdefault(e.name[6:], collections.Counter()).update(comp)
            seq.setdefault(e.name[6:], order)
            n[e.name[6:]] += 1
    return {k: {c: v / n[k] for c, v in comp.items()} for k, comp in out.items()}, seq


def _walk(e, comp: str, big: str | None, counter, launches_of, order) -> int:
    """Add ``e``'s launches to ``counter`` (and ``(label, op)`` to ``order``); an op launches once
    unless something below it does."""
    if e.name.startswith("c:"):
        comp = e.name[2:]
    elif e.name.startswith("op:") and big is None:
        big = e.name[3:]
    label = big or comp
    if e.name.startswith("triton::"):
        counter[label] += 1
        order.append((label, e.name))
        return 1
    below = sum(_walk(k, comp, big, counter, launches_of, order) for k in sorted(e.cpu_children,
                                                                               key=lambda c: c.time_range.start))
    if below == 0 and launches_of(e.name):
        counter[label] += 1
        order.append((label, e.name))
        return 1
    return below


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qat", action="store_true", help="QAT simulation on (FP8 KV, FP4 indexer keys)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--fused", action="store_true", help="small-op Triton kernels (interpreter) + fused ops")
    ap.add_argument("--list", action="store_true", help="also list each layer kind's launches in order")
    args = ap.parse_args()
    if args.fused:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_num_threads(1)
    from dsv4.config import preset
    from dsv4.engine.runner import Runner
    from dsv4.testing import decode, prefill
    from dsv4.model.init import init_random
    from dsv4.model.transformer import Transformer

    # index heads of 32 dims: the smallest the indexer kernel takes (the tiny model's 16 run the reference)
    config = dataclasses.replace(preset("tiny", num_layers=4), index_head_dim=32)
    model = init_random(Transformer(config, torch.float32, with_mtp=False), seed=0).eval()
    _release_formats(model)
    runner = Runner(model, max_num_seqs=max(2, args.batch), max_model_len=256, qat_sim=args.qat)
    for s in range(args.batch):
        prefill(runner, s, list(range(2, 2 + 37 + s)))
    if args.fused:
        _use_fused(model)
    _hooks()
    cache: dict[str, int] = {}

    def launches_of(name: str) -> int:
        if name not in cache:
            cache[name] = 0 if (name in NO_LAUNCH or _is_view(name) or not name.startswith("aten::")) else 1
        return cache[name]

    ids = torch.arange(args.batch) + 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode(runner, list(range(args.batch)), ids)
    table, seq = count(prof, launches_of)
    if args.list:
        for kind, order in seq.items():
            print(f"{kind} layer, in launch order:")
            for label, name in order:
                print(f"    {label:<18} {name}")
    labels = sorted({c for comp in table.values() for c in comp}, key=lambda c: (c in BIG_OPS, c))
    print(f"launches per decode layer (batch {args.batch}, qat_sim={args.qat}, "
          f"{'fused small ops' if args.fused else 'reference ops'}); big ops of other areas last")
    print(f"{'':<22}" + "".join(f"{k:>9}" for k in table))
    for c in labels:
        print(f"{c:<22}" + "".join(f"{table[k].get(c, 0):>9.0f}" for k in table))
    for name, sel in (("small ops + glue", lambda c: c not in BIG_OPS), ("big ops", lambda c: c in BIG_OPS),
                      ("total", lambda c: True)):
        print(f"{name:<22}" + "".join(f"{sum(v for c, v in table[k].items() if sel(c)):>9.0f}" for k in table))


def _release_formats(model) -> None:
    """The attention's projections and the shared expert in FP8 blocks, the routed experts in MXFP4,
    as in the released checkpoints (plain weights run on the reference: a pair of them would count
    as two launches, the MoE as many; the BF16 precision floor stays)."""
    from dsv4.model.attention import Attention
    from dsv4.model.moe import MoE
    from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight
    for m in model.modules():
        if isinstance(m, Attention):
            for lin in (m.wq_a, m.wq_b, m.wkv, m.wo_a, m.wo_b, *([m.indexer.wq_b] if m.kind == "csa" else [])):
                lin.set_weight(Fp8BlockWeight.quantize(lin.weight.detach(), ue8m0=True))
        if isinstance(m, MoE):
            for lin in (m.experts.w1, m.experts.w2, m.experts.w3):
                lin.set_weight(Mxfp4Weight.quantize(lin.weight.detach()))
            for lin in (m.shared_experts.w1, m.shared_experts.w2, m.shared_experts.w3):
                lin.set_weight(Fp8BlockWeight.quantize(lin.weight.detach(), ue8m0=True))


def _use_fused(model) -> None:
    """Register the small-op kernels for the CPU (interpreter) and apply the model edits proposed
    in the kernel report as monkeypatches (skipped for any the model already has)."""
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
