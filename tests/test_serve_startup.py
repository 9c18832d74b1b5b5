"""`dsv4 serve` start-up: every engine argument is checked before the port is bound and before any
weight is read; any failure on the way to `ready` ends the process with one line (status 2 for an
error the user caused), never a server answering 503 forever. Also `serve MODEL`, `--seed`, and
how `--gpu-memory-utilization` sizes the generation state (unit test on fake memory numbers)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from serve_util import ServerProcess


def _serve(*args: str, cache=None, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if cache is not None:
        env["DSV4_CACHE"] = str(cache.parent)
    return subprocess.run([sys.executable, "-m", "dsv4.cli", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    err = proc.stderr
    assert proc.returncode == 2, err
    assert "Traceback" not in err and "dsv4 serve on" not in err, err      # never bound, never a traceback
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    # said once: by the engine, or by argparse for a flag value its field's rule refuses
    assert len(errors) == 1 and errors[0].startswith(("dsv4 serve: error: ", "dsv4: error: serve: ")), err
    assert all(w in errors[0] for w in words), err


@pytest.fixture(scope="module")
def bare_checkpoint(tiny_checkpoint, tmp_path_factory):
    bare = tmp_path_factory.mktemp("bare") / "no-tokenizer"
    shutil.copytree(tiny_checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    return bare


def test_serve_without_a_tokenizer_exits_2_before_reading_weights(bare_checkpoint):
    proc = _serve("--model", str(bare_checkpoint), "--port", "0")
    _one_line_error(proc, "tokenizer.json", str(bare_checkpoint))
    assert "loaded" not in proc.stderr and "state:" not in proc.stderr


def test_chat_and_generate_check_the_tokenizer_before_the_weights(bare_checkpoint, capsys):
    from dsv4.cli import main
    for argv in (["chat"], ["generate", "Hello"]):
        rc = main([*argv, "--model", str(bare_checkpoint)])
        err = capsys.readouterr().err
        assert rc == 2 and "tokenizer.json" in err and "loaded" not in err, err


@pytest.mark.parametrize("flags, words", [
    (["--max-model-len", "10000000"], ["--max-model-len", "exceeds"]),
    (["--dtype", "fp8"], ["--dtype", "fp8"]),
    (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], ["--max-num-batched-tokens", "must exceed"]),
    (["--model", "/nonexistent/ckpt"], ["/nonexistent/ckpt", "does not exist"]),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], ["cuda", "no CUDA GPU"])]))
def test_bad_engine_arguments_fail_before_the_port_is_bound(tiny_checkpoint, flags, words):
    with socket.socket() as busy:         # a taken port: binding first would report that instead
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        proc = _serve("--port", str(busy.getsockname()[1]), *flags, cache=tiny_checkpoint)
    _one_line_error(proc, *words)


def _fake_llm_without_engine():
    return object()     # starting the engine on it fails (no tokenizer, no engine): a bug-like failure


def _failing_load():
    raise RuntimeError("the load exploded")


@pytest.mark.parametrize("load, error", [(_failing_load, RuntimeError), (_fake_llm_without_engine, AttributeError)])
def test_any_failure_on_the_way_to_ready_stops_the_server(load, error):
    from dsv4.serve.server import run_server
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    raised: list[BaseException] = []

    def serve():
        try:
            run_server(load, model_names=["x"], sock=sock, log_level="warning")
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the server stayed up after its model failed to start"
    assert len(raised) == 1 and isinstance(raised[0], error)


def test_serve_model_positional(tiny_checkpoint, capsys):
    from dsv4.cli import main
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "give the model once" in capsys.readouterr().err
    path = str(tiny_checkpoint)
    server = ServerProcess(path, "--model", path, "--max-num-seqs", "2", "--max-model-len", "128",
                           env={"OMP_NUM_THREADS": "1"})     # positional, and the same again with --model
    try:
        server.wait_ready()
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [path]
    finally:
        assert server.stop() == 0


def test_server_seed_is_the_seed_of_requests_without_one(tiny_checkpoint):
    from fastapi.testclient import TestClient

    from dsv4.engine.llm import LLM
    from dsv4.serve.app import create_app
    llm = LLM(tiny_checkpoint, max_num_seqs=2, max_model_len=128, progress=False)
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 12, "temperature": 1.0}

    def two_answers(seed):
        with TestClient(create_app(llm, model_names=["tiny"], default_seed=seed)) as client:
            return [client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)]

    first, again = two_answers(7), two_answers(7)
    assert first == again                     # a fresh server with the same --seed answers alike
    assert first[0] != first[1]               # ... but requests do not share one seed
    assert two_answers(8) != first
    with TestClient(create_app(llm, model_names=["tiny"], default_seed=7)) as client:   # a request's seed wins
        own = [client.post("/v1/completions", json={**body, "seed": 1}).json()["choices"][0]["text"] for _ in range(2)]
    assert own[0] == own[1]


# --------------------------------------------------------------------------- --gpu-memory-utilization

GiB = 1 << 30


def test_gpu_memory_utilization_sizes_the_state(tiny_config):
    from dsv4.engine.limits import (MAX_DERIVED_NUM_SEQS, WORKING_MARGIN_BYTES, DeviceMemory, size_state,
                                    state_bytes)
    from dsv4.errors import UsageError
    cfg, ctx, dt, cuda = tiny_config, 4096, torch.bfloat16, torch.device("cuda")
    weights = 3 * GiB

    def size(slots, util, free, total):
        return size_state(cfg, slots, ctx, dt, cuda, False, util, lambda: weights, DeviceMemory(free, total))

    # a share that leaves room for exactly 5 sequences' state after weights and the margin
    room = state_bytes(cfg, 5, ctx, dt) + (state_bytes(cfg, 6, ctx, dt) - state_bytes(cfg, 5, ctx, dt)) // 2
    total = int((room + weights + WORKING_MARGIN_BYTES) / 0.5) + 1
    assert size(None, 0.5, total, total) == (5, state_bytes(cfg, 5, ctx, dt))
    assert size(None, 1.0, total, total)[0] > 5                             # a bigger share, more sequences
    assert size(None, 1.0, total // 2 + 1, total)[0] == 5                   # never more than is free now
    assert size(None, 0.9, 10_000 * GiB, 10_000 * GiB)[0] == MAX_DERIVED_NUM_SEQS
    assert size(5, 0.5, total, total)[0] == 5
    with pytest.raises(UsageError, match=r"--max-num-seqs\) 6 .*--gpu-memory-utilization"):
        size(6, 0.5, total, total)
    with pytest.raises(UsageError, match=r"not even one sequence fits.*--gpu-memory-utilization"):
        size(None, 0.5, 8 * GiB, 8 * GiB)
    with pytest.raises(UsageError, match="gpu_memory_utilization"):
        size(None, 1.5, total, total)
    # the CPU: the share is not applied; no --max-num-seqs means 8
    cpu = size_state(cfg, None, 128, torch.float32, torch.device("cpu"), False, 0.01, lambda: 1 / 0)
    assert cpu[0] == 8


def test_gpu_memory_utilization_flag(tiny_checkpoint, capsys):
    from dsv4.cli import build_parser, main
    from dsv4.engine.config import EngineConfig
    from dsv4.engine.llm import plan_engine
    assert build_parser().parse_args(["serve"]).gpu_memory_utilization == 0.9
    with pytest.raises(SystemExit):
        main(["serve", "--gpu-memory-utilization", "1.5"])
    assert "--gpu-memory-utilization" in capsys.readouterr().err
    engine = EngineConfig(model=str(tiny_checkpoint), device="cpu", max_num_seqs=None, max_model_len=128)
    assert plan_engine(engine).max_num_seqs == 8
