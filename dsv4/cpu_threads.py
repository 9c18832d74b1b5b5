"""How many CPU threads torch may use: the cores that are free now, not all of them.

torch's default is one thread per physical core. When another process keeps a core busy, the
thread that lands there stalls every parallel op of the step, since the others wait for it at
each barrier: measured on the 2-core CI machine with the tiny model, one busy core (``yes >
/dev/null``) took decode from 17-23 tok/s to about 1.3 tok/s with 2 threads, while 1 thread kept
8-9 tok/s. So the default is the physical cores this process may run on, minus the cores other
processes are keeping busy right now (sampled from ``/proc/stat`` for a fifth of a second), and at
least 1. ``--threads N`` sets it outright; ``OMP_NUM_THREADS`` is respected when set.
"""

from __future__ import annotations

import os
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
    busy = 0.0
    for cpu in cpus:
        if cpu in before and cpu in after:
            d_busy, d_total = (a - b for a, b in zip(after[cpu], before[cpu]))
            busy += d_busy / d_total if d_total > 0 else 0.0
    return busy


def choose_threads(requested: int | str | None = "auto") -> tuple[int, str]:
    """``(threads, why)``: ``requested`` when it is a number, else ``OMP_NUM_THREADS`` when set, else
    the physical cores minus the busy ones (at least 1)."""
    if requested not in (None, "auto"):
        return int(requested), "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cpus = _allowed_cpus()
    cores, logical = physical_cores(cpus), len(cpus)
    busy = busy_cpus(cpus) * cores / max(1, logical)  # busy logical CPUs -> busy cores
    threads = max(1, cores - round(busy))
    return threads, f"{cores} core(s), {busy:.1f} busy with other work"
