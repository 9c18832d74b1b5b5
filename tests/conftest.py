"""Shared fixtures: small configs and random models built in-process (tests never download)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from dsv4.config import ModelConfig, YarnConfig, preset
from dsv4.model.init import init_random
from dsv4.model.transformer import Transformer
from dsv4.testing import prefill

from launch_guard import guarded_launches  # noqa: E402


@pytest.fixture(autouse=True)
def _guarded_interpreted_launches(request):
    """Kernel tests in Triton's interpreter run each launch between NaN guard bands
    (tests/launch_guard.py): a read past a tensor's end that reaches a result shows as NaN."""
    module = request.module.__name__.rpartition(".")[2]
    if os.environ.get("TRITON_INTERPRET") == "1" and module.startswith("test_triton_"):
        with guarded_launches():
            yield
    else:
        yield


def parity_config(**overrides) -> ModelConfig:
    """The HF-parity geometry: window 8, CSA ratio 4, HCA ratio 16, a top-k that really selects,
    every layer kind, hash and top-k MoE layers."""
    kinds = ["sliding", "csa", "hca", "csa", "hca"]
    ratio = {"sliding": 0, "csa": 4, "hca": 16}
    base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=len(kinds), num_attention_heads=4, head_dim=32,
                qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, layer_kinds=kinds,
                compress_ratios=[ratio[k] for k in kinds], hash_layers=[True, True, False, False, False],
                sliding_window=8, index_n_heads=8, index_head_dim=16, index_topk=5, hc_mult=4,
                hc_sinkhorn_iters=20, routed_scaling_factor=1.5, compress_rope_theta=160000.0,
                yarn=YarnConfig(factor=4.0, original_max_position_embeddings=64),
                num_nextn_predict_layers=1, max_position_embeddings=65536)
    base.update(overrides)
    return ModelConfig(**base)


def tp_config(**overrides) -> ModelConfig:
    """A tiny geometry that shards over 2 ranks on FP8 blocks of 128: per rank, ``wq_b`` holds 128 rows
    (2 heads of 64), ``wo_a`` 128 rows (1 group of 128), ``wo_b`` and the shared expert's ``w2`` 128
    columns. (The tiny preset splits over 2 as well, with other sizes: 4 heads of 32, 2 groups of 64.)"""
    kinds = ["sliding", "csa", "hca", "csa"]
    ratio = {"sliding": 0, "csa": 4, "hca": 16}
    base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=len(kinds), num_attention_heads=4, head_dim=64,
                qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=128, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=256, layer_kinds=kinds,
                compress_ratios=[ratio[k] for k in kinds], hash_layers=[True, False, False, False],
                sliding_window=8, index_n_heads=4, index_head_dim=16, index_topk=4, hc_mult=4,
                hc_sinkhorn_iters=20, routed_scaling_factor=1.5, compress_rope_theta=160000.0,
                yarn=YarnConfig(factor=4.0, original_max_position_embeddings=64),
                num_nextn_predict_layers=1, max_position_embeddings=65536)
    base.update(overrides)
    return ModelConfig(**base)


def random_model(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                 with_mtp: bool = False) -> Transformer:
    return init_random(Transformer(config, dtype, with_mtp=with_mtp), seed=seed).eval()


# The reference path runs thousands of tiny ops: one thread avoids OpenMP wake-up costs that
# dominate on a 2-core CI machine, and makes CPU reductions bitwise repeatable between tests and
# module-scoped fixtures whatever the machine's core count.
torch.set_num_threads(1)
# The same for the `dsv4` command, in-process and in subprocesses: its automatic thread count
# (dsv4.cpu_threads) honours OMP_NUM_THREADS, so CLI results equal the in-process references bit for bit.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def random_prefills(runner, slot: int, rng, long_chance: float, short_max: int, logits_chance: float):
    """Fill ``slot`` from empty with prompt chunks of random lengths (with probability
    ``long_chance`` 1..``max_num_batched_tokens``, else 1..``short_max``), some with every position's logits,
    until the next would overflow ``max_model_len``; yields ``(n, start)`` after each chunk."""
    runner.reset([slot])
    vocab = runner.model.config.vocab_size
    pos = 0
    while True:
        n = rng.randint(1, runner.max_num_batched_tokens) if rng.random() < long_chance else rng.randint(1, short_max)
        if pos + n > runner.max_model_len:
            return
        prefill(runner, slot, [rng.randrange(vocab) for _ in range(n)], all_logits=rng.random() < logits_chance)
        yield n, pos
        pos += n


@pytest.fixture
def tiny_config() -> ModelConfig:
    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The embedded tiny checkpoint, built once per session in a private cache dir."""
    from dsv4.tiny import ensure_tiny
    return ensure_tiny(tmp_path_factory.mktemp("dsv4cache"))


__all__ = ["parity_config", "tp_config", "random_model", "dataclasses"]


def _serve_tiny(*flags: str):
    """`dsv4 serve` on the embedded tiny model with ``flags``, in a subprocess, until the session ends."""
    from serve_util import ServerProcess
    server = ServerProcess(*flags, env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def served():
    """`dsv4 serve` on the embedded tiny model, in a subprocess shared by the server tests."""
    yield from _serve_tiny("--max-num-seqs", "16", "--max-model-len", "512", "--served-model-name", "tiny", "dsv4-tiny")


@pytest.fixture(scope="session")
def served_long():
    """`dsv4 serve` on the tiny model with a 2048-token context, for prompts that carry tool schemas or
    a response format (in the tiny tokenizer those take hundreds of tokens)."""
    yield from _serve_tiny("--max-num-seqs", "8", "--max-model-len", "2048", "--served-model-name", "tiny")


if os.environ.get("DSV4_REPORT_AT_ONCE"):
    # For device runs under a time limit (bench/gpu_quick.sh): print each failure as it happens,
    # so a run killed at its limit still shows why the tests that failed before it did.
    def pytest_runtest_logreport(report):
        if report.failed:
            text = str(report.longrepr)
            print(f"\n--- FAILED {report.nodeid} ({report.when})\n{text[-3000:]}\n", flush=True)
