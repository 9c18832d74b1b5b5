"""Tensor + expert parallel over 2 CPU processes (gloo): the same greedy tokens and logits as one
process, for the tiny model (BF16), a release-layout checkpoint (FP8 block + MXFP4, QAT simulation
on) built through ``dsv4 quantize``, a checkpoint written by transformers' ``save_pretrained``, and
the random-weights-on-device path of the benchmark. Also: the collectives, a rank that dies.

All 2-rank jobs share one process start-up (the module fixture); the references run here, in one
process. Logits agree to fp32 rounding (sums over ranks reassociate): max|diff| <= 1e-4 max|logit|.
"""

from __future__ import annotations

import pytest
import torch

import parallel_workers as workers
from conftest import parity_config, tp_config
from dsv4.engine.distributed import greedy, spawn
from dsv4.engine.runner import Runner
from dsv4.random_weights import random_sharded
from dsv4.weights.loader import load_model

PROMPTS = [[0, 17, 3, 99, 250, 4, 8, 15, 16, 23, 42, 108, 7, 300, 5, 6, 77], [0, 400, 21]]
STEPS = 8


def _release_checkpoint(root):
    """The tp geometry stored like DeepSeek's release, built the way the tiny model is."""
    from dsv4.model.init import init_random
    from dsv4.model.transformer import Transformer
    from dsv4.tiny import write_checkpoint
    from dsv4.weights.quantize import quantize_checkpoint

    src, dst = root / "bf16", root / "release"
    write_checkpoint(init_random(Transformer(tp_config(), torch.bfloat16), seed=11), src)
    quantize_checkpoint(src, dst, "mxfp4", policy="floor", dense_format="fp8", scale_fmt="ue8m0", progress=False)
    return dst


def _hf_checkpoint(root):
    pytest.importorskip("transformers", minversion="5.23")
    from transformers import DeepseekV4ForCausalLM

    from hf_oracle import hf_config

    torch.manual_seed(0)
    DeepseekV4ForCausalLM(hf_config(parity_config())).eval().save_pretrained(root / "hf")
    return root / "hf"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from dsv4.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("tp")
    paths = {"tiny": ensure_tiny(root / "cache", "bf16"), "release": _release_checkpoint(root)}
    jobs = [("tiny", "checkpoint", (paths["tiny"], PROMPTS, STEPS, False)),
            ("release", "checkpoint", (paths["release"], PROMPTS, STEPS, True)),
            ("random", "random", (tp_config().to_dict(), PROMPTS, STEPS)),
            ("collectives", "collectives", ())]
    try:
        paths["hf"] = _hf_checkpoint(root)
        jobs.append(("hf", "checkpoint", (paths["hf"], PROMPTS, STEPS, False)))
    except pytest.skip.Exception:
        pass
    results = spawn(workers.scenarios, 2, jobs, timeout_s=120)
    return paths, results


def _single(path, qat_sim):
    model, _ = load_model(path, dtype=torch.float32, progress=False)
    return greedy(Runner(model, max_num_seqs=len(PROMPTS), max_model_len=96, qat_sim=qat_sim), PROMPTS, STEPS)


def _same(got: dict, want_tokens, want_logits) -> None:
    assert got["tokens"] == want_tokens
    err = (got["logits"] - want_logits).abs().max()
    assert err <= 1e-4 * want_logits.abs().max(), f"max |logit diff| {err}"
    assert got["again"] == [t[:3] for t in want_tokens]          # the ranks survived the failed plan
    assert "out of range" in got["failed"]


@pytest.mark.parametrize("job, qat_sim", [("tiny", False), ("release", True), ("hf", False)])
def test_two_ranks_generate_what_one_does(run, job, qat_sim):
    paths, results = run
    if job not in paths:
        pytest.skip("the HF oracle needs transformers>=5.23")
    rank0, rank1 = results[0][job], results[1][job]
    _same(rank0, *_single(paths[job], qat_sim))
    # the load report: bytes per rank, the same list on both ranks, each well under the whole
    assert rank0["rank_bytes"] == rank1["rank_bytes"] and len(rank0["rank_bytes"]) == 2
    assert "rank 0 of 2 (per rank:" in rank0["line"]


def test_random_weights_on_device_match_one_process(run):
    """Each rank makes its own slices of the random weights; the model they make together decodes
    what one process's does. With the QAT simulation off: two ranks sum their heads' partial
    products in another order than one process (a few 1e-7 apart), and the simulation's FP8 / FP4
    rounding is a step function that can turn such a difference into a whole grid step (measured on
    this geometry: 1.9e-6 apart without it; with it 0.10 from the step whose CSA top-k first selects,
    or 1.4e-6, depending on the order of the top-k picks and on the process's thread settings). The
    QAT path under tensor parallel is
    compared by the release checkpoint above, whose values do not sit on those edges."""
    _, results = run
    model = random_sharded(tp_config(), torch.float32, "cpu", seed=7)
    _same(results[0]["random"], *greedy(Runner(model, max_num_seqs=len(PROMPTS), max_model_len=96, qat_sim=False),
                                        PROMPTS, STEPS))


def test_collectives(run):
    _, results = run
    for rank in (0, 1):
        got = results[rank]["collectives"]
        a, b = torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3) + 10
        assert got["gathered"] == [torch.cat([a, b], 0).tolist(), torch.cat([a, b], 1).tolist(),
                                   torch.cat([a, b], 1).tolist()]
        assert got["summed"] == [3.0] * 3 and got["ids"] == [7, 8, 9]
        assert got["plan"] == {"from": 0} and got["objects"] == [0, 1]


def test_a_rank_that_dies_fails_the_group_with_a_message():
    with pytest.raises(Exception) as info:
        spawn(workers.dies, 2, timeout_s=30)
    assert "ParallelError" in str(info.value) and "all_reduce failed" in str(info.value)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.gpu
@two_gpus
def test_nccl_collectives_replay_in_a_cuda_graph():
    results = spawn(workers.graph_collectives, 2, device="cuda", timeout_s=120)
    for rank in (0, 1):
        for value, (summed, gathered, bcast) in zip((1.0, 3.0), results[rank]["results"]):
            total = 2 * (value + value + 1)               # rank 0 holds value, rank 1 value + 1
            assert torch.equal(summed, torch.full((4, 8), total))
            assert torch.equal(gathered, torch.cat([torch.full((4, 4), total), torch.full((4, 4), total + 1)], 1))
            assert torch.equal(bcast, torch.full((8,), value))


@pytest.mark.gpu
@two_gpus
def test_two_gpus_generate_what_one_does():
    """The release layout (random weights made on each GPU) over NCCL vs one GPU, in fp32: the
    oracle needs sums that differ only by fp32 rounding. (In bf16, measured on 2xH200, this tiny
    random model's logits differed by a median 4% per step between one and two GPUs with the
    kernels, and its argmax at the first step already with the reference ops.)"""
    config = tp_config()
    results = spawn(workers.scenarios, 2, [("random", "random_cuda", (config.to_dict(), PROMPTS, STEPS))],
                    device="cuda", timeout_s=300)
    model = random_sharded(config, torch.float32, "cuda:0", seed=7)
    tokens, logits = greedy(Runner(model, max_num_seqs=len(PROMPTS), max_model_len=96, qat_sim=True), PROMPTS, STEPS)
    got = results[0]["random"]
    assert got["tokens"] == tokens
    assert (got["logits"] - logits).abs().max() <= 1e-4 * logits.abs().max()