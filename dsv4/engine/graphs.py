"""CUDA graphs of the runner's steps: what one captured step holds, its bucket sizes, how it is
recorded, and how a new slot list reaches it.

A decode step without a constrained row is one graph per (batch bucket, sampling flags); one with a
constrained row is two: the bucket's forward graph (its logits a static output) and a sampler graph
per flag set that reads them, so the host can stage grammar masks between the two launches. All
graphs share one memory pool: they run one after another on one stream, and each graph's outputs are
read (copied out) before the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from .sampling import SampleOutput


def batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: powers of two up to ``max_batch``, and it."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


@dataclass
class StepGraph:
    """One captured step: a decode step, its forward or its sampler, or a verify step."""

    graph: torch.cuda.CUDAGraph
    slots: torch.Tensor          # static input [bucket] (a sampler graph reads its forward graph's)
    out: SampleOutput | None     # static outputs (None: a forward graph)
    loaded: tuple[int, ...] = ()  # the slot list ``slots`` holds now (host copy)
    drafts: torch.Tensor | None = None   # verify graphs with host drafts: static input [bucket, k]
    kept: torch.Tensor | None = None     # verify graphs: static output, tokens kept per row [bucket]
    logits: torch.Tensor | None = None   # forward graphs: static output [bucket, vocab]


class SlotUpload:
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


def record(fn: Callable[[], Any], pool, device: torch.device) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``fn`` (device work only) twice on a side stream (lazy initialisation, autotuning), then
    capture it into a graph of memory pool ``pool``; returns the graph and ``fn``'s static outputs."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), ops.sync_free():
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with ops.sync_free(), torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
