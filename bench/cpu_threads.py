"""Decode tok/s of the embedded tiny model on the CPU by thread count, with and without a busy core.

    python bench/cpu_threads.py [--tokens 64] [--repeats 3] [--threads 1,2]

For each load (none, then one `yes > /dev/null` process started here) it prints the thread count
``dsv4.cpu_threads.choose_threads`` picks, then the median decode tok/s of greedy runs for each
thread count asked for, and for the automatic choice.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from dsv4 import LLM, SamplingParams
from dsv4.cpu_threads import choose_threads


def decode_rate(llm: LLM, threads: int, tokens: int, repeats: int) -> list[float]:
    torch.set_num_threads(threads)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0))  # warm up
    return [llm.generate("Once upon a time", params)[0].decode_tokens_per_s for _ in range(repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="1,2", help="comma list of thread counts to measure")
    args = p.parse_args()
    llm = LLM("tiny", device="cpu", max_num_seqs=1, progress=False)
    for load in ("idle", "one busy core"):
        busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if load != "idle" else None
        try:
            time.sleep(0.5)
            auto, why = choose_threads("auto")
            print(f"{load}: auto picks {auto} ({why})", flush=True)
            for label, n in [(str(n), int(n)) for n in args.threads.split(",")] + [("auto", auto)]:
                rates = decode_rate(llm, n, args.tokens, args.repeats)
                print(f"  threads {label:>4} ({n}): median {statistics.median(rates):6.1f} tok/s   "
                      + " ".join(f"{r:.1f}" for r in rates), flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()


if __name__ == "__main__":
    main()
