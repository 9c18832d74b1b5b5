"""Sampling, in one place: :class:`SamplingParams` (what a request asks for), the per-slot rows
the runner samples with (:class:`SlotSampling`), :func:`sample`, and the host-side stops.

One call to :func:`sample` serves a whole batch whose rows each carry their own
:class:`SamplingParams`. It runs on the logits' device without a host sync: per-row knobs
live in tensors of a :class:`SamplingBatch`, greedy rows are picked with ``torch.where``,
and the only Python branches test flags fixed when the batch is built (``any row uses
top-p?``), never tensor values. One step over ``logits [B, V]``:

0. vLLM's ``allowed_token_ids`` (every other id -inf), the logit bias (OpenAI's ``logit_bias``: a
   number in [-100, 100] added to a token's logit) and ``min_tokens`` (vLLM's: the ids that would
   stop the request -- EOS unless ``ignore_eos``, and ``stop_token_ids`` -- are -inf until it has
   that many tokens), as vLLM orders them: before the penalties. All three live in small per-row
   tables (ids and values), made dense only here;
1. penalties -- repetition (CTRL / HF: a seen token's logit is divided by ``r`` when
   positive, multiplied by ``r`` when negative; "seen" = prompt or output), then
   presence / frequency (OpenAI: ``l -= freq * count + pres * (count > 0)`` over
   *generated* tokens only);
2. logprobs -- reported from ``log_softmax`` of the penalised logits at temperature 1: the
   model's distribution after penalties, before temperature and truncation. It does not
   depend on the sampling knobs, so a greedy row reports real probabilities, not 0 / -inf;
   then a constrained row's grammar bitmask (:mod:`dsv4.engine.grammar`) sets the tokens it
   forbids to -inf, before the argmax or the draw;
3. temperature (``< GREEDY_EPS`` means greedy); 4. top-k; 5. top-p, on the top-k
   renormalised distribution (keep the smallest prefix whose mass reaches ``top_p``);
6. min-p: keep ``p >= min_p * p_max`` (invariant under renormalisation, so it commutes
   with 4-5 and is computed in log space);
7. draw -- exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, done in log space as
   ``argmax(logit + Gumbel)`` so no softmax is needed.

The noise is counter-based, not a ``torch.Generator``: the value for (row seed, row step,
vocab id) is a pure function of those integers (two rounds of the lowbias32 hash, computed
in 32-bit lanes of int64 tensors so nothing overflows). A seeded request therefore draws
the same tokens whatever else is in the batch and whichever row it sits in, provided its
logits are bitwise the same. Each row's step advances on every :func:`sample`.

Per slot, for the runner: :class:`SlotSampling` holds one row of every :class:`SamplingBatch`
tensor per slot (plus a spare scratch slot for padding rows). A request's row is written once when
it is admitted (:meth:`SlotSampling.assign`, host to device, outside any graph); each step gathers
the rows of its slots by a device index tensor, samples, and scatters the advanced counters back:
device ops only, fixed shapes, so the sampler runs inside a captured decode graph. What a step
computes is decided by host flags derived from its rows' parameters (:class:`SampleFlags`: all
greedy? top-p sort? penalties? how many logprobs? a grammar?), one graph per flag set and batch bucket; a set
is widened, never narrowed, when rows differ (a greedy row in a sampling batch is exact either way).

:class:`StopChecker` is the host-side half: stop token ids, EOS, ``max_tokens`` and
stop strings matched across token boundaries, holding back text that may still become one.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch
from torch import Tensor

from ..errors import RequestError
from ..ops import draw_tokens
from ..ops.noise import M32 as _M32, _mix32, _mul32, gumbel_noise, uniform_noise, unit_interval  # noqa: F401
from .grammar import StructuredOutputsParams, TokenBitmask, apply_token_bitmask
from .h2d import copy_into

MAX_LOGPROBS = 20  # most top alternatives one request may ask for
MAX_LOGIT_BIAS = 1024  # most logit_bias entries one request may give (a row of each slot's table)
MAX_STOP_TOKEN_IDS = 64  # most stop_token_ids one request may give (min_tokens holds them back, and EOS)
MAX_ALLOWED_TOKEN_IDS = 1024  # most allowed_token_ids one request may give
GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows fp32)


# ----------------------------------------------------------------------------- params


@dataclass
class SamplingParams:
    """How one request picks its tokens. Every field is checked in ``__post_init__``."""

    max_tokens: int = 128
    """Generate at most this many tokens (>= 1); reaching it finishes with reason "length"."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 (anything below ``GREEDY_EPS``) is greedy argmax."""
    top_k: int = 0
    """Keep the k most likely tokens (>= 0); 0 keeps all."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of tokens whose mass reaches top_p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p * p_max``, in [0, 1]; 0 keeps all."""
    repetition_penalty: float = 1.0
    """> 0; seen tokens (prompt or output) get positive logits / r, negative logits * r."""
    presence_penalty: float = 0.0
    """In [-2, 2]; subtracted once from the logit of every token generated so far."""
    frequency_penalty: float = 0.0
    """In [-2, 2]; subtracted per occurrence from the logit of generated tokens."""
    seed: int | None = None
    """Same seed, same logits -> same tokens, whatever the batch. None: a random seed."""
    logprobs: int | None = None
    """None: no logprobs; n in [0, 20]: the sampled token's logprob and the top n."""
    prompt_logprobs: int | None = None
    """None: none; n in [0, 20]: each prompt token's logprob given the tokens before it (the
    model's distribution, before penalties and temperature; None for the first token) and the top
    n at each position. Delivered with the request's first output (lm-eval's loglikelihood)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (their text is not emitted); at most ``MAX_STOP_TOKEN_IDS``."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the output stops right before the first match."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the output (and a stop token's text) at its end (vLLM's)."""
    ignore_eos: bool = False
    """Keep generating past the EOS token (``stop_token_ids`` still stop)."""
    min_tokens: int = 0
    """Generate at least this many tokens (<= ``max_tokens``): until then the ids that would stop the
    request (EOS unless ``ignore_eos``, ``stop_token_ids``) are never drawn and stop strings are not
    matched (vLLM's)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a number in [-100, 100] added to its logit before anything else (OpenAI's; -100
    bans a token in practice, +100 all but forces it); at most ``MAX_LOGIT_BIAS`` entries."""
    allowed_token_ids: list[int] | None = None
    """Only these ids may be drawn (vLLM's); None: all. At most ``MAX_ALLOWED_TOKEN_IDS``."""
    structured_outputs: StructuredOutputsParams | None = None
    """A :class:`~dsv4.engine.grammar.StructuredOutputsParams`: the output must match its grammar
    (enforced by a token bitmask; with thinking on, from the token after ``</think>``)."""
    thinking_token_budget: int | None = None
    """With thinking on (the prompt ends with ``<think>``): at most this many reasoning tokens, then
    ``</think>`` is forced. None: no limit."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI accepts one string
            self.stop = [self.stop]
        for name in _RULES:
            problem = field_problem(name, getattr(self, name))
            if problem:
                raise RequestError(f"SamplingParams.{name} {problem}")
        if self.min_tokens > self.max_tokens:
            raise RequestError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens "
                               f"({self.max_tokens})")
        self.stop_token_ids, self.stop = list(self.stop_token_ids), list(self.stop)
        self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()} if self.logit_bias else None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax."""
        return self.temperature < GREEDY_EPS

    @property
    def constrained(self) -> bool:
        """True when a token bitmask may restrict this request's tokens."""
        return self.structured_outputs is not None or self.thinking_token_budget is not None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_list_of(v: object, ok: Callable[[object], bool]) -> bool:
    return isinstance(v, (list, tuple)) and all(ok(x) for x in v)


