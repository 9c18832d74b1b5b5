"""Benchmark cases for ``bench/kernels.py``: one module per kernel family.

Each module defines ``cases(env) -> list[Case]``. ``env`` carries the device, the copy bandwidth
and tensor-core peak measured at the start of the run, and the geometries (Flash / Pro presets).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

#: modules under bench/kernel_cases, run in this order
MODULES: tuple[str, ...] = ("linear", "moe", "attention", "small")


@dataclass
class Case:
    """One timed kernel call and, optionally, the same op through a peer implementation.

    ``bytes``: the fewest bytes the op must move (inputs read once, outputs written once);
    ``flops``: its arithmetic (0 for memory-bound decode ops). The table reports whichever of
    ``bytes / copy bandwidth`` and ``flops / tensor peak`` is the larger floor.
    """

    family: str          # "linear", "moe", "attention", ...
    name: str            # e.g. "flash wq_b fp8 b=1"
    fn: Callable[[], object]
    bytes: float
    flops: float = 0.0
    peer: str | None = None
    peer_fn: Callable[[], object] | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)
    #: ``fn`` (and ``peer_fn``) already replay a CUDA graph of their own: time them as they are
    #: (a graph cannot be captured inside another one's capture)
    captured: bool = False


def graph_replay(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """Warm every call up (compile, counters), capture them in one CUDA graph, return its replay.

    The replay closure keeps ``calls`` (and with them the inputs and weights the graph reads)
    alive: a captured graph holds raw addresses, not references."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()

    def replay(calls=calls) -> None:
        g.replay()
    return replay


def time_replay(fn: Callable[[], object], iters: int = 50) -> float:
    """Seconds per replay of ``fn`` captured alone in a CUDA graph (:func:`graph_replay`), warm, L2
    not flushed: the cost of an op inside a captured decode step."""
    return time_graph([fn], iters)


def time_graph(calls: list[Callable[[], object]], iters: int = 50) -> float:
    """Seconds per replay of ``calls`` captured as one CUDA graph (:func:`graph_replay`), warm."""
    replay = graph_replay(calls)
    replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters
