"""Kernel launches of one step, per layer and per component, counted on CPU.

    python bench/count_launches.py [--qat] [--batch 1] [--fused] [--verify K | --prefill N]

A random model with every layer kind (sliding, CSA, HCA; hash and top-k MoE) runs a few prefill
tokens, then one step under ``torch.profiler``: by default the decode step a CUDA graph captures
(``Runner._step``, ``--batch`` rows of one token); ``--verify K`` the speculative verify step a
verify graph captures (``Runner._verify_step``: ``--batch`` rows of 1 + K tokens, n-gram drafts,
with the state saves, the acceptance and the rollback); ``--prefill N`` one prompt chunk of ``N``
tokens through ``Runner.run`` (the varlen forward of an engine step). Each block, and each component
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
kind's launches in order. The counted step is the second (the first allocates what kernels make on
first use, as the runner's warm-up before a capture does). Per-forward work (the ring rows of the
decode step's window store) lands on the first layer that asks for it. Launches outside the layers
(embedding, context, head, sampler, verify, state saves and rollback) are counted per step in a
second table; the saves and rollbacks are also split by layer kind. ``--ops`` lists the launching
ops of each component, summed over the layers.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NO_LAUNCH = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::detach_", "aten::resize_", "aten::new_empty",
             "aten::lift_fresh", "aten::scalar_tensor",
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
COMPONENTS = ("mhc_pre", "mhc_post", "mhc_post_pre", "q_path", "kv_path", "kv_store", "compressor", "indexer",
              "attn_out", "router", "other")


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


def _cache_kind(cache) -> str:
    return "csa" if cache.indexer is not None else "hca" if cache.compressor is not None else "sliding"


def _hooks() -> None:
    """Wrap blocks, their parts and the big ops in record_function regions."""
    from dsv4 import ops
    from dsv4.engine import runner, sampling
    from dsv4.model import attention, cache, common, compressor, indexer, mhc, moe, transformer  # noqa: F401

    _wrap(transformer.Block, "run", lambda b: f"layer:{b.attn.kind}")
    # per step (outside the layers)
    _wrap(transformer.Transformer, "context", "s:context")
    _wrap(transformer.Transformer, "logits", "s:head")
    # what the layers leave: the embedding, and the last block's mHC post (the others run in the next
    # block's first pre)
    _wrap(transformer.Transformer, "hidden_streams", "s:embed")
    _wrap(common.ForwardContext, "varlen", "s:context")
    _wrap(sampling.SlotSampling, "sample", "s:sampler")
    _wrap(runner, "verify_tokens", "s:verify (acceptance)")
    _wrap(cache.LayerCache, "save", lambda c: f"state:save:{_cache_kind(c)}")
    _wrap(cache.LayerCache, "rollback", lambda c: f"state:rollback:{_cache_kind(c)}")
    _wrap(mhc.HyperConnection, "pre", "c:mhc_pre")
    _wrap(mhc.HyperConnection, "post", "c:mhc_post")
    _wrap(mhc.HyperConnection, "post_pre", "c:mhc_post_pre")
    _wrap(attention.Attention, "_store_window", "c:kv_store")
    _wrap(compressor.Compressor, "forward", "c:compressor")
    _wrap(compressor.Compressor, "decode_step", "c:compressor")
    _wrap(compressor.Compressor, "decode_step_with", "c:compressor")
    _wrap(indexer.Indexer, "forward", "c:indexer")
    _wrap(moe.MoE, "forward", "c:router")       # the experts (routed and shared) are the moe op
    from dsv4.ops import fused
    for op in BIG_OPS:
        mod = fused if hasattr(fused, op) else ops      # the model looks them up there at each call
        if not hasattr(getattr(mod, op), "_counted"):
            _wrap(mod, op, f"op:{op}")
            getattr(mod, op)._counted = True


@functools.lru_cache(maxsize=None)
def launches_of(name: str) -> int:
    """1 if the profiler op ``name`` launches a kernel when nothing below it does (an aten op that
    is no view and not in :data:`NO_LAUNCH`), else 0."""
    return 0 if (name in NO_LAUNCH or _is_view(name) or not name.startswith("aten::")) else 1


def hook_gpu_triton() -> None:
    """Each Triton kernel launched on a GPU as a ``triton::<name>`` profiler region (what
    :func:`_use_fused` does for the interpreter), so :func:`count` counts it."""
    import torch
    from triton.runtime.jit import JITFunction
    if getattr(JITFunction.run, "_counted", False):
        return
    orig = JITFunction.run

    def run(self, *a, **k):
        with torch.profiler.record_function(f"triton::{self.fn.__name__}"):
            return orig(self, *a, **k)
    run._counted = True
    JITFunction.run = run


def count(prof, launches_of=launches_of) -> tuple[dict, dict, collections.Counter]:
    """``(layers, state, step)``: ``{layer kind: {label: launches}}`` averaged over the layers of
    each kind; ``{"save"/"rollback": {layer kind: launches}}`` likewise; the step's other launches
    by label."""
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    n: collections.Counter = collections.Counter()
    tops = sorted((e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start)
    for e in tops:
        _walk(e, "step", "other", None, per, n, launches_of)
    layers = {k[6:]: {c: v / n[k] for c, v in comp.items()} for k, comp in per.items() if k.startswith("layer:")}
    state: dict[str, dict[str, float]] = {}
    for k, comp in per.items():
        if k.startswith("state:"):
            _, what, kind = k.split(":")
            state.setdefault(what, {})[kind] = sum(comp.values()) / n[k]
    return layers, state, per["step"]


def _walk(e, scope: str, comp: str, big: str | None, per, n, launches_of) -> int:
    """Add ``e``'s launches to ``per[scope]``; an op launches once unless something below it does."""
    if e.name.startswith(("layer:", "state:")) and not scope.startswith(("layer:", "state:")):
        scope, comp, big = e.name, "other", None
        n[scope] += 1
        _CURRENT[0] = id(e)
    elif e.name.startswith("c:") or e.name.startswith("s:") and scope == "step":
        comp = e.name[2:]
    elif e.name.startswith("op:") and big is None:
        big = e.name[3:]
    label = big or comp
    if e.name.startswith("triton::") or not e.cpu_children and launches_of(e.name):
        _add(e, scope, label, per)
        return 1
    below = sum(_walk(k, scope, comp, big, per, n, launches_of)
                for k in sorted(e.cpu_children, key=lambda c: c.time_range.start))
    if below == 0 and launches_of(e.name):
        _add(e, scope, label, per)
        return 1
    return below


