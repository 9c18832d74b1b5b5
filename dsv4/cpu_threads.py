"""How many CPU threads torch may use: the cores that are free now, not all of them.

torch's default is one thread per physical core. When another process keeps a core busy, the
thread that lands there stalls every parallel op of the step, since the others wait for it at
each barrier: measured on the 2-core CI machine with the tiny model, one busy core (``yes >
/dev/null``) took decode from 17-23 tok/s to about 1.3 tok/s with 2 threads, while 1 thread kept
8-9 tok/s. So the default is the physical cores this process may run on, minus the cores other
processes are keeping busy right now (sampled from ``/proc/stat`` for a fifth of a second), and at
least 1. ``--threads N`` sets it outright; ``OMP_NUM_THREADS`` is respected when set.

The CLI (``--threads``) and the Python API (``LLM(threads=...)``) both go through
:func:`apply_threads`. A server runs for hours while other work comes and goes, so
:class:`ThreadMonitor` re-evaluates the count between engine steps: it compares two ``/proc/stat``
readings a few seconds apart (no sleep: the interval is the time between calls) and subtracts the
CPU time this process itself used in it, which leaves what other processes took.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

SAMPLE_SECONDS = 0.2


def physical_cores(cpus: set[int] | None = None) -> int:
    """Distinct physical cores among ``cpus`` (default: the CPUs this process may run on)."""
    cpus = cpus if cpus is not None else _allowed_cpus()
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology: count the logical CPU
    return max(1, len(cores))


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _read_stat() -> dict[int, tuple[int, int]]:
    """Per logical CPU: (busy, total) jiffies since boot. Steal counts as busy: another VM has it."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            v = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle = v[3] + v[4]
            out[int(name[3:])] = (sum(v) - idle, sum(v))
    return out


def busy_cpus(cpus: set[int] | None = None, seconds: float = SAMPLE_SECONDS,
              read_stat: Callable[[], dict[int, tuple[int, int]]] = _read_stat) -> float:
    """How many of ``cpus`` other work kept busy over the next ``seconds`` (0 when unknown)."""
    cpus = cpus if cpus is not None else _allowed_cpus()
    try:
        before = read_stat()
        time.sleep(seconds)
        after = read_stat()
    except (OSError, ValueError):
        return 0.0
    return _busy_between(before, after, cpus)


def _busy_between(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpus: set[int]) -> float:
    """Busy logical CPUs among ``cpus`` between two ``/proc/stat`` readings (each CPU's busy fraction, summed)."""
    busy = 0.0
    for cpu in cpus:
        if cpu in before and cpu in after:
            d_busy, d_total = (a - b for a, b in zip(after[cpu], before[cpu]))
            busy += d_busy / d_total if d_total > 0 else 0.0
    return busy


def _free_cores(cpus: set[int], busy_logical: float) -> tuple[int, int, float]:
    """``(threads, cores, busy cores)``: the physical cores among ``cpus`` minus those that
    ``busy_logical`` busy logical CPUs take, at least 1."""
    cores, logical = physical_cores(cpus), len(cpus)
    busy = busy_logical * cores / max(1, logical)  # busy logical CPUs -> busy cores
    return max(1, cores - round(busy)), cores, busy


def choose_threads(requested: int | str | None = "auto") -> tuple[int, str]:
    """``(threads, why)``: ``requested`` when it is a number, else ``OMP_NUM_THREADS`` when set, else
    the physical cores minus the busy ones (at least 1)."""
    if requested not in (None, "auto"):
        return int(requested), "--threads"
    if _omp_env():
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cpus = _allowed_cpus()
    threads, cores, busy = _free_cores(cpus, busy_cpus(cpus))
    return threads, f"{cores} core(s), {busy:.1f} busy with other work"


def check_threads(requested: object, what: str = "threads") -> None:
    """Raise :class:`~dsv4.errors.UsageError` unless ``requested`` is ``"auto"``, a positive int or None."""
    from .errors import UsageError
    if requested is None or requested == "auto":
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise UsageError(f"{what} must be 'auto', a positive int or None, got {requested!r}")


def apply_threads(requested: int | str | None, announce: bool = True) -> Callable[[], None]:
    """Set torch's CPU threads by the policy above (``requested``: ``"auto"``, a number, or None to
    leave torch alone); prints the choice on stderr when ``announce``. Returns the undo."""
    check_threads(requested)
    if requested is None:
        return lambda: None
    import torch

    threads, why = choose_threads(requested)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    if announce:
        print(f"cpu: {threads} thread{'s' if threads > 1 else ''} ({why}; --threads N overrides)", file=sys.stderr)
    return lambda: torch.set_num_threads(previous)


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class ThreadMonitor:
    """Re-applies the ``auto`` policy every ``interval`` seconds while a process serves.

    Call :meth:`poll` often (between engine steps, on the thread that runs them); it costs two
    clock reads except once per ``interval``, when it reads ``/proc/stat`` and may change torch's
    thread count. Inactive (``poll`` does nothing) unless ``requested`` is ``"auto"`` and
    ``OMP_NUM_THREADS`` is unset.
    """

    def __init__(self, requested: int | str | None, interval: float = 5.0,
                 read_stat: Callable[[], dict[int, tuple[int, int]]] = _read_stat,
                 own_cpu_seconds: Callable[[], float] = _own_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic):
        self.active = requested == "auto" and not _omp_env()
        self.interval, self.read_stat, self.own, self.clock = interval, read_stat, own_cpu_seconds, clock
        self.cpus = _allowed_cpus()
        self.changes: list[tuple[int, int]] = []   # (from, to) of every change, for logs and tests
        self._last = self._sample() if self.active else None

    def _sample(self):
        try:
            return self.clock(), self.read_stat(), self.own()
        except (OSError, ValueError):
            return None

    def poll(self) -> int | None:
        """Re-evaluate when ``interval`` has passed; returns the new thread count when it changed."""
        if not self.active or self._last is None or self.clock() - self._last[0] < self.interval:
            return None
        now = self._sample()
        if now is None:
            self.active = False
            return None
        (t0, before, own0), (t1, after, own1) = self._last, now
        self._last = now
        own = (own1 - own0) / max(t1 - t0, 1e-9)   # logical CPUs this process kept busy
        threads, _, _ = _free_cores(self.cpus, max(0.0, _busy_between(before, after, self.cpus) - own))
        import torch
        previous = torch.get_num_threads()
        if threads == previous:
            return None
        torch.set_num_threads(threads)
        self.changes.append((previous, threads))
        return threads


def _omp_env() -> bool:
    env = os.environ.get("OMP_NUM_THREADS", "")
    return env.isdigit() and int(env) > 0
