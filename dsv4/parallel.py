"""Tensor + expert parallel groups over ``torch.distributed`` (DESIGN decision 4).

One model spans ``N`` ranks (one process per GPU). Every layer is split across all of them, so every
GPU works on every step; the split is a property of the weights' shards (each module is built with
its local sizes, :mod:`dsv4.weights.sharding` says which slice of each tensor a rank holds) plus a
few collectives:

==========================  ===============================================  =====================
where                       what is split                                    collective
==========================  ===============================================  =====================
embedding                   vocab rows                                       all-reduce (sum)
attention                   query heads (``wq_b`` rows, ``attn_sink``),      all-reduce after
                            output groups (``wo_a`` rows, ``wo_b`` columns)  ``wo_b``
MoE                         routed experts (expert parallel, ``E/N`` whole   one all-reduce of
                            experts a rank), shared expert by its            routed + shared
                            intermediate dim
head                        vocab rows                                       all-gather
==========================  ===============================================  =====================

Replicated: the single K=V head ``wkv``, ``wq_a``, compressors, indexer, router, mHC, norms. A
decode step therefore runs ``2 * layers + 2`` collectives. World size 1 runs none and needs no
``torch.distributed``.

The collectives are CUDA-graph capturable on NCCL: in-place on the caller's tensors (or into one
fresh output for the gather), no host reads, no Python branch on device values. On CPU they run
over gloo (tests). Host-side messages (a step plan, load progress, an error on one rank) go through
a separate gloo "control" group, so they never enter a captured graph or a NCCL stream.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import Dsv4Error

#: seconds a collective may wait for the other ranks before the group fails with an error
#: (``DSV4_DIST_TIMEOUT`` overrides; a rank that dies is noticed by its launcher much sooner)
DEFAULT_TIMEOUT_S = 600.0
#: seconds a follower rank waits for rank 0's next step plan (``DSV4_IDLE_TIMEOUT`` overrides)
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


class ParallelError(Dsv4Error, RuntimeError):
    """A collective failed (a peer rank died, timed out or raised); the message says which op and rank."""


class ShardError(Dsv4Error, ValueError):
    """A tensor does not split evenly across the ranks; the message names the tensor and the sizes."""


@dataclass
class ParallelGroup:
    """This process's place in a tensor/expert-parallel group of ``world_size`` ranks.

    ``group`` is the process group of the collectives (NCCL on CUDA, gloo on CPU) and ``control``
    a gloo group for host-side messages; both ``None`` for world size 1, and for a *layout-only*
    group (:meth:`layout`): a rank/world pair that shards weights (tests, inspection) but cannot
    communicate.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    control: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad parallel rank {self.rank} of world size {self.world_size}")
        self.device = torch.device(self.device)

    @classmethod
    def layout(cls, rank: int, world_size: int, device: torch.device | str = "cpu") -> "ParallelGroup":
        """A rank/world pair that shards weights like rank ``rank`` of ``world_size`` would, without
        any process group: collectives raise. For tests and for inspecting a rank's shards."""
        return cls(rank, world_size, device=torch.device(device))

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    @property
    def connected(self) -> bool:
        return self.group is not None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"ParallelGroup(rank {self.rank} of {self.world_size}, {self.device})"

    # ------------------------------------------------------------------ splitting sizes
    def split(self, total: int, what: str, tensor: str) -> int:
        """``total // world_size``; :class:`ShardError` naming ``tensor`` and ``what`` (the config
        field being split) when it does not divide."""
        if total % self.world_size:
            raise ShardError(f"cannot shard `{tensor}` across {self.world_size} ranks: its {total} {what} "
                             f"do not divide by {self.world_size}")
        return total // self.world_size

    def local_range(self, total: int, what: str, tensor: str) -> tuple[int, int]:
        """``[lo, hi)`` of this rank's equal share of ``total`` units."""
        n = self.split(total, what, tensor)
        return self.rank * n, (self.rank + 1) * n

    # ------------------------------------------------------------------ device collectives
    def _need_group(self, op: str) -> None:
        if self.group is None:
            raise ParallelError(f"{op} on {self!r}: this group has no process group (a layout-only group, "
                                "or torch.distributed was not initialised)")

    def _failed(self, op: str, e: Exception) -> ParallelError:
        return ParallelError(f"rank {self.rank} of {self.world_size}: {op} failed; another rank probably "
                             f"died, raised or did not answer within {self.timeout_s:.0f} s ({e})")

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``. Identity at world size 1."""
        if self.world_size == 1:
            return x
        self._need_group("all_reduce")
        import torch.distributed as dist
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:
            raise self._failed("all_reduce", e) from e
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on each) along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        self._need_group("all_gather")
        import torch.distributed as dist
        flat = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        try:
            gather(flat, x.contiguous().view(-1), group=self.group)
        except RuntimeError as e:
            raise self._failed("all_gather", e) from e
        dim = dim % x.dim()
        return flat.view(self.world_size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` from rank ``src`` on every rank, in place (e.g. rank 0's sampled token ids)."""
        if self.world_size == 1:
            return x
        self._need_group("broadcast")
        import torch.distributed as dist
        try:
            dist.broadcast(x, src=src, group=self.group)
        except RuntimeError as e:
            raise self._failed("broadcast", e) from e
        return x

    # ------------------------------------------------------------------ host messages (control group)
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable host object from rank ``src`` (a step plan); other ranks pass anything."""
        if self.world_size == 1:
            return obj
        self._need_group("broadcast_object")
        import torch.distributed as dist
        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self.control)
        except RuntimeError as e:
            raise self._failed("broadcast_object", e) from e
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (load progress, per-rank errors, reports)."""
        if self.world_size == 1:
            return [obj]
        self._need_group("all_gather_object")
        import torch.distributed as dist
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.control)
        except RuntimeError as e:
            raise self._failed("all_gather_object", e) from e
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            self._need_group("barrier")
            import torch.distributed as dist
            try:
                dist.barrier(group=self.control)
            except RuntimeError as e:
                raise self._failed("barrier", e) from e

    def close(self) -> None:
        """Tear down the process groups (the default group too, if this group created it)."""
        if self.group is None:
            return
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        self.group = self.control = None