#: ``--ops``: launching op names per (scope, label), summed over the layers
OPS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
#: ``--list``: the launches of the first layer of each kind, in order ``{scope: [(label, op)]}``
ORDER: dict[str, list] = {}
_FIRST: dict[str, int] = {}


def _add(e, scope: str, label: str, per) -> None:
    per[scope][label] += 1
    OPS[scope.split(":")[0] + ":" + label][e.name] += 1
    if scope.startswith("layer:") and _FIRST.setdefault(scope, _CURRENT[0]) == _CURRENT[0]:
        ORDER.setdefault(scope, []).append((label, e.name))


_CURRENT = [0]     # the layer region being walked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qat", action="store_true", help="QAT simulation on (FP8 KV, FP4 indexer keys)")
    ap.add_argument("--batch", type=int, default=1, help="rows of the decode or verify step")
    ap.add_argument("--fused", action="store_true", help="small-op Triton kernels (interpreter) + fused ops")
    ap.add_argument("--list", action="store_true", help="also list each layer kind's launches in order")
    ap.add_argument("--ops", action="store_true", help="also list the launching ops of each component")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--verify", type=int, metavar="K", help="a verify step of 1 + K tokens per row")
    what.add_argument("--prefill", type=int, metavar="N", help="one prompt chunk of N tokens")
    args = ap.parse_args()
    if args.fused:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_num_threads(1)
    from dsv4.config import preset
    from dsv4.engine.batch import Row, ScheduledBatch
    from dsv4.engine.runner import Runner
    from dsv4.engine.sampling import SampleFlags
    from dsv4.testing import prefill
    from dsv4.model.init import init_random
    from dsv4.model.transformer import Transformer

    # index heads of 32 dims: the smallest the indexer kernel takes (the tiny model's 16 run the reference)
    config = dataclasses.replace(preset("tiny", num_layers=4), index_head_dim=32)
    model = init_random(Transformer(config, torch.float32, with_mtp=False), seed=0).eval()
    _release_formats(model)
    spec = {"method": "ngram", "num_speculative_tokens": args.verify} if args.verify else None
    # slots: the --batch rows, then --prefill's chunk and its warm-up's
    runner = Runner(model, max_num_seqs=args.batch + 2, max_model_len=256 + (args.prefill or 0),
                    qat_sim=args.qat, max_num_batched_tokens=max(512, args.prefill or 0), speculative=spec)
    for s in range(args.batch):
        prefill(runner, s, list(range(2, 2 + 37 + s)))
    if args.fused:
        _use_fused(model)
    _hooks()

    idx = torch.arange(args.batch)
    warm = None
    bound = runner.max_model_len
    if args.verify:
        step = f"verify step ({args.batch} rows x {1 + args.verify} tokens, Runner._verify_step)"
        drafts = torch.full((args.batch, args.verify), 7)
        run = lambda: runner._verify_step(idx, drafts, SampleFlags(), bound)    # noqa: E731
    elif args.prefill:
        step = f"prefill chunk ({args.prefill} tokens, Runner.run)"
        prompt = tuple(3 + i % (config.vocab_size - 3) for i in range(args.prefill))
        run = lambda: runner.run(ScheduledBatch((Row(args.batch, 0, prompt, sample=True),)))   # noqa: E731
        warm = lambda: runner.run(ScheduledBatch((Row(args.batch + 1, 0, prompt, sample=True),)))  # noqa: E731
    else:
        step = f"decode step ({args.batch} rows, Runner._step)"
        run = lambda: runner._step(idx, SampleFlags(), bound)                   # noqa: E731
    # the step once unprofiled first, as the runner does before it captures a graph: what a kernel
    # allocates on its first call (its arrival counters, zero-filled) is part of no later step
    with torch.inference_mode():
        (warm or run)()
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    layers, state, rest = count(prof, launches_of)
    if args.list:
        for kind, order in ORDER.items():
            print(f"{kind[6:]} layer, in launch order:")
            for label, name in order:
                print(f"    {label:<18} {name}")
    print(f"# {step}, qat_sim={args.qat}, {'fused small ops' if args.fused else 'reference ops'}")
    print("launches per layer; big ops of other areas last")
    labels = sorted({c for comp in layers.values() for c in comp}, key=lambda c: (c in BIG_OPS, c))
    print(f"{'':<22}" + "".join(f"{k:>9}" for k in layers))
    for c in labels:
        print(f"{c:<22}" + "".join(f"{layers[k].get(c, 0):>9.0f}" for k in layers))
    for name, sel in (("small ops + glue", lambda c: c not in BIG_OPS), ("big ops", lambda c: c in BIG_OPS),
                      ("total", lambda c: True)):
        print(f"{name:<22}" + "".join(f"{sum(v for c, v in layers[k].items() if sel(c)):>9.0f}" for k in layers))
    for what, kinds in state.items():
        print(f"{'state ' + what:<22}" + "".join(f"{kinds.get(k, 0):>9.0f}" for k in layers))
    n_layers = collections.Counter(b.attn.kind for b in model.layers)
    in_layers = sum(n_layers[k] * sum(v.values()) for k, v in layers.items())
    in_state = sum(n_layers[k] * v for kinds in state.values() for k, v in kinds.items())
    print("launches per step outside the layers")
    for c, v in sorted(rest.items()):
        print(f"{c:<22}{v:>9.0f}")
    total = in_layers + in_state + sum(rest.values())
    print(f"{'step total':<22}{total:>9.0f}   ({len(model.layers)} layers: "
          f"{', '.join(f'{v} {k}' for k, v in n_layers.items())})")
    if args.ops:
        for where, names in sorted(OPS.items()):
            print(f"\n{where} (all layers): " + ", ".join(f"{k.removeprefix('aten::')} x{v}"
                                                        for k, v in names.most_common()))


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
