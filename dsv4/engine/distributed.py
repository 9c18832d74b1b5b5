"""One model over N processes: rank 0 drives, the other ranks follow its step plan.

Every rank holds its shard of the network (:mod:`dsv4.parallel`) and a full :class:`Runner` of its
own (the generation state is replicated: the K=V head is shared by all query heads). Rank 0 owns
everything above the runner (scheduler, sampler, requests) and wraps its runner in a
:class:`ParallelRunner`: each runner call first broadcasts a :class:`StepPlan` (the host-side
arguments of that call) over the control group, then runs. The other ranks sit in :func:`follow`,
receive the plan and make the same call, so all ranks enter the same forward with the same shapes
and meet in the same collectives. Token ids sampled on rank 0 reach the others by a device
broadcast inside the decode step (graph-capturable), not through the host.

:func:`spawn` starts N local processes (gloo on CPU, NCCL on GPUs) for tests and tools; under
``torchrun`` call :func:`dsv4.parallel.init_parallel` instead.

    def worker(tp):                       # every rank
        model, _ = load_model(path, parallel=tp)
        runner = Runner(model, max_slots=4)
        if tp.rank != 0:
            return follow(runner, tp)     # until rank 0 closes
        with ParallelRunner(runner, tp) as r:
            return greedy(r, [[0, 5, 7]], steps=8)
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..parallel import ParallelError, ParallelGroup, init_parallel
from .runner import Runner
from .sampler import SampleOutput, SamplingParams
from .slot_sampling import SampleFlags

OPS = ("reset", "start", "prefill", "sample_first", "decode", "decode_step", "capture", "warm_up", "stop")


@dataclass(frozen=True)
class StepPlan:
    """The host-side arguments of one runner call, as rank 0 made it."""

    op: str                              # one of OPS
    slots: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()      # prefill, start: the tokens; decode: none (broadcast on the device)
    n_tokens: int = 0                    # decode: how many ids the device broadcast carries
    all_logits: bool = False
    params: SamplingParams | None = None                # start: the request's sampling parameters
    flag_sets: tuple[SampleFlags, ...] = ()             # capture
    max_batch: int | None = None                        # capture
    buckets: tuple[int, ...] | None = None              # capture

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown step plan op {self.op!r}; known: {', '.join(OPS)}")


class _Follower:
    """A follower rank's side: the runner, plus the last prefill logits of each slot (the input of
    the next ``sample_first``, which rank 0 passes by value and the others recompute)."""

    def __init__(self, runner: Runner, tp: ParallelGroup):
        self.runner, self.tp = runner, tp
        self.last_logits: dict[int, torch.Tensor] = {}


def execute(runner: Runner, plan: StepPlan, tp: ParallelGroup, token_ids: torch.Tensor | None = None,
            logits: torch.Tensor | None = None, follower: _Follower | None = None) -> Any:
    """Make the runner call ``plan`` describes, on any rank. ``token_ids``: rank 0's decode ids (the
    other ranks receive them by the broadcast); ``logits``: rank 0's ``sample_first`` input (the
    others use their own copy of the same prefill logits)."""
    op = plan.op
    if op == "reset":
        return runner.reset(list(plan.slots))
    if op == "start":
        return runner.start(plan.slots[0], plan.params, list(plan.token_ids))
    if op == "prefill":
        out = runner.prefill(plan.slots[0], list(plan.token_ids), all_logits=plan.all_logits)
        if follower is not None:
            follower.last_logits[plan.slots[0]] = out[-1] if plan.all_logits else out
        return out
    if op == "sample_first":
        if logits is None:
            logits = torch.stack([follower.last_logits.pop(s) for s in plan.slots])
        return runner.sample_first(list(plan.slots), logits)
    if op == "decode":
        if token_ids is None:
            token_ids = torch.empty(plan.n_tokens, dtype=torch.int64, device=runner.device)
        ids = tp.broadcast(token_ids, src=0)
        return runner.decode(list(plan.slots), ids)
    if op == "decode_step":
        return runner.decode_step(list(plan.slots))
    if op == "capture":
        return runner.capture(plan.flag_sets, plan.max_batch, progress=tp.rank == 0, buckets=plan.buckets)
    if op == "warm_up":
        return runner.warm_up(progress=tp.rank == 0)
    return None


def follow(runner: Runner, tp: ParallelGroup) -> None:
    """Run rank 0's step plans on this rank until it sends ``stop`` (or the group fails).

    A plan that fails its host-side checks here (a full context, a bad slot) failed the same way on
    rank 0 before any collective, and rank 0 has told its caller; this rank waits for the next plan.
    """
    me = _Follower(runner, tp)
    while True:
        plan: StepPlan = tp.broadcast_object(None, src=0)
        if plan.op == "stop":
            return
        try:
            execute(runner, plan, tp, follower=me)
        except (ValueError, IndexError):
            continue


class ParallelRunner:
    """Rank 0's runner for a tensor-parallel group: the :class:`Runner` interface (``reset``,
    ``start``, ``prefill``, ``sample_first``, ``decode``, ``decode_step``, ``capture`` and the
    runner's attributes), each call broadcast as a :class:`StepPlan` first, so an :class:`Engine`
    drives N ranks exactly as it drives one. Close it (or leave its ``with`` block) to release the
    followers.

    ``health``: called before every plan goes out (a launcher's check that every follower process is
    still alive), so a dead rank is reported by name instead of waiting out a collective's timeout.
    """

    def __init__(self, runner: Runner, tp: ParallelGroup, health: Callable[[], None] | None = None):
        if tp.rank != 0:
            raise ValueError(f"ParallelRunner runs on rank 0; rank {tp.rank} calls follow()")
        self.runner, self.tp, self.closed, self.health = runner, tp, False, health
        self.broken = False

    def __getattr__(self, name: str) -> Any:   # lengths, max_slots, max_context, device, state, model ...
        return getattr(self.runner, name)

    def _send(self, plan: StepPlan) -> None:
        if self.closed:
            raise RuntimeError("ParallelRunner is closed: the other ranks no longer follow")
        if self.health is not None:
            self.health()
        self.tp.broadcast_object(plan, src=0)

    def _run(self, plan: StepPlan, **kw: Any) -> Any:
        try:
            self._send(plan)
            return execute(self.runner, plan, self.tp, **kw)
        except (ValueError, IndexError):   # host-side checks: failed the same way on every rank, before any collective
            raise
        except BaseException:
            # interrupted anywhere from sending the plan to the end of the call (Ctrl-C, a device
            # error): the followers may sit in a collective this rank will never enter, so no further
            # plan can reach them; the launcher must stop them
            self.broken = True
            raise

    def reset(self, slots: Sequence[int]) -> None:
        self._run(StepPlan("reset", tuple(int(s) for s in slots)))

    def start(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self._run(StepPlan("start", (int(slot),), tuple(int(t) for t in prompt_ids), params=params))

    def prefill(self, slot: int, token_ids: Sequence[int] | torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        ids = tuple(int(t) for t in torch.as_tensor(token_ids).flatten().tolist())
        return self._run(StepPlan("prefill", (int(slot),), ids, all_logits=all_logits))

    def sample_first(self, slots: Sequence[int], logits: torch.Tensor) -> SampleOutput:
        return self._run(StepPlan("sample_first", tuple(int(s) for s in slots)), logits=logits)

    def decode(self, slots: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(token_ids).to(self.runner.device, torch.int64).flatten()
        if ids.numel() != len(slots):   # checked before the plan goes out: the broadcast needs both sizes equal
            raise ValueError(f"decode got {ids.numel()} token ids for {len(slots)} slots")
        plan = StepPlan("decode", tuple(int(s) for s in slots), n_tokens=len(slots))
        return self._run(plan, token_ids=ids.clone())

    def decode_step(self, slots: Sequence[int]) -> SampleOutput:
        return self._run(StepPlan("decode_step", tuple(int(s) for s in slots)))

    def capture(self, flag_sets: Sequence[SampleFlags] = (SampleFlags(), SampleFlags(all_greedy=False)),
                max_batch: int | None = None, progress: bool = True, buckets: Sequence[int] | None = None) -> None:
        """Every rank captures the same graphs in the same order (their collectives meet inside)."""
        buckets = tuple(buckets) if buckets else None
        try:
            self._send(StepPlan("capture", flag_sets=tuple(flag_sets), max_batch=max_batch, buckets=buckets))
            self.runner.capture(flag_sets, max_batch, progress=progress, buckets=buckets)
        except BaseException:
            self.broken = True
            raise

    def warm_up(self, progress: bool = True) -> float:
        """Every rank runs the same warm-up (its forwards meet in the same collectives)."""
        try:
            self._send(StepPlan("warm_up"))
            return self.runner.warm_up(progress=progress)
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        """Send the followers ``stop``. Never raises for a group that already broke (a dead rank has
        nothing left to release; the launcher tears the rest down)."""
        if self.closed:
            return
        self.closed = True
        if self.broken:
            return
        try:
            if self.health is not None:
                self.health()
            self.tp.broadcast_object(StepPlan("stop"), src=0)
        except ParallelError:
            pass

    def __enter__(self) -> "ParallelRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@torch.inference_mode()
def greedy(runner: Runner | ParallelRunner, prompts: Sequence[Sequence[int]], steps: int
           ) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuation of each prompt (one slot each, decoded together): the ``steps`` new token
    ids per prompt and the fp32 logits that chose them ``[len(prompts), steps, vocab]``."""
    slots = list(range(len(prompts)))
    runner.reset(slots)
    logits = [torch.stack([runner.prefill(s, p) for s, p in zip(slots, prompts)])]
    tokens = [logits[-1].argmax(-1)]
    for _ in range(steps - 1):
        logits.append(runner.decode(slots, tokens[-1]))
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, 1).tolist(), torch.stack(logits, 1).float().cpu()


