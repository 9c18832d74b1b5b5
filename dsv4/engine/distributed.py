"""One model over N processes: rank 0 drives, the other ranks follow its step plan.

Every rank holds its shard of the network (:mod:`dsv4.parallel`) and a full :class:`Runner` of its
own (the generation state is replicated: the K=V head is shared by all query heads). Rank 0 owns
everything above the runner (scheduler, sampler, requests) and wraps its runner in a
:class:`ParallelRunner`: each step first broadcasts its :class:`~dsv4.engine.batch.ScheduledBatch`
(plain host data) over the control group, then runs. The other ranks sit in :func:`follow`,
receive the batch and run the same step, so all ranks enter the same forward with the same shapes
and meet in the same collectives. Token ids sampled on rank 0 reach the others by a device
broadcast inside the decode step (graph-capturable), not through the host.

:func:`spawn` starts N local processes (gloo on CPU, NCCL on GPUs) for tests and tools; under
``torchrun`` call :func:`dsv4.parallel.init_parallel` instead.

    def worker(tp):                       # every rank
        model, _ = load_model(path, parallel=tp)
        runner = Runner(model, max_num_seqs=4)
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
from pathlib import Path
from typing import Any

import torch

from ..parallel import ParallelError, ParallelGroup, init_parallel
from .batch import NewSequence, Row, ScheduledBatch, StepOutput
from .runner import CAPTURED_FLAGS, Runner
from .sampling import SamplingParams
from .sampling import SampleFlags

#: what rank 0 broadcasts before each call: ``("run", ScheduledBatch)`` once per step, the start-up
#: calls ``("capture", kwargs)`` and ``("warm_up", None)``, and ``("stop", None)`` at the end
Message = tuple[str, Any]


def follow(runner: Runner, tp: ParallelGroup) -> None:
    """Run rank 0's steps on this rank until it sends ``stop`` (or the group fails).

    A step that fails its host-side checks here (a full context, a bad slot) failed the same way on
    rank 0 before any collective, and rank 0 has told its caller; this rank waits for the next one.
    """
    while True:
        verb, payload = tp.broadcast_object(None, src=0)
        if verb == "stop":
            return
        try:
            if verb == "run":
                runner.run(payload)
            elif verb == "capture":
                runner.capture(**payload, progress=False)
            elif verb == "warm_up":
                runner.warm_up(progress=False)
            else:
                raise RuntimeError(f"tensor parallel: unknown message {verb!r} from rank 0")
        except (ValueError, IndexError):
            continue


class ParallelRunner:
    """Rank 0's runner for a tensor-parallel group: :meth:`run` (one step), :meth:`capture`,
    :meth:`warm_up` and the runner's attributes, each call broadcast to the other ranks first, so an
    :class:`Engine` drives N ranks exactly as it drives one. Close it (or leave its ``with`` block)
    to release the followers.

    ``health``: called before every message goes out (a launcher's check that every follower
    process is still alive), so a dead rank is reported by name instead of waiting out a
    collective's timeout.
    """

    def __init__(self, runner: Runner, tp: ParallelGroup, health: Callable[[], None] | None = None):
        if tp.rank != 0:
            raise ValueError(f"ParallelRunner runs on rank 0; rank {tp.rank} calls follow()")
        self.runner, self.tp, self.closed, self.health = runner, tp, False, health
        self.broken = False

    def __getattr__(self, name: str) -> Any:   # lengths, max_num_seqs, max_model_len, device, state, model ...
        return getattr(self.runner, name)

    def _send(self, message: Message) -> None:
        if self.closed:
            raise RuntimeError("ParallelRunner is closed: the other ranks no longer follow")
        if self.health is not None:
            self.health()
        self.tp.broadcast_object(message, src=0)

    def _call(self, message: Message, fn: Callable[[], Any], checks_first: bool = True) -> Any:
        """Send ``message``, then make the same call here. ``checks_first``: the call's ValueError and
        IndexError come from host-side checks made before any collective (they fail the same way on
        every rank, and the group stays usable)."""
        try:
            self._send(message)
            return fn()
        except (ValueError, IndexError):
            if not checks_first:
                self.broken = True
            raise
        except BaseException:
            # interrupted anywhere from sending the message to the end of the call (Ctrl-C, a device
            # error): the followers may sit in a collective this rank will never enter, so nothing
            # further can reach them; the launcher must stop them
            self.broken = True
            raise

    def run(self, batch: ScheduledBatch, before_sample: Callable[[], None] | None = None) -> StepOutput:
        """One engine step on every rank (one message: the whole batch). ``before_sample`` runs here
        only: every rank splits the step the same way (by the batch's sampling flags), and rank 0's
        sampled ids are the ones every rank feeds next."""
        return self._call(("run", batch), lambda: self.runner.run(batch, before_sample))

    def capture(self, flag_sets: Sequence[SampleFlags] = CAPTURED_FLAGS,
                max_batch: int | None = None, progress: bool = True, buckets: Sequence[int] | None = None) -> None:
        """Every rank captures the same graphs in the same order (their collectives meet inside)."""
        kw = dict(flag_sets=tuple(flag_sets), max_batch=max_batch, buckets=tuple(buckets) if buckets else None)
        self._call(("capture", kw), lambda: self.runner.capture(**kw, progress=progress), checks_first=False)

    def warm_up(self, progress: bool = True) -> float:
        """Every rank runs the same warm-up (its forwards meet in the same collectives)."""
        return self._call(("warm_up", None), lambda: self.runner.warm_up(progress=progress), checks_first=False)

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
            self.tp.broadcast_object(("stop", None), src=0)
        except ParallelError:
            pass

    def __enter__(self) -> "ParallelRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@torch.inference_mode()
def greedy(runner: Runner | ParallelRunner, prompts: Sequence[Sequence[int]], steps: int
           ) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuation of each prompt (one slot each; the prompts in one step, then decoded
    together): the ``steps`` new token ids per prompt and the fp32 logits that chose them
    ``[len(prompts), steps, vocab]``."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    rows = [Row(s, 0, tuple(p), logits=True, new=NewSequence(params, tuple(p))) for s, p in enumerate(prompts)]
    out = runner.run(ScheduledBatch(tuple(rows)))
    logits = [torch.stack([out.logits[i][-1] for i in range(len(prompts))])]
    tokens = [out.sampled.token_ids.clone()]
    for _ in range(steps - 1):
        rows = [Row(s, runner.lengths[s], logits=True) for s in range(len(prompts))]
        out = runner.run(ScheduledBatch(tuple(rows)))
        logits.append(torch.stack([out.logits[i][0] for i in range(len(prompts))]))
        tokens.append(out.sampled.token_ids.clone())
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
