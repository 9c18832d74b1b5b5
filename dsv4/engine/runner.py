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
- A step of several decode steps (``ScheduledBatch.decode_steps``, the engine's choice for a step
  that also runs prompt chunks) replays the decode step that many times for its decode rows, then
  runs the other rows' varlen forward: an eager forward costs the host tens of ms of launches at any
  chunk size, and the GPU decodes meanwhile instead of idling.
- A step with a constrained row (``SampleFlags.grammar``) runs its forward and its sampler apart
  (two graphs per bucket: the forward, shared by every flag set, and the sampler), and calls the
  caller's ``before_sample`` in between: the engine learns the previous step's tokens and stages
  the grammar masks on the host while the device runs this step's forward, which needs no mask.
- Speculative decoding (``speculative``, :mod:`dsv4.engine.speculative`): a verify row feeds a
  slot's last token plus ``k`` drafts (from the host, or the MTP block's in ``drafts``); verify rows
  of one length form one group of the varlen forward, then acceptance and the rollback of every
  layer to the kept length. A step of verify rows only replays a verify graph per batch bucket
  (:meth:`capture_verify`). The host learns each row's kept count at the end of the step (one sync).
  A constrained verify row's masks, one per position, are staged by ``before_sample`` (before the
  replay, or between the varlen forward and the acceptance) into the sampler's ``draft_bits``, a
  static input of the verify graphs (flag set ``grammar``), like the decode graphs' bitmask.

The host keeps its own count of each slot's length (it issued every token), which it uses to refuse
a context overflow before touching any state.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..errors import ContextOverflowError
from ..model.cache import block_size
from ..model.transformer import Transformer
from ..parallel import SINGLE
from .batch import Row, ScheduledBatch, StepOutput
from .graphs import SlotUpload, StepGraph, batch_buckets, record
from .h2d import upload_ints, upload_parts
from .prefix_store import PrefixStore
from .sampling import SampleFlags, SampleOutput, SamplingParams, SlotSampling
from .speculative import SpeculativeConfig, mtp_drafts
from .speculative import rollback as spec_rollback
from .speculative import verify as verify_tokens
from .state import GenerationState


#: the sampler modes a decode (or verify) graph is captured for at start-up: greedy, and sampling
CAPTURED_FLAGS = (SampleFlags(), SampleFlags(all_greedy=False))


