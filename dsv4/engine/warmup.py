"""Compile, at start-up, every kernel specialization that serving can reach.

A Triton kernel is compiled once per specialization (:mod:`dsv4.ops.triton.variants`): constexpr
tile choices bucketed by row count (powers of two), and integer arguments that are 1 or a
multiple of 16. Prompt chunks come in every length from 1 to ``max_num_batched_tokens`` at every position,
so without a warm-up the first prompt of a new length class stalls the engine — and every request
running with it — for seconds per kernel while Triton compiles (measured on an H100: a throughput
run of mixed prompts took 120 s instead of 4 s, time-to-first-token p90 13 s).

:func:`warm_up` runs, on the runner's scratch slot (whose state nobody reads):

- prefill chunks of every length class up to ``max_num_batched_tokens`` (the tokens of one step,
  :func:`length_classes`), in a row, so they land at many positions (the window ring wraps,
  compressed entries appear), the last chunk of each length class also with every position's
  logits (prompt logprobs); a class longer than ``max_model_len`` as a step of several rows;
- eager decode steps for every batch-size class up to ``max_num_seqs`` (without CUDA graphs every
  decode step is eager; with them, the one-token rows of a step that also runs prompt chunks);
- the indexer's top-k for every power-of-two count of compressed entries up to ``max_model_len``
  (position-dependent tile sizes a short warm-up never reaches).

Tests (interpreter, CPU) check that prefills of random lengths at random positions after it add no
specialization. The time and the number of compiled variants are printed.
"""

from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from .. import ops
from .h2d import upload_parts
from .sampling import SampleFlags


def length_classes(limit: int) -> list[int]:
    """For each power-of-two bucket ``(p/2, p]`` up to ``limit``: its smallest and largest length and its
    largest multiple of 16, i.e. every bucket and every integer class Triton specializes on (1,
    multiple of 16, other) within it."""
    out, p = set(), 1
    while p // 2 + 1 <= limit:
        lo, hi = p // 2 + 1, min(p, limit)
        out.update((lo, hi))
        if hi - hi % 16 >= lo:
            out.add(hi - hi % 16)
        p *= 2
    return sorted(out)


@torch.inference_mode()
def warm_up(runner, *, decode: bool = True, progress: bool = True) -> float:
    """Run the warm-up on ``runner`` (its live slots untouched); returns the seconds taken."""
    t0 = time.perf_counter()
    before = compiled_variants()
    scratch, model = runner.scratch, runner.model
    config = model.config
    lengths = length_classes(runner.max_num_batched_tokens)
    # eager decode batches: without graphs every decode step, with graphs the one-token rows of a
    # step that also runs prompt chunks
    batches = length_classes(runner.max_num_seqs) if decode else []
    ratios = sorted({r for r in (config.compress_ratios or []) if r})
    k = getattr(config, "index_topk", 0) or 0
    counts = length_classes(max(1, runner.max_model_len // min(ratios))) if k and ratios else []
    steps = len(lengths) + len(batches) + len(counts)
    bar = tqdm(total=steps, desc="compiling kernels (warm-up)", disable=not progress, file=sys.stderr)
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    pos = 0
    runner.state.reset([scratch])
    for i, n in enumerate(lengths):
        if pos + n > runner.max_model_len:
            runner.state.reset([scratch])
            pos = 0
        ids = torch.randint(0, vocab, (n,), generator=gen).to(runner.device)
        if n > runner.max_model_len:     # a step of several prompts' chunks: rows on the scratch slot in turn
            _several_rows(runner, ids)
            pos = runner.max_model_len
        else:
            _one_row(runner, ids, pos, all_logits=(i % 3 == 2))
            pos += n
        bar.update()
    idx_all = torch.full((max(batches, default=1),), scratch, dtype=torch.int64, device=runner.device)
    for b in batches:
        # near the start and as deep as the state goes: the attention splits its keys more with more
        # compressed entries
        for bound in sorted({min(runner.max_model_len, b + 1), runner.max_model_len}):
            runner.state.reset([scratch])
            runner._step(idx_all[:b], SampleFlags(), bound)
        bar.update()
    for n in counts:
        scores = torch.zeros(1, 2, n, dtype=torch.float32, device=runner.device)
        ops.topk_indices(scores, min(k, n), torch.zeros(1, 2, dtype=torch.int64, device=runner.device))
        bar.update()
    runner.state.reset([scratch])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    bar.close()
    seconds = time.perf_counter() - t0
    if progress:
        added = compiled_variants() - before
        print(f"warm-up: {len(lengths)} prompt lengths, {len(batches)} eager batch sizes, {len(counts)} top-k "
              f"sizes in {seconds:.1f} s" + (f"; {added} kernel variants compiled" if added >= 0 else ""),
              file=sys.stderr)
    return seconds


def _one_row(runner, ids: torch.Tensor, start: int, all_logits: bool) -> None:
    """The forward of a step with one prompt chunk ``ids`` at ``start`` on the scratch slot (a slot
    :meth:`Runner.run` refuses): the same varlen forward, index tensors uploaded the same way."""
    n = ids.numel()
    rows = list(range(n)) if all_logits else [n - 1]
    slot, begin, logit_rows = upload_parts([[runner.scratch], [start], rows], runner.device)
    runner.model.forward_varlen(ids, [(slot, begin, n, start + n)], runner.state.layers, logit_rows,
                                runner.qat_sim)


def _several_rows(runner, ids: torch.Tensor) -> None:
    """One varlen forward of ``ids`` cut into rows of at most ``max_model_len`` tokens, every row on
    the scratch slot from position 0 (what a step of several prompts' chunks runs token-wise)."""
    n, cap = ids.numel(), runner.max_model_len
    zero = torch.zeros(1, dtype=torch.int64, device=runner.device)
    slot = zero + runner.scratch
    groups = [(slot, zero, min(cap, n - lo), min(cap, n - lo)) for lo in range(0, n, cap)]
    runner.model.forward_varlen(ids, groups, runner.state.layers, zero + n - 1, runner.qat_sim)


def compiled_variants() -> int:
    """Compiled Triton variants so far (-1 when Triton is not in use)."""
    try:
        from ..ops.triton import variants
    except ImportError:
        return -1
    try:
        return variants.total()
    except Exception:   # noqa: BLE001 - a count is informational only
        return -1