# ----------------------------------------------------------------------------- local launcher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, args: tuple, out_dir: str, device: str,
            timeout_s: float, threads: int) -> None:
    torch.set_num_threads(threads)
    dev = f"cuda:{rank}" if device == "cuda" else device
    tp = init_parallel(world_size, rank, device=dev, master_addr="127.0.0.1", master_port=port, timeout_s=timeout_s)
    try:
        result = fn(tp, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        tp.close()


def spawn(fn: Callable, world_size: int, *args: Any, device: str = "cpu", timeout_s: float = 120.0,
          threads: int | None = None) -> list[Any]:
    """Run ``fn(tp, *args)`` in ``world_size`` fresh processes, one rank each (gloo on ``cpu``, NCCL on
    ``cuda``: rank r on ``cuda:r``), and return every rank's result (saved with ``torch.save``).

    ``fn`` must be importable by name (a module-level function). If a rank raises or dies, the others
    are stopped and the error is raised here with that rank's traceback.
    """
    import torch.multiprocessing as mp

    # CPU ranks: one thread each by default (the reference ops are thousands of small ops, where
    # OpenMP wake-ups cost more than they give, many times over with ranks sharing the cores)
    threads = threads or (1 if device == "cpu" else max(1, (os.cpu_count() or 1) // world_size))
    with tempfile.TemporaryDirectory(prefix="dsv4-spawn-") as out:
        mp.start_processes(_worker, args=(fn, world_size, free_port(), args, out, device, timeout_s, threads),
                           nprocs=world_size, join=True, start_method="spawn")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
