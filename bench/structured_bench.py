"""Decode speed with a share of the batch constrained by a JSON schema, one run on one device (issue 26).

    python bench/structured_bench.py [--preset flash] [--layers 4] [--format fp8-mxfp4] [--batch 32]
                                     [--share 0 0.5 1] [--tokens 128] [--context 256] [--device cuda|cpu]

Random weights made on the device (``dsv4.random_weights``) and the tiny DSV4 tokenizer padded
to the preset's vocabulary (129,280 ids for Flash: the grammar's masks have the real width). A batch of
``--batch`` seeded sampling requests decodes ``--tokens`` tokens each through the engine; a share of
them (0, 50%, 100%) must write JSON matching a schema (an object holding an array of objects), so
every step computes those rows' masks on the host (llguidance) and the sampler applies them on the
device. The engine's own step loop runs: a step with a constrained row launches its forward, then
collects the previous step and stages the masks while the device runs it, then launches the sampler.
On a GPU every step is a CUDA graph replay (the one-graph step without the mask, and the forward and
sampler graphs of a constrained step, captured before timing); the CPU runs fp32 eager (the tiny
preset runs in seconds: the test suite runs it). Prints decode tokens/s per share, the ratio to the
unconstrained batch (target: >= 0.95 at 100%), and the distinct token ids per step: with the default
4-layer slice, 3 layers route by token id (hash layers), so a step whose rows write few distinct
tokens (JSON punctuation; EOS over and over once a constrained answer is closed, as the requests
ignore EOS to keep the batch full) reads fewer experts and runs faster on the device.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.config import preset  # noqa: E402
from dsv4.engine.core import Engine  # noqa: E402
from dsv4.engine.grammar import StructuredOutputsParams  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SampleFlags, SamplingParams  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402
from dsv4.text.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402
from dsv4.text.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "score": {"type": "number"}},
    "required": ["name", "score"]}}}, "required": ["items"]}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(engine: Engine, prompts: list[list[int]], constrained: int, tokens: int, device: str) -> tuple[float, float]:
    """Decode tokens/s of one batch whose first ``constrained`` requests follow the schema, and the
    mean number of distinct token ids a step returned."""
    spec = StructuredOutputsParams(json=SCHEMA)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                                             structured_outputs=spec if i < constrained else None))
    engine.step()                                   # the prefill step (and every first token)
    sync(device)
    t0 = time.perf_counter()
    n, distinct, steps = 0, 0, 0
    while engine.has_unfinished:
        ids = [t for o in engine.step() for t in o.new_token_ids]
        n, distinct, steps = n + len(ids), distinct + len(set(ids)), steps + bool(ids)
    sync(device)
    return n / (time.perf_counter() - t0), distinct / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4", choices=["bf16", "fp8-mxfp4", "fp8-nvfp4"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--share", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--context", type=int, default=256, help="prompt length")
    ap.add_argument("--repeat", type=int, default=2, help="rounds over the shares (the best of each is kept)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    graphs = cuda and not args.eager
    dtype = torch.bfloat16 if cuda else torch.float32
    qat = cuda and args.format != "bf16"
    config = preset(args.preset, num_layers=args.layers)
    model = build_random_model(config, args.format, args.device, dtype=dtype)
    V = config.vocab_size
    tokenizer = Tokenizer.from_dir(write_tiny_tokenizer(tempfile.mkdtemp(prefix="dsv4-struct-"), V, pad=V > 600))
    runner = Runner(model, max_num_seqs=args.batch, max_model_len=args.context + args.tokens + 8, qat_sim=qat,
                    max_num_batched_tokens=args.context * args.batch + args.batch)
    if graphs:
        runner.capture([SampleFlags(all_greedy=False), SampleFlags(all_greedy=False, grammar=True)],
                       buckets=[args.batch], progress=False)
    engine = Engine(runner, tokenizer, tokenizer.eos_id)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(300, V, (args.context,), generator=gen).tolist() for _ in range(args.batch)]
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# structured_bench: {args.preset} x{args.layers} {args.format} {str(dtype).removeprefix('torch.')} "
          f"qat={'on' if qat else 'off'} on {name}, {'CUDA graphs' if graphs else 'eager'}; batch {args.batch}, "
          f"{args.tokens} tokens a request after a {args.context}-token prompt, vocab {V}, JSON schema {SCHEMA}")
    run(engine, prompts, args.batch, min(args.tokens, 8), args.device)      # warm: grammar tokenizer, kernels
    best: dict[float, tuple[float, float]] = {}
    for _ in range(args.repeat):
        for share in args.share:
            rate = run(engine, prompts, round(share * args.batch), args.tokens, args.device)
            best[share] = max(best.get(share, (0.0, 0.0)), rate)
    print(f"{'constrained':>12} {'tok/s':>9} {'vs 0%':>7} {'distinct ids/step':>18}")
    base = (best.get(0.0) or best[args.share[0]])[0]
    for share in args.share:
        rate, distinct = best[share]
        print(f"{f'{round(share * args.batch)}/{args.batch}':>12} {rate:>9.1f} {rate / base:>6.3f}x {distinct:>18.1f}")


if __name__ == "__main__":
    main()
