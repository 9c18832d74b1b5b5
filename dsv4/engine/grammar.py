"""Constrained decoding: a grammar per request, compiled with llguidance, and the token bitmask the
sampler applies on the device.

A request with ``SamplingParams.structured_outputs`` (vLLM's fields: ``json`` schema, ``regex``,
``choice``, ``grammar`` in Lark/GBNF, ``json_object``) gets a :class:`Constraint`: an llguidance
matcher plus the reasoning phase. Before each step the engine writes every constrained row's
allowed-token bitmask into :class:`TokenBitmask`'s host buffer (one row per slot) and copies those
rows to the device buffer the sampler gathers by slot index, inside the captured decode graph (a
static input, so constrained and free rows share one graph). Free rows in such a batch read all-ones
rows; a batch with no constrained row runs the graph without the mask, so free requests pay nothing.
A row's mask needs its previous token, which on a GPU is still in flight when the next step is
planned: a step with a constrained row launches its forward (which needs no mask), then the engine
collects the previous step, advances the grammars and stages the masks while the device runs that
forward, and only then launches the sampler (:meth:`dsv4.engine.runner.Runner.run`'s ``before_sample``).

Each accepted token advances the constraint (:meth:`Constraint.accept`, which takes several tokens
so a speculative verify step can feed all the tokens it accepted). A speculative verify row with host
(n-gram) drafts ``d1..dk`` gets ``1 + k`` masks, one per position: position ``i``'s is the mask after
accepting ``d1..di`` (:meth:`Constraint.draft_masks`, on a copy of the matcher), written into
:attr:`TokenBitmask.draft_bits`, which the verify step (and its graph) reads by slot like ``bits``.
With thinking on (the prompt ends with ``<think>``) the reasoning is free text (no special token, no
EOS) and the grammar starts after ``</think>``; a ``thinking_token_budget`` forces ``</think>`` once
the reasoning has used that many.

A grammar alone does not bound the output's length: a JSON string from a weak (or random) model may
run on until ``max_tokens`` cuts it, and the answer does not parse. So a constraint knows its token
limit (``max_tokens``, or what is left of ``max_model_len``) and keeps a reserve: a quarter of the
limit, at most 512 tokens, but at least the shortest answer (a JSON schema's shortest instance,
the tool-call block's ``min_reserve``; with a small ``max_tokens`` that may be the whole limit). Once only twice the reserve is left, a
reasoning phase gets ``</think>``; once only the reserve is left, the mask keeps, where the grammar
allows any, just the tokens made of closing characters (``"``, then ``}]``, ``</``, ``,``, ``0``),
which finish a JSON value in a few tokens. A capable model rarely comes near that point; a tiny
random one still returns a valid object every time.

Why llguidance, not xgrammar (``bench/grammar_libs.py``: mask time per token while walking a valid
answer to a JSON schema, CPU; bench/results/2026-11-25b/grammar_libs_cpu.txt): xgrammar computes a
mask faster (2.1 us mean vs 9.2 us at a 129K vocabulary; 2.2 vs 47 us at 512, where llguidance's
first mask builds its lexer in 3 ms), but both are far below a decode step (milliseconds; 32 rows
take under 0.3 ms either way), so speed does not decide. llguidance has no dependencies (xgrammar
pulls transformers, triton and tvm-ffi into the base install); its Lark grammars name special
tokens by id (``<[id]>``), which the DSV4 tool-call markup needs (``｜DSML｜`` is a special token)
and which no text can forge, and embed JSON schemas (``%json``) for the tool arguments; it rolls
back, for speculative decoding.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..errors import RequestError
from .h2d import upload, upload_ints

ALL_ALLOWED = -1      # an int32 word with every bit set
#: closing mode's preferences, in order: tokens made only of these characters finish a JSON value (or
#: a tool-call block) soonest: close a string, close a container, close a DSML tag, go on to the next
#: required key, and only then start a number (with "0", after which JSON allows no more digits)
CLOSING_TIERS = ('"', "}]", "</", ",", "0")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match; exactly one of the first five fields is set (vLLM's
    names). ``param`` is the request field it came from, named in errors."""

    json: str | dict | None = None
    """A JSON schema (object or its text)."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect: ``<[id]>`` is a token, ``%json{...}`` a schema) or GBNF."""
    json_object: bool = False
    """Any JSON object."""
    param: str = field(default="structured_outputs", compare=False)
    min_reserve: int = field(default=0, compare=False)
    """Tokens the shortest completion may need from anywhere in the output (closing mode, below,
    starts no later than this many tokens before the limit); the tool-call grammar sets it."""

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise RequestError(f"{self.param}: exactly one of json, regex, choice, grammar, json_object must be "
                               f"given, got {given or 'none'}", param=self.param)
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise RequestError(f"{self.param}.choice: expected a non-empty list of strings", param=self.param)

    def lark(self) -> str:
        """The grammar in llguidance's format (JSON schemas and regexes wrapped by llguidance)."""
        import llguidance
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
            except ValueError as e:
                raise RequestError(f"{self.param}: invalid JSON schema: {e}", param=self.param) from None
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        if "::=" in self.grammar:     # GBNF (llama.cpp's, also what vLLM's xgrammar backend reads)
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                return gbnf_to_lark(self.grammar)
            except Exception as e:    # the converter raises plain exceptions on bad input
                raise RequestError(f"{self.param}: invalid GBNF grammar: {e}", param=self.param) from None
        return self.grammar


