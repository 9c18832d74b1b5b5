"""Pieces every ``dsv4`` sub-command shares: how a model is named, flag types, the help format.

Every command takes its model the same way: ``--model`` (a checkpoint directory, ``tiny`` or
``tiny:<variant>``), defaulting to the embedded tiny model. Commands that always took a positional
path (``inspect PATH``, ``quantize SRC DST``, ``eval-quant SRC``) still do; giving both is an error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import UsageError

MODEL_HELP = ("checkpoint directory, or tiny[:mxfp4|nvfp4|bf16] for the embedded tiny model (default: tiny, "
              "i.e. tiny:mxfp4, stored like DeepSeek's FP8+MXFP4 release)")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's one-line errors, exit status 2: ``dsv4: error: generate:
    unrecognized arguments: --foo (see dsv4 generate --help)`` (no usage block before it).
    Sub-command parsers inherit the class (``add_subparsers`` makes them with ``type(self)``)."""

    def error(self, message: str):
        root, _, command = self.prog.partition(" ")
        self.exit(2, f"{root}: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but unknown arguments are reported by the sub-command that was given them."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self._innermost(namespace).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def _innermost(self, namespace: argparse.Namespace) -> argparse.ArgumentParser:
        """The deepest sub-command parser that ``namespace`` went through (``dsv4 bench serve``)."""
        parser = self
        while True:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            chosen = getattr(namespace, sub.dest, None) if sub is not None else None
            if chosen not in getattr(sub, "choices", {}):
                return parser
            parser = sub.choices[chosen]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default; ``None`` defaults (computed later) are left out."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the flag is named in argparse's message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def threads_value(text: str) -> str | int:
    """argparse type of ``--threads``: ``auto`` or a positive integer."""
    return text if text == "auto" else positive_int(text)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads_value, default="auto",
                   help="CPU threads for torch: auto = the physical cores other processes leave free "
                        "(OMP_NUM_THREADS when set), or a number")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (a CUDA GPU when torch sees one, else the CPU), "
                                                    "cpu, cuda or cuda:N")


def pick_model(positional: str | None, flag: str | None, what: str = "PATH") -> Path:
    """The checkpoint named by a positional ``what`` or by ``--model`` (not both); the tiny model
    when neither is given."""
    from .tiny import resolve_model

    if positional is not None and flag is not None:
        raise UsageError(f"give the model once: as {what} ({positional}) or as --model ({flag}), not both")
    return resolve_model(positional if positional is not None else flag)
