"""``dsv4 quantize`` and ``dsv4 eval-quant``: write a quantized checkpoint, measure what it costs.

``add_parsers`` adds both sub-commands to the ``dsv4`` parser; :data:`HANDLERS` maps each command
name to its handler. Handlers raise the project's errors (``QuantizeError``, ``ConfigError``,
``CheckpointError``, ``UsageError``) for user errors; the ``dsv4`` entry point prints those on one
line, exit 2. Both take their source model like every command (``--model``, default the tiny
model) or as the positional ``SRC`` they always took.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .cli_common import HelpFormatter, add_device_arg, add_model_arg, add_threads_arg, pick_model, positive_int
from .errors import UsageError
from .weights.quant_options import DENSE_FORMATS, FORMATS, POLICIES, SCALE_FMTS

__all__ = ["add_parsers", "cmd_quantize", "cmd_eval_quant", "HANDLERS"]

QUANTIZE_USAGE = "dsv4 quantize [options] [SRC] DST --format {nvfp4,mxfp4,fp8}"


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add ``quantize`` and ``eval-quant`` to the sub-command set of the ``dsv4`` parser."""
    q = subparsers.add_parser("quantize", help="write a quantized copy of a BF16/FP8 checkpoint",
                              usage=QUANTIZE_USAGE, formatter_class=HelpFormatter)
    q.add_argument("paths", nargs="+", metavar="[SRC] DST",
                   help="source checkpoint (or --model; default: the tiny model) and the new directory "
                        "DST: written atomically, never over a directory dsv4 did not write")
    add_model_arg(q)
    q.add_argument("--format", required=True, choices=FORMATS, help="format of the routed experts")
    q.add_argument("--policy", default="floor", choices=POLICIES,
                   help="floor: keep head, router, compressor/indexer helpers, MTP projections as in the "
                        "source; all: quantize every 2-D linear weight")
    q.add_argument("--dense-format", default="fp8", choices=DENSE_FORMATS,
                   help="format of the other quantized linears: fp8 block (release layouts) or the same "
                        "as --format")
    q.add_argument("--scale-fmt", default="ue8m0", choices=SCALE_FMTS,
                   help="FP8 block scales: power-of-two e8m0 (like DeepSeek's releases) or fp32")
    q.add_argument("--overwrite", action="store_true", help="replace DST if it is a previous dsv4 output")
    add_device_arg(q)
    q.add_argument("--shard-gb", type=float, default=4.0, help="max output shard size in GiB")
    add_threads_arg(q)
    q.set_defaults(handler=cmd_quantize)

    e = subparsers.add_parser("eval-quant", help="KL / top-1 / logit error of quantized variants vs the source",
                              formatter_class=HelpFormatter)
    e.add_argument("src", metavar="SRC", nargs="?",
                   help="source (BF16) checkpoint directory (or --model; default: the tiny model)")
    add_model_arg(e)
    e.add_argument("--formats", default=",".join(FORMATS), help="comma list of routed-expert formats")
    e.add_argument("--policies", default=",".join(POLICIES), help="comma list of policies")
    e.add_argument("--dense-format", default="fp8", choices=DENSE_FORMATS, help="format of the other linears")
    e.add_argument("--csv", default=None, metavar="PATH", help="write the rows as CSV")
    e.add_argument("--sequences", type=positive_int, default=4, help="held-out sequences")
    e.add_argument("--length", type=int, default=64,
                   help="tokens per sequence (>= 2, at most the model's max_position_embeddings)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random sequences")
    e.add_argument("--work-dir", default=None, help="where variants are written (default: system temp)")
    add_threads_arg(e)
    e.set_defaults(handler=cmd_eval_quant)


def _comma_list(value: str, choices: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in choices]
    if not items or bad:
        raise UsageError(f"{flag} takes a comma list of {', '.join(choices)}; got {value!r}")
    return items


def _quantize_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """(SRC, DST) from ``[SRC] DST`` and ``--model``."""
    if len(args.paths) > 2:
        raise UsageError(f"quantize takes [SRC] DST, got {len(args.paths)} paths: {' '.join(args.paths)}")
    src = args.paths[0] if len(args.paths) == 2 else None
    return pick_model(src, args.model, "SRC"), Path(args.paths[-1])


def cmd_quantize(args: argparse.Namespace) -> int:
    """``dsv4 quantize [SRC] DST ...``: write the quantized checkpoint, print a one-line summary."""
    from .weights.quantize import quantize_checkpoint

    if args.shard_gb <= 0:
        raise UsageError(f"--shard-gb must be positive, got {args.shard_gb}")
    src, dst = _quantize_paths(args)
    quantize_checkpoint(src, dst, args.format, args.policy, args.dense_format, args.scale_fmt, progress=True,
                        overwrite=args.overwrite, device=args.device, max_shard_bytes=int(args.shard_gb * 2**30))
    print(f"wrote {dst} from {src} (experts {args.format}, policy {args.policy}, dense {args.dense_format}, "
          f"FP8 scales {args.scale_fmt})", file=sys.stderr)
    return 0


def cmd_eval_quant(args: argparse.Namespace) -> int:
    """``dsv4 eval-quant [SRC] ...``: print the comparison table (and write the CSV)."""
    from .weights.eval_quant import eval_quant

    formats = _comma_list(args.formats, FORMATS, "--formats")
    policies = _comma_list(args.policies, POLICIES, "--policies")
    if args.length < 2:
        raise UsageError(f"--length must be >= 2, got {args.length}")
    eval_quant(pick_model(args.src, args.model, "SRC"), formats, policies, n_seqs=args.sequences,
               seq_len=args.length, seed=args.seed, dense_format=args.dense_format,
               csv_path=Path(args.csv) if args.csv else None,
               work_dir=Path(args.work_dir) if args.work_dir else None)
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {"quantize": cmd_quantize, "eval-quant": cmd_eval_quant}
