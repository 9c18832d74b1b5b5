"""How an engine is set up: :class:`EngineConfig`, one name per knob from the CLI down to the runner.

``LLM(model, **fields)``, ``dsv4 generate|chat|serve --flags`` and the server all build one
:class:`EngineConfig`; :func:`~dsv4.engine.llm.plan_engine` resolves its ``auto``/``None`` values
against the machine and the checkpoint, and the runner, scheduler and tensor-parallel ranks get the
resolved values under the same names (``max_num_seqs``, ``max_model_len``,
``max_num_batched_tokens``, ``long_prefill_token_threshold``). Names and defaults follow vLLM's
engine arguments where vLLM has the knob.

Each field has a docstring (the flag's ``--help`` text, read from this file) and a rule checked in
``__post_init__``: a bad value raises :class:`~dsv4.errors.UsageError` with one line naming the
field and its flag (``max_num_seqs (--max-num-seqs) must be an int >= 1 or None, got 0``), which
the CLI prints and exits with status 2. The flags of ``generate``, ``chat`` and ``serve`` are
generated from the fields by :func:`add_engine_flags` (``--max-num-seqs`` for ``max_num_seqs``).

To add a knob, add it here and nowhere else to get it everywhere: a field with its default, a
docstring under it (first sentence: what it is; the rest: its default's meaning), and its rule in
``_RULES`` (the check and what the value must be; a value given as text to parse further, such as
JSON, also gets a ``_CONVERT`` entry). The flag, its type (from the annotation: ``bool``
gives ``--x/--no-x``), ``LLM(x=...)`` and the error messages follow. Extra flag spellings go in
``_ALIASES``; a command whose default differs passes it to :func:`add_engine_flags`. Then read it
where it is used (``config.x`` in :class:`~dsv4.engine.llm.LLM` or :func:`plan_engine`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import UsageError

if TYPE_CHECKING:
    from .speculative import SpeculativeConfig

# no torch import here: the CLI builds its flags from this module and must start fast
#: activation dtypes by name (``auto``: bf16 on CUDA, fp32 elsewhere); LLM also takes a torch dtype of these
DTYPE_NAMES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")
_TORCH_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")
QAT_SIM = ("auto", "on", "off", "true", "false", "1", "0")


@dataclass
class EngineConfig:
    """Every engine knob (see the module docstring). Build one with keyword arguments; it checks
    every field on construction."""

    model: str | None = None
    """Checkpoint directory, or tiny[:mxfp4|nvfp4|bf16] for the embedded tiny model (default: tiny,
    i.e. tiny:mxfp4, stored like DeepSeek's FP8+MXFP4 release)."""
    device: str = "auto"
    """auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """Activations and unquantized weights: auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32."""
    qat_sim: str = "auto"
    """Simulate the FP8 KV cache / FP4 indexer the weights were trained with: auto (on for quantized
    releases, off for BF16 checkpoints), on, off."""
    max_num_seqs: int | None = 4
    """Sequences generated together (the generation state holds this many). Unset (None): on a CUDA
    device as many as fit in gpu_memory_utilization (at most 256), 8 on the CPU."""
    max_model_len: int | None = None
    """Positions per sequence, prompt included (more than the model's max_position_embeddings is
    refused). Unset (None): 4096, or max_position_embeddings if smaller."""
    max_num_batched_tokens: int = 8192
    """Tokens of one engine step (decode rows plus prompt chunks of several requests, run as one
    forward); must exceed max_num_seqs."""
    long_prefill_token_threshold: int = 0
    """The most prompt tokens one request gets in a step (its prefill chunk). 0: whatever the decode
    rows and earlier prompts leave of max_num_batched_tokens."""
    tensor_parallel_size: int | None = None
    """Split the model over N GPUs (cuda:0..N-1, or N CPU processes), one process each. Unset (None):
    torchrun's WORLD_SIZE, else 1."""
    prefill_decode_steps: int | None = None
    """Decode steps the running requests take in a step that also runs prompt chunks: each a replay
    of the captured decode step, launched ahead of the chunks' eager forward, so the GPU decodes while
    the host launches the chunks (tens of ms for a short chunk as for a long one). Unset (None): with
    CUDA graphs 4 when the step's chunks hold at most 1024 tokens, else 1; 1: the decode rows run in
    the chunks' forward, one token a step."""
    enforce_eager: bool = False
    """No CUDA graphs (on a GPU the decode step is otherwise captured at start-up, one graph per batch
    bucket, and replayed)."""
    warm_up: bool = True
    """On a GPU, compile at start-up every kernel variant that prompts of any length at any position
    reach (without it, the first prompt of each new length class waits for its compiles)."""
    gpu_memory_utilization: float = 0.9
    """On a CUDA device, the fraction of the GPU's total memory the engine may use (weights,
    generation state, working margin); with max_num_seqs None the state takes what the weights leave
    of it. Ignored on the CPU, where the state is checked against the free RAM."""
    threads: int | str | None = "auto"
    """CPU threads for torch: auto (the physical cores other processes leave free; OMP_NUM_THREADS
    when set), a number, or (LLM only) None to leave torch's setting alone."""
    load_mtp: bool = False
    """Also load the checkpoint's multi-token-prediction layers (speculative decoding with method mtp
    loads them anyway)."""
    enable_prefix_caching: bool = True
    """Reuse the state of earlier prompts' common prefixes, in blocks of 128 tokens on Flash and Pro
    (the lcm of the window and the compression ratios): a request starting with a cached prefix
    prefills only the rest; outputs say how many prompt tokens came from it (num_cached_tokens)."""
    prefix_cache_gib: float | None = None
    """Memory of the prefix cache in GiB; least recently used prefixes are evicted when it is full.
    Unset (None): on a GPU 10% of gpu_memory_utilization of its memory (none when the state asked for
    leaves no room), 1 GiB on the CPU."""
    speculative_config: SpeculativeConfig | str | dict | None = None
    """Speculative decoding, vLLM's form: '{"method": "mtp"|"ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}' (ngram: drafts from the prompt and output; mtp:
    the checkpoint's MTP block). JSON text or a dict, kept as a SpeculativeConfig; unset: off."""

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _CONVERT:
                value = _convert(f.name, value, UsageError)
                setattr(self, f.name, value)
            ok, want = _RULES[f.name]
            if not ok(value):
                raise UsageError(f"{describe(f.name)} must be {want}, got {value!r}")
        if self.max_num_seqs is not None and self.max_num_batched_tokens <= self.max_num_seqs:
            raise UsageError(f"{describe('max_num_batched_tokens')} {self.max_num_batched_tokens} must exceed "
                             f"{describe('max_num_seqs')} {self.max_num_seqs}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config that :func:`add_engine_flags`'s flags parsed into ``args`` describe."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


def flag(name: str) -> str:
    """The CLI flag of field ``name``: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def describe(name: str) -> str:
    """How errors name a field: ``max_num_seqs (--max-num-seqs)``."""
    return f"{name} ({flag(name)})"


# ----------------------------------------------------------------------------- rules


def _is_int(v: object, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _is_torch(v: object, kind: str) -> bool:
    return type(v).__module__ == "torch" and type(v).__name__ == kind


def _device_ok(v: object) -> bool:
    if _is_torch(v, "device"):
        return v.type in ("cpu", "cuda")
    return isinstance(v, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None


def _dtype_ok(v: object) -> bool:
    return str(v) in _TORCH_DTYPES if _is_torch(v, "dtype") else v in DTYPE_NAMES


#: field -> (check, what the value must be); every field has one
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: v is None or (isinstance(v, str) and v != ""), "a checkpoint directory, tiny[:variant] or None"),
    "device": (_device_ok, "auto, cpu, cuda or cuda:N"),
    "dtype": (_dtype_ok, "auto, bf16, fp16 or fp32"),
    "qat_sim": (lambda v: isinstance(v, bool) or v in QAT_SIM, "auto, on or off"),
    "max_num_seqs": (lambda v: v is None or _is_int(v, 1), "an int >= 1 or None"),
    "max_model_len": (lambda v: v is None or _is_int(v, 1), "an int >= 1 or None"),
    "max_num_batched_tokens": (lambda v: _is_int(v, 1), "an int >= 1"),
    "long_prefill_token_threshold": (lambda v: _is_int(v, 0), "an int >= 0 (0: no limit of its own)"),
    "tensor_parallel_size": (lambda v: v is None or _is_int(v, 1), "an int >= 1 or None"),
    "prefill_decode_steps": (lambda v: v is None or (_is_int(v, 1) and v <= 64), "an int from 1 to 64 or None"),
    "enforce_eager": (lambda v: isinstance(v, bool), "a bool"),
    "warm_up": (lambda v: isinstance(v, bool), "a bool"),
    "gpu_memory_utilization": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                               and math.isfinite(v) and 0 < v <= 1, "a fraction in (0, 1]"),
    "threads": (lambda v: v is None or v == "auto" or _is_int(v, 1), "auto, an int >= 1 or None"),
    "load_mtp": (lambda v: isinstance(v, bool), "a bool"),
    "enable_prefix_caching": (lambda v: isinstance(v, bool), "a bool"),
    "prefix_cache_gib": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and math.isfinite(v) and v > 0), "a positive number of GiB or None"),
    "speculative_config": (lambda v: v is None or type(v).__name__ == "SpeculativeConfig",
                           "None or a speculative config"),
}

def _speculative(value: object) -> object:
    from .speculative import SpeculativeConfig     # lazily: it imports torch
    try:
        return SpeculativeConfig.parse(value)
    except UsageError as e:     # said without its own "speculative config" prefix: _convert names the field
        raise UsageError(str(e).removeprefix("speculative config: ").removeprefix("speculative config ")) from None


#: fields whose value is parsed into another form first (JSON text -> a config object); a problem is
#: a UsageError describing the value, which the message prefixes with the field and its flag
_CONVERT: dict[str, Callable[[Any], Any]] = {"speculative_config": _speculative}


def _convert(name: str, value: Any, error: type[Exception]) -> Any:
    try:
        return _CONVERT[name](value)
    except UsageError as e:
        raise error(f"{describe(name) if error is UsageError else 'invalid value'}: {e}") from None


#: extra spellings of a field's flag (vLLM's short forms)
_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("-tp",)}

#: metavars of flags whose value is not a plain number
_METAVARS: dict[str, str] = {"speculative_config": "JSON", "prefix_cache_gib": "GIB", "model": "MODEL", "device": "DEVICE", "dtype": "DTYPE",
                             "qat_sim": "{auto,on,off}",
                             "threads": "THREADS", "tensor_parallel_size": "N", "gpu_memory_utilization": "FRACTION"}


# ----------------------------------------------------------------------------- flags


def field_docs(cls: type = EngineConfig) -> dict[str, str]:
    """Each field's docstring (the string literal under it), whitespace collapsed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _parse_threads(text: str) -> int | str:
    return text if text == "auto" else _parse_int(text)


def _parser_of(annotation: str) -> Callable[[str], Any] | None:
    """The argparse ``type`` for a field's annotation (None: a boolean flag)."""
    kinds = {part.strip() for part in annotation.split("|")} - {"None"}
    if kinds == {"bool"}:
        return None
    if kinds == {"int", "str"}:
        return _parse_threads
    if kinds == {"int"}:
        return _parse_int
    if kinds == {"float"}:
        return _parse_float
    if "str" in kinds:           # text, parsed further by the field's _CONVERT entry
        return str
    raise TypeError(f"EngineConfig: no flag type for the annotation {annotation!r}")


def _checked(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, then the field's rule: a bad value is argparse's one-line error naming the flag."""
    ok, want = _RULES[name]

    def convert(text: str) -> Any:
        value = parse(text)
        if name in _CONVERT:
            value = _convert(name, value, argparse.ArgumentTypeError)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value
    convert.__name__ = name      # argparse names the type in some messages
    return convert


def add_engine_flags(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add one flag per :class:`EngineConfig` field to ``parser`` (help from the field's docstring;
    ``defaults`` overrides a field's default for this command). Each value is checked by its field's
    rule as it is parsed (argparse's one-line error, exit status 2); :meth:`EngineConfig.from_args`
    checks what involves several fields."""
    unknown = set(defaults) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise TypeError(f"add_engine_flags: not EngineConfig fields: {sorted(unknown)}")
    docs = {name: doc.replace("%", "%%") for name, doc in field_docs().items()}   # argparse formats help with %
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        default = defaults.get(f.name, f.default)
        names = (flag(f.name), *_ALIASES.get(f.name, ()))
        parse = _parser_of(f.type)
        if parse is None:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=docs[f.name])
        else:
            group.add_argument(*names, dest=f.name, type=_checked(f.name, parse), default=default,
                               metavar=_METAVARS.get(f.name, "N"),
                               help=docs[f.name])
