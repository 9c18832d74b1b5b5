"""One run, one table per kernel family: time, achieved GB/s or TFLOP/s, percent of the roofline
measured in the same run, and the same op through the peer implementation.

    python bench/kernels.py [--families linear moe attention ...] [--out DIR]

The copy bandwidth (a large device-to-device copy, bytes read + written) and the dense BF16
tensor-core peak (a large cuBLAS matmul) are measured first; each kernel's floor is the larger
of bytes / bandwidth and flops / peak. Times are medians of ``triton.testing.do_bench`` over a CUDA
graph of ``GRAPH_REPS`` calls, each after an L2 flush whose own time is subtracted (device time with
cold weights, as a captured decode step sees it: a decode-shape kernel runs for a few microseconds,
less than one eager launch costs the host); a case that cannot be captured (a host sync) is timed
eagerly and marked ``eager``. A PNG
bar chart of percent-of-roofline per kernel is written next to the table (``--out``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import MODULES, graph_replay  # noqa: E402


GRAPH_REPS = 10


class Env:
    def __init__(self, device: str):
        import triton.testing as tt
        self.device = device
        self.do_bench = lambda fn: tt.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
        self.copy_gbs = self._copy_bandwidth()
        self.peak_tflops = self._bf16_peak()
        self._flush = torch.empty(128 << 20, dtype=torch.uint8, device=device)   # > L2 (50 MB on H100/H200)

    def _copy_bandwidth(self) -> float:
        n = 1 << 30
        a = torch.empty(n, dtype=torch.uint8, device=self.device)
        b = torch.empty_like(a)
        t = self.do_bench(lambda: b.copy_(a))
        return 2 * n / t / 1e9

    def _bf16_peak(self) -> float:
        m = 8192
        a = torch.randn(m, m, dtype=torch.bfloat16, device=self.device)
        b = torch.randn(m, m, dtype=torch.bfloat16, device=self.device)
        t = self.do_bench(lambda: a @ b)
        return 2 * m ** 3 / t / 1e12

    def time(self, fn, captured: bool = False) -> tuple[float, str]:
        """Seconds per call of ``fn``: CUDA-graph replay, else eager launches.

        A decode-shape kernel runs for a few microseconds, less than an eager launch costs the
        host, so it is timed inside a graph of GRAPH_REPS calls. Each call is preceded by an L2
        flush (a decode step reads every layer's weights once, far more than L2 holds: a kernel
        must not find its weights cached by its previous call), and the time of a graph of the
        flushes alone is subtracted.
        """
        if captured:                                # fn replays a graph of its own
            return self.do_bench(fn), "graph"
        try:
            timed = graph_replay([self._flush.zero_, fn] * GRAPH_REPS)
            flushes = graph_replay([self._flush.zero_] * GRAPH_REPS)
            t = (self.do_bench(timed) - self.do_bench(flushes)) / GRAPH_REPS
            if t > 0:
                return t, "graph"
        except Exception:                           # noqa: BLE001 - not capturable: time it eagerly
            pass
        torch.cuda.synchronize()
        return self.do_bench(fn), "eager"

    def floor(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.copy_gbs * 1e9), flops / (self.peak_tflops * 1e12))


def run_cases(env: Env, families: list[str] | None) -> list[dict]:
    rows = []
    for name in MODULES:
        module = importlib.import_module(f"bench.kernel_cases.{name}")
        for case in module.cases(env):
            if families and case.family not in families:
                continue
            t, mode = env.time(case.fn, case.captured)
            floor = env.floor(case.bytes, case.flops)
            row = dict(family=case.family, name=case.name, us=t * 1e6, gbs=case.bytes / t / 1e9,
                       tflops=case.flops / t / 1e12, pct_roofline=100 * floor / t, peer=case.peer,
                       notes=case.notes, mode=mode, **case.extra)
            if case.peer_fn is not None:
                tp, _ = env.time(case.peer_fn, case.captured)
                row.update(peer_us=tp * 1e6, peer_pct_roofline=100 * floor / tp, speedup_vs_peer=tp / t)
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


def _fmt(r: dict) -> str:
    peer = (f" | {r['peer']}: {r['peer_us']:9.1f} us ({r['peer_pct_roofline']:5.1f}%), x{r['speedup_vs_peer']:.2f}"
            if "peer_us" in r else "")
    return (f"{r['family']:<10} {r['name']:<40} {r['us']:9.1f} us {r['gbs']:8.1f} GB/s {r['tflops']:7.1f} TF/s "
            f"{r['pct_roofline']:5.1f}% roof{'' if r.get('mode', 'graph') == 'graph' else ' (eager)'}{peer}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [f"{r['family']}: {r['name']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["pct_roofline"] for r in rows], height=0.4, label="dsv4")
    ax.barh([i - 0.2 for i in y], [r.get("peer_pct_roofline", 0) for r in rows], height=0.4, label="peer")
    ax.set_yticks(list(y), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of roofline (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    env = Env("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {env.copy_gbs:.0f} GB/s, bf16 dense {env.peak_tflops:.0f} TFLOP/s")
    rows = run_cases(env, args.families)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(dict(copy_gbs=env.copy_gbs, peak_tflops=env.peak_tflops,
                                                      device=torch.cuda.get_device_name(), rows=rows), indent=1))
    plot(rows, out / "kernels.png")


if __name__ == "__main__":
    main()