def field_problem(name: str, value: object) -> str | None:
    """What is wrong with ``value`` for the field ``name`` (``"must be ..., got ..."``), or None.
    Callers name the field their own way (``SamplingParams.top_p``, the CLI's ``--top-p``)."""
    ok, want = _RULES[name]
    return None if ok(value) else f"must be {want}, got {value!r}"


# field -> (check, what it must be); a failed check raises a RequestError naming both.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "temperature": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an int >= 0 (0 = off)"),
    "top_p": (lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _is_real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _is_real(v) and v > 0, "a finite number > 0"),
    "presence_penalty": (lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "seed": (lambda v: v is None or _is_int(v), "an int or None"),
    "logprobs": (
        lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
        f"None or an int in [0, {MAX_LOGPROBS}]",
    ),
    "prompt_logprobs": (
        lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
        f"None or an int in [0, {MAX_LOGPROBS}]",
    ),
    "stop_token_ids": (
        lambda v: _is_list_of(v, lambda t: _is_int(t) and t >= 0) and len(v) <= MAX_STOP_TOKEN_IDS,
        f"a list of at most {MAX_STOP_TOKEN_IDS} ints >= 0",
    ),
    "stop": (
        lambda v: _is_list_of(v, lambda t: isinstance(t, str) and t != ""),
        "a list of non-empty strings",
    ),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "a bool"),
    "min_tokens": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    "logit_bias": (
        lambda v: v is None or (isinstance(v, dict) and len(v) <= MAX_LOGIT_BIAS
                                and all(_is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100
                                        for t, b in v.items())),
        f"None or a dict of at most {MAX_LOGIT_BIAS} token ids (ints >= 0) to numbers in [-100, 100]",
    ),
    "allowed_token_ids": (
        lambda v: v is None or (_is_list_of(v, lambda t: _is_int(t) and t >= 0)
                                and 1 <= len(v) <= MAX_ALLOWED_TOKEN_IDS),
        f"None or a list of 1 to {MAX_ALLOWED_TOKEN_IDS} ints >= 0",
    ),
    "structured_outputs": (lambda v: v is None or isinstance(v, StructuredOutputsParams),
                           "None or a StructuredOutputsParams"),
    "thinking_token_budget": (lambda v: v is None or (_is_int(v) and v >= 0), "None or an int >= 0"),
}


