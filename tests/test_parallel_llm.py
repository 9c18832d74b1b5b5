"""``LLM(..., tensor_parallel_size=N)`` and ``--tensor-parallel-size``: the engine (scheduler, chunked
prefill, sampler, prompt logprobs) over a group this process starts, against the same engine on one
process. On CPU: 2 ranks over gloo, the tiny BF16 model (through the CLI also the default and NVFP4 tiny
models, against a one-process CLI run). A dead rank and a model that cannot split
are one-line errors, never a hang. The GPU variant (2 GPUs, NCCL, CUDA graphs) runs in
``bench/tp_check.sh``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from dsv4.engine.grammar import StructuredOutputsParams
from dsv4.engine.llm import LLM, SamplingParams
from dsv4.errors import UsageError
from dsv4.parallel import ParallelError

PROMPTS = [[0, 17, 3, 99, 250, 4], [0, 400, 21], [0, 5, 6, 7, 8, 9, 10, 11],
           [0] + [int(t) for t in torch.randint(2, 500, (700,), generator=torch.Generator().manual_seed(3))]]


def _runs(llm: LLM) -> dict:
    greedy = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    # constrained rows next to free ones: the step's forward and sampler run apart on every rank
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}})
    mixed = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, structured_outputs=spec if s % 2 else None)
             for s in range(3)]
    g = llm.generate(PROMPTS, greedy)
    return dict(greedy=[o.token_ids for o in g], logprobs=[o.logprobs for o in g],
                sampled=[o.token_ids for o in llm.generate(PROMPTS, sampled)],
                prompt_logprobs=llm.generate(PROMPTS[2], scored)[0].prompt_logprobs,
                constrained=[(o.token_ids, o.text) for o in llm.generate(PROMPTS[:3], mixed)])


@pytest.fixture(scope="module")
def both():
    # 3 decode steps of the running requests in each step that admits a prompt (both ways): the
    # steps' decode_steps and the saves inside them reach every rank in the step's batch
    kw = dict(device="cpu", max_num_seqs=2, max_model_len=1024, progress=False, max_num_batched_tokens=256,
              prefill_decode_steps=3)
    one = _runs(LLM("tiny:bf16", **kw))
    with LLM("tiny:bf16", tensor_parallel_size=2, **kw) as llm:
        assert llm.tensor_parallel_size == 2 and llm.runner.tp.world_size == 2
        two = _runs(llm)
    return one, two


def test_two_ranks_generate_what_one_does(both):
    one, two = both
    assert two["greedy"] == one["greedy"]          # incl. a 700-token prompt prefilled in chunks
    assert two["sampled"] == one["sampled"]        # seeded sampling, top-p
    assert two["constrained"] == one["constrained"]
    assert json.loads(two["constrained"][1][1]).keys() <= {"n"}
    for a, b in zip(one["logprobs"], two["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert two["prompt_logprobs"][0] is None
    assert two["prompt_logprobs"][1:] == pytest.approx(one["prompt_logprobs"][1:], abs=1e-4)


def test_dead_rank_is_named_not_a_hang():
    llm = LLM("tiny:bf16", device="cpu", max_num_seqs=1, tensor_parallel_size=2, progress=False)
    os.kill(llm._group.procs[0].pid, signal.SIGKILL)
    llm._group.procs[0].join(10)
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank 1 of 2 exited \(exit code -9\)"):
        llm.generate([[0, 1, 2]], SamplingParams(max_tokens=4))
    llm.close()
    llm.close()                                    # idempotent
    assert time.monotonic() - t0 < 30


def test_bad_sizes_are_usage_errors(monkeypatch):
    with pytest.raises(UsageError, match="tensor_parallel_size"):
        LLM("tiny:bf16", device="cpu", tensor_parallel_size=0, progress=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="differs from torchrun's WORLD_SIZE 2"):
        LLM("tiny:bf16", device="cpu", tensor_parallel_size=3, progress=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "dsv4.cli", "generate", "--device", "cpu", "--max-tokens", "8",
                           "--temperature", "0", "--ignore-eos", "--json", *args, "Hello"],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("model", [[], ["--model", "tiny:nvfp4"]], ids=["default", "nvfp4"])
def test_cli_flag_matches_one_rank(model):
    """The default tiny model (FP8 block + MXFP4, QAT simulation on) and NVIDIA's layout split in two
    (the README's table) and give the greedy ids of one process."""
    one = _cli(*model)
    two = _cli(*model, "--tensor-parallel-size", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "tensor parallel: starting 1 more rank(s) on the CPU (gloo)" in two.stderr
    ids = json.loads(one.stdout)["token_ids"]
    assert len(ids) == 8 and json.loads(two.stdout)["token_ids"] == ids


def test_cli_names_a_bad_split():
    # the default tiny model's FP8 projections are two 128-row blocks: no 4-way split
    bad = _cli("--tensor-parallel-size", "4")
    assert bad.returncode == 2
    assert re.search(r"error: cannot shard `layers\.0\.attn\.(wq_b|wo_a)\.weight` \(FP8 block.*multiple of 128",
                     bad.stderr), bad.stderr
    assert "Traceback" not in bad.stderr


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.gpu
@two_gpus
def test_two_gpus_with_graphs_generate_what_one_does():
    """NCCL, CUDA graphs captured on both ranks (the collectives and the id broadcast inside)."""
    kw = dict(device="cuda", dtype="fp32", max_num_seqs=2, max_model_len=1024, progress=False)
    one = _runs(LLM("tiny:bf16", **kw))
    with LLM("tiny:bf16", tensor_parallel_size=2, **kw) as llm:
        assert llm.runner.use_graphs
        two = _runs(llm)
    assert two["greedy"] == one["greedy"]
    assert two["sampled"] == one["sampled"]
    assert two["constrained"] == one["constrained"]      # the split forward and sampler graphs


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"     # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads child processes from /proc")
@pytest.mark.parametrize("to", ["group", "rank 0"])
def test_ctrl_c_stops_every_rank(to):
    """SIGINT mid-generation, to the process group (a terminal's Ctrl-C) or to rank 0 alone: exit
    status 130 within seconds and no rank left running. Rank 0 interrupted mid-step cannot tell the
    others to stop (they wait in a collective it will not enter), so it terminates them."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "generate", "--model", "tiny:bf16", "--device", "cpu",
                             "--tensor-parallel-size", "2", "--max-tokens", "2000", "--ignore-eos", "Hello"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdout.read(8)                       # generation is under way (text is streaming)
        ranks = [k for k in _children(proc.pid) if "spawn_main" in open(f"/proc/{k}/cmdline").read()]
        assert ranks, "no follower rank found"
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=20) == 130         # not a 30 s wait for ranks that cannot hear "stop"
        deadline = time.monotonic() + 30
        while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(r) for r in ranks), "a rank is still running after Ctrl-C"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
