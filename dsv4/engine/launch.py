"""Start a tensor-parallel group for :class:`~dsv4.engine.llm.LLM`: one process per GPU.

Two ways in, one layout (rank 0 owns the scheduler, the sampler's outputs and the requests; every
other rank loads its shard, builds the same :class:`Runner` and follows rank 0's step plans, see
:mod:`dsv4.engine.distributed`):

- **self-launched** (``LLM(model, tensor_parallel_size=N)``, ``dsv4 generate|chat|serve
  --tensor-parallel-size N``): this process is rank 0 and starts ranks 1..N-1 as child processes
  (``spawn``), on ``cuda:1..N-1`` (NCCL) or on the CPU (gloo). They die with it.
- **torchrun** (``torchrun --nproc-per-node N -m dsv4.cli ...``, also across nodes): every process
  runs the same command; ``WORLD_SIZE``/``RANK`` say which it is. Rank 0 goes on as usual; on any
  other rank, building the ``LLM`` follows rank 0 until it closes, then exits the process.

A follower that dies is named (with its exit code) at rank 0's next step instead of surfacing as a
collective timeout; a failed load is agreed on by all ranks (:func:`dsv4.weights.loader.load_model`),
so every rank raises the same one-line error.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..parallel import ParallelError, ParallelGroup, init_parallel
from ..weights.loader import LoadReport, load_model
from .runner import Runner


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its shard and its runner (picklable: it is sent to the
    spawned ranks). Rank 0 resolves every ``auto`` first, so all ranks build the same thing."""

    path: str
    device_type: str          # "cuda" or "cpu"
    dtype: torch.dtype
    qat_sim: bool
    max_num_seqs: int
    max_model_len: int
    load_mtp: bool = False
    threads: int | None = None
    max_num_batched_tokens: int = 8192    # tokens of one step, run as one forward
    prefix_cache_bytes: int = 0           # every rank holds the same prefix-cache pages
    speculative: object | None = None     # a SpeculativeConfig (speculative decoding), or None


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` when this process was started by torchrun (or another launcher), else 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        raise UsageError(f"environment variable WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def check_gpus(world_size: int, device_type: str) -> None:
    """Refuse a CUDA group larger than the GPUs this process sees (before any process starts)."""
    if device_type == "cuda":
        n = torch.cuda.device_count()
        if n < world_size:
            raise UsageError(f"tensor_parallel_size {world_size} needs {world_size} GPUs (one per rank); "
                             f"this process sees {n} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def build_runner(spec: RankSpec, tp: ParallelGroup, progress: bool) -> tuple[Runner, LoadReport]:
    """Load this rank's shard of ``spec.path`` and build its runner (every rank calls this together)."""
    net, report = load_model(spec.path, tp.device, spec.dtype, load_mtp=spec.load_mtp, progress=progress,
                             parallel=tp)
    runner = Runner(net, max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len, qat_sim=spec.qat_sim,
                    max_num_batched_tokens=spec.max_num_batched_tokens, prefix_cache_bytes=spec.prefix_cache_bytes,
                    speculative=spec.speculative)
    return runner, report


def serve_as_follower(spec: RankSpec, tp: ParallelGroup) -> None:
    """A follower rank's whole life: load, build the runner, follow rank 0 until it sends stop."""
    from .distributed import follow
    runner, _ = build_runner(spec, tp, progress=False)
    follow(runner, tp)


def _follower_process(rank: int, world_size: int, port: int, spec: RankSpec, timeout_s: float | None) -> None:
    """Entry point of a spawned rank (module-level: the spawn start method imports it by name)."""
    import threading

    from tqdm import tqdm

    from ..errors import Dsv4Error
    # tqdm's default lock is a multiprocessing semaphore, which a rank that exits on an error leaves
    # behind ("leaked semaphore" warnings at shutdown); this process draws no bars of its own
    tqdm.set_lock(threading.RLock())
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = f"cuda:{rank}" if spec.device_type == "cuda" else "cpu"
    tp = None
    try:
        tp = init_parallel(world_size, rank, device=device, master_addr="127.0.0.1", master_port=port,
                           timeout_s=timeout_s)
        serve_as_follower(spec, tp)
    except KeyboardInterrupt:      # Ctrl-C reaches the whole process group; rank 0 reports it
        sys.exit(130)
    except (Dsv4Error, ParallelError):   # a load error all ranks agreed on (rank 0 prints it), or rank 0 left
        sys.exit(1)
    finally:
        if tp is not None:
            tp.close()


class SpawnedGroup:
    """Rank 0 of a group whose other ranks this process started (see the module docstring)."""

    def __init__(self, spec: RankSpec, world_size: int, timeout_s: float | None = None):
        import torch.multiprocessing as mp

        from .distributed import free_port
        check_gpus(world_size, spec.device_type)
        port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_follower_process, args=(r, world_size, port, spec, timeout_s),
                                  name=f"dsv4-rank{r}", daemon=True) for r in range(1, world_size)]
        for p in self.procs:
            p.start()
        try:
            device = "cuda:0" if spec.device_type == "cuda" else "cpu"
            self.tp = init_parallel(world_size, 0, device=device, master_addr="127.0.0.1", master_port=port,
                                    timeout_s=timeout_s)
        except BaseException:
            self.terminate()
            raise

    def check_alive(self) -> None:
        """Raise :class:`ParallelError` naming a follower that has exited."""
        for r, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise ParallelError(f"tensor-parallel rank {r} of {len(self.procs) + 1} exited "
                                    f"(exit code {p.exitcode}); the group cannot go on")

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the followers to leave (after the runner sent them ``stop``), then tear down."""
        for p in self.procs:
            p.join(timeout=timeout_s)
        self.terminate()
        self.tp.close()