#: the world-size-1 group: no collectives, no torch.distributed
SINGLE = ParallelGroup()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_parallel(world_size: int | None = None, rank: int | None = None, *, local_rank: int | None = None,
                  device: str | torch.device | None = None, backend: str | None = None,
                  master_addr: str | None = None, master_port: int | None = None,
                  timeout_s: float | None = None) -> ParallelGroup:
    """Join (or create) the group. Arguments left out come from torchrun's environment: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; with neither, world size 1.

    ``device`` defaults to ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; the backend is
    NCCL for CUDA devices and gloo for the CPU. ``NCCL_NVLS_ENABLE=0`` (no NVLink multicast) is set in
    the environment before NCCL starts unless the caller set it. ``timeout_s`` (default
    ``DSV4_DIST_TIMEOUT`` or 600) bounds every collective: a rank that dies or stops answering takes
    the group down with a :class:`ParallelError`, never a silent hang.
    """
    world_size = world_size if world_size is not None else (_env_int("WORLD_SIZE") or 1)
    rank = rank if rank is not None else (_env_int("RANK") or 0)
    local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK")
    local_rank = rank if local_rank is None else local_rank
    if timeout_s is None:
        timeout_s = float(os.environ.get("DSV4_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if world_size == 1:
        return ParallelGroup(0, 1, device=device, timeout_s=timeout_s)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")

    import torch.distributed as dist
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")   # a timed-out NCCL op aborts the process
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise ValueError("init_parallel: world size > 1 needs MASTER_PORT (torchrun sets it) or master_port=")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = dict(device_id=device) if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}, not {rank} of {world_size}")
    group = dist.group.WORLD
    # host messages wait as long as rank 0 is idle (a server between requests); a rank that dies
    # closes its sockets, which ends such a wait at once
    idle = datetime.timedelta(seconds=max(timeout_s, float(os.environ.get("DSV4_IDLE_TIMEOUT", IDLE_TIMEOUT_S))))
    control = dist.new_group(backend="gloo", timeout=idle)
    pg = ParallelGroup(rank, world_size, group, control, device, timeout_s)
    # first collective now, so communicators exist before any CUDA graph capture
    pg.all_reduce_sum(torch.zeros(1, device=device))
    return pg
