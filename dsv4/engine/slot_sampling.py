"""Sampling state kept per slot, so the sampler can run inside a captured decode graph.

:class:`SlotSampling` holds one row of every :class:`~dsv4.engine.sampler.SamplingBatch` tensor per
slot (plus a spare scratch slot for padding rows): temperature, top-k/p, min-p, penalties, the
seed halves and the draw counter, and the penalty counts. A request's row is written once when it
is admitted (:meth:`assign`, host to device, outside any graph). Each step gathers the rows of the
batch's slots by a device index tensor, samples, and scatters the advanced counters back: device
ops only, fixed shapes, so the whole thing is capturable.

What the step computes is decided by host flags derived from the batch's parameters
(:class:`SampleFlags`: all greedy? top-p sort? penalties? how many logprobs? a grammar?) — one graph per
flag set and batch bucket. A set is widened, never narrowed, when rows differ (a greedy row in a
sampling batch is exact either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .grammar import TokenBitmask
from .h2d import copy_into
from .sampler import MAX_LOGPROBS, SampleOutput, SamplingBatch, SamplingParams, _has_penalty, sample


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
                   grammar=any(p.constrained for p in params))


class SlotSampling:
    """Per-slot sampling rows for ``slots`` slots (the last one is the scratch slot)."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device | str):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.rows = SamplingBatch([SamplingParams(temperature=0.0)] * slots, vocab_size, self.device)
        V = vocab_size
        # penalty state for every slot (allocated once: counts are int32, [slots, V])
        self.rows.counts = torch.zeros(slots, V, dtype=torch.int32, device=self.device)
        self.rows.prompt_mask = torch.zeros(slots, V, dtype=torch.bool, device=self.device)
        self.params: list[SamplingParams | None] = [None] * slots
        #: grammar masks by slot (the engine stages the rows before a step with a constrained row)
        self.bitmask = TokenBitmask(slots, vocab_size, self.device)

    def assign(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        """Write ``slot``'s row for a new request (host to device; never inside a graph). The row
        is built on the host and copied through page-locked memory, and the penalty rows are
        cleared with ``fill_``: admitting a request never makes the host wait for the device."""
        one = SamplingBatch([params], self.vocab_size, "cpu", prompt_ids=[prompt_ids])
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

    def sample(self, logits: Tensor, slot_idx: Tensor, flags: SampleFlags) -> SampleOutput:
        """Sample one token per row of ``logits [B, V]`` with the rows of ``slot_idx [B]`` (device),
        then advance those rows' draw counters and penalty counts. Device ops only."""
        rows = self.rows
        batch = SamplingBatch.__new__(SamplingBatch)
        batch.vocab_size, batch.device = self.vocab_size, self.device
        batch.params = [None] * slot_idx.shape[0]          # only its length is read
        for name in ("greedy", "temperature", "top_k", "top_p", "min_p", "log_min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed_lo", "seed_hi", "step"):
            setattr(batch, name, getattr(rows, name).index_select(0, slot_idx))
        batch.counts = rows.counts.index_select(0, slot_idx) if flags.penalties else None
        batch.prompt_mask = rows.prompt_mask.index_select(0, slot_idx) if flags.penalties else None
        batch.all_greedy, batch.use_top_p, batch.use_min_p = flags.all_greedy, flags.top_p, flags.min_p
        batch.use_top_k = flags.top_k and not flags.top_p
        batch.max_top_k = flags.max_top_k or self.vocab_size
        batch.num_logprobs = flags.logprobs
        batch.token_bitmask = self.bitmask.gather(slot_idx) if flags.grammar else None
        out = sample(logits, batch)
        rows.step.index_copy_(0, slot_idx, batch.step)
        if flags.penalties:
            batch.update(out.token_ids)
            rows.counts.index_copy_(0, slot_idx, batch.counts)
            rows.prompt_mask.index_copy_(0, slot_idx, batch.prompt_mask)
        return out