# ----------------------------------------------------------------------------- batch state


class SamplingBatch:
    """Per-row sampling state of a batch, on one device (B rows, vocab V).

    Tensors: ``temperature`` [B] fp32 (1 on greedy rows), ``greedy`` [B] bool, ``top_k`` [B]
    int64 (V when off), ``top_p``, ``min_p``, ``log_min_p``, ``repetition_penalty``,
    ``presence_penalty``, ``frequency_penalty`` [B] fp32, ``seed_lo`` / ``seed_hi`` [B] int64
    (32-bit halves of the 64-bit seed), ``step`` [B] int64 (draws made so far).
    Biases: ``bias_ids`` [B, MAX_LOGIT_BIAS] int64 / ``bias_vals`` fp32 (a row's logit_bias, padded
    with id 0 and value 0), ``min_tokens`` [B] int64, ``ban_ids`` [B, MAX_STOP_TOKEN_IDS + 1] int64 /
    ``ban_on`` fp32 (1 for the ids min_tokens holds back, 0 on padding), ``allow_ids``
    [B, MAX_ALLOWED_TOKEN_IDS] int64 / ``allow_on`` fp32 (1 for a row's allowed ids; a row without
    any allows every id).
    Penalty state, allocated only when some row has a penalty (else None): ``counts`` [B, V]
    int32 (generated-token counts) and ``prompt_mask`` [B, V] bool (tokens seen in the prompt
    *or* the output). Host side: ``params``, the effective ``seeds``, and flags derived from
    the params (``all_greedy``, ``use_top_k``, ``use_top_p``, ``use_min_p``, ``max_top_k``,
    ``num_logprobs``, ``use_bias``) that let :func:`sample` skip work without reading tensors.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str = "cpu",
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        rng: random.Random | None = None,
        stop_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Build the state once per batch; one host-to-device copy per tensor.

        ``stop_ids[i]``: the ids that would stop row i (EOS unless ``ignore_eos``, and its
        ``stop_token_ids``), which ``min_tokens`` holds back; default its ``stop_token_ids``.

        ``prompt_ids[i]`` feeds row i's repetition penalty. ``output_ids[i]`` resumes a row
        (e.g. after preemption): its counts and its ``step = len(output_ids[i])``, so a
        seeded request continues its own random stream. Rows whose ``seed`` is None get one
        from ``rng`` (default: a fresh OS-seeded ``random.Random``), kept in ``self.seeds``.
        """
        if not params:
            raise ValueError("SamplingBatch needs at least one SamplingParams")
        B, V = len(params), vocab_size
        prompt_ids = prompt_ids if prompt_ids is not None else [()] * B
        output_ids = output_ids if output_ids is not None else [()] * B
        if len(prompt_ids) != B or len(output_ids) != B:
            got = f"{len(prompt_ids)}/{len(output_ids)}"
            raise ValueError(f"prompt_ids/output_ids need {B} rows each, got {got}")
        rng = rng or random.Random()
        self.vocab_size, self.device = V, torch.device(device)
        self.params = list(params)
        self.seeds = [(rng.getrandbits(64) if p.seed is None else p.seed) % 2**64 for p in params]

        def col(values: list[float | int], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        self.greedy = col([p.greedy for p in params], torch.bool)
        self.temperature = col([1.0 if p.greedy else p.temperature for p in params], torch.float32)
        self.top_k = col([p.top_k if 0 < p.top_k < V else V for p in params], torch.int64)
        self.top_p = col([p.top_p for p in params], torch.float32)
        self.min_p = col([p.min_p for p in params], torch.float32)
        self.log_min_p = torch.log(self.min_p)  # -inf where min-p is off
        self.repetition_penalty = col([p.repetition_penalty for p in params], torch.float32)
        self.presence_penalty = col([p.presence_penalty for p in params], torch.float32)
        self.frequency_penalty = col([p.frequency_penalty for p in params], torch.float32)
        self.seed_lo = col([s & _M32 for s in self.seeds], torch.int64)
        self.seed_hi = col([s >> 32 for s in self.seeds], torch.int64)
        self.step = col([len(o) for o in output_ids], torch.int64)
        biases = [sorted((p.logit_bias or {}).items()) for p in params]
        allowed = [p.allowed_token_ids or [] for p in params]
        for what, ids in (("logit_bias", [t for row in biases for t, _ in row]),
                          ("allowed_token_ids", [t for row in allowed for t in row])):
            bad = [t for t in ids if t >= V]
            if bad:
                raise RequestError(f"{what}: token ids outside [0, {V}): {bad[:5]}", param=what)
        self.allow_ids, self.allow_on = _padded_table(allowed, [[1.0] * len(row) for row in allowed],
                                                      MAX_ALLOWED_TOKEN_IDS, self.device)
        self.bias_ids, self.bias_vals = _padded_table([[t for t, _ in row] for row in biases],
                                                      [[b for _, b in row] for row in biases], MAX_LOGIT_BIAS,
                                                      self.device)
        self.min_tokens = col([p.min_tokens for p in params], torch.int64)
        # an id outside the vocabulary (an engine without an end token passes -1) is never drawn anyway
        stops = [sorted({t for t in ids if 0 <= t < V})
                 for ids in (stop_ids if stop_ids is not None else [p.stop_token_ids for p in params])]
        if len(stops) != B or any(len(ids) > MAX_STOP_TOKEN_IDS + 1 for ids in stops):
            raise ValueError(f"stop_ids need {B} rows of at most {MAX_STOP_TOKEN_IDS + 1} ids")
        self.ban_ids, self.ban_on = _padded_table(stops, [[1.0] * len(ids) for ids in stops], MAX_STOP_TOKEN_IDS + 1,
                                                  self.device)
        self.counts: Tensor | None = None
        self.prompt_mask: Tensor | None = None
        #: allowed-token bitmask rows [B, ceil(V/32)] int32 (dsv4.engine.grammar), or None: no constraint
        self.token_bitmask: Tensor | None = None
        if any(_has_penalty(p) for p in params):
            self.counts = _count_ids(output_ids, V, self.device)
            self.prompt_mask = (_count_ids(prompt_ids, V, self.device) > 0) | (self.counts > 0)
        self._set_flags()

    def _set_flags(self) -> None:
        """Host flags from ``params`` alone (never from tensor values)."""
        V, ps = self.vocab_size, self.params
        ks = [p.top_k for p in ps if not p.greedy and 0 < p.top_k < V]
        self.all_greedy = all(p.greedy for p in ps)
        self.use_top_k, self.max_top_k = bool(ks), max(ks, default=V)
        self.use_top_p = any(not p.greedy and p.top_p < 1 for p in ps)
        self.use_min_p = any(not p.greedy and p.min_p > 0 for p in ps)
        asked = [p.logprobs for p in ps if p.logprobs is not None]
        self.num_logprobs: int | None = max(asked) if asked else None
        self.use_bias = any(_has_bias(p) for p in ps)

    def __len__(self) -> int:
        return len(self.params)

    def update(self, sampled_ids: Tensor) -> None:
        """Count the tokens just sampled (``sampled_ids`` [B] int64) for the penalties.

        Device-side ``scatter_add_`` / ``scatter_``; a no-op when no row has a penalty.
        """
        if self.counts is None or self.prompt_mask is None:
            return
        ids = sampled_ids.view(-1, 1)
        self.counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=self.counts.dtype))
        self.prompt_mask.scatter_(1, ids, True)

    def select(self, rows: Sequence[int]) -> SamplingBatch:
        """A new batch of the given rows, in that order, with their steps and counts."""
        out = SamplingBatch.__new__(SamplingBatch)
        out.__dict__.update(self.__dict__)
        idx = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        for name, value in self.__dict__.items():
            if isinstance(value, Tensor):
                setattr(out, name, value.index_select(0, idx))
        out.params = [self.params[i] for i in rows]
        out.seeds = [self.seeds[i] for i in rows]
        out._set_flags()
        return out


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _padded_table(ids: Sequence[Sequence[int]], values: Sequence[Sequence[float]], width: int,
                  device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged rows of (id, value) as ``[rows, width]`` int64 ids and fp32 values, padded with id 0 and
    value 0 (built on the host, one copy each to ``device``)."""
    out_ids = torch.zeros(len(ids), width, dtype=torch.int64)
    out_values = torch.zeros(len(ids), width, dtype=torch.float32)
    for i, (row_ids, row_values) in enumerate(zip(ids, values)):
        if row_ids:
            out_ids[i, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.int64)
            out_values[i, :len(row_values)] = torch.tensor(row_values, dtype=torch.float32)
    return out_ids.to(device), out_values.to(device)


def _has_bias(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.min_tokens > 0 or p.allowed_token_ids is not None


#: the per-row tables :func:`apply_logit_bias` reads (besides ``step``)
BIAS_TABLES = ("bias_ids", "bias_vals", "min_tokens", "ban_ids", "ban_on", "allow_ids", "allow_on")
#: the per-row knobs and draw counters every step reads
_ROW_KNOBS = ("greedy", "temperature", "top_k", "top_p", "min_p", "log_min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty", "seed_lo", "seed_hi", "step")


def _read_by(flags: SampleFlags) -> frozenset[str]:
    """The per-row knobs a step with ``flags`` reads (a step gathers only those: at batch 1 each
    gather is a few microseconds of a ~1.4 ms decode step)."""
    names = {"greedy", "step"}
    if not flags.all_greedy:
        names |= {"temperature", "seed_lo", "seed_hi"}
        if flags.top_p or flags.top_k:
            names |= {"top_k", "top_p"}
        if flags.min_p:
            names.add("log_min_p")
    if flags.penalties:
        names |= {"repetition_penalty", "presence_penalty", "frequency_penalty"}
    if flags.bias:
        names |= set(BIAS_TABLES)
    return frozenset(names)


def _count_ids(rows: Sequence[Sequence[int]], V: int, device: torch.device) -> Tensor:
    """Token counts ``[len(rows), V]`` int32 from ragged id lists, with one device scatter."""
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    bad = flat[(flat < 0) | (flat >= V)]  # checked on the host, before any device work
    if bad.numel():
        raise ValueError(f"token ids must be in [0, {V}), got {bad[:5].tolist()}")
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(rows)), lens)
    counts = torch.zeros(len(rows), V, dtype=torch.int32, device=device)
    ones = torch.ones(flat.numel(), dtype=torch.int32, device=device)
    return counts.index_put_((row.to(device), flat.to(device)), ones, accumulate=True)


# ----------------------------------------------------------------------------- sampling


class SampleOutput(NamedTuple):
    """What :func:`sample` returns for a batch of B rows.

    ``token_ids`` [B] int64; ``logprobs`` [B] fp32 (sampled token) or None when no row asked;
    ``top_logprobs`` = (ids [B, n] int64, values [B, n] fp32), sorted by value descending,
    n = the largest ``logprobs`` in the batch (each row keeps its own first few), or None
    when n is 0 or no row asked.
    """

    token_ids: Tensor
    logprobs: Tensor | None
    top_logprobs: tuple[Tensor, Tensor] | None


def sample(logits: Tensor, batch: SamplingBatch) -> SampleOutput:
    """Pick one token per row from ``logits`` [B, V] (any float dtype, computed in fp32).

    Runs the module-docstring pipeline on the device with no host sync, then advances every
    row's ``batch.step``. Call ``batch.update(out.token_ids)`` to feed the penalties.
    """
    if logits.dim() != 2 or logits.shape[0] != len(batch) or logits.shape[1] != batch.vocab_size:
        want = [len(batch), batch.vocab_size]
        raise ValueError(f"logits must be {want}, got {list(logits.shape)}")
    logits = logits.float()
    if batch.use_bias:
        logits = apply_logit_bias(logits, batch)
    logits = apply_penalties(logits, batch)  # [B, V] fp32
    logp = torch.log_softmax(logits, dim=-1) if batch.num_logprobs is not None else None
    if batch.token_bitmask is not None:   # a grammar truncates like top-k: logprobs stay the model's
        logits = apply_token_bitmask(logits, batch.token_bitmask)
    # the argmax, or the draw with the noise made in the op (one kernel on a GPU); truncation needs
    # the scaled logits as a tensor, the plain temperature draw only the temperatures
    scaled = None
    if not batch.all_greedy and (batch.use_top_p or batch.use_top_k or batch.use_min_p):
        scaled = apply_top_k_top_p_min_p(logits / batch.temperature[:, None], batch)
    token_ids = draw_tokens(logits, scaled, batch.temperature, batch.greedy, batch.seed_lo, batch.seed_hi,
                            batch.step, sampling=not batch.all_greedy)
    batch.step += 1
    if logp is None:
        return SampleOutput(token_ids, None, None)
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1)  # [B]
    top = logp.topk(batch.num_logprobs, dim=-1) if batch.num_logprobs else None  # sorted
    return SampleOutput(token_ids, chosen, None if top is None else (top.indices, top.values))


def apply_logit_bias(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Each row's ids outside its ``allowed_token_ids`` at -inf, its ``logit_bias`` added, and the ids
    its ``min_tokens`` holds back at -inf while the row has drawn fewer than ``min_tokens`` tokens
    (``batch.step``); ``logits`` [B, V] fp32 -> new [B, V] fp32. The padding entries add 0 and ban
    or allow nothing."""
    allowed = torch.zeros_like(logits).scatter_add_(1, batch.allow_ids, batch.allow_on) > 0
    logits = logits.masked_fill(~allowed & (batch.allow_on[:, :1] > 0), -math.inf)   # rows with a list only
    bias = torch.zeros_like(logits).scatter_add_(1, batch.bias_ids, batch.bias_vals)
    held = torch.zeros_like(logits).scatter_add_(1, batch.ban_ids, batch.ban_on) > 0
    held &= (batch.step < batch.min_tokens)[:, None]
    return (logits + bias).masked_fill(held, -math.inf)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, then presence/frequency penalties; ``logits`` [B, V] fp32 -> new [B, V] fp32.

    Returns ``logits`` itself (not a copy) when no row has a penalty; never writes in place.
    """
    if batch.counts is None or batch.prompt_mask is None:
        return logits
    r = torch.where(batch.prompt_mask, batch.repetition_penalty[:, None], 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / r, logits * r)
    counts = batch.counts.float()
    freq, pres = batch.frequency_penalty[:, None], batch.presence_penalty[:, None]
    return logits - (freq * counts + pres * (counts > 0))


def apply_top_k_top_p_min_p(scaled: Tensor, batch: SamplingBatch) -> Tensor:
    """Mask tokens outside each row's top-k / top-p / min-p set with -inf.

    ``scaled`` [B, V] fp32 are temperature-scaled logits; returns [B, V] fp32 (``scaled``
    itself if nothing applies; never written in place). Rows with a knob off are untouched.
    Top-p needs one sort; top-k alone uses ``topk`` with the batch's largest k (then ties with
    the k-th value are all kept).
    """
    B, V = scaled.shape
    if batch.use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
        rank = torch.arange(V, device=scaled.device)
        drop = rank[None, :] >= batch.top_k[:, None]
        probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep while the mass before < top_p
        drop |= (mass_before >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None]
        scaled = scaled.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), -math.inf)
    elif batch.use_top_k:
        top = scaled.topk(batch.max_top_k, dim=-1).values  # [B, max_k], sorted
        kth = top.gather(1, (batch.top_k.clamp(max=batch.max_top_k) - 1)[:, None])  # [B, 1]
        kth = torch.where((batch.top_k < V)[:, None], kth, -math.inf)
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if batch.use_min_p:
        # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p); the max survives 4-5.
        floor = scaled.amax(dim=-1, keepdim=True) + batch.log_min_p[:, None]
        scaled = scaled.masked_fill(scaled < floor, -math.inf)
    return scaled


# ----------------------------------------------------------------------------- per-slot rows (graph-capturable)


@dataclass(frozen=True)
class SampleFlags:
    """Which parts of the sampler a step runs (host-known; part of a graph's key)."""

    all_greedy: bool = True
    top_p: bool = False      # the sort path (covers top-k too)
    top_k: bool = False      # top-k without top-p
    max_top_k: int = 0
    min_p: bool = False
    penalties: bool = False
    logprobs: int | None = None
    grammar: bool = False    # some row is constrained: apply the slots' token bitmasks
    bias: bool = False       # some row has a logit_bias, min_tokens or allowed ids: apply the slots' tables

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab_size: int) -> "SampleFlags":
        sampling = [p for p in params if not p.greedy]
        ks = [p.top_k for p in sampling if 0 < p.top_k < vocab_size]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(all_greedy=not sampling,
                   top_p=any(p.top_p < 1 for p in sampling),
                   top_k=bool(ks),
                   # one bucket of k per power of two keeps the number of graphs small
                   max_top_k=min(vocab_size, 1 << (max(ks) - 1).bit_length()) if ks else 0,
                   min_p=any(p.min_p > 0 for p in sampling),
                   penalties=any(_has_penalty(p) for p in params),
                   logprobs=MAX_LOGPROBS if asked and max(asked) > 0 else (0 if asked else None),
                   grammar=any(p.constrained for p in params),
                   bias=any(_has_bias(p) for p in params))


