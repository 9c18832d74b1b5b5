"""Speculative decoding: drafts from the request's own tokens (n-gram) or the checkpoint's MTP block,
verified in one step, rejected drafts rolled back (DESIGN decisions 6 and 7).

A verify row feeds a slot's last sampled token plus ``k`` drafts at positions ``p .. p + k``; the
step's forward gives the target's logits at every one of them. :func:`verify` keeps the longest
accepted prefix of the drafts plus one token drawn from the target (the correction where a draft was
rejected, else the bonus token after the last draft), and the state of every layer is rolled back to
the kept length (:meth:`dsv4.model.cache.LayerCache.rollback`), so the slot holds exactly what plain
decoding of the kept tokens leaves.

Acceptance is standard rejection sampling with a one-hot draft distribution (both drafters propose
one token, the argmax for MTP): draft ``d`` at a position whose target distribution is ``p`` (after
penalties, temperature, top-k/p, min-p) is kept with probability ``p(d)``; on rejection the token
is drawn from ``p`` without ``d``, renormalised (``(p - q)+`` for ``q = onehot(d)``). The emitted
tokens are then distributed exactly as the target's. Greedy rows keep a draft iff it is the argmax,
so their tokens are exactly plain decoding's. Penalties see the drafts before each position; the
draws use the request's counter-based noise at draw counter ``step + i`` (uniform of the accept
test on a salted stream), so a seeded request is reproducible.

When to speculate (:class:`SpecPolicy`). A verify step costs more than a decode step, so drafts that
are rejected lose time. Measured on one H200 (Flash x4 slice, FP8 + MXFP4, QAT, CUDA graphs, k = 3,
``bench/spec_bench.py --tables cost``, ``bench/results/2026-11-29b/call4_spec_cost.txt``): a verify
step of 1 + 3 tokens a row costs 1.81x a decode step at batch 1 (1.947 vs 1.075 ms) and 1.73x at
batch 32 (8.98 vs 5.20 ms). (On an H100, with the code of 2026-11-26: 2.39x and 1.62x.) A verify
step reads every token's experts, so even at the bytes floor it costs about a decode step of four
rows: 1.46x at batch 1 (``bench/decode_bench.py``'s floors). Speculation pays only while a verify
step emits more tokens than that ratio: at zero acceptance it loses 45% at batch 1 and 42% at batch
32. Two rules keep that loss small:

- ``disable_by_batch_size`` (vLLM's field; default :data:`DEFAULT_DISABLE_BY_BATCH_SIZE`): more
  decode rows than this decode plainly. Above 32 rows nothing is measured; a verify step of b rows
  feeds ``4 b`` tokens, and once the step's cost grows linearly with its tokens (at the latest above
  the 128 tokens of the measured batch-32 verify step) a verify step of 64 rows costs
  ``2 x 15.7 = 31.4`` ms against a decode step of about 12.3 ms (the H100 measurement of 2026-11-26:
  9.7 ms at 32 rows, 15.7 ms at 128 tokens, interpolated in log-log): 2.55x, the accepted length
  good MTP drafts give (2.5 tokens a step with 3 drafts). Above 64 rows even good acceptance rarely
  pays.
- Per request, an exponential moving average of its tokens per verify step (accepted drafts + 1;
  it starts at ``1 + k / 2``, above every ratio; weight 0.1, 0.5 for a probe and for the first
  verify step). While it is below the verify step's cost ratio at the step's batch size
  (:func:`verify_cost_ratio`: the measured table, interpolated in log2 of the batch, its extra cost
  scaled by ``k / 3``) the request decodes plainly and drafts again only on every
  ``probe_every``-th engine step, the same step for every such request (at zero acceptance a probe
  is one verify step of the whole batch, not a mix of verify and plain rows, and costs
  ``(ratio - 1) / probe_every``: 1.3% at batch 1, 1.1% at batch 32 for ``probe_every = 64``).

A table, not a ratio timed at start-up: the same decisions on every run, no timing noise (a GPU or
model far from the measured one gets this table's decisions all the same: ``SpecPolicy.cost``). The
table is of CUDA graph replays, so the engine applies the policy where graphs replay (on the CPU a
verify step of the tiny model costs about 1.3-1.4x a decode step; there, and with
``enforce_eager``, every row that can speculates, unless ``Engine.spec_policy`` is set).

A step with both verify and plain rows is exact but runs the eager varlen step (graphs replay steps
of one kind, and an eager step costs several graph steps on a GPU), so with verify graphs a step of
decode rows only is of one kind: all verify rows when the rows' expected extra tokens (the sum of
``average - 1``) pay for the verify step of the whole batch (``(ratio - 1) x rows``), else all
plain (n-gram misses and constrained rows with MTP drafts still mix).

Constrained requests (structured outputs, :mod:`dsv4.engine.grammar`) verify n-gram drafts: before
the step's acceptance the engine stages, for each constrained verify row, ``1 + k`` token bitmasks
(:meth:`~dsv4.engine.grammar.Constraint.draft_masks`: position ``i``'s is what plain decoding would
apply after accepting drafts ``1..i``, reasoning phase and thinking budget included) into
``TokenBitmask.draft_bits``, a static input of the verify graphs; :func:`verify` masks each position's
logits with it before the accept test and the draw. A draft its position forbids has masked
probability 0, so it is rejected and the emitted tokens follow the masked target, exactly plain
constrained decoding's for greedy rows. The constraint then accepts the emitted tokens. MTP drafts
are on the device when the host would stage those masks, so a constrained request with MTP decodes
plainly (it would need the drafts copied to the host, which costs the overlap of host and device).

MTP: a plain decode step does not run the MTP block, so its drafts go stale; the probe's first
verify step refreshes them and does not count, its second does (the block's window misses the
plain steps' positions, which only makes its drafts poorer until it refills).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
from torch import Tensor

from ..errors import UsageError
from ..ops import draw_tokens
from .grammar import apply_token_bitmask
from .sampling import SampleOutput, apply_logit_bias, apply_penalties, apply_top_k_top_p_min_p, uniform_noise

METHODS = ("ngram", "mtp")
#: ``disable_by_batch_size``'s default (module docstring: above 64 rows a verify step's cost ratio
#: reaches the 2.5 tokens a step of good drafts)
DEFAULT_DISABLE_BY_BATCH_SIZE = 64
#: a verify step of 1 + 3 tokens a row against a decode step, by batch size (one H200, Flash x4
#: slice, FP8 + MXFP4, QAT, CUDA graphs: 1.947 / 1.075 ms at batch 1, 8.98 / 5.20 ms at batch 32;
#: module docstring)
VERIFY_COST_K3 = ((1, 1.81), (32, 1.73))
_ACCEPT_SALT = 0x5BD1E995          # the accept test's uniforms: a stream apart from the draws'


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` fields that apply here."""

    method: str
    """``"ngram"`` (drafts from the request's own prompt and output) or ``"mtp"`` (the checkpoint's
    multi-token-prediction block, applied recursively for k > 1)."""
    num_speculative_tokens: int
    """Drafts per step, k >= 1 (a verify row is 1 + k tokens)."""
    prompt_lookup_min: int = 1
    """n-gram: the shortest suffix of the tokens that is looked up earlier in them."""
    prompt_lookup_max: int = 4
    """n-gram: the longest suffix looked up (the longest earlier match wins)."""
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    """Decode plainly while more than this many requests decode (a verify step of that many rows
    costs more than good drafts win back: module docstring); None (JSON null): at any batch size."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> UsageError:
            return UsageError(f"speculative config: {msg}")
        if self.method not in METHODS:
            raise bad(f"method must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be an int >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                      f"({self.prompt_lookup_max})")
        v = self.disable_by_batch_size
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise bad(f"disable_by_batch_size must be an int >= 1 or null, got {v!r}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the JSON text of ``--speculative-config``, a dict, or a config (None: off). Any problem
        is one :class:`~dsv4.errors.UsageError` naming it."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise UsageError(f"speculative config: not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
        if not isinstance(value, dict):
            raise UsageError(f"speculative config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise UsageError(f"speculative config: unknown field(s) {unknown}; known: {sorted(known)}")
        for need in ("method", "num_speculative_tokens"):
            if need not in value:
                raise UsageError(f"speculative config: {need!r} is required")
        return cls(**value)

    def check_model(self, config: Any, has_mtp: bool) -> None:
        """Refuse what this model cannot do: MTP without the block, a verify row longer than the
        sliding window (rollback restores each window row once)."""
        if self.method == "mtp" and not has_mtp:
            raise UsageError("speculative config: method 'mtp' needs the checkpoint's MTP block (mtp.0), "
                             "which this model does not have")
        if self.k + 1 > config.sliding_window:
            raise UsageError(f"speculative config: num_speculative_tokens ({self.k}) + 1 exceeds the sliding "
                             f"window ({config.sliding_window})")


def ngram_propose(tokens: Sequence[int], k: int, nmin: int, nmax: int) -> list[int] | None:
    """The ``k`` tokens after the latest earlier occurrence of the longest suffix of ``tokens`` of
    ``nmin..nmax`` tokens (padded with its last token when the continuation is shorter), or None."""
    L = len(tokens)
    for n in range(min(nmax, L - 1), nmin - 1, -1):
        suffix = list(tokens[L - n:])
        for i in range(L - n - 1, -1, -1):
            if list(tokens[i:i + n]) == suffix:
                cont = list(tokens[i + n:i + n + k])
                return cont + [cont[-1]] * (k - len(cont))
    return None


@dataclass
class SpecStats:
    """Acceptance counts (vLLM's ``spec_decode`` metrics): verify rows run, drafts proposed, drafts
    accepted, and accepted per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None
    num_policy_plain_rows: int = 0
    """decode rows run plainly by the policy (acceptance below the verify step's cost, or more rows
    than ``disable_by_batch_size``); not verify rows, so not in the counts above"""

    def add(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        if self.accepted_per_pos is None or len(self.accepted_per_pos) < k:
            self.accepted_per_pos = (self.accepted_per_pos or []) + [0] * (k - len(self.accepted_per_pos or []))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify row (accepted drafts + 1)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict:
        per = self.accepted_per_pos or []
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "mean_accepted_length": round(self.mean_accepted_length, 4),
                "acceptance_rate": round(self.num_accepted_tokens / self.num_draft_tokens, 4)
                if self.num_draft_tokens else 0.0,
                "acceptance_per_position": [round(a / self.num_drafts, 4) for a in per] if self.num_drafts else [],
                "num_policy_plain_rows": self.num_policy_plain_rows}


@functools.lru_cache(maxsize=1024)      # asked for every decode row of every step
def verify_cost_ratio(batch: int, k: int, table: tuple[tuple[int, float], ...] = VERIFY_COST_K3) -> float:
    """What a verify step of ``1 + k`` tokens a row costs against a decode step at ``batch`` rows:
    ``table`` (measured at k = 3) interpolated linearly in log2 of the batch, constant beyond its
    ends, and its extra cost scaled by ``k / 3`` (the drafts are the extra tokens)."""
    x = math.log2(max(batch, 1))
    pts = [(math.log2(b), r) for b, r in table]
    r3 = pts[0][1] if x <= pts[0][0] else pts[-1][1]
    for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
        if x0 < x < x1:
            r3 = r0 + (x - x0) / (x1 - x0) * (r1 - r0)
    return 1 + (r3 - 1) * k / 3


@dataclass
class Acceptance:
    """One request's speculation state (:class:`SpecPolicy`)."""

    ema: float
    """moving average of its tokens per verify step (accepted drafts + 1)"""
    probing: bool = True
    """its next verify step is a probe (its first, or one while its average is below the cost)"""
    stale: bool = False
    """MTP: its drafts in the runner's buffer are not from its last step (a step without the MTP
    block ran since): the next verify step only refreshes them and does not count"""
    follow: bool = False
    """verify on the next step too (an MTP probe whose first step was a refresh)"""


@dataclass
class SpecPolicy:
    """When a request's decode row verifies drafts (module docstring): while its average tokens per
    verify step are at least the verify step's cost ratio at this batch size, else only on probe
    steps (every ``probe_every``-th engine step)."""

    alpha: float = 0.1
    """weight of a verify step in the moving average while the request speculates: small, so that
    the runs of rejected steps of drafts that are right 80% of the time seldom turn it off (with
    0.25 they did, often enough to lose half of speculation's gain at 2.95 tokens a step, batch 1)"""
    probe_alpha: float = 0.5
    """weight of a probe (and of a request's first verify step): rarer, so it counts more; one
    fully accepted probe turns speculation on again"""
    probe_every: int = 64
    """engine steps between probes of requests decoding plainly"""
    cost: tuple[tuple[int, float], ...] = VERIFY_COST_K3
    """the verify step's cost ratio by batch size, ``((batch, ratio), ...)`` (k = 3; :func:`verify_cost_ratio`)"""

    def start(self, k: int) -> Acceptance:
        """A new request's state: half its drafts accepted, which is above every ratio (it speculates)."""
        return Acceptance(1 + k / 2)

    def pays(self, acc: Acceptance, batch: int, k: int) -> bool:
        """The request's average tokens per verify step pay for a verify step of ``batch`` rows."""
        return acc.ema >= verify_cost_ratio(batch, k, self.cost)

    def speculate(self, acc: Acceptance, batch: int, k: int, step: int) -> bool:
        """Whether the request verifies drafts at engine step ``step`` with ``batch`` decode rows."""
        if self.pays(acc, batch, k):
            return True
        acc.probing = True
        return acc.follow or step % self.probe_every == 0

    def verified(self, acc: Acceptance, accepted: int) -> None:
        """A verify step of the request accepted ``accepted`` drafts."""
        acc.follow = acc.stale             # a refresh: the probe's next step counts
        if not acc.stale:
            acc.ema += (self.probe_alpha if acc.probing else self.alpha) * (1 + accepted - acc.ema)
            acc.probing = False
        acc.stale = False


# ----------------------------------------------------------------------------- verification


def verify(sampling: Any, logits: Tensor, slot_idx: Tensor, drafts: Tensor, flags: Any
           ) -> tuple[SampleOutput, Tensor]:
    """Accept drafts by rejection sampling (module docstring). ``logits [b, S, V]`` fp32 at the verify
    positions of ``slot_idx [b]``, ``drafts [b, S - 1]``; ``sampling`` the runner's
    :class:`~dsv4.engine.sampling.SlotSampling`, whose rows (draw counters, penalty counts)
    advance by the emitted tokens. With ``flags.grammar`` each position's logits are masked by that
    slot's staged mask for the position (``sampling.bitmask.draft_bits``: what plain decoding would
    apply after accepting the drafts before it) before the acceptance test and the draw of the
    correction or bonus token, so the emitted tokens follow the masked target; logprobs stay the
    model's, as in :func:`~dsv4.engine.sampling.sample`. Returns the emitted ids ``[b, S]`` (the first
    ``kept`` valid, the rest -1) with their logprobs, and ``kept [b]`` (1..S). Device ops only
    (capturable)."""
    b, S, V = logits.shape
    k = S - 1
    rows = sampling.rows
    idx = slot_idx.repeat_interleave(S)                                          # [b*S]
    pos = torch.arange(S, device=logits.device)
    batch = sampling.gather(idx, flags)
    batch.step = batch.step + pos.repeat(b)         # position i is the row's draw step + i (min_tokens)
    if flags.penalties:
        # position i has seen the drafts d_1..d_i as generated tokens
        seen = torch.zeros(b, S, V, dtype=rows.counts.dtype, device=logits.device)
        seen[:, 1:].scatter_add_(2, drafts.unsqueeze(-1), torch.ones_like(drafts, dtype=seen.dtype).unsqueeze(-1))
        seen = seen.cumsum(1, dtype=seen.dtype)
        batch.counts = (rows.counts.index_select(0, slot_idx).unsqueeze(1) + seen).flatten(0, 1)
        batch.prompt_mask = (rows.prompt_mask.index_select(0, slot_idx).unsqueeze(1) | (seen > 0)).flatten(0, 1)

    pen = logits.flatten(0, 1).float()                                            # [b*S, V]
    pen = apply_penalties(apply_logit_bias(pen, batch) if flags.bias else pen, batch)
    # a grammar truncates like top-k (logprobs stay the model's): each position's own mask
    allowed = apply_token_bitmask(pen, sampling.bitmask.gather_drafts(slot_idx, S)) if flags.grammar else pen
    target = draw_tokens(allowed, None, batch.temperature, batch.greedy, batch.seed_lo, batch.seed_hi, batch.step,
                         sampling=False)                                # [b*S] argmax
    padded = torch.cat([drafts, drafts.new_zeros(b, 1)], 1)                       # [b, S]: no draft after d_k
    if flags.all_greedy:
        accept, alt = drafts == target.view(b, S)[:, :k], target
    else:
        scaled = apply_top_k_top_p_min_p(allowed / batch.temperature[:, None], batch)
        d = padded.flatten().unsqueeze(1)
        p_d = torch.softmax(scaled, -1).gather(1, d).squeeze(1)
        u = uniform_noise(batch.seed_lo ^ _ACCEPT_SALT, batch.seed_hi, batch.step, 1).squeeze(1)
        has_draft = (pos < k).repeat(b)
        residual = torch.where(has_draft.unsqueeze(1), scaled.scatter(1, d, -math.inf), scaled)
        accept = torch.where(batch.greedy.view(b, S)[:, :k], drafts == target.view(b, S)[:, :k],
                             (u < p_d).view(b, S)[:, :k])
        # a greedy row's position takes the argmax, another draws from the residual
        alt = draw_tokens(allowed, residual, batch.temperature, batch.greedy, batch.seed_lo, batch.seed_hi,
                          batch.step)
    n_acc = accept.to(torch.int64).cumprod(1).sum(1)                              # [b] accepted drafts
    kept = n_acc + 1
    tokens = torch.where(pos < n_acc.unsqueeze(1), padded, alt.view(b, S))
    tokens = torch.where(pos < kept.unsqueeze(1), tokens, -1)
    rows.step.index_copy_(0, slot_idx, rows.step.index_select(0, slot_idx) + kept)
    if flags.penalties:
        valid = (pos < kept.unsqueeze(1)).to(rows.counts.dtype)
        counts = rows.counts.index_select(0, slot_idx).scatter_add(1, tokens.clamp(min=0), valid)
        rows.counts.index_copy_(0, slot_idx, counts)
        mask = rows.prompt_mask.index_select(0, slot_idx) | (counts > 0)
        rows.prompt_mask.index_copy_(0, slot_idx, mask)
    if flags.logprobs is None:
        return SampleOutput(tokens, None, None), kept
    logp = torch.log_softmax(pen, -1)
    chosen = logp.gather(1, tokens.clamp(min=0).flatten().unsqueeze(1)).view(b, S)
    top = None
    if flags.logprobs:
        t = logp.topk(flags.logprobs, dim=-1)
        top = (t.indices.view(b, S, -1), t.values.view(b, S, -1))
    return SampleOutput(tokens, chosen, top), kept


def rollback(layers: Sequence[Any], saved: Sequence[Any], slots: Tensor, start: Tensor, S: int, kept: Tensor) -> None:
    """Every layer keeps the first ``kept [b]`` of the ``S`` positions written since ``saved`` (the
    index tensors, which depend only on the rows' positions, made once for all layers)."""
    plans: dict = {}
    for layer, s in zip(layers, saved):
        layer.rollback(s, slots, start, S, kept, plans)


# ----------------------------------------------------------------------------- MTP drafts


def mtp_drafts(model: Any, layers: Sequence[Any], h: Tensor, next_ids: Tensor, ctx: Any, sel: Tensor,
               slots: Tensor, length: Tensor, k: int, qat_sim: bool, bound: int) -> Tensor:
    """Run the MTP block over a forward's tokens and draft ``k`` tokens for some of its rows.

    ``h [1, T, nc, D]`` the main model's final streams, ``next_ids [T]`` each position's next token
    (or ``[B, S, nc, D]`` and ``[B, S]``);
    the block's state (``layers[-1]``) takes every position. ``sel [R]``: the flattened index of the
    last kept position of each drafting row (slot ``slots [R]``, new length ``length [R]``). Draft 1
    is the block's argmax there; drafts 2..k apply it again on its own streams at positions
    ``length ..``, whose rows of its state are put back afterwards. Returns ``[R, k]``."""
    mtp, cache = model.mtp[0], layers[-1]
    head = model.project_head if model.tp.parallel else model.head.w
    e = model.embed(next_ids)
    logits, x = mtp.predict(h, e.unsqueeze(0) if next_ids.dim() == 1 else e, ctx, cache, head, rows=sel)
    token = logits.argmax(-1)                                                    # [R]
    out = [token]
    if k > 1:
        x = x.flatten(0, 1).index_select(0, sel).unsqueeze(1)                    # [R, 1, nc, D]
        saved = cache.save(slots, length, k - 1)
        for j in range(k - 1):
            ids = token.unsqueeze(1)
            c = model.context(ids, slots, length + j, qat_sim, bound)
            logits, x = mtp.predict(x, model.embed(ids), c, cache, head)
            token = logits[:, 0].argmax(-1)
            out.append(token)
        cache.rollback(saved, slots, length, k - 1, torch.zeros_like(length))
    return torch.stack(out, 1)
