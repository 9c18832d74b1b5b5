"""Which kernel moves the logits: the parity model's prefill + decode in fp32 on one device, with
the reference ops, with every kernel, and with one kernel at a time; max |logit difference| over
the run relative to the largest logit, against the reference ops on the same device.

    python bench/kernel_drift.py [--steps 40] [--device cuda]

Each kernel is tested against its reference alone (``tests/test_triton_*.py``); this finds the one
whose GPU numerics (operation order, fused multiply-adds, approximate exp/rsqrt) grow over many
decode steps. fp32 rounding alone stays near 1e-6.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import parity_config, random_model  # noqa: E402
from dsv4 import ops  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.testing import decode, prefill  # noqa: E402
from dsv4.ops import triton as kernels  # noqa: E402


def logits(model, prompts, steps: int) -> torch.Tensor:
    runner = Runner(model, max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + steps + 8)
    out = []
    with torch.inference_mode():
        for s, p in enumerate(prompts):
            out.append([prefill(runner, s, p)])
        g = torch.Generator().manual_seed(7)
        for _ in range(steps):
            ids = torch.randint(2, model.config.vocab_size, (len(prompts),), generator=g)
            row = decode(runner, list(range(len(prompts))), ids)
            for s in range(len(prompts)):
                out[s].append(row[s])
    return torch.stack([torch.stack(o) for o in out]).float().cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    model = random_model(parity_config(), torch.float32, seed=5).to(dev)
    model.init_rope(dev)
    g = torch.Generator().manual_seed(105)
    prompts = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (37, 11)]

    registered = kernels.register_all(dev.type)
    ops._CUDA_KERNELS_LOADED = True      # the dispatch must not register them again on the first CUDA op
    table = {k: v for k, v in ops._KERNELS.items() if k[1] == dev.type}
    for k in table:
        ops._KERNELS.pop(k)
    ref = logits(model, prompts, args.steps)
    scale = ref.abs().max().item()

    def run(keys) -> str:
        for k in keys:
            ops._KERNELS[k] = table[k]
        try:
            got = logits(model, prompts, args.steps)
        finally:
            for k in keys:
                ops._KERNELS.pop(k, None)
        err = (got - ref).abs().amax(-1) / scale            # [prompts, steps + 1]
        off = (err > 1e-4).nonzero()
        first = "none" if not len(off) else f"prompt {off[0, 0].item()} step {off[0, 1].item()}"
        return f"{err.max().item():.2e}  median {err.median().item():.1e}  first row > 1e-4: {first}"

    print(f"{dev}: {len(registered)} kernels; parity model, prompts 37 and 11 tokens, {args.steps} decode steps, fp32")
    print(f"{'reference again':<24} {run([])}")      # run-to-run noise of the reference ops themselves
    print(f"{'all kernels':<24} {run(list(table))}")
    for key in table:
        print(f"{key[0]:<24} {run([key])}", flush=True)


if __name__ == "__main__":
    main()
