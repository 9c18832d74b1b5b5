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

:func:`precompile` (before the CUDA-graph capture, one process) compiles the same kernels and the
captured decode steps' on a thread pool first: the same forwards, through one block of each kind,
run with every Triton launch turned into a compile request (Triton's ``AsyncCompileMode``; nothing
is launched, buffers start zeroed so the torch ops between read valid indices), the compiles run
side by side, and the capture and :func:`warm_up` then find every kernel compiled.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

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


def _items(runner, decode: bool, captured: tuple = ()) -> tuple[list[Callable[[], None]], str]:
    """The warm-up's forwards as callables, in order (they share the scratch slot's position), and
    their description; ``captured``: also the decode step of each ``(bucket, flags)`` the capture
    records (its kernels, at the state's full length)."""
    scratch, config = runner.scratch, runner.model.config
    lengths = length_classes(runner.max_num_batched_tokens)
    # eager decode batches: without graphs every decode step, with graphs the one-token rows of a
    # step that also runs prompt chunks
    batches = length_classes(runner.max_num_seqs) if decode else []
    ratios = sorted({r for r in (config.compress_ratios or []) if r})
    k = getattr(config, "index_topk", 0) or 0
    counts = length_classes(max(1, runner.max_model_len // min(ratios))) if k and ratios else []
    gen = torch.Generator().manual_seed(0)
    items: list[Callable[[], None]] = [lambda: runner.state.reset([scratch])]
    pos = 0
    for i, n in enumerate(lengths):
        if pos + n > runner.max_model_len:
            items.append(lambda: runner.state.reset([scratch]))
            pos = 0
        ids = torch.randint(0, config.vocab_size, (n,), generator=gen)
        if n > runner.max_model_len:     # a step of several prompts' chunks: rows on the scratch slot in turn
            items.append(lambda ids=ids: _several_rows(runner, ids.to(runner.device)))
            pos = runner.max_model_len
        else:
            items.append(lambda ids=ids, pos=pos, i=i: _one_row(runner, ids.to(runner.device), pos,
                                                                 all_logits=(i % 3 == 2)))
            pos += n

    def step(b: int, flags: SampleFlags, bound: int) -> None:
        runner.state.reset([scratch])
        runner._step(torch.full((b,), scratch, dtype=torch.int64, device=runner.device), flags, bound)
    for b in batches:
        # near the start and as deep as the state goes: the attention splits its keys more with more
        # compressed entries
        for bound in sorted({min(runner.max_model_len, b + 1), runner.max_model_len}):
            items.append(lambda b=b, bound=bound: step(b, SampleFlags(), bound))
    for b, flags in captured:
        items.append(lambda b=b, flags=flags: step(b, flags, runner.max_model_len))

    def draw(sampling: bool, truncated: bool) -> None:
        # the sampler's draw kernel: greedy, temperature only, and over truncated (top-k/p, min-p)
        # logits (the decode steps above sample greedy rows only)
        logits = torch.zeros(1, config.vocab_size, dtype=torch.float32, device=runner.device)
        ids = torch.zeros(1, dtype=torch.int64, device=runner.device)
        ops.draw_tokens(logits, logits if truncated else None, torch.ones(1, device=runner.device),
                        torch.zeros(1, dtype=torch.bool, device=runner.device), ids, ids, ids, sampling=sampling)
    items += [lambda s=s, t=t: draw(s, t) for s, t in ((False, False), (True, False), (True, True))]

    def topk(n: int) -> None:
        scores = torch.zeros(1, 2, n, dtype=torch.float32, device=runner.device)
        ops.topk_indices(scores, min(k, n), torch.zeros(1, 2, dtype=torch.int64, device=runner.device))
    items += [lambda n=n: topk(n) for n in counts]
    items.append(lambda: runner.state.reset([scratch]))
    what = f"{len(lengths)} prompt lengths, {len(batches)} eager batch sizes, {len(counts)} top-k sizes"
    return items, what


@torch.inference_mode()
def warm_up(runner, *, decode: bool = True, progress: bool = True) -> float:
    """Run the warm-up on ``runner`` (its live slots untouched); returns the seconds taken."""
    t0 = time.perf_counter()
    before = compiled_variants()
    items, what = _items(runner, decode)
    for item in tqdm(items, desc="compiling kernels (warm-up)", disable=not progress, file=sys.stderr):
        item()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - t0
    if progress:
        added = compiled_variants() - before
        print(f"warm-up: {what} in {seconds:.1f} s" + (f"; {added} kernel variants compiled" if added >= 0 else ""),
              file=sys.stderr)
    return seconds


@contextlib.contextmanager
def _compile_only() -> Iterator[None]:
    """Every Triton launch in the block becomes a compile request (``warmup=True``: nothing runs)."""
    from triton.runtime.jit import JITFunction
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)
    JITFunction.run = compile_only
    try:
        yield
    finally:
        JITFunction.run = launch


@contextlib.contextmanager
def _one_layer_of_each_kind(runner) -> Iterator[None]:
    """Within the block the model runs one block of each kind only (attention kind and ratio, hash
    or top-k routing, the same parameter dtypes and shapes), with those blocks' state: the same
    kernels and specializations as all of them, for a fraction of the host time. The MTP block's
    state stays last."""
    model, state, config = runner.model, runner.state, runner.model.config
    # every block's multiplication mode first: the forwards below set it only when it changes,
    # and would set it on the kept blocks alone (the others would keep the old one for good)
    model.set_qat_sim(runner.qat_sim)
    layers, caches = model.layers, state.layers
    seen, keep = set(), []
    for i, block in enumerate(layers):
        tensors = sorted((n, t.dtype, tuple(t.shape)) for n, t in [*block.named_parameters(), *block.named_buffers()])
        key = (config.layer_kind(i), config.layer_ratio(i), bool(config.hash_layers[i]), tuple(tensors))
        if key not in seen:
            seen.add(key)
            keep.append(i)
    model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    state.layers = [caches[i] for i in keep] + list(caches[len(layers):])
    try:
        yield
    finally:
        model.layers, state.layers = layers, caches


@torch.inference_mode()
def precompile(runner, captured: tuple = (), *, decode: bool = True, workers: int | None = None,
               progress: bool = True) -> float:
    """Compile what :func:`warm_up` and the capture of ``captured`` ``(bucket, flags)`` decode steps
    will launch, on ``workers`` threads (default: the CPU count), before either runs (CUDA only; a
    no-op where Triton has no ``AsyncCompileMode``). Returns the seconds taken. A kernel whose
    compile fails here is compiled again, and its error raised, where it is first launched."""
    if runner.device.type != "cuda":
        return 0.0
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return 0.0
    from ..ops.triton import runtime
    t0 = time.perf_counter()
    before = compiled_variants()
    items, what = _items(runner, decode, captured)
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as pool:
        with _compile_only(), runtime.zeroed(), _one_layer_of_each_kind(runner), \
                AsyncCompileMode(pool, ignore_errors=True):
            for item in tqdm(items, desc=f"compiling kernels ({workers} threads)", disable=not progress,
                             file=sys.stderr):
                item()
            # (leaving AsyncCompileMode waits for every compile and enters it in the kernel caches)
    torch.cuda.synchronize(runner.device)
    runner.state.reset([runner.scratch])
    torch.cuda.empty_cache()        # the pass's zeroed buffers: back to the device before the capture sizes its pool
    seconds = time.perf_counter() - t0
    if progress:
        added = compiled_variants() - before
        print(f"compiled in parallel: {what}, {len(captured)} graph steps in {seconds:.1f} s"
              + (f"; {added} kernel variants" if added >= 0 else ""), file=sys.stderr)
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
