"""Silent-corruption hunt on the GPU: every op of many step shapes, run on poisoned memory.

    python bench/nan_hunt.py [--layers 4] [--dtype fp32 bf16-qat] [--lengths 1 2 ... ] [--batches 1 ... 32]

A kernel that reads memory it does not own (past a tensor's end, a workspace element nobody
wrote) usually finds finite values on the GPU, so its result is silently wrong; it shows only when
that memory holds NaN. Here every allocation starts as NaN: PyTorch's deterministic mode fills
``torch.empty`` (and ``runtime.empty``) with NaN, and the caching allocator's pools are filled with
NaN before the model runs, so gaps between buffers hold NaN too. Then, on a random model with every
layer kind (``--layers 4``: sliding, CSA, HCA), one prompt chunk of each of ``--lengths`` tokens
on a fresh slot, and decode steps of each of ``--batches`` rows; every dispatched op's outputs are
checked, and an op that makes non-finite values from finite inputs is reported with the step's shape
(the split and tile arithmetic of the kernels depends on the token count and the SM count, which
the interpreter tests on CPU cannot cover at real shapes; this is how a read past the last token's
mHC weights at 129 tokens was found). Exits 1 if any op is reported.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dsv4.ops as ops_mod  # noqa: E402
import dsv4.ops.fused as fused_mod  # noqa: E402
from dsv4.config import preset  # noqa: E402
from dsv4.engine.batch import NewSequence, Row, ScheduledBatch  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.ops.triton import runtime  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402

DEFAULT_LENGTHS = list(range(1, 41)) + [47, 63, 64, 65, 95, 127, 128, 129, 131, 143, 160, 161, 191, 255, 256, 257,
                                        300, 383, 511, 513, 640, 1000, 1023, 1025, 2049, 4097]


def _tensors(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


def _bad(t: torch.Tensor) -> bool:
    # NaN only: -inf is how masked scores are written (the indexer's, the attention's)
    return t.is_floating_point() and t.numel() > 0 and bool(torch.isnan(t.float()).any())


class Tracer:
    """Wraps the op dispatch: after each op, its float outputs are checked; inputs without NaN and
    an output with NaN are a finding (the op and the argument shapes)."""

    def __init__(self):
        self.findings: list[str] = []
        self.where = ""
        self._orig = ops_mod._call

    def __call__(self, op, device, fmt, *args):
        out = self._orig(op, device, fmt, *args)
        if any(_bad(t) for t in _tensors(out)) and not any(_bad(t) for a in args for t in _tensors(a)):
            shapes = [tuple(a.shape) if torch.is_tensor(a) else type(a).__name__ for a in args[:6]]
            self.findings.append(f"{self.where}: {op} {shapes}")
            print(f"  FOUND {self.findings[-1]}", flush=True)
        return out

    def install(self) -> None:
        ops_mod._call = fused_mod._call = self


def poison_pools(device: torch.device) -> None:
    """Fill the caching allocator's large and small pools with NaN and hand them back to it."""
    free, _ = torch.cuda.mem_get_info(device)
    big = torch.full((int(free * 0.5) // 4,), float("nan"), device=device)
    small = [torch.full((256 << 10,), float("nan"), device=device) for _ in range(256)]   # 1 MiB each
    del big, small


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--dtype", nargs="*", default=["fp32", "bf16-qat"])
    ap.add_argument("--lengths", type=int, nargs="*", default=DEFAULT_LENGTHS)
    ap.add_argument("--batches", type=int, nargs="*", default=list(range(1, 33)))
    ap.add_argument("--device", default="cuda", help="cpu: a quick run of the script itself (--preset tiny)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    dev = torch.device(args.device)
    tracer = Tracer()
    tracer.install()
    config = preset(args.preset, num_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(2, config.vocab_size, (n,), generator=g).tolist())   # noqa: E731
    greedy = SamplingParams(temperature=0.0)
    for dtype in args.dtype:
        qat = dtype == "bf16-qat"
        model = build_random_model(config, args.format, dev, dtype=torch.bfloat16 if qat else torch.float32)
        n_slots = max(args.batches)
        longest = max(args.lengths)
        runner = Runner(model, max_num_seqs=n_slots, max_model_len=longest + 64, qat_sim=qat,
                        max_num_batched_tokens=max(longest, n_slots))
        if dev.type == "cuda":
            poison_pools(dev)
        with runtime.poisoned():
            for i, n in enumerate(args.lengths):
                if i % 10 == 0:
                    print(f"{dtype}: prompts of {n} tokens and on ({len(tracer.findings)} findings)", flush=True)
                tracer.where = f"{dtype} prompt of {n} tokens"
                p = ids(n)
                runner.run(ScheduledBatch((Row(0, 0, p, new=NewSequence(greedy, p)),)))
            # decode steps of B rows: each slot first gets a short prompt (lengths differ per slot)
            length = [5 + 7 * s for s in range(n_slots)]
            runner.run(ScheduledBatch(tuple(Row(s, 0, p, new=NewSequence(greedy, p))
                                            for s in range(n_slots) for p in [ids(length[s])])))
            for B in args.batches:
                tracer.where = f"{dtype} decode step of {B} rows"
                runner.run(ScheduledBatch(tuple(Row(s, length[s]) for s in range(B))))
                for s in range(B):
                    length[s] += 1
        print(f"{dtype}: {len(args.lengths)} prompt lengths, {len(args.batches)} decode batch sizes; "
              f"findings so far {len(tracer.findings)}", flush=True)
        del runner, model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{len(tracer.findings)} findings" + "".join(f"\n  {f}" for f in tracer.findings))
    sys.exit(1 if tracer.findings else 0)


if __name__ == "__main__":
    main()
