"""``dsv4 quantize`` and ``dsv4 eval-quant``: write a quantized checkpoint, measure what it costs.

``add_parsers`` adds both sub-commands to the ``dsv4`` parser; :data:`HANDLERS` maps each command
name to its handler. Handlers raise ``ValueError`` (``QuantizeError``), ``ConfigError`` or
``CheckpointError`` for user errors; the ``dsv4`` entry point prints those on one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import UsageError
from .weights.quantize import DENSE_FORMATS, FORMATS, POLICIES, SCALE_FMTS


def _src(value: str) -> Path:
    """SRC: a checkpoint directory, or ``tiny:bf16`` (etc.) for the embedded tiny model."""
    from .tiny import resolve_model
    return resolve_model(value)

__all__ = ["add_parsers", "cmd_quantize", "cmd_eval_quant", "HANDLERS"]


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add ``quantize`` and ``eval-quant`` to the sub-command set of the ``dsv4`` parser."""
    q = subparsers.add_parser("quantize", help="write a quantized copy of a BF16/FP8 checkpoint")
    q.add_argument("src", metavar="SRC", help="source checkpoint directory (official tensor names)")
    q.add_argument("dst", metavar="DST", help="new checkpoint directory (written atomically)")
    q.add_argument("--format", required=True, choices=FORMATS, help="format of the routed experts")
    q.add_argument("--policy", default="floor", choices=POLICIES,
                   help="floor: keep head, router, compressor/indexer helpers, MTP projections as in the "
                        "source (default); all: quantize every 2-D linear weight")
    q.add_argument("--dense-format", default="fp8", choices=DENSE_FORMATS,
                   help="format of the other quantized linears: fp8 block (release layouts, default) or "
                        "the same as --format")
    q.add_argument("--scale-fmt", default="ue8m0", choices=SCALE_FMTS,
                   help="FP8 block scales: power-of-two e8m0 (default, like DeepSeek's releases) or fp32")
    q.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    q.add_argument("--device", default="cpu", help="device for the quantization math (default: cpu)")
    q.add_argument("--shard-gb", type=float, default=4.0, help="max output shard size in GiB (default 4)")
    q.set_defaults(handler=cmd_quantize)

    e = subparsers.add_parser("eval-quant", help="KL / top-1 / logit error of quantized variants vs the source")
    e.add_argument("src", metavar="SRC", help="source (BF16) checkpoint directory")
    e.add_argument("--formats", default=",".join(FORMATS), help="comma list of routed-expert formats "
                   f"(default {','.join(FORMATS)})")
    e.add_argument("--policies", default=",".join(POLICIES), help=f"comma list (default {','.join(POLICIES)})")
    e.add_argument("--dense-format", default="fp8", choices=DENSE_FORMATS)
    e.add_argument("--csv", default=None, metavar="PATH", help="write the rows as CSV")
    e.add_argument("--sequences", type=int, default=4, help="held-out sequences (default 4)")
    e.add_argument("--length", type=int, default=64, help="tokens per sequence (default 64)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random sequences (default 0)")
    e.add_argument("--work-dir", default=None, help="where variants are written (default: system temp)")
    e.set_defaults(handler=cmd_eval_quant)


def _comma_list(value: str, choices: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in choices]
    if not items or bad:
        raise UsageError(f"{flag} takes a comma list of {', '.join(choices)}; got {value!r}")
    return items


def cmd_quantize(args: argparse.Namespace) -> int:
    """``dsv4 quantize SRC DST ...``: write the quantized checkpoint, print a one-line summary."""
    from .weights.quantize import quantize_checkpoint

    if args.shard_gb <= 0:
        raise UsageError(f"--shard-gb must be positive, got {args.shard_gb}")
    quantize_checkpoint(_src(args.src), Path(args.dst), args.format, args.policy, args.dense_format,
                        args.scale_fmt, progress=True, overwrite=args.overwrite, device=args.device,
                        max_shard_bytes=int(args.shard_gb * 2**30))
    print(f"wrote {args.dst} (experts {args.format}, policy {args.policy}, dense {args.dense_format}, "
          f"FP8 scales {args.scale_fmt})", file=sys.stderr)
    return 0


def cmd_eval_quant(args: argparse.Namespace) -> int:
    """``dsv4 eval-quant SRC ...``: print the comparison table (and write the CSV)."""
    from .weights.eval_quant import eval_quant

    formats = _comma_list(args.formats, FORMATS, "--formats")
    policies = _comma_list(args.policies, POLICIES, "--policies")
    if args.sequences <= 0 or args.length < 2:
        raise UsageError(f"--sequences must be >= 1 and --length >= 2, got {args.sequences}, {args.length}")
    eval_quant(_src(args.src), formats, policies, n_seqs=args.sequences, seq_len=args.length, seed=args.seed,
               dense_format=args.dense_format, csv_path=Path(args.csv) if args.csv else None,
               work_dir=Path(args.work_dir) if args.work_dir else None)
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {"quantize": cmd_quantize, "eval-quant": cmd_eval_quant}