class Runner:
    """One model + its fixed-shape state for ``max_num_seqs`` sequences of ``max_model_len`` positions,
    run in steps of at most ``max_num_batched_tokens`` tokens (the names of
    :class:`~dsv4.engine.config.EngineConfig`; the engine passes its resolved values)."""

    def __init__(self, model: Transformer, max_num_seqs: int = 4, max_model_len: int = 4096,
                 qat_sim: bool = False, max_num_batched_tokens: int = 8192, prefix_cache_bytes: int = 0,
                 speculative: SpeculativeConfig | dict | str | None = None):
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
        self.model, self.qat_sim, self.max_num_batched_tokens = model, qat_sim, max_num_batched_tokens
        self.device = model.embed.weight.device
        #: tensor-parallel group of the model: every rank runs the sampler, rank 0's ids win
        self.tp = getattr(model, "tp", SINGLE)
        #: speculative decoding (verify rows, rollback; MTP drafts into ``drafts``), or None
        self.speculative = spec = SpeculativeConfig.parse(speculative)
        if spec is not None:
            spec.check_model(model.config, hasattr(model, "mtp"))
        self.state = GenerationState(model.config, max_num_seqs + 1, max_model_len, model.dtype, self.device,
                                     include_mtp=spec is not None and spec.method == "mtp", qat_sim=qat_sim)
        if spec is not None:
            for layer in self.state.layers:
                for comp in (layer.compressor, layer.indexer):
                    if comp is not None:
                        comp.enable_log(spec.k + 1)
        self.drafts = torch.zeros(max_num_seqs + 1, spec.k if spec else 1, dtype=torch.int64, device=self.device)
        self.scratch = max_num_seqs                   # padding rows of a graph bucket run here
        self.lengths = [0] * max_num_seqs             # host mirror of state.positions
        self.tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.sampling = SlotSampling(max_num_seqs + 1, model.config.vocab_size, self.device)
        if spec is not None:
            self.sampling.bitmask.enable_drafts(spec.k)     # a constrained verify row's mask per position
        self.graphs: dict[tuple[int, SampleFlags], StepGraph] = {}
        #: steps with a constrained row: the forward by bucket, the sampler by (bucket, flags)
        self.forward_graphs: dict[int, StepGraph] = {}
        self.sampler_graphs: dict[tuple[int, SampleFlags], StepGraph] = {}
        #: speculative verify steps captured like decode steps: (bucket, flags, host drafts?) -> graph
        self.verify_graphs: dict[tuple[int, SampleFlags, bool], StepGraph] = {}
        #: eager steps read compressed entries up to the batch's longest context; a graph reads up
        #: to ``max_model_len`` (its shapes are fixed). True makes eager steps do the same, so eager
        #: and replay compute bit-identical steps (tests).
        self.full_bound = False
        self.graph_pool = None
        self._uploads: dict[int, SlotUpload] = {}
        self.capture_seconds = 0.0
        self.graph_pool_bytes = 0
        #: the prefix cache's pages (``prefix_cache_bytes`` of them; None: caching off)
        self.prefix_store = (PrefixStore(self.state, block_size(model.config), prefix_cache_bytes)
                             if prefix_cache_bytes > 0 else None)

    @property
    def max_num_seqs(self) -> int:
        return self.scratch

    @property
    def max_model_len(self) -> int:
        return self.state.max_context

    @property
    def use_graphs(self) -> bool:
        return bool(self.graphs or self.forward_graphs)

    @staticmethod
    def _verify_only(rows: Sequence[Row]) -> bool:
        """Every row a sampled verify row of the same length, drafts all from the host or all from
        the device: the step a captured verify graph replays."""
        r0 = rows[0]
        return all(r.is_verify and r.sample and not r.logits and r.new is None and r.num_tokens == r0.num_tokens
                   and bool(r.draft) == bool(r0.draft) for r in rows)

    # ------------------------------------------------------------------ slots
    def _flush_saves(self) -> None:
        """Run the prefix-cache saves the last step deferred (before anything changes a slot)."""
        if self.prefix_store is not None:
            self.prefix_store.flush()

    def reset(self, slots: Sequence[int]) -> None:
        """Free ``slots`` for new sequences."""
        self._flush_saves()
        for s in slots:
            self._check_slot(s)
            self.lengths[s] = 0
        self.state.reset(list(slots))

    def start(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int],
              stop_ids: Sequence[int] | None = None) -> None:
        """Make ``slot`` empty and give it a request's sampling parameters (``stop_ids``: what its
        ``min_tokens`` holds back, :class:`~dsv4.engine.batch.NewSequence`)."""
        self.reset([slot])
        self.sampling.assign(slot, params, prompt_ids, stop_ids)

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
    def run(self, batch: ScheduledBatch, before_sample: Callable[[], None] | None = None) -> StepOutput:
        """Run one engine step: every row's new tokens in one forward, then the sampler on the rows
        with ``sample`` (their ids stay on the device as the slots' next inputs). ``before_sample``
        is called once, after the forward is launched and before the sampler is (the engine stages
        grammar masks there); a step without a constrained row calls it first.

        A step of sampled decode rows only is :meth:`decode_step` (one graph replay when graphs are
        captured). Any other step is one varlen forward (:meth:`Transformer.forward_varlen`): the
        rows of one token (decode rows and 1-token chunks) form one group, each longer row its own.
        Every check (slots, lengths, context) runs before any state changes. The step's prefix-cache
        saves (``batch.saves``) are deferred to the start of the next call that touches the state
        (:meth:`PrefixStore.defer`), so the caller's copy of the sampled ids is queued first."""
        self._flush_saves()
        rows = batch.rows
        if not rows:
            raise ValueError("run needs at least one row")
        slots = [r.slot for r in rows]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step got a slot twice: {slots}")
        steps = batch.decode_steps
        if steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {steps}")
        for r in rows:
            if steps > 1 and r.is_decode and (r.is_verify or not r.sample or r.logits):
                raise ValueError(f"slot {r.slot}: a step of {steps} decode steps takes plain sampled decode rows only")
            self._check_slot(r.slot)
            if r.new is not None and r.new.cached is not None and self.prefix_store is None:
                raise ValueError(f"slot {r.slot}: a cached prefix to restore, but prefix caching is off")
            have = self.lengths[r.slot] if r.new is None else r.new.cached.length if r.new.cached else 0
            if r.start != have:
                raise ValueError(f"slot {r.slot}: row starts at {r.start}, the slot holds {have} tokens")
            if r.token_ids is not None and not r.token_ids:
                raise ValueError(f"slot {r.slot}: a row needs at least one token")
            n = steps if r.is_decode else r.num_tokens
            if r.start + n > self.max_model_len:
                raise ContextOverflowError(f"slot {r.slot}: {r.start} + {n} tokens exceed "
                                           f"max_model_len={self.max_model_len}")
        ends = {r.slot: r.start + r.num_tokens for r in rows}
        decoding = {r.slot: r.start for r in rows if r.is_decode}
        prompts = {r.slot: r for r in rows if r.token_ids is not None and not r.is_verify}
        snaps: dict[int, list[tuple[int, int, int]]] = {}      # slot -> (start, boundary, stage slot)
        staged: dict[int, int] = {}                            # save index -> its stage slot
        for i, sv in enumerate(batch.saves):
            self._check_slot(sv.slot)
            end = (sv.first_block + len(sv.blocks)) * self.prefix_store.block if self.prefix_store else -1
            at = ends.get(sv.slot, self.lengths[sv.slot])
            if sv.decode_step is not None:       # after decode step j of a decode row: its length then
                ok = steps > 1 and sv.slot in decoding and 0 <= sv.decode_step < steps
                at = decoding[sv.slot] + sv.decode_step + 1 if ok else -1
            r = prompts.get(sv.slot)
            inside = (sv.tail and sv.decode_step is None and r is not None and r.start < end < at
                      and len(staged) < self.prefix_store.snapshots)
            if self.prefix_store is None or (sv.tail and at != end and not inside) or at < 0:
                raise ValueError(f"slot {sv.slot}: cannot save {len(sv.blocks)} blocks from block {sv.first_block} "
                                 f"(prefix caching {'on' if self.prefix_store else 'off'})")
            if inside:                           # a boundary inside the prompt chunk: its snapshot
                staged[i] = len(staged)
                snaps.setdefault(sv.slot, []).append((r.start, end, staged[i]))
        for r in rows:
            if r.new is not None:
                self.start(r.slot, r.new.params, r.new.prompt_ids, r.new.stop_ids)
                if r.new.cached is not None:
                    self._restore(r.slot, r.new.cached)
        if steps > 1:
            out = self._run_decode_steps(rows, steps, batch.saves, before_sample, snaps)
        elif batch.decode_only:
            out = StepOutput(self.decode_step(slots, before_sample), {})
        elif self.verify_graphs and self._verify_only(rows):
            if before_sample is not None:
                before_sample()
            out = self._verify_replay(rows)
        else:
            out = self._run_varlen(rows, before_sample, snaps)
        for i, sv in enumerate(batch.saves):      # after the caller queued the sampled ids' copy
            if sv.decode_step is None:
                self.prefix_store.defer(sv.slot, sv.first_block, sv.blocks, sv.tail, staged.get(i))
        return out

    def _run_decode_steps(self, rows: Sequence[Row], steps: int, saves: Sequence, before_sample,
                          snaps: dict | None = None) -> StepOutput:
        """A step of ``steps`` decode steps: the decode rows' steps first (graph replays when
        captured; each replay's outputs copied out before the next overwrites them; a save planned
        after step j runs right after it), then one varlen forward of the other rows. The sampled
        rows come back in row order as ``[N, steps]`` ids: a decode row's ``steps`` tokens, another
        row's one token in column 0 (``emitted`` says how many)."""
        dec = [r for r in rows if r.is_decode]
        rest = [r for r in rows if not r.is_decode]
        slots = [r.slot for r in dec]
        after: dict[int, list] = {}
        for sv in saves:
            if sv.decode_step is not None:
                after.setdefault(sv.decode_step, []).append(sv)
        if before_sample is not None and not rest:
            before_sample()
            before_sample = None
        outs = []
        for j in range(steps if dec else 0):
            o = self.decode_step(slots)
            outs.append(SampleOutput(o.token_ids.clone(), None if o.logprobs is None else o.logprobs.clone(),
                                     None if o.top_logprobs is None else tuple(t.clone() for t in o.top_logprobs)))
            for sv in after.get(j, ()):
                self.prefix_store.save(sv.slot, sv.first_block, sv.blocks, sv.tail)
        other = self._run_varlen(rest, before_sample, snaps) if rest else StepOutput(None, {})
        parts = []                              # (sampled rows in order, their [n, steps] outputs)
        if outs:
            tops = None if outs[0].top_logprobs is None else tuple(
                torch.stack([o.top_logprobs[i] for o in outs], 1) for i in range(2))
            parts.append((dec, SampleOutput(torch.stack([o.token_ids for o in outs], 1),
                                            None if outs[0].logprobs is None else
                                            torch.stack([o.logprobs for o in outs], 1), tops)))
        if other.sampled is not None:
            o = other.sampled
            pad = lambda t, fill: torch.nn.functional.pad(t.unsqueeze(1), (0, steps - 1), value=fill)  # noqa: E731
            parts.append(([r for r in rest if r.sample], SampleOutput(
                pad(o.token_ids, -1), None if o.logprobs is None else pad(o.logprobs, 0.0),
                None if o.top_logprobs is None else
                tuple(torch.nn.functional.pad(t.unsqueeze(1), (0, 0, 0, steps - 1)) for t in o.top_logprobs))))
        index = {i: j for j, i in enumerate(i for i, r in enumerate(rows) if not r.is_decode)}
        logits = {i: other.logits[index[i]] for i in index if index[i] in other.logits}
        sampled = [r for r in rows if r.sample]
        if not parts:
            return StepOutput(None, logits)
        return StepOutput(_in_row_order(parts, sampled, self.device), logits,
                          [steps if r.is_decode else 1 for r in sampled])

    def _restore(self, slot: int, cached) -> None:
        """Start ``slot`` from a cached prefix: its state copied in from the cache's pages (device
        copies only), its length that of the prefix."""
        self.prefix_store.restore(slot, cached.blocks, cached.tail)
        self.lengths[slot] = cached.length
        self.state.positions[slot].fill_(cached.length)

    def _run_varlen(self, rows: Sequence[Row], before_sample: Callable[[], None] | None = None,
                    snaps: dict[int, list[tuple[int, int, int]]] | None = None) -> StepOutput:
        """One varlen forward of ``rows`` (see :meth:`run`); ``snaps``: by slot, the block boundaries
        inside its prompt row whose ``window`` pieces the forward leaves in the prefix store's stage."""
        singles = [r for r in rows if r.num_tokens == 1]
        verify: dict[int, list[Row]] = {}                                  # verify rows by length
        for r in rows:
            if r.is_verify:
                verify.setdefault(r.num_tokens, []).append(r)
        vrows = [r for S in sorted(verify) for r in verify[S]]
        order = singles + vrows + [r for r in rows if r.num_tokens > 1 and not r.is_verify]   # flattened order
        ids_host, offset, lo = [], {}, 0
        for r in order:
            ids_host += ([0] * (1 + r.device_draft) + list(r.draft)) if r.token_ids is None else list(r.token_ids)
            offset[r.slot] = lo
            lo += r.num_tokens
        decode = [r.slot for r in order if r.token_ids is None]            # first token from ``tokens``
        plain = [r for r in rows if r.sample and not r.is_verify]          # sampled by the sampler
        sample_slots = [r.slot for r in plain]
        logit_rows = [offset[r.slot] + r.num_tokens - 1 for r in plain]
        logit_rows += [offset[r.slot] + i for r in vrows for i in range(r.num_tokens)]
        wanted = {}
        for i, r in enumerate(rows):
            if r.logits:
                wanted[i] = (len(logit_rows), r.num_tokens)
                logit_rows += range(offset[r.slot], offset[r.slot] + r.num_tokens)
        dev_draft = [(offset[r.slot] + 1 + j, r.slot, j) for r in vrows for j in range(r.device_draft)]
        # one host -> device copy of everything, each part 16-byte aligned (upload_parts): ids; the
        # one-token rows' slots and starts; each verify group's and each longer row's slots and
        # starts; every row's slot and end; the decode rows' token index and slot; the sampled
        # slots; the logit rows; the device drafts' token index, slot and column
        D, N, k = len(decode), len(sample_slots), len(singles)
        longer = [verify[S] for S in sorted(verify)] + [[r] for r in order[k + len(vrows):]]
        lists = ([ids_host, [r.slot for r in singles], [r.start for r in singles]]
                 + [x for g in longer for x in ([r.slot for r in g], [r.start for r in g])]
                 + [[r.slot for r in order], [r.start + r.num_tokens for r in order],
                    [offset[s] for s in decode], decode, sample_slots, logit_rows])
        if dev_draft:
            lists += [list(x) for x in zip(*dev_draft)]
        parts = upload_parts(lists, self.device)
        ids, one_slot, one_start = parts[:3]
        g_at = 3 + 2 * len(longer)
        slot_t, end_t, dec_at, dec_slot, sample_t, rows_t = parts[g_at:g_at + 6]
        if D:
            ids = ids.index_copy(0, dec_at, self.tokens[dec_slot])
        if dev_draft:
            at, dslot, col = parts[g_at + 6:g_at + 9]
            ids = ids.index_copy(0, at, self.drafts[dslot, col])
        groups = []
        if k:
            bound = self.max_model_len if self.full_bound else max(r.start for r in singles) + 1
            groups.append((one_slot, one_start, 1, bound))
        for j, g in enumerate(longer):
            bound = self.max_model_len if self.full_bound and g[0].is_verify else max(r.start + r.num_tokens for r in g)
            groups.append((parts[3 + 2 * j], parts[4 + 2 * j], g[0].num_tokens, bound))
        # verify groups: what their tokens overwrite, for the rollback (``groups`` index 1.. when k)
        vgroups = [(groups[int(bool(k)) + j], verify[S]) for j, S in enumerate(sorted(verify))]
        saved = [self._save(g[0], g[1], g[2]) for g, _ in vgroups]
        mtp = self.speculative is not None and self.speculative.method == "mtp"
        first = int(bool(k)) + len(vgroups)                # the prompt rows' groups: one row each, in order
        by_group = {first + j: tuple(snaps[r.slot]) for j, r in enumerate(order[k + len(vrows):])
                    if snaps and r.slot in snaps}
        res = self.model.forward_varlen(ids, groups, self.state.layers, rows_t, self.qat_sim, streams=mtp,
                                        snaps=by_group)
        logits, h, ctx = res if mtp else (res, None, None)
        self.state.positions.index_copy_(0, slot_t, end_t)
        if before_sample is not None:
            before_sample()
        out = None
        if N:
            out = self._agree(self.sampling.sample(logits[:N], sample_t, self.sampling.flags(sample_slots)))
            self.tokens[sample_t] = out.token_ids
        if not vgroups:
            if mtp:
                self._mtp_step(rows, offset, ids, h, ctx, out, [])
            for r in order:
                self.lengths[r.slot] = r.start + r.num_tokens
            return StepOutput(out, {i: logits[a:a + n] for i, (a, n) in wanted.items()})
        # verify rows: accept, roll every layer back to the kept length, the last emitted id is the next input
        at, vouts = N, []
        for ((vslot, vstart, S, _), g), sv in zip(vgroups, saved):
            vlog = logits[at:at + len(g) * S].view(len(g), S, -1)
            at += len(g) * S
            drafts = ids[offset[g[0].slot]:offset[g[0].slot] + len(g) * S].view(len(g), S)[:, 1:]
            vo, kept = verify_tokens(self.sampling, vlog, vslot, drafts, self.sampling.flags([r.slot for r in g]))
            vo = vo._replace(token_ids=self._agree(SampleOutput(vo.token_ids, None, None)).token_ids)
            kept = (vo.token_ids >= 0).sum(1)
            spec_rollback(self.state.layers, sv, vslot, vstart, S, kept)
            self.state.positions[vslot] = vstart + kept
            self.tokens[vslot] = vo.token_ids.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
            vouts.append((g, vo, kept, vslot, vstart))
        if mtp:
            self._mtp_step(rows, offset, ids, h, ctx, out, vouts)
        kept_host = torch.cat([kv for _, _, kv, _, _ in vouts]).tolist()         # the host learns the lengths
        n_kept = dict(zip([r.slot for g, *_ in vouts for r in g], kept_host))
        for r in order:
            self.lengths[r.slot] = r.start + (n_kept[r.slot] if r.is_verify else r.num_tokens)
        return self._spec_output(rows, out, vouts, n_kept, {i: logits[a:a + n] for i, (a, n) in wanted.items()})

    def _spec_output(self, rows: Sequence[Row], out: SampleOutput | None, vouts: list, n_kept: dict[int, int],
                     logits: dict) -> StepOutput:
        """The step's sampled rows in row order as ``[N, n]`` ids (logprobs, top logprobs): a plain
        row's one token in column 0, a verify row's emitted tokens."""
        n = max(vo.token_ids.shape[1] for _, vo, *_ in vouts)
        pad = lambda t, fill: torch.nn.functional.pad(t, (0, n - t.shape[1]), value=fill)   # noqa: E731
        pad3 = lambda t: torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[1]))              # noqa: E731
        ids, lps, tops, where = [], [], [], {}
        if out is not None:
            ids.append(pad(out.token_ids.unsqueeze(1), -1))
            lps.append(None if out.logprobs is None else pad(out.logprobs.unsqueeze(1), 0.0))
            tops.append(None if out.top_logprobs is None else tuple(pad3(t.unsqueeze(1)) for t in out.top_logprobs))
            where.update({r.slot: i for i, r in enumerate(r for r in rows if r.sample and not r.is_verify)})
        for g, vo, *_ in vouts:
            where.update({r.slot: len(where) + i for i, r in enumerate(g)})
            ids.append(pad(vo.token_ids, -1))
            lps.append(None if vo.logprobs is None else pad(vo.logprobs, 0.0))
            tops.append(None if vo.top_logprobs is None else tuple(pad3(t) for t in vo.top_logprobs))
        sampled = [r for r in rows if r.sample]
        perm = upload_ints([where[r.slot] for r in sampled], self.device)
        token_ids = torch.cat(ids).index_select(0, perm)
        logprobs = top = None
        if all(x is not None for x in lps):
            logprobs = torch.cat(lps).index_select(0, perm)
        if all(x is not None for x in tops):
            w = min(t[0].shape[-1] for t in tops)
            top = tuple(torch.cat([t[i][..., :w] for t in tops]).index_select(0, perm) for i in range(2))
        emitted = [n_kept[r.slot] if r.is_verify else 1 for r in sampled]
        return StepOutput(SampleOutput(token_ids, logprobs, top), logits, emitted)

    def _mtp_step(self, rows: Sequence[Row], offset: dict[int, int], ids: torch.Tensor, h: torch.Tensor, ctx,
                  out: SampleOutput | None, vouts: list) -> None:
        """Speculative MTP: the block takes every position of the step (its input at position ``t``
        is the main streams there and token ``t + 1``: the next fed token, the sampled or emitted
        one, or a chunk's ``next_token``), then drafts ``k`` tokens for every row that sampled, into
        the draft buffer (the next step's verify rows read them)."""
        plain = [r for r in rows if r.sample and not r.is_verify]        # the sampler's rows, in ``out`` order
        chunks = [r for r in rows if not r.sample and r.next_token is not None]
        lists = [[offset[r.slot] + r.num_tokens - 1 for r in chunks], [r.next_token for r in chunks],
                 [offset[r.slot] + r.num_tokens - 1 for r in plain], [r.slot for r in plain],
                 [r.start + r.num_tokens for r in plain]] + [[offset[r.slot] for r in g] for g, *_ in vouts]
        parts = upload_parts(lists, self.device)
        c_at, c_id, p_last, p_slot, p_len = parts[:5]
        nxt = torch.roll(ids, -1)
        if chunks:
            nxt = nxt.index_copy(0, c_at, c_id)
        sel, slots, length = [p_last], [p_slot], [p_len]
        if plain:
            nxt = nxt.index_copy(0, p_last, out.token_ids)
        for (g, vo, kept, vslot, vstart), first in zip(vouts, parts[5:]):
            S = vo.token_ids.shape[1]
            at = (first.unsqueeze(1) + torch.arange(S, device=self.device)).flatten()
            nxt = nxt.index_copy(0, at, vo.token_ids.clamp(min=0).flatten())
            sel.append(first + kept - 1)
            slots.append(vslot)
            length.append(vstart + kept)
        sel, slots, length = torch.cat(sel), torch.cat(slots), torch.cat(length)
        drafts = mtp_drafts(self.model, self.state.layers, h, nxt, ctx, sel, slots, length, self.speculative.k,
                            self.qat_sim, self.max_model_len)
        self.drafts[slots] = drafts

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
    def decode_step(self, slots: Sequence[int], before_sample: Callable[[], None] | None = None) -> SampleOutput:
        """One decode step for ``slots``: each feeds its last sampled token, the sampler picks the
        next one (left on the device as the next input). Returns the sampled ids (and logprobs),
        device tensors ``[len(slots)]``; with graphs they are views of the graph's static outputs,
        valid until the next step.

        With a constrained row the forward and the sampler are launched apart and ``before_sample``
        runs in between (it may stage grammar masks: the sampler reads them); otherwise the whole
        step is one launch (one graph) and ``before_sample`` runs first."""
        self._flush_saves()
        self._check_batch(slots)
        flags = self.sampling.flags(slots)
        n = len(slots)
        split = flags.grammar
        if before_sample is not None and not split:
            before_sample()
        bucket = next((b for b in self._buckets() if b >= n), None) if self.use_graphs else None
        if bucket is None:
            idx = upload_ints(slots, self.device)
            bound = self.max_model_len if self.full_bound else max(self.lengths[s] for s in slots) + 1
            if split:
                logits = self._forward(idx, bound)
                if before_sample is not None:
                    before_sample()
                out = self._sample(idx, logits, flags)
            else:
                out = self._step(idx, flags, bound)
        else:
            padded = tuple(slots) + (self.scratch,) * (bucket - n)
            if split:
                # both graphs exist before any slot is loaded (a capture runs on the scratch slot)
                sampler = self.sampler_graphs.get((bucket, flags)) or self._capture_sampler(bucket, flags)
                graph = self.forward_graphs[bucket]
            else:
                graph = self.graphs.get((bucket, flags)) or self._capture_one(bucket, flags)
            if padded != graph.loaded:        # steady decoding keeps the same slots: no copy at all
                self._uploads.setdefault(bucket, SlotUpload(bucket))(graph.slots, padded)
                graph.loaded = padded
            graph.graph.replay()
            if split:
                if before_sample is not None:
                    before_sample()
                sampler.graph.replay()
                graph = sampler
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
        return self._sample(idx, self._forward(idx, bound), flags)

    def _forward(self, idx: torch.Tensor, bound: int) -> torch.Tensor:
        """The decode step's forward (device work only): the last-token logits ``[B, vocab]``; the
        slots' positions move on by one."""
        positions = self.state.positions
        start = positions[idx]
        logits, _ = self.model(self.tokens[idx].view(-1, 1), idx, start, self.state.layers, self.qat_sim,
                               context_bound=bound)
        positions[idx] = start + 1
        positions.narrow(0, self.scratch, 1).zero_()     # padding rows never move the scratch slot along (no host scalar: capturable)
        return logits[:, 0]

    def _sample(self, idx: torch.Tensor, logits: torch.Tensor, flags: SampleFlags) -> SampleOutput:
        """The decode step's sampler (device work only): the next ids, also into ``tokens``."""
        out = self._agree(self.sampling.sample(logits, idx, flags))
        self.tokens[idx] = out.token_ids
        return out

    def precompile(self, graphs: bool = True, progress: bool = True) -> float:
        """Compile, on a thread pool, the kernels :meth:`warm_up` and (``graphs``) :meth:`capture`
        will launch, before they run (:func:`dsv4.engine.warmup.precompile`); returns the seconds."""
        from .warmup import precompile
        captured = tuple((b, f) for b in batch_buckets(self.max_num_seqs) for f in CAPTURED_FLAGS) \
            if graphs else ()
        return precompile(self, captured, progress=progress)

    def warm_up(self, progress: bool = True) -> float:
        """Compile every kernel variant prefill and eager decode can reach, on the scratch slot
        (:mod:`dsv4.engine.warmup`); returns the seconds taken."""
        from .warmup import warm_up
        return warm_up(self, progress=progress)

    # ------------------------------------------------------------------ CUDA graphs
    def _buckets(self) -> list[int]:
        return sorted({b for b, _ in self.graphs} | set(self.forward_graphs))

    def _record(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        return record(fn, self.graph_pool, self.device)

    # ------------------------------------------------------------------ verify steps (speculative)
    def _save(self, slots: torch.Tensor, start: torch.Tensor, S: int) -> list:
        """Every layer's state a verify forward of ``S`` tokens may overwrite (for the rollback)."""
        return [layer.save(slots, start, S) for layer in self.state.layers]

    def _verify_step(self, idx: torch.Tensor, drafts: torch.Tensor | None, flags: SampleFlags, bound: int
                     ) -> tuple[SampleOutput, torch.Tensor]:
        """A verify step as device work only (what a verify graph captures): each slot of ``idx``
        feeds its last token and ``k`` drafts (``drafts [B, k]``, or the draft buffer), one forward,
        acceptance, rollback of every layer to the kept length, the next inputs and (MTP) drafts.
        Returns the emitted ids ``[B, 1 + k]`` (with logprobs) and the kept counts ``[B]``."""
        k = self.speculative.k
        S = k + 1
        positions = self.state.positions
        start = positions[idx]
        drafts = self.drafts[idx] if drafts is None else drafts
        ids = torch.cat([self.tokens[idx].unsqueeze(1), drafts], 1)                  # [B, S]
        saved = self._save(idx, start, S)
        ctx = self.model.context(ids, idx, start, self.qat_sim, bound)
        h = self.model.hidden_streams(ctx, self.state.layers)
        logits = self.model.logits(h)                                                # [B, S, V]
        out, _ = verify_tokens(self.sampling, logits, idx, drafts, flags)
        tokens = self._agree(SampleOutput(out.token_ids, None, None)).token_ids
        kept = (tokens >= 0).sum(1)
        spec_rollback(self.state.layers, saved, idx, start, S, kept)
        positions[idx] = start + kept
        self.tokens[idx] = tokens.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        if self.speculative.method == "mtp":
            sel = torch.arange(idx.shape[0], device=idx.device) * S + kept - 1
            self.drafts[idx] = mtp_drafts(self.model, self.state.layers, h, tokens.clamp(min=0), ctx, sel, idx,
                                          start + kept, k, self.qat_sim, bound)
        positions.narrow(0, self.scratch, 1).zero_()     # padding rows never move the scratch slot along
        return out._replace(token_ids=tokens), kept

    def _verify_replay(self, rows: Sequence[Row]) -> StepOutput:
        """Replay the verify graph of the batch's bucket (captured on first use)."""
        n, slots = len(rows), [r.slot for r in rows]
        flags = self.sampling.flags(slots)
        host = bool(rows[0].draft)
        bucket = next(b for b in sorted({b for b, *_ in self.verify_graphs}) + [self.max_num_seqs] if b >= n)
        graph = self.verify_graphs.get((bucket, flags, host)) or self._capture_verify(bucket, flags, host)
        padded = tuple(slots) + (self.scratch,) * (bucket - n)
        if padded != graph.loaded:
            graph.slots.copy_(torch.tensor(padded, dtype=torch.int64))
            graph.loaded = padded
        if host:
            k = self.speculative.k
            graph.drafts.copy_(torch.tensor([list(r.draft) for r in rows] + [[0] * k] * (bucket - n)))
        graph.graph.replay()
        kept = graph.kept[:n].tolist()                   # the host learns the lengths (one sync)
        for r, c in zip(rows, kept):
            self.lengths[r.slot] = r.start + c
        o = graph.out
        out = SampleOutput(o.token_ids[:n], None if o.logprobs is None else o.logprobs[:n],
                           None if o.top_logprobs is None else tuple(t[:n] for t in o.top_logprobs))
        return StepOutput(out, {}, kept)

    def capture_verify(self, flag_sets: Sequence[SampleFlags] = CAPTURED_FLAGS,
                       buckets: Sequence[int] | None = None, progress: bool = True) -> None:
        """Capture the speculative verify step per batch bucket and flag set (as :meth:`capture`
        does the decode step): host drafts (n-gram) or the draft buffer (MTP)."""
        if self.speculative is None:
            raise RuntimeError("verify graphs need speculative decoding on")
        buckets = sorted(buckets) if buckets else batch_buckets(self.max_num_seqs)
        host = self.speculative.method != "mtp"
        for b in tqdm(sorted(buckets, reverse=True), desc="capturing verify graphs", disable=not progress,
                      file=sys.stderr):
            for f in flag_sets:
                self._capture_verify(b, f, host)

    @torch.inference_mode()
    def _capture_verify(self, bucket: int, flags: SampleFlags, host: bool) -> StepGraph:
        idx = torch.full((bucket,), self.scratch, dtype=torch.int64, device=self.device)
        drafts = torch.zeros(bucket, self.speculative.k, dtype=torch.int64, device=self.device) if host else None
        graph, (out, kept) = self._record(lambda: self._verify_step(idx, drafts, flags, self.max_model_len))
        entry = StepGraph(graph, idx, out, (self.scratch,) * bucket, drafts, kept)
        self.verify_graphs[(bucket, flags, host)] = entry
        return entry

    def capture(self, flag_sets: Sequence[SampleFlags] = CAPTURED_FLAGS,
                max_batch: int | None = None, progress: bool = True, buckets: Sequence[int] | None = None) -> None:
        """Capture one decode-step graph per batch bucket (up to ``max_batch``, default all slots;
        or exactly ``buckets``) and flag set, largest first (smaller ones reuse its memory pool); a
        flag set with ``grammar`` gets the bucket's forward graph and its own sampler graph instead.
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
            if f.grammar and (b, f) not in self.sampler_graphs:
                self._capture_sampler(b, f)
            elif not f.grammar and (b, f) not in self.graphs:
                self._capture_one(b, f)
        self.capture_seconds += time.perf_counter() - t0
        self.graph_pool_bytes = torch.cuda.memory_reserved(self.device) - before
        if progress:
            n = len(self.graphs) + len(self.forward_graphs) + len(self.sampler_graphs)
            print(f"captured {n} decode graphs (batch {', '.join(map(str, buckets))}) in "
                  f"{self.capture_seconds:.1f} s; graph memory pool {self.graph_pool_bytes / 2**20:.0f} MiB",
                  file=sys.stderr)

    @torch.inference_mode()
    def _capture_one(self, bucket: int, flags: SampleFlags) -> StepGraph:
        """Warm up then capture the decode step for ``bucket`` rows (all on the scratch slot while
        capturing: no live slot's state moves)."""
        idx = torch.full((bucket,), self.scratch, dtype=torch.int64, device=self.device)
        graph, out = self._record(lambda: self._step(idx, flags, self.max_model_len))
        entry = StepGraph(graph, idx, out, (self.scratch,) * bucket)
        self.graphs[(bucket, flags)] = entry
        return entry

    @torch.inference_mode()
    def _capture_sampler(self, bucket: int, flags: SampleFlags) -> StepGraph:
        """Capture the sampler of a step with a constrained row for ``bucket`` rows, after the
        bucket's forward graph (captured first if missing) whose slots and logits it reads; both on
        the scratch slot, so no live slot's state moves."""
        scratch = (self.scratch,) * bucket
        fwd = self.forward_graphs.get(bucket)
        if fwd is None:
            idx = torch.full((bucket,), self.scratch, dtype=torch.int64, device=self.device)
            graph, logits = self._record(lambda: self._forward(idx, self.max_model_len))
            fwd = self.forward_graphs[bucket] = StepGraph(graph, idx, None, scratch, logits=logits)
        if fwd.loaded != scratch:              # its slots hold the last batch's: capture on the scratch slot
            fwd.slots.fill_(self.scratch)
            fwd.loaded = scratch
        graph, out = self._record(lambda: self._sample(fwd.slots, fwd.logits, flags))
        entry = self.sampler_graphs[(bucket, flags)] = StepGraph(graph, fwd.slots, out, scratch)
        return entry


def _in_row_order(parts: list[tuple[list[Row], SampleOutput]], sampled: Sequence[Row], device) -> SampleOutput:
    """Concatenate per-group sampled outputs ``[n_g, steps]`` (each group's rows in its own order)
    and put them in ``sampled``'s order; logprobs zero and top logprobs zero-padded to the widest
    where a group has none (the engine reads them only for the requests that asked)."""
    where, at = {}, 0
    for group, _ in parts:
        where.update({r.slot: at + i for i, r in enumerate(group)})
        at += len(group)
    perm = upload_ints([where[r.slot] for r in sampled], device)
    outs = [o for _, o in parts]
    ids = torch.cat([o.token_ids for o in outs]).index_select(0, perm)
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = torch.cat([o.token_ids.new_zeros(o.token_ids.shape, dtype=torch.float32) if o.logprobs is None
                              else o.logprobs.float() for o in outs]).index_select(0, perm)
    top = None
    if any(o.top_logprobs is not None for o in outs):
        w = max(o.top_logprobs[0].shape[-1] for o in outs if o.top_logprobs is not None)

        def widen(o: SampleOutput, i: int) -> torch.Tensor:
            if o.top_logprobs is None:
                dtype = torch.int64 if i == 0 else torch.float32
                return torch.zeros(*o.token_ids.shape, w, dtype=dtype, device=o.token_ids.device)
            t = o.top_logprobs[i]
            return torch.nn.functional.pad(t, (0, w - t.shape[-1]))
        top = tuple(torch.cat([widen(o, i) for o in outs]).index_select(0, perm) for i in range(2))
    return SampleOutput(ids, logprobs, top)

