"""`dsv4 serve` on a random-weight slice of a real geometry (no checkpoint needed), for
`dsv4 bench serve` on a GPU:

    python bench/serve_random.py --preset flash --layers 4 --format fp8-mxfp4 --max-num-seqs 64 \
        --max-model-len 4096 --port 8000 &
    dsv4 bench serve --base-url http://127.0.0.1:8000 -n 512 --concurrency 64 --input-len 512 --output-len 128

The weights are made on the device in the release layout (``dsv4.random_weights``), the
state and CUDA graphs as ``LLM`` makes them, and the tokenizer is the tiny byte-level one sized to
the geometry's vocabulary (the benchmark sends token-id prompts). Everything after that is the
real server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.config import preset  # noqa: E402
from dsv4.engine.core import Engine  # noqa: E402
from dsv4.engine.limits import prefix_cache_budget  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.random_weights import LAYOUTS, build_random_model  # noqa: E402
from dsv4.serve.cli import _listen  # noqa: E402
from dsv4.serve.server import run_server  # noqa: E402
from dsv4.text.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402
from dsv4.text.tokenizer import Tokenizer  # noqa: E402


def runner_device(model) -> torch.device:
    return model.embed.weight.device


def load(args) -> SimpleNamespace:
    """What the server needs of an ``LLM``: engine, tokenizer, limits."""
    t0 = time.perf_counter()
    config = preset(args.preset, num_layers=args.layers)
    model = build_random_model(config, args.format, args.device)
    qat = args.format != "bf16"
    cache = prefix_cache_budget(args.enable_prefix_caching, args.prefix_cache_gib, runner_device(model), 0.9)
    runner = Runner(model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, qat_sim=qat,
                    max_num_batched_tokens=args.max_num_batched_tokens, prefix_cache_bytes=cache)
    print(f"prefix cache: {cache / 2**30:.2f} GiB" if cache else "prefix caching off", file=sys.stderr)
    if runner.device.type == "cuda":
        runner.precompile(graphs=not args.enforce_eager)    # as LLM does: the start-up's kernels side by side
    if runner.device.type == "cuda" and not args.enforce_eager:
        runner.capture()
    if runner.device.type == "cuda":
        runner.warm_up()      # as LLM does: no Triton compile while serving
    tok_dir = Path(tempfile.mkdtemp(prefix="dsv4-random-tok-"))
    tokenizer = Tokenizer.from_dir(write_tiny_tokenizer(tok_dir, config.vocab_size, pad=True))
    engine = Engine(runner, tokenizer, config.eos_token_id)
    print(f"random {args.preset} x{args.layers} {args.format} on {runner.device} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return SimpleNamespace(engine=engine, tokenizer=tokenizer, max_model_len=args.max_model_len,
                           max_num_seqs=args.max_num_seqs, path=f"random:{args.preset}x{args.layers}:{args.format}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--format", default="fp8-mxfp4", choices=LAYOUTS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prefix-cache-gib", type=float, default=None,
                   help="default: 10%% of 0.9 of the GPU's memory (as dsv4 serve), 1 GiB on the CPU")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    args = p.parse_args()
    name = args.served_model_name or f"{args.preset}-x{args.layers}-{args.format}"
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    return run_server(lambda: load(args), model_names=[name], host=host, port=port, sock=sock)


if __name__ == "__main__":
    sys.exit(main())
