"""The ``dsv4`` command: ``generate``, ``chat``, ``inspect``.

Errors a user can cause (bad flag values, a corrupt checkpoint, a bad config) are the project's
own :class:`~dsv4.errors.Dsv4Error` classes: they print one line naming the culprit and exit with
status 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import Dsv4Error


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory, or tiny / tiny:nvfp4 / tiny:bf16 "
                                   "(default: the embedded tiny model, stored like DeepSeek's FP8+MXFP4 release)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32")
    p.add_argument("--qat-sim", default="auto", choices=["auto", "on", "off"],
                   help="simulate the FP8 KV cache / FP4 indexer the weights were trained with "
                        "(auto: on for quantized releases, off for BF16 checkpoints)")
    p.add_argument("--max-context", type=int, default=4096, help="positions per sequence (default 4096)")


def _add_sampling_args(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (argument or stdin)")
    gen.add_argument("prompt", nargs="?", help="prompt text; read from stdin when omitted")
    _add_model_args(gen)
    _add_sampling_args(gen, 64)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    _add_model_args(chat)
    _add_sampling_args(chat, 512)
    chat.add_argument("--think", action="store_true", help="start in thinking mode")
    chat.add_argument("--system", default=None, help="system prompt")

    ins = sub.add_parser("inspect", help="summarise a checkpoint directory")
    ins.add_argument("path", nargs="?", help="checkpoint directory (default: the embedded tiny model)")

    from .quant_cli import add_parsers
    add_parsers(sub)
    return parser


def _sampling(args: argparse.Namespace):
    from .engine.sampler import SamplingParams
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=args.seed)


def _llm(args: argparse.Namespace):
    from .engine.llm import LLM
    return LLM(args.model, device=args.device, dtype=args.dtype, qat_sim=args.qat_sim, max_slots=1,
               max_context=args.max_context)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    params = _sampling(args)
    llm = _llm(args)
    t0 = time.perf_counter()
    out = None
    for event in llm.stream(prompt, params):
        if not args.json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        out = event.output
    total = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "time_to_first_token_s": round(out.time_to_first_token, 6),
            "decode_tokens_per_s": round(out.decode_tokens_per_s, 3), "total_s": round(total, 6)}))
    else:
        sys.stdout.write("\n")
        print(f"[{len(out.token_ids)} tokens, ttft {out.time_to_first_token * 1000:.1f} ms, "
              f"{out.decode_tokens_per_s:.1f} tok/s decode, finish: {out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .weights.inspect import describe
    from .tiny import resolve_model
    print(describe(resolve_model(args.path)))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat_repl import run_chat
    return run_chat(_llm(args), _sampling(args), thinking=args.think, system=args.system)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .quant_cli import HANDLERS
    handlers = {"generate": cmd_generate, "inspect": cmd_inspect, "chat": cmd_chat, **HANDLERS}
    try:
        return handlers[args.command](args)
    except Dsv4Error as e:
        print(f"dsv4 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