class GrammarCompiler:
    """Grammars for one tokenizer: builds the llguidance tokenizer once (about a second for a
    129K vocabulary, so it starts on a thread when the engine is made) and compiles requests."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.think_start = tokenizer.hf.token_to_id("<think>")
        self.think_end = tokenizer.hf.token_to_id("</think>")
        self._lock = threading.RLock()
        self._ll = None
        self._classes: TokenClasses | None = None

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                try:
                    import llguidance
                except ImportError:
                    raise RequestError("structured outputs need the llguidance package (pip install llguidance)",
                                       param="structured_outputs") from None
                self._ll = llguidance.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=self.tokenizer.eos_id)
            return self._ll

    def prepare(self) -> None:
        """Build the llguidance tokenizer and the token classes on a thread (a server calls this at
        start-up, so that its first constrained request waits only for what is left of that work)."""
        threading.Thread(target=lambda: (self.ll_tokenizer, self.token_classes), daemon=True,
                         name="dsv4-grammar-tokenizer").start()

    def check(self, spec: StructuredOutputsParams) -> str:
        """The compiled grammar text; a :class:`RequestError` naming ``spec.param`` if it is invalid."""
        import llguidance
        text = spec.lark()
        error = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer)
        if error:
            first = error.strip().splitlines()[0]
            raise RequestError(f"{spec.param}: invalid grammar: {first}", param=spec.param)
        return text

    @property
    def token_classes(self) -> "TokenClasses":
        """Bitmasks of token classes (computed once: one decode per vocabulary entry)."""
        with self._lock:
            if self._classes is None:
                self._classes = TokenClasses(self.tokenizer, self.vocab_size, self.think_end)
            return self._classes

    def shortest_answer(self, spec: StructuredOutputsParams) -> int:
        """Tokens of the shortest instance of a JSON schema (a lower bound of what closing needs
        from the start of the answer); 0 for other grammars."""
        if spec.json is None and not spec.json_object:
            return 0
        schema = {"type": "object"} if spec.json_object else spec.json
        try:
            schema = json.loads(schema) if isinstance(schema, str) else schema
            text = json.dumps(_shortest_instance(schema, schema), separators=(",", ":"))
        except (ValueError, TypeError, KeyError, RecursionError):
            return 0
        return len(self.tokenizer.encode(text)) + 2

    def constraint(self, params, prompt_ids: Sequence[int], limit: int) -> "Constraint | None":
        """The constraint of a request (None when it has none): its grammar's matcher, and the
        reasoning phase when the prompt opens one (ends with ``<think>``); ``limit`` is the most
        tokens it may generate."""
        spec, budget = params.structured_outputs, params.thinking_token_budget
        reasoning = bool(prompt_ids) and prompt_ids[-1] == self.think_start and self.think_end is not None
        if spec is None and not (budget is not None and reasoning):
            return None
        matcher = None
        if spec is not None:
            import llguidance
            matcher = llguidance.LLMatcher(self.ll_tokenizer, self.check(spec), log_level=0)
        reserve = 0
        if spec is not None:
            least = spec.min_reserve or self.shortest_answer(spec)
            reserve = min(max(min(limit // 4, 512), least), limit)
        return Constraint(matcher, reasoning, self.think_end, budget, self.tokenizer.eos_id, limit, reserve,
                          self.token_classes if matcher is not None else None)


def _shortest_instance(schema: Any, root: dict, depth: int = 0) -> Any:
    """A short value of a JSON schema: required properties only, empty arrays, zero numbers."""
    if depth > 32 or not isinstance(schema, dict):
        return None
    if "$ref" in schema and schema["$ref"].startswith("#/"):
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return _shortest_instance(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return min(schema["enum"], key=lambda v: len(json.dumps(v)))
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return _shortest_instance(schema[key][0], root, depth + 1)
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: _shortest_instance(props.get(k, {}), root, depth + 1) for k in schema.get("required") or []}
    if kind == "array":
        return [_shortest_instance(schema.get("items", {}), root, depth + 1)] * int(schema.get("minItems", 0))
    if kind == "string":
        return "x" * int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    return {"boolean": False, "null": None}.get(kind)


def _bitmask(ids, words: int) -> torch.Tensor:
    bits = [0] * words
    for t in ids:
        bits[t // 32] |= 1 << (t % 32)
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)


class TokenClasses:
    """Bitmasks ``[ceil(V/32)]`` int32 over the vocabulary: ``text`` (every token but the special
    ones, plus ``</think>``: what a constrained request's reasoning may use, so that it can neither
    end with EOS nor write stray markup) and the closing ``tiers`` ``[len(CLOSING_TIERS), ceil(V/32)]``
    (:data:`CLOSING_TIERS`, in order)."""

    def __init__(self, tokenizer, vocab_size: int, think_end: int | None):
        words = (vocab_size + 31) // 32
        specials = {t for t, a in tokenizer.hf.get_added_tokens_decoder().items() if a.special}
        texts = {t: tokenizer.decode([t]) for t in range(tokenizer.vocab_size) if t not in specials}
        self.text = _bitmask([t for t in texts] + ([think_end] if think_end is not None else []), words)
        self.tiers = torch.stack([_bitmask([t for t, x in texts.items() if x and all(c in chars for c in x)], words)
                                  for chars in CLOSING_TIERS])                  # [tiers, words]


class Constraint:
    """One request's constraint: free reasoning up to ``</think>`` (when ``reasoning``), then the
    grammar (when ``matcher``); :meth:`accept` advances it, :meth:`mask_row` says what is allowed next."""

    def __init__(self, matcher, reasoning: bool, think_end: int | None, budget: int | None, eos_id: int,
                 limit: int, reserve: int = 0, classes: TokenClasses | None = None):
        self.matcher, self.reasoning, self.think_end, self.budget, self.eos_id = (matcher, reasoning, think_end,
                                                                                  budget, eos_id)
        self.limit, self.classes = limit, classes
        self.reserve = reserve
        self.generated = 0
        self.reasoning_tokens = 0

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance past ``tokens``, the tokens just accepted for this request in order (one per decode
        step; several after a speculative verify). A token the grammar forbids (it cannot come from
        the masked sampler) leaves the matcher in its error state, which then allows only EOS."""
        for t in tokens:
            self.generated += 1
            if self.reasoning:
                if t == self.think_end:
                    self.reasoning = False
                else:
                    self.reasoning_tokens += 1
            elif self.matcher is not None:
                self.matcher.consume_token(int(t))

    def mask_row(self, row: torch.Tensor) -> None:
        """Write the bitmask of the tokens allowed next into ``row [ceil(V/32)]`` (int32, contiguous,
        on the host): the one forced token, the text tokens during reasoning before a grammar,
        everything while free, else the grammar's mask (narrowed to the closing tokens in the reserve)."""
        only = self.only()
        if only is not None:
            _only_row(row, only)
        elif self.free and self.reasoning and self.classes is not None:
            row.copy_(self.classes.text)           # reasoning before a grammar: text and </think>
        elif self.free:
            row.fill_(ALL_ALLOWED)
        else:
            # ~7 us a row at a 129K vocabulary
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if self.closing:        # keep the best closing tokens the grammar allows, if it allows any
                kept = row & self.classes.tiers                                 # every tier at once
                some = kept.any(1).nonzero()
                if len(some):
                    row.copy_(kept[some[0, 0]])

    def draft_masks(self, drafts: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """The masks of a speculative verify row, without changing this constraint: ``out [n + 1,
        ceil(V/32)]`` (host int32) gets, for the ``n`` drafts, row ``i`` = the mask plain decoding
        applies after accepting ``drafts[:i]`` (reasoning, thinking budget, reserve and grammar
        included), computed on a copy (the matcher's ``deep_copy``: well under a microsecond).
        Rows after a draft its own row forbids hold an EOS-only mask: rejection sampling rejects
        that draft (its masked probability is 0), so nothing after it is kept and any mask does."""
        fork = copy.copy(self)
        fork.matcher = None if self.matcher is None else self.matcher.deep_copy()
        for i, d in enumerate(drafts):
            fork.mask_row(out[i])
            if not _allows(out[i], int(d)):
                for j in range(i + 1, len(drafts) + 1):
                    _only_row(out[j], self.eos_id)
                return out
            fork.accept([int(d)])
        fork.mask_row(out[len(drafts)])
        return out

    @property
    def free(self) -> bool:
        """True when the next token is unconstrained (reasoning within its budget, or no grammar)."""
        if self.reasoning:
            spent = self.budget is not None and self.reasoning_tokens >= self.budget
            return not spent and self.left > 2 * self.reserve
        return self.matcher is None

    @property
    def left(self) -> int:
        """Tokens this request may still generate (the next one included)."""
        return self.limit - self.generated

    @property
    def closing(self) -> bool:
        """In the reserve: prefer the tokens that finish the grammar's value."""
        return self.classes is not None and not self.reasoning and self.left <= self.reserve

    def only(self) -> int | None:
        """The one token allowed next when that is decided without the grammar (``</think>`` once the
        budget is spent; EOS after a grammar error), else None."""
        if self.reasoning:
            return None if self.free else self.think_end
        if self.matcher is not None and self.matcher.is_error():
            return self.eos_id
        return None

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher is not None and self.matcher.is_error() else None


def _only_row(row: torch.Tensor, token: int) -> None:
    """``row`` allows ``token`` alone."""
    row.zero_()
    row[token // 32] = 1 << (token % 32) if token % 32 != 31 else -(1 << 31)


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether bitmask ``row`` allows ``token``."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


class TokenBitmask:
    """The allowed-token bitmask of every slot: ``bits [slots, ceil(V / 32)]`` int32 on the device
    (bit ``t % 32`` of word ``t // 32`` allows token t; llguidance's layout), filled from a
    host copy before the step that reads it. With speculative decoding (:meth:`enable_drafts`) also
    ``draft_bits [slots, 1 + k, ceil(V / 32)]``: a verify row's mask at each of its positions."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device | str):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        words = (vocab_size + 31) // 32
        self.bits = torch.full((slots, words), ALL_ALLOWED, dtype=torch.int32, device=self.device)
        self.host = torch.full((slots, words), ALL_ALLOWED, dtype=torch.int32)
        self.draft_bits: torch.Tensor | None = None
        self.draft_host: torch.Tensor | None = None

    def enable_drafts(self, k: int) -> None:
        """Room for verify rows of up to ``k`` drafts (a static input of the verify graphs, like
        ``bits`` of the decode graphs)."""
        slots, words = self.bits.shape
        self.draft_bits = torch.full((slots, k + 1, words), ALL_ALLOWED, dtype=torch.int32, device=self.device)
        self.draft_host = torch.full((slots, k + 1, words), ALL_ALLOWED, dtype=torch.int32)

    def stage(self, rows: Sequence[tuple[int, Constraint | None]],
              drafts: Mapping[int, Sequence[int]] | None = None) -> None:
        """Write the masks of one step's sampled rows ``(slot, constraint or None)`` and start their
        copy to the device (ordered before the step on the stream). Rows without a constraint, or
        in free reasoning, allow everything. A slot in ``drafts`` is a verify row with those host
        drafts: its masks go to ``draft_bits``, one per position (:meth:`Constraint.draft_masks`;
        a row without a constraint allows everything at every position, whatever its drafts)."""
        drafts = drafts or {}
        plain, verify = [], []
        for slot, c in rows:
            if slot not in drafts:
                plain.append(slot)
                if c is None:
                    self.host[slot].fill_(ALL_ALLOWED)
                else:
                    # one row at a time (llguidance's thread-pool executor measured 10x slower for
                    # 32 rows: its hand-off costs more than the masks)
                    c.mask_row(self.host[slot])
                continue
            verify.append(slot)
            if c is None:
                self.draft_host[slot].fill_(ALL_ALLOWED)
            elif not drafts[slot]:
                raise ValueError(f"slot {slot}: a constrained verify row needs its drafts on the host")
            else:
                c.draft_masks(drafts[slot], self.draft_host[slot, :len(drafts[slot]) + 1])
        # the sampled slots' rows, staged through page-locked memory: the host never waits
        if plain:
            self.bits.index_copy_(0, upload_ints(plain, self.device),
                                  upload(self.host.index_select(0, torch.tensor(plain)), self.device))
        if verify:
            self.draft_bits.index_copy_(0, upload_ints(verify, self.device),
                                        upload(self.draft_host.index_select(0, torch.tensor(verify)), self.device))

    def gather(self, slot_idx: torch.Tensor) -> torch.Tensor:
        """The rows of ``slot_idx`` (device ops only: capturable)."""
        return self.bits.index_select(0, slot_idx)

    def gather_drafts(self, slot_idx: torch.Tensor, S: int) -> torch.Tensor:
        """The masks of verify rows of ``S`` positions at ``slot_idx [b]``: ``[b * S, ceil(V/32)]``,
        row-major by (row, position) (device ops only: capturable)."""
        return self.draft_bits.index_select(0, slot_idx)[:, :S].flatten(0, 1)


def apply_token_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with every token whose bit is clear in ``bits [B, ceil(V/32)]`` set to -inf."""
    B, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).view(B, -1)[:, :V].bool()
    return logits.masked_fill(~allowed, float("-inf"))
