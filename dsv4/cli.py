"""The ``dsv4`` command: ``generate``, ``chat``, ``serve``, ``bench serve``, ``inspect``, ``quantize``, ``eval-quant``.

Errors a user can cause (bad flag values, a corrupt checkpoint, a bad config) are the project's
own :class:`~dsv4.errors.Dsv4Error` classes: they print one line naming the culprit and exit with
status 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import __version__
from .cli_common import ArgumentParser, HelpFormatter, add_model_arg, pick_model, positive_int
from .cli_prompt import clean_text, prompt_ids, read_stdin
from .cpu_threads import apply_threads
from .engine.config import EngineConfig, add_engine_flags
from .errors import Dsv4Error, UsageError


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=max_tokens, help="generate at most this many tokens")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--seed", type=int, default=None, help="same seed, same tokens (default: a random seed)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dsv4", description="DeepSeek-V4 inference engine", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text from a prompt (argument or stdin)",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompt", nargs="?", help="prompt text; read from stdin when omitted")
    gen.add_argument("--prompt-ids", type=prompt_ids, default=None, metavar="IDS",
                     help="the prompt as token ids separated by commas or spaces (e.g. 0,15,27), "
                          "for checkpoints without a tokenizer")
    add_engine_flags(gen, max_num_seqs=1)
    _add_sampling_args(gen, 64)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal", formatter_class=HelpFormatter)
    add_engine_flags(chat, max_num_seqs=1)
    _add_sampling_args(chat, 512)
    chat.add_argument("--think", action="store_true", help="start in thinking mode")
    chat.add_argument("--system", default=None, help="system prompt")

    ins = sub.add_parser("inspect", help="summarise a checkpoint directory", formatter_class=HelpFormatter)
    ins.add_argument("path", nargs="?", help="checkpoint directory (or use --model; default: the tiny model)")
    add_model_arg(ins)
    ins.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                     help="check names, shapes, dtypes, index and quantization config against the config "
                          "(headers only: no tensor data is read)")
    ins.add_argument("--check-data", action="store_true",
                     help="also read every tensor: NaN/Inf values and scales, unreadable or truncated data")

    from .serve.cli import add_bench_parser, add_serve_parser
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, tools)",
                         formatter_class=HelpFormatter)
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model, as with --model (`dsv4 serve MODEL`, as `vllm serve MODEL`)")
    add_engine_flags(srv, max_num_seqs=None)    # None: sized from the GPU's memory (8 on the CPU)
    add_serve_parser(srv)
    add_bench_parser(sub)

    from .quant_cli import add_parsers
    add_parsers(sub)
    return parser


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed")


def _sampling(args: argparse.Namespace):
    from .engine.sampling import SamplingParams, field_problem
    for name in _SAMPLING_FLAGS:   # named as the user typed them, not as SamplingParams fields
        problem = field_problem(name, getattr(args, name))
        if problem:
            raise UsageError(f"--{name.replace('_', '-')} {problem}")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)


def _llm(engine: EngineConfig, require_tokenizer: bool):
    from .engine.llm import LLM
    return LLM.from_config(engine, require_tokenizer=require_tokenizer)


def _prompt(args: argparse.Namespace) -> str | list[int]:
    """The prompt: ``--prompt-ids``, the argument, or stdin (said so on a terminal)."""
    if args.prompt_ids is not None:
        if args.prompt is not None:
            raise UsageError("give the prompt as text or as --prompt-ids, not both")
        return args.prompt_ids
    if args.prompt is not None:
        text, replaced = clean_text(args.prompt)
    else:
        if sys.stdin.isatty():
            print("dsv4 generate: reading the prompt from stdin; end it with Ctrl-D "
                  "(or pass it as an argument)", file=sys.stderr)
        text, replaced = read_stdin()
    if replaced:
        print("dsv4 generate: warning: the prompt is not valid UTF-8; invalid bytes were replaced by U+FFFD",
              file=sys.stderr)
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    engine = EngineConfig.from_args(args)      # first: its errors need nothing loaded
    prompt = _prompt(args)
    params = _sampling(args)
    # a text prompt needs the tokenizer: say so before minutes of reading weights, not after;
    # closing releases a tensor-parallel group's other ranks
    with _llm(engine, require_tokenizer=isinstance(prompt, str)) as llm:
        return _generate(args, llm, prompt, params)


def _generate(args: argparse.Namespace, llm, prompt, params) -> int:
    t0 = time.perf_counter()
    out = None
    for event in llm.stream(prompt, params):
        if not args.json:
            # without a tokenizer there is no text: stream the token ids instead
            piece = event.text if llm.tokenizer is not None else f"{event.token_id} "
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
        out = event.output
    total = time.perf_counter() - t0
    rate = out.decode_tokens_per_s
    if args.json:
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "time_to_first_token_s": round(out.time_to_first_token, 6),
            "decode_tokens_per_s": None if rate is None else round(rate, 3), "total_s": round(total, 6),
            "spec_decode": None if out.spec_decode is None else out.spec_decode.to_dict()}))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[{len(out.token_ids)} tokens, ttft {out.time_to_first_token * 1000:.1f} ms, "
              f"{'n/a' if rate is None else f'{rate:.1f}'} tok/s decode, finish: {out.finish_reason}]",
              file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .weights.inspect import describe
    check = "data" if args.check_data else "headers" if args.check else None
    print(describe(pick_model(args.path, args.model), check))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = EngineConfig.from_args(args)
    from .chat_repl import run_chat
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 becomes U+FFFD, not a traceback
        sys.stdin.reconfigure(errors="replace")
    params = _sampling(args)
    with _llm(engine, require_tokenizer=True) as llm:
        return run_chat(llm, params, thinking=args.think, system=args.system)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.cli import serve
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(f"give the model once: as MODEL ({args.model_tag}) or as --model ({args.model}), "
                             "or the same in both")
        args.model = args.model_tag
    engine = EngineConfig.from_args(args)
    return serve(args, engine, lambda: _llm(engine, require_tokenizer=True))


def cmd_bench(args: argparse.Namespace) -> int:
    from .serve.cli import bench
    return bench(args)


_LLM_COMMANDS = ("generate", "chat", "serve")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .quant_cli import HANDLERS as QUANT_HANDLERS
    HANDLERS = {**QUANT_HANDLERS, "serve": cmd_serve, "bench": cmd_bench}
    handlers = {"generate": cmd_generate, "inspect": cmd_inspect, "chat": cmd_chat, **HANDLERS}
    # commands that build an LLM apply --threads through it (LLM(threads=...)); the others here
    restore = apply_threads(None if args.command in _LLM_COMMANDS else getattr(args, "threads", None))
    try:
        return handlers[args.command](args)
    except Dsv4Error as e:
        print(f"dsv4 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dsv4 generate ... | head`: the reader left; exit quietly, as Unix tools do
        _discard_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe
    finally:
        restore()


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (tests, embedding)
        pass


if __name__ == "__main__":
    sys.exit(main())
