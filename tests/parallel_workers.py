"""What each rank runs in the multi-process tests (module-level, so spawned processes import them)."""

from __future__ import annotations

import os
import time

import torch

from dsv4.config import ModelConfig
from dsv4.engine.batch import Row, ScheduledBatch
from dsv4.engine.distributed import ParallelRunner, follow, greedy
from dsv4.engine.runner import Runner
from dsv4.random_weights import random_sharded
from dsv4.parallel import ParallelGroup
from dsv4.weights.loader import load_model


def _drive(tp: ParallelGroup, runner: Runner, prompts, steps: int) -> dict:
    """Rank 0 runs greedy decoding (then a call that fails its checks, then greedy again: the other
    ranks must survive the failed plan); the others follow."""
    if tp.rank != 0:
        follow(runner, tp)
        return {}
    with ParallelRunner(runner, tp) as r:
        tokens, logits = greedy(r, prompts, steps)
        try:
            r.run(ScheduledBatch((Row(len(prompts) + 5, 0),)))
        except IndexError as e:
            failed = str(e)
        again, _ = greedy(r, prompts, 3)
    return dict(tokens=tokens, logits=logits, failed=failed, again=again)


def checkpoint(tp: ParallelGroup, path, prompts, steps: int, qat_sim: bool) -> dict:
    model, report = load_model(path, dtype=torch.float32, progress=False, parallel=tp)
    runner = Runner(model, max_num_seqs=len(prompts), max_model_len=96, qat_sim=qat_sim)
    return dict(_drive(tp, runner, prompts, steps), rank_bytes=report.rank_bytes, line=report.one_line())


def random(tp: ParallelGroup, config: dict, prompts, steps: int, dtype: torch.dtype = torch.float32) -> dict:
    model = random_sharded(ModelConfig.from_dict(config), dtype, tp.device, tp, seed=7)
    runner = Runner(model, max_num_seqs=len(prompts), max_model_len=96, qat_sim=False)   # test_parallel says why
    return _drive(tp, runner, prompts, steps)


def collectives(tp: ParallelGroup) -> dict:
    r = tp.rank
    x = torch.arange(6.0).view(2, 3) + 10 * r
    gathered = [tp.all_gather(x, dim).tolist() for dim in (0, 1, -1)]
    summed = tp.all_reduce_sum(torch.full((3,), float(r + 1))).tolist()
    ids = tp.broadcast(torch.tensor([7, 8, 9]) if r == 0 else torch.zeros(3, dtype=torch.int64)).tolist()
    plan = tp.broadcast_object({"from": r})
    return dict(gathered=gathered, summed=summed, ids=ids, plan=plan, objects=tp.all_gather_object(r * r))


def scenarios(tp: ParallelGroup, jobs: list[tuple[str, str, tuple]]) -> dict:
    """Run several jobs in one group (one process start-up for all of them)."""
    table = dict(checkpoint=checkpoint, random=random, collectives=collectives,
                 random_cuda=random)   # fp32 on the GPUs too
    return {key: table[kind](tp, *args) for key, kind, args in jobs}


def dies(tp: ParallelGroup) -> None:
    """Rank 1 vanishes (as a crashed process would); rank 0's next collective must fail, not hang."""
    if tp.rank == 1:
        os._exit(0)
    time.sleep(0.5)
    tp.all_reduce_sum(torch.ones(4))


def graph_collectives(tp: ParallelGroup) -> dict:
    """The collectives captured in one CUDA graph (NCCL), replayed on new inputs."""
    dev = tp.device
    x = torch.zeros(4, 8, device=dev)

    def step():
        y = tp.all_reduce_sum(x * 2)
        return y, tp.all_gather(y[:, : 4] + tp.rank, dim=-1), tp.broadcast(x[0].clone())

    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    results = []
    for value in (1.0, 3.0):
        x.fill_(value + tp.rank)
        graph.replay()
        torch.cuda.synchronize(dev)
        results.append([t.cpu() for t in outs])
    return dict(results=results)