class SlotSampling:
    """Per-slot sampling rows for ``slots`` slots (the last one is the scratch slot)."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device | str):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.rows = SamplingBatch([SamplingParams(temperature=0.0)] * slots, vocab_size, self.device)
        V = vocab_size
        # penalty state for every slot (allocated once: counts are int32, [slots, V])
        self.rows.counts = torch.zeros(slots, V, dtype=torch.int32, device=self.device)
        self.rows.prompt_mask = torch.zeros(slots, V, dtype=torch.bool, device=self.device)
        #: grammar masks by slot (the engine stages the rows before a step with a constrained row)
        self.bitmask = TokenBitmask(slots, vocab_size, self.device)
        self.params: list[SamplingParams | None] = [None] * slots

    def assign(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int],
               stop_ids: Sequence[int] | None = None) -> None:
        """Write ``slot``'s row for a new request (host to device; never inside a graph). The row
        is built on the host and copied through page-locked memory, and the penalty rows are
        cleared with ``fill_``: admitting a request never makes the host wait for the device.
        ``stop_ids``: the ids that would stop it, which ``min_tokens`` holds back (default its
        ``stop_token_ids``; the engine adds EOS unless ``ignore_eos``)."""
        one = SamplingBatch([params], self.vocab_size, "cpu", prompt_ids=[prompt_ids],
                            stop_ids=None if stop_ids is None else [stop_ids])
        for name, value in vars(one).items():
            if isinstance(value, Tensor) and name not in ("counts", "prompt_mask"):
                copy_into(getattr(self.rows, name)[slot], value[0])
        self.rows.counts[slot].fill_(0)
        if one.prompt_mask is not None:
            copy_into(self.rows.prompt_mask[slot], one.prompt_mask[0])
        else:
            self.rows.prompt_mask[slot].fill_(False)
        self.params[slot] = params
        self.rows.seeds[slot] = one.seeds[0]

    def flags(self, slots: Sequence[int]) -> SampleFlags:
        return SampleFlags.of([self.params[s] for s in slots if self.params[s] is not None], self.vocab_size)

    def gather(self, idx: Tensor, flags: SampleFlags) -> SamplingBatch:
        """A batch of the rows ``idx`` (device; a slot may repeat) with the host flags of ``flags``: the
        knobs and draw counters those flags read (the others None; ``flags.bias``: the bias tables);
        no penalty state, no grammar masks (the caller adds what its step needs). Device ops only."""
        rows = self.rows
        batch = SamplingBatch.__new__(SamplingBatch)
        batch.vocab_size, batch.device = self.vocab_size, self.device
        batch.params = [None] * idx.shape[0]          # only its length is read
        read = _read_by(flags)
        for name in _ROW_KNOBS + BIAS_TABLES:     # one gather (a kernel) per knob the flags read, None else
            setattr(batch, name, getattr(rows, name).index_select(0, idx) if name in read else None)
        batch.counts = batch.prompt_mask = batch.token_bitmask = None
        batch.all_greedy, batch.use_top_p, batch.use_min_p = flags.all_greedy, flags.top_p, flags.min_p
        batch.use_top_k = flags.top_k and not flags.top_p
        batch.max_top_k = flags.max_top_k or self.vocab_size
        batch.num_logprobs, batch.use_bias = flags.logprobs, flags.bias
        return batch

    def sample(self, logits: Tensor, slot_idx: Tensor, flags: SampleFlags) -> SampleOutput:
        """Sample one token per row of ``logits [B, V]`` with the rows of ``slot_idx [B]`` (device),
        then advance those rows' draw counters and penalty counts. Device ops only."""
        rows = self.rows
        batch = self.gather(slot_idx, flags)
        if flags.penalties:
            batch.counts = rows.counts.index_select(0, slot_idx)
            batch.prompt_mask = rows.prompt_mask.index_select(0, slot_idx)
        if flags.grammar:
            batch.token_bitmask = self.bitmask.gather(slot_idx)
        out = sample(logits, batch)
        rows.step.index_copy_(0, slot_idx, batch.step)
        if flags.penalties:
            batch.update(out.token_ids)
            rows.counts.index_copy_(0, slot_idx, batch.counts)
            rows.prompt_mask.index_copy_(0, slot_idx, batch.prompt_mask)
        return out


