"""The prefix cache's device memory: fixed-size pages that hold slot state at block boundaries.

DESIGN decision 7. The generation state at a block boundary (:func:`dsv4.model.cache.block_size`)
is the ``entries`` rows before it plus the ``window`` pieces (:data:`dsv4.model.cache.PIECE_KINDS`;
the ``open`` pieces hold nothing then). So the cache keeps two things, in pages of one byte pool:

- a **block**: one page with the ``entries`` rows of ``block_size`` positions of every layer
  (append-only state, shared by every prefix that contains the block);
- a **tail**: the ``window`` pieces of one slot at one boundary, over as many pages as it needs.

A boundary inside a prompt chunk is saved without ending the chunk there: the forward leaves the
``window`` pieces as they are at the boundary in a small *stage* state (``snapshots`` slots of the
same layout, :attr:`dsv4.model.cache.LayerCache.stage`), and the tail is copied from there; the
entries before the boundary are final in the slot after the forward.

Saving and restoring are device copies only, one indexed copy per state buffer whatever the number
of blocks (page numbers go host -> device; nothing comes back). The runner owns this pool and
executes what the host-side index (:mod:`dsv4.engine.prefix_cache`) plans, so under tensor
parallel every rank copies its own state the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.cache import StatePiece
from .h2d import upload_ints
from .state import GenerationState


ALIGN = 16   # every piece starts 16-byte aligned in a page (any dtype can be viewed there, kernels like it)
#: boundaries inside prompt chunks one step can save (stage slots: ~4 MiB each on Flash); the
#: scheduler ends a chunk at any further one
SNAPSHOTS = 8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, ``[..., last * itemsize]`` uint8 (a view)."""
    return t.view(torch.uint8)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PrefixStore:
    """``num_pages`` pages of ``page_bytes`` each, for ``state``'s slots (``block`` positions a block),
    and ``snapshots`` stage slots for boundaries inside prompt chunks, all within ``budget_bytes``."""

    def __init__(self, state: GenerationState, block: int, budget_bytes: int, snapshots: int = SNAPSHOTS):
        self.state, self.block = state, block
        pieces = state.pieces()
        # the stage: the same layers (MTP included) for ``snapshots`` slots of one block's positions
        # (its entries are never used), at most 1/16 of the budget; each layer's state points at its stage
        mtp = len(state.layers) > state.config.num_hidden_layers
        stage = lambda n, dev: GenerationState(state.config, n, block, state.dtype, dev,  # noqa: E731
                                               include_mtp=mtp, qat_sim=state.qat_sim)
        self.snapshots = min(snapshots, int(budget_bytes // 16 // stage(1, "meta").nbytes()))
        self.stage = stage(self.snapshots, state.device) if self.snapshots else None
        for layer, st in zip(state.layers, self.stage.layers if self.stage else ()):
            layer.stage = st
            for comp, sc in ((layer.compressor, st.compressor), (layer.indexer, st.indexer)):
                if comp is not None:
                    comp.stage = sc
        self.stage_window = [p for p in self.stage.pieces() if p.kind == "window"] if self.stage else []
        budget_bytes -= self.stage.nbytes() if self.stage else 0
        self.entries = [p for p in pieces if p.kind == "entries"]
        self.window = [p for p in pieces if p.kind == "window"]
        for p in self.entries:
            if block % p.ratio:
                raise ValueError(f"block {block} is not a multiple of the compression ratio {p.ratio}")
        # a block page: each entries piece's block rows back to back
        self._entry_spans, off = [], 0
        for p in self.entries:
            n = block // p.ratio * p.nbytes_per_row()
            self._entry_spans.append((off, n))
            off = _align(off + n)
        self.block_bytes = off
        # a tail: each window piece's slot bytes, back to back (aligned)
        self._tail_spans, off = [], 0
        for p in self.window:
            self._tail_spans.append((off, p.nbytes_per_slot()))
            off = _align(off + p.nbytes_per_slot())
        self.tail_bytes = off
        self.page_bytes = max(self.block_bytes, ALIGN)
        self.tail_pages = -(-self.tail_bytes // self.page_bytes)
        self.num_pages = int(budget_bytes // self.page_bytes)
        if self.num_pages < self.tail_pages + 1:
            raise ValueError(f"a prefix cache of {budget_bytes / 2**20:.1f} MiB cannot hold one cached prefix "
                             f"({(self.tail_pages + 1) * self.page_bytes / 2**20:.1f} MiB); give more memory or "
                             "turn prefix caching off")
        # never read before written (a page is entered only after its save ran): no need to clear it, and on
        # the CPU untouched pages cost no RAM
        self.pool = torch.empty(self.num_pages, self.page_bytes, dtype=torch.uint8, device=state.device)
        #: saves queued by :meth:`defer`, run by :meth:`flush`
        self._deferred: list[tuple] = []

    @property
    def nbytes(self) -> int:
        return self.pool.numel()

    def _rows(self, p: StatePiece, slot: int, first_block: int, n_blocks: int) -> torch.Tensor:
        r = self.block // p.ratio
        return p.tensor[slot, first_block * r:(first_block + n_blocks) * r]

    def _check(self, blocks: Sequence[int], tail: Sequence[int], allow_no_tail: bool) -> None:
        if len(tail) != self.tail_pages and not (allow_no_tail and not tail):
            raise ValueError(f"a tail takes {self.tail_pages} pages, got {len(tail)}")
        bad = [p for p in [*blocks, *tail] if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"prefix-cache pages out of range [0, {self.num_pages}): {bad[:5]}")

    # ------------------------------------------------------------------ slot -> pages
    def save(self, slot: int, first_block: int, blocks: Sequence[int], tail: Sequence[int],
             stage: int | None = None) -> None:
        """Copy ``slot``'s entry rows of blocks ``first_block ..`` into pages ``blocks`` (one page a
        block, in order) and, with ``tail``, its window pieces into those pages: the slot's own, or
        those the forward left in stage slot ``stage`` (a boundary inside a prompt chunk)."""
        self._check(blocks, tail, allow_no_tail=True)
        dev = self.state.device
        if blocks:
            pages = upload_ints(list(blocks), dev)
            for p, (off, n) in zip(self.entries, self._entry_spans):
                src = _bytes(self._rows(p, slot, first_block, len(blocks))).reshape(len(blocks), n)
                self.pool[:, off:off + n].index_copy_(0, pages, src)
        if tail:
            flat = self.pool.new_zeros(len(tail) * self.page_bytes)
            src, i = (self.window, slot) if stage is None else (self.stage_window, stage)
            for p, (off, n) in zip(src, self._tail_spans):
                flat[off:off + n] = _bytes(p.tensor[i]).reshape(-1)
            self.pool.index_copy_(0, upload_ints(list(tail), dev), flat.view(len(tail), self.page_bytes))

    def defer(self, slot: int, first_block: int, blocks: Sequence[int], tail: Sequence[int],
              stage: int | None = None) -> None:
        """:meth:`save` later, at the next :meth:`flush` (checked now). The runner defers a step's
        saves so the step's sampled ids start to the host before the copies are queued (a prompt's
        first token does not wait for them), and flushes before anything that changes a slot's
        state or reads pages (its next step, a reset, :meth:`restore`)."""
        self._check(blocks, tail, allow_no_tail=True)
        self._deferred.append((slot, first_block, tuple(blocks), tuple(tail), stage))

    def flush(self) -> None:
        """Run the deferred saves, in order."""
        saves, self._deferred = self._deferred, []
        for args in saves:
            self.save(*args)

    # ------------------------------------------------------------------ pages -> slot
    def restore(self, slot: int, blocks: Sequence[int], tail: Sequence[int]) -> None:
        """Make ``slot`` hold the prefix of ``len(blocks)`` blocks: entry rows from ``blocks`` (block
        0 first) and the window pieces from ``tail``. The caller sets the slot's length."""
        self.flush()
        self._check(blocks, tail, allow_no_tail=False)
        dev = self.state.device
        pages = upload_ints(list(blocks) + list(tail), dev)
        if blocks:
            chosen = self.pool.index_select(0, pages[:len(blocks)])
            for p, (off, n) in zip(self.entries, self._entry_spans):
                dst = self._rows(p, slot, 0, len(blocks))
                dst.view(len(blocks), -1).copy_(chosen[:, off:off + n].view(p.tensor.dtype))
        flat = self.pool.index_select(0, pages[len(blocks):]).view(-1)
        for p, (off, n) in zip(self.window, self._tail_spans):
            dst = p.tensor[slot]
            dst.copy_(flat[off:off + n].view(p.tensor.dtype).view(dst.shape))
