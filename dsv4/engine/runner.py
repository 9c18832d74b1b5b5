"""Runs the network over generation slots: one step (:meth:`Runner.run`) at a time.

The runner owns the fixed-shape state (:class:`GenerationState`, ``max_num_seqs`` slots plus one
scratch slot), each slot's last sampled token (on the device: a decode step reads its input ids
from there, so sampled ids never travel device -> host -> device), and the per-slot sampling rows
(:class:`SlotSampling`). It knows slots and token ids, never requests (DESIGN decision 5).

- :meth:`run` runs one :class:`ScheduledBatch`: prompt chunks and decode rows of several slots as
  one varlen forward, then the sampler on the rows that ask for it (and the logits of rows that ask
  for them: prompt logprobs; :mod:`dsv4.testing` builds its logits-only steps on this).
- A step of decode rows only is :meth:`decode_step`: embedding, all layers, head and sampler for a
  batch of slots at their own positions. With CUDA graphs on (:meth:`capture`), it is one graph
  replay per batch bucket (1, 2, 4, ...): the batch is padded with the scratch slot, whose state
  nobody reads.

The host keeps its own count of each slot's length (it issued every token), which it uses to refuse
a context overflow before touching any state.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .. import ops
from ..errors import ContextOverflowError
from ..model.transformer import Transformer
from ..parallel import SINGLE
from .batch import Row, ScheduledBatch, StepOutput
from .h2d import upload_ints, upload_parts
from .sampling import SampleOutput, SamplingParams
from .sampling import SampleFlags, SlotSampling
from .state import GenerationState


def batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: powers of two up to ``max_batch``, and it."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    slots: torch.Tensor          # static input [bucket]
    out: SampleOutput            # static outputs
    loaded: tuple[int, ...] = ()  # the slot list ``slots`` holds now (host copy)


class _SlotUpload:
    """Host -> device copies of a graph's slot list without stalling the host: two page-locked
    buffers used in turn, each reused only once its previous copy has completed."""

    def __init__(self, size: int):
        self.bufs = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def __call__(self, dst: torch.Tensor, values: Sequence[int]) -> None:
        i, self.turn = self.turn, 1 - self.turn
        if self.done[i] is not None:
            self.done[i].synchronize()
        buf = self.bufs[i]
        buf.copy_(torch.tensor(values, dtype=torch.int64))
        dst.copy_(buf, non_blocking=True)
        self.done[i] = torch.cuda.Event()
        self.done[i].record()


class Runner:
    """One model + its fixed-shape state for ``max_num_seqs`` sequences of ``max_model_len`` positions,
    run in steps of at most ``max_num_batched_tokens`` tokens (the names of
    :class:`~dsv4.engine.config.EngineConfig`; the engine passes its resolved values)."""

    def __init__(self, model: Transformer, max_num_seqs: int = 4, max_model_len: int = 4096,
                 qat_sim: bool = False, max_num_batched_tokens: int = 8192):
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
        self.model, self.qat_sim, self.max_num_batched_tokens = model, qat_sim, max_num_batched_tokens
        self.device = model.embed.weight.device
        #: tensor-parallel group of the model: every rank runs the sampler, rank 0's ids win
        self.tp = getattr(model, "tp", SINGLE)
        self.state = GenerationState(model.config, max_num_seqs + 1, max_model_len, model.dtype, self.device,
                                     qat_sim=qat_sim)
        self.scratch = max_num_seqs                   # padding rows of a graph bucket run here
        self.lengths = [0] * max_num_seqs             # host mirror of state.positions
        self.tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.sampling = SlotSampling(max_num_seqs + 1, model.config.vocab_size, self.device)
        self.graphs: dict[tuple[int, SampleFlags], _Graph] = {}
        #: eager steps read compressed entries up to the batch's longest context; a graph reads up
        #: to ``max_model_len`` (its shapes are fixed). True makes eager steps do the same, so eager
        #: and replay compute bit-identical steps (tests).
        self.full_bound = False
        self.graph_pool = None
        self._uploads: dict[int, _SlotUpload] = {}
        self.capture_seconds = 0.0
        self.graph_pool_bytes = 0

    @property
    def max_num_seqs(self) -> int:
        return self.scratch

    @property
    def max_model_len(self) -> int:
        return self.state.max_context

    @property
    def use_graphs(self) -> bool:
        return bool(self.graphs)

    # ------------------------------------------------------------------ slots
    def reset(self, slots: Sequence[int]) -> None:
        """Free ``slots`` for new sequences."""
        for s in slots:
            self._check_slot(s)
            self.lengths[s] = 0
        self.state.reset(list(slots))

    def start(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        """Make ``slot`` empty and give it a request's sampling parameters."""
        self.reset([slot])
        self.sampling.assign(slot, params, prompt_ids)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_num_seqs:
            raise IndexError(f"slot {slot} out of range (max_num_seqs={self.max_num_seqs})")

    def _reserve(self, slot: int, n: int) -> int:
        self._check_slot(slot)
        start = self.lengths[slot]
        if start + n > self.max_model_len:
            raise ContextOverflowError(
                f"slot {slot}: {start} + {n} tokens exceed max_model_len={self.max_model_len}")
        return start

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Run one engine step: every row's new tokens in one forward, then the sampler on the rows
        with ``sample`` (their ids stay on the device as the slots' next inputs).

        A step of sampled decode rows only is :meth:`decode_step` (one graph replay when graphs are
        captured). Any other step is one varlen forward (:meth:`Transformer.forward_varlen`): the
        rows of one token (decode rows and 1-token chunks) form one group, each longer row its own.
        Every check (slots, lengths, context) runs before any state changes."""
        rows = batch.rows
        if not rows:
            raise ValueError("run needs at least one row")
        slots = [r.slot for r in rows]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step got a slot twice: {slots}")
        for r in rows:
            self._check_slot(r.slot)
            have = 0 if r.new is not None else self.lengths[r.slot]
            if r.start != have:
                raise ValueError(f"slot {r.slot}: row starts at {r.start}, the slot holds {have} tokens")
            if r.token_ids is not None and not r.token_ids:
                raise ValueError(f"slot {r.slot}: a row needs at least one token")
            if r.start + r.num_tokens > self.max_model_len:
                raise ContextOverflowError(f"slot {r.slot}: {r.start} + {r.num_tokens} tokens exceed "
                                           f"max_model_len={self.max_model_len}")
        for r in rows:
            if r.new is not None:
                self.start(r.slot, r.new.params, r.new.prompt_ids)
        if batch.decode_only:
            return StepOutput(self.decode_step(slots), {})
        return self._run_varlen(rows)

    def _run_varlen(self, rows: Sequence[Row]) -> StepOutput:
        singles = [r for r in rows if r.num_tokens == 1]
        order = singles + [r for r in rows if r.num_tokens > 1]          # the flattened token order
        ids_host, offset, lo = [], {}, 0
        for r in order:
            ids_host += [0] if r.token_ids is None else list(r.token_ids)
            offset[r.slot] = lo
            lo += r.num_tokens
        decode = [r.slot for r in singles if r.token_ids is None]
        sample_slots = [r.slot for r in rows if r.sample]                  # sampled in the caller's row order
        logit_rows = [offset[r.slot] + r.num_tokens - 1 for r in rows if r.sample]
        wanted = {}
        for i, r in enumerate(rows):
            if r.logits:
                wanted[i] = (len(logit_rows), r.num_tokens)
                logit_rows += range(offset[r.slot], offset[r.slot] + r.num_tokens)
        # one host -> device copy of everything, each part 16-byte aligned (upload_parts): ids; the
        # one-token rows' slots and starts; each longer row's slot and start; every row's end; the
        # decode rows' token index and slot; the sampled slots; the logit rows
        D, N, k = len(decode), len(sample_slots), len(singles)
        longer = order[k:]
        parts = upload_parts([ids_host, [r.slot for r in singles], [r.start for r in singles]]
                             + [x for r in longer for x in ([r.slot], [r.start])]
                             + [[r.slot for r in order], [r.start + r.num_tokens for r in order],
                                [offset[s] for s in decode], decode, sample_slots, logit_rows], self.device)
        ids, one_slot, one_start = parts[:3]
        slot_t, end_t, dec_at, dec_slot, sample_t, rows_t = parts[3 + 2 * len(longer):]
        if D:
            ids = ids.index_copy(0, dec_at, self.tokens[dec_slot])
        groups = []
        if k:
            bound = self.max_model_len if self.full_bound else max(r.start for r in singles) + 1
            groups.append((one_slot, one_start, 1, bound))
        groups += [(parts[3 + 2 * j], parts[4 + 2 * j], r.num_tokens, r.start + r.num_tokens)
                   for j, r in enumerate(longer)]
        logits = self.model.forward_varlen(ids, groups, self.state.layers, rows_t, self.qat_sim)
        self.state.positions.index_copy_(0, slot_t, end_t)
        for r in order:
            self.lengths[r.slot] = r.start + r.num_tokens
        out = None
        if N:
            out = self._agree(self.sampling.sample(logits[:N], sample_t, self.sampling.flags(sample_slots)))
            self.tokens[sample_t] = out.token_ids
        return StepOutput(out, {i: logits[a:a + n] for i, (a, n) in wanted.items()})

    def _agree(self, out: SampleOutput) -> SampleOutput:
        """Tensor parallel: every rank holds the same full-vocab logits and samples, but rank 0's ids
        are the ones every rank feeds next (a device broadcast, captured in the step's graph), so no
        rank can drift even where a draw is not bit-reproducible across processes."""
        if not self.tp.parallel:
            return out
        return out._replace(token_ids=self.tp.broadcast(out.token_ids.contiguous(), src=0))

    # ------------------------------------------------------------------ decode
    def _check_batch(self, slots: Sequence[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode got a slot twice: {list(slots)}")
        for s in slots:
            self._reserve(s, 1)

    @torch.inference_mode()
    def decode_step(self, slots: Sequence[int]) -> SampleOutput:
        """One decode step for ``slots``: each feeds its last sampled token, the sampler picks the
        next one (left on the device as the next input). Returns the sampled ids (and logprobs),
        device tensors ``[len(slots)]``; with graphs they are views of the graph's static outputs,
        valid until the next step."""
        self._check_batch(slots)
        flags = self.sampling.flags(slots)
        n = len(slots)
        bucket = next((b for b in self._buckets() if b >= n), None) if self.use_graphs else None
        if bucket is None:
            idx = upload_ints(slots, self.device)
            bound = self.max_model_len if self.full_bound else max(self.lengths[s] for s in slots) + 1
            out = self._step(idx, flags, bound)
        else:
            graph = self.graphs.get((bucket, flags)) or self._capture_one(bucket, flags)
            padded = tuple(slots) + (self.scratch,) * (bucket - n)
            if padded != graph.loaded:        # steady decoding keeps the same slots: no copy at all
                self._uploads.setdefault(bucket, _SlotUpload(bucket))(graph.slots, padded)
                graph.loaded = padded
            graph.graph.replay()
            out = SampleOutput(graph.out.token_ids[:n],
                               None if graph.out.logprobs is None else graph.out.logprobs[:n],
                               None if graph.out.top_logprobs is None else
                               tuple(t[:n] for t in graph.out.top_logprobs))
        for s in slots:
            self.lengths[s] += 1
        return out

    def _step(self, idx: torch.Tensor, flags: SampleFlags, bound: int) -> SampleOutput:
        """The decode step as device work only (what a graph captures): inputs from ``tokens``,
        the forward, the sampler, the outputs back into ``tokens`` and ``positions``."""
        positions = self.state.positions
        start = positions[idx]
        logits, _ = self.model(self.tokens[idx].view(-1, 1), idx, start, self.state.layers, self.qat_sim,
                               context_bound=bound)
        out = self._agree(self.sampling.sample(logits[:, 0], idx, flags))
        self.tokens[idx] = out.token_ids
        positions[idx] = start + 1
        positions.narrow(0, self.scratch, 1).zero_()     # padding rows never move the scratch slot along (no host scalar: capturable)
        return out

    def warm_up(self, progress: bool = True) -> float:
        """Compile every kernel variant prefill and eager decode can reach, on the scratch slot
        (:mod:`dsv4.engine.warmup`); returns the seconds taken."""
        from .warmup import warm_up
        return warm_up(self, progress=progress)

    # ------------------------------------------------------------------ CUDA graphs
    def _buckets(self) -> list[int]:
        return sorted({b for b, _ in self.graphs})

    def capture(self, flag_sets: Sequence[SampleFlags] = (SampleFlags(), SampleFlags(all_greedy=False)),
                max_batch: int | None = None, progress: bool = True, buckets: Sequence[int] | None = None) -> None:
        """Capture one decode-step graph per batch bucket (up to ``max_batch``, default all slots;
        or exactly ``buckets``) and flag set, largest first (smaller ones reuse its memory pool).
        Prints the time taken and the pool's size."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        buckets = sorted(buckets) if buckets else batch_buckets(max_batch or self.max_num_seqs)
        if buckets[-1] > self.max_num_seqs:
            raise ValueError(f"graph bucket {buckets[-1]} exceeds max_num_seqs={self.max_num_seqs}")
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        todo = [(b, f) for b in sorted(buckets, reverse=True) for f in flag_sets]
        for b, f in tqdm(todo, desc="capturing CUDA graphs", disable=not progress, file=sys.stderr):
            self._capture_one(b, f)
        self.capture_seconds += time.perf_counter() - t0
        self.graph_pool_bytes = torch.cuda.memory_reserved(self.device) - before
        if progress:
            print(f"captured {len(self.graphs)} decode graphs (batch {', '.join(map(str, buckets))}) in "
                  f"{self.capture_seconds:.1f} s; graph memory pool {self.graph_pool_bytes / 2**20:.0f} MiB",
                  file=sys.stderr)

    @torch.inference_mode()
    def _capture_one(self, bucket: int, flags: SampleFlags) -> _Graph:
        """Warm up then capture the decode step for ``bucket`` rows (all on the scratch slot while
        capturing: no live slot's state moves)."""
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        idx = torch.full((bucket,), self.scratch, dtype=torch.int64, device=self.device)
        bound = self.max_model_len
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), ops.sync_free():
            for _ in range(2):
                self._step(idx, flags, bound)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with ops.sync_free(), torch.cuda.graph(graph, pool=self.graph_pool):
            out = self._step(idx, flags, bound)
        entry = _Graph(graph, idx, out, (self.scratch,) * bucket)
        self.graphs[(bucket, flags)] = entry
        return entry