# ----------------------------------------------------------------------------- stops


FinishReason = Literal["stop", "length"]


class StopChecker:
    """Host-side stop logic for one request: stop ids, EOS, length and stop strings.

    Feed each new token's incrementally decoded text to :meth:`check`. A stop string may be
    split over tokens ("ST" + "OP"), so any tail of the text that is a prefix of a stop
    string is held back until it either completes a match (then dropped with everything
    after it) or stops matching (then emitted). A stop token's own text is not emitted.
    Until the ``min_tokens``-th token nothing stops the request but ``max_tokens`` (the sampler
    never draws a stop id then) and stop strings are not looked for (vLLM's).
    """

    def __init__(
        self,
        stop_strings: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        eos_id: int | None = None,
        ignore_eos: bool = False,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.min_tokens = min_tokens
        self.include_stop = include_stop      # the matched stop string / stop token's text is emitted too
        self.stop_ids = set(stop_token_ids)
        if eos_id is not None and not ignore_eos:
            self.stop_ids.add(eos_id)
        self._custom_ids = set(stop_token_ids)
        #: what ended the output, vLLM's ``stop_reason``: the stop string or the stop token id (from
        #: ``stop_token_ids``); None for the end token, ``max_tokens`` or before the end
        self.stop_reason: int | str | None = None
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.stopped = False
        self._held = ""  # decoded text not emitted yet: a possible start of a stop string

    @classmethod
    def from_params(cls, params: SamplingParams, eos_id: int | None) -> StopChecker:
        """The checker for one request's params and the tokenizer's EOS id."""
        p = params
        return cls(p.stop, p.stop_token_ids, eos_id, p.ignore_eos, p.max_tokens, p.min_tokens,
                   p.include_stop_str_in_output)

    def check(self, new_text: str, token_id: int) -> tuple[str, bool, FinishReason | None]:
        """Take one generated token; return ``(emit_text, stopped, reason)``.

        ``emit_text`` is safe to stream now. ``reason`` is "stop" (stop id, EOS or stop
        string), "length" (``max_tokens`` reached; held text is flushed) or None.
        """
        if self.stopped:
            raise RuntimeError("StopChecker.check called after the request stopped")
        self.num_tokens += 1
        if self.num_tokens < self.min_tokens:
            if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
                return self._end(new_text, "length")
            return new_text, False, None
        if token_id in self.stop_ids:
            self.stop_reason = token_id if token_id in self._custom_ids else None
            return self._end(self._held + (new_text if self.include_stop else ""), "stop")
        text = self._held + new_text
        found = [(i, n) for n, i in enumerate(text.find(s) for s in self.stop_strings) if i >= 0]
        if found:
            cut, n = min(found)       # the earliest match (the first listed of those at one place)
            self.stop_reason = self.stop_strings[n]
            return self._end(text[:cut + (len(self.stop_strings[n]) if self.include_stop else 0)], "stop")
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._end(text, "length")
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False, None

    def finish(self) -> str:
        """Flush the held-back text when generation ends without a stop-string match."""
        held, self._held = self._held, ""
        return held

    def _end(self, emit: str, reason: FinishReason) -> tuple[str, bool, FinishReason]:
        self.stopped, self._held = True, ""
        return emit, True, reason

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
