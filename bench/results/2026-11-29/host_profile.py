"""Call 7: the host's share of a verify step at batch 1 (Flash x4, fp8-mxfp4, QAT, CUDA graphs, k = 3):
the step as bench/spec_bench.py times it (runner.run, host drafts), its graph replayed alone, and a
cProfile of the steps (top functions by own time)."""
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.spec_bench import ngram_runner, plain_decode, spec_decode, sync  # noqa: E402
from dsv4.config import preset  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402


class A:
    k, context, graphs = 3, 1024, True


model = build_random_model(preset("flash", num_layers=4), "fp8-mxfp4", "cuda", dtype=torch.bfloat16, with_mtp=True)
rng = random.Random(0)
V = model.config.vocab_size
r, _ = ngram_runner(model, A, True, 1, 1024 + 400, rng)
junk = lambda s, e: [rng.randrange(2, V) for _ in range(3)]   # noqa: E731
plain_decode(r, 3)
spec_decode(r, 3, 3, junk)
N = 50
t_dec, _ = plain_decode(r, N)
t_ver, steps, _ = spec_decode(r, N, 3, junk)
g = next(iter(r.verify_graphs.values()))
sync("cuda")
t0 = time.perf_counter()
for _ in range(N):
    g.graph.replay()
sync("cuda")
t_rep = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(N):
    g.graph.replay()
    g.kept[:1].tolist()
t_rep_sync = time.perf_counter() - t0
print(f"decode step {1e3 * t_dec / N:.3f} ms; verify step {1e3 * t_ver / steps:.3f} ms; verify graph replayed "
      f"back to back {1e3 * t_rep / N:.3f} ms, with a sync each {1e3 * t_rep_sync / N:.3f} ms")
for name, fn in (("verify", lambda: spec_decode(r, N, 3, junk)), ("decode", lambda: plain_decode(r, N))):
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    print(f"\n## {name}: {N} steps, top by own time")
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
