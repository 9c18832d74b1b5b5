"""The ``dsv4`` command in-process (``dsv4.cli.main``) and once through a real subprocess."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points

import pytest
import torch
from safetensors import safe_open

from dsv4.cli import main
from dsv4.engine.runner import Runner
from dsv4.text.tokenizer import Tokenizer
from dsv4.weights.loader import load_model
from dsv4.testing import decode, prefill

PROMPT = "Once upon a time"


@pytest.fixture
def cache(tiny_checkpoint, monkeypatch):
    """DSV4_CACHE pointing at the session's tiny checkpoint (so no --model means the tiny model)."""
    monkeypatch.setenv("DSV4_CACHE", str(tiny_checkpoint.parent))
    return tiny_checkpoint


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def generate_json(capsys, *extra: str, prompt: str | None = PROMPT) -> dict:
    argv = ["generate"] + ([prompt] if prompt is not None else []) + ["--max-tokens", "8", "--json", *extra]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # one JSON object, nothing else on stdout
    return json.loads(lines[0])


def no_traceback(err: str) -> None:
    assert "Traceback" not in err, err


# --------------------------------------------------------------------------- generate --json

def test_generate_json_object(cache, capsys):
    obj = generate_json(capsys, "--temperature", "0")
    for key in ("prompt_token_ids", "token_ids", "text", "finish_reason", "time_to_first_token_s",
                "decode_tokens_per_s", "total_s"):
        assert key in obj, key
    tok = Tokenizer.from_dir(cache)
    assert obj["prompt_token_ids"] == tok.encode(PROMPT, add_bos=True)
    assert obj["prompt_token_ids"][0] == 0
    assert isinstance(obj["text"], str)
    ids = obj["token_ids"]
    assert 1 <= len(ids) <= 8 and all(isinstance(t, int) and 0 <= t < 512 for t in ids)
    assert obj["finish_reason"] in ("length", "stop")
    assert len(ids) == 8 or obj["finish_reason"] == "stop"
    for key in ("time_to_first_token_s", "decode_tokens_per_s", "total_s"):
        assert isinstance(obj[key], (int, float)) and obj[key] >= 0, key
    assert obj["total_s"] >= obj["time_to_first_token_s"] > 0


def test_greedy_is_deterministic_and_is_the_argmax_chain(cache, capsys):
    a = generate_json(capsys, "--temperature", "0")
    b = generate_json(capsys, "--temperature", "0", "--seed", "99")  # the seed does not matter when greedy
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    # the same chain computed directly from the checkpoint
    model, _ = load_model(cache, dtype=torch.float32, progress=False)
    from dsv4.engine.llm import resolve_qat_sim
    runner = Runner(model, max_num_seqs=1, max_model_len=4096, qat_sim=resolve_qat_sim("auto", model.config))
    logits = prefill(runner, 0, a["prompt_token_ids"])
    chain = []
    for _ in range(len(a["token_ids"])):
        chain.append(int(logits.argmax()))
        logits = decode(runner, [0], torch.tensor([chain[-1]]))[0]
    assert chain == a["token_ids"]


def test_seeded_sampling(cache, capsys):
    runs = {seed: generate_json(capsys, "--temperature", "1.0", "--seed", str(seed))["token_ids"]
            for seed in (1, 2, 3)}
    again = generate_json(capsys, "--temperature", "1.0", "--seed", "1")["token_ids"]
    assert again == runs[1]
    assert len({tuple(v) for v in runs.values()}) > 1, runs


def test_prompt_from_stdin(cache, capsys, monkeypatch):
    direct = generate_json(capsys, "--temperature", "0")
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    piped = generate_json(capsys, "--temperature", "0", prompt=None)
    assert piped["prompt_token_ids"] == direct["prompt_token_ids"]
    assert piped["token_ids"] == direct["token_ids"]


def test_explicit_model_dir(tiny_checkpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "empty-cache"))  # the default model is NOT used
    obj = generate_json(capsys, "--temperature", "0", "--model", str(tiny_checkpoint))
    assert len(obj["token_ids"]) >= 1
    assert not list((tmp_path / "empty-cache").glob("*tiny*"))       # nothing built there


# --------------------------------------------------------------------------- streaming

def test_streaming_prints_text_and_stats(cache, capsys):
    ref = generate_json(capsys, "--temperature", "0")
    rc, out, err = run(capsys, "generate", PROMPT, "--max-tokens", "8", "--temperature", "0")
    assert rc == 0, err
    assert out == ref["text"] + "\n"
    stats = re.search(r"\[(\d+) tokens, ttft ([\d.]+) ms, ([\d.]+) tok/s decode", err)
    assert stats, err
    assert int(stats.group(1)) == len(ref["token_ids"])
    assert float(stats.group(2)) > 0


# --------------------------------------------------------------------------- inspect

def test_inspect(cache, capsys):
    rc, out, err = run(capsys, "inspect", str(cache))
    assert rc == 0, err
    assert "layers: sliding, csa, hca, csa" in out
    assert "MTP layer: sliding" in out
    assert "4 layers (+1 MTP)" in out
    total = 0
    (shard,) = cache.glob("*.safetensors")  # the tiny model is written as one indexed shard
    with safe_open(str(shard), framework="pt") as f:
        for name in f.keys():
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            total += n
    m = re.search(r"parameters\s+([\d,]+)", out)
    assert m, out
    assert int(m.group(1).replace(",", "")) == total
    rc2, out2, _ = run(capsys, "inspect")  # default: the embedded tiny model from DSV4_CACHE
    assert rc2 == 0 and out2 == out


# --------------------------------------------------------------------------- errors

def _assert_clean_error(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    no_traceback(err)
    lines = [l for l in err.splitlines() if "error" in l]
    assert lines, err
    for w in words:
        assert any(w in l for l in lines), (w, err)


def test_bad_model_directory(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    rc, _, err = run(capsys, "generate", PROMPT, "--model", str(missing))
    _assert_clean_error(rc, err, str(missing))


def test_corrupt_checkpoint_directory(tiny_checkpoint, capsys, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    (shard,) = bad.glob("*.safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    rc, _, err = run(capsys, "generate", PROMPT, "--max-tokens", "2", "--model", str(bad))
    _assert_clean_error(rc, err, shard.name)
    rc, _, err = run(capsys, "inspect", str(bad))
    _assert_clean_error(rc, err, shard.name)


def test_truncated_checkpoint_is_one_line_in_every_command(tiny_checkpoint, tmp_path):
    """Issue 21, item 3: eval-quant gave a safetensors traceback where the others name the shard."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    (shard,) = bad.glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:1000])
    commands = [["eval-quant", str(bad), "--formats", "fp8", "--sequences", "1", "--length", "4"],
                ["quantize", str(bad), str(tmp_path / "q"), "--format", "fp8"],
                ["generate", PROMPT, "--max-tokens", "2", "--model", str(bad)],
                ["inspect", str(bad)]]
    procs = [subprocess.Popen([sys.executable, "-m", "dsv4.cli", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv in commands]
    for argv, proc in zip(commands, procs):
        _, err = proc.communicate(timeout=300)
        errors = [line for line in err.splitlines() if "error" in line]
        assert proc.returncode == 2, (argv[0], err)
        assert len(errors) == 1 and errors[0].startswith(f"dsv4 {argv[0]}: error: ") and shard.name in errors[0], err
        no_traceback(err)


def test_checkpoint_without_config(tiny_checkpoint, capsys, tmp_path):
    bad = tmp_path / "noconfig"
    shutil.copytree(tiny_checkpoint, bad)
    (bad / "config.json").unlink()
    rc, _, err = run(capsys, "generate", PROMPT, "--max-tokens", "2", "--model", str(bad))
    _assert_clean_error(rc, err, str(bad / "config.json"))


def test_inspect_missing_path(capsys, tmp_path):
    rc, _, err = run(capsys, "inspect", str(tmp_path / "nothing-here"))
    _assert_clean_error(rc, err, "nothing-here")


BAD_FLAGS = [
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--top-k", "-1"], "top_k"),
    (["--min-p", "2"], "min_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--top-p", "abc"], "--top-p"),  # argparse: not a number
    (["--dtype", "fp8"], "dtype"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-model-len", "100000"], "max_position_embeddings"),  # the tiny model has 65536 positions
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--device", "tpu"], "tpu"),
]


@pytest.mark.parametrize("flags,word", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_invalid_flag_values(cache, capsys, flags, word):
    rc, out, err = run(capsys, "generate", PROMPT, *flags)
    alt = word.replace("_", "-") if not word.startswith("--") else word
    assert rc == 2, err
    no_traceback(err)
    assert word in err or alt in err, err
    assert out == ""


# --------------------------------------------------------------------------- real entry point

def test_console_script_entry_point():
    try:
        distribution("dsv4")
    except PackageNotFoundError:
        pytest.skip("dsv4 is importable but not pip-installed here (no entry points to check)")
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("dsv4") == "dsv4.cli:main"


def test_subprocess_end_to_end(cache, capsys):
    env = dict(os.environ, DSV4_CACHE=str(cache.parent))
    argv = ["generate", PROMPT, "--max-tokens", "4", "--temperature", "0", "--json"]
    proc = subprocess.run([sys.executable, "-m", "dsv4.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    assert obj["token_ids"] == json.loads(out)["token_ids"]
    assert obj["prompt_token_ids"][0] == 0


# --------------------------------------------------------------------------- error policy

def test_only_project_errors_become_one_line_messages(cache, capsys, monkeypatch):
    import dsv4.cli as cli

    def buggy(args):
        raise KeyError("a bug, not a user error")
    monkeypatch.setattr(cli, "cmd_inspect", buggy)
    with pytest.raises(KeyError):  # a bug keeps its traceback
        main(["inspect"])


def test_dsv4_cache_pointing_at_a_file(capsys, monkeypatch, tmp_path):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("DSV4_CACHE", str(not_a_dir))
    rc, _, err = run(capsys, "generate", PROMPT, "--max-tokens", "2")
    _assert_clean_error(rc, err, str(not_a_dir), "DSV4_CACHE")


def test_unknown_tiny_variant(capsys):
    rc, _, err = run(capsys, "generate", PROMPT, "--model", "tiny:int3")
    _assert_clean_error(rc, err, "int3", "mxfp4")


# --------------------------------------------------------------------------- one way to name a model

def test_inspect_and_quantize_take_the_model_like_generate(cache, capsys, tmp_path):
    rc, by_path, err = run(capsys, "inspect", str(cache))
    assert rc == 0, err
    rc, by_flag, err = run(capsys, "inspect", "--model", "tiny")
    assert rc == 0 and by_flag == by_path, err
    rc, _, err = run(capsys, "inspect", str(cache), "--model", "tiny:bf16")
    _assert_clean_error(rc, err, "--model", "not both")
    rc, _, err = run(capsys, "quantize", str(tmp_path / "q"), "--model", str(cache), "--format", "nvfp4",
                     "--device", "cpu")
    assert rc == 0, err
    rc, out, err = run(capsys, "inspect", "--model", str(tmp_path / "q"))
    assert rc == 0 and "NVFP4" in out, err
    rc, _, err = run(capsys, "quantize", str(cache), str(tmp_path / "r"), "--model", "tiny", "--format", "fp8")
    _assert_clean_error(rc, err, "SRC", "--model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_cuda_without_a_gpu_fails_everywhere(cache, capsys, tmp_path):
    rc, _, err = run(capsys, "quantize", str(cache), str(tmp_path / "q"), "--format", "fp8", "--device", "cuda")
    _assert_clean_error(rc, err, "cuda", "no CUDA GPU")
    assert not (tmp_path / "q").exists()
    rc, _, err = run(capsys, "generate", PROMPT, "--device", "cuda:0")
    _assert_clean_error(rc, err, "cuda", "no CUDA GPU")


def test_help_shows_every_default(capsys):
    from dsv4.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    out = out[out.index("options:"):]
    for flag, default in (("--max-tokens", "64"), ("--top-p", "1.0"), ("--min-p", "0.0"), ("--device", "auto"),
                          ("--temperature", "1.0")):
        block = out[out.index(flag + " "):]
        assert f"(default: {default})" in " ".join(block.split()[:40]), (flag, out)
    assert "a random seed" in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--help"])
    assert "(default: 512)" in " ".join(capsys.readouterr().out.split())


# --------------------------------------------------------------------------- issue 21, items 4 and 5

def _cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4.cli", *argv], capture_output=True, text=True, timeout=120, **kw)


ARGPARSE_ERRORS = [
    (["generate", "--foo"], "dsv4: error: generate: unrecognized arguments: --foo (see dsv4 generate --help)"),
    ([], "dsv4: error: the following arguments are required: COMMAND (see dsv4 --help)"),
    (["generate", "x", "--top-p", "abc"],
     "dsv4: error: generate: argument --top-p: invalid float value: 'abc' (see dsv4 generate --help)"),
    (["bench", "serve", "--bar", "1"], "dsv4: error: bench serve: unrecognized arguments: --bar 1 "
                                       "(see dsv4 bench serve --help)"),
    (["nonsense"], "dsv4: error: argument COMMAND: invalid choice: 'nonsense'"),
]


@pytest.mark.parametrize("argv,line", ARGPARSE_ERRORS, ids=[" ".join(a) or "nothing" for a, _ in ARGPARSE_ERRORS])
def test_argparse_errors_are_one_line(argv, line):
    r = _cli(*argv)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(line), r.stderr


def test_sampling_errors_name_the_flag(cache):
    r = _cli("generate", PROMPT, "--top-p", "2", env=dict(os.environ, DSV4_CACHE=str(cache.parent)))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "dsv4 generate: error: --top-p must be a number in (0, 1], got 2.0"
    assert "SamplingParams" not in r.stderr


def test_help_and_version_do_not_import_torch():
    """`dsv4 --help` took 3-4 s importing torch; the engine loads only in the command that runs."""
    script = ("import sys, json\n"
              "from dsv4.cli import main\n"
              "seen = {}\n"
              "for argv in (['--help'], ['generate', '--help'], ['--version'], ['serve', '--help'],\n"
              "             ['bench', 'serve', '--help'], ['quantize', '--help'], ['generate', '--foo']):\n"
              "    try:\n"
              "        main(argv)\n"
              "    except SystemExit:\n"
              "        pass\n"
              "    heavy = ('torch', 'dsv4.engine.llm', 'dsv4.engine.runner', 'dsv4.model')\n"
              "    seen[' '.join(argv)] = sorted(m for m in heavy if m in sys.modules)\n"
              "print(json.dumps(seen), file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    seen = json.loads(r.stderr.strip().splitlines()[-1])
    assert len(seen) == 7 and all(v == [] for v in seen.values()), seen


def test_version(capsys):
    import dsv4
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"dsv4 {dsv4.__version__}"


# --------------------------------------------------------------------------- ordinary input, no tracebacks

def test_invalid_utf8_prompt_argument_and_stdin(cache, capsys, monkeypatch):
    clean = generate_json(capsys, "--temperature", "0", prompt="abc\ufffd")
    # how Python hands over argv bytes that are not UTF-8 (surrogateescape)
    rc, out, err = run(capsys, "generate", "abc\udcff", "--max-tokens", "8", "--temperature", "0", "--json")
    assert rc == 0 and "not valid UTF-8" in err, err
    assert json.loads(out)["prompt_token_ids"] == clean["prompt_token_ids"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abc\xff")))
    rc, out, err = run(capsys, "generate", "--max-tokens", "8", "--temperature", "0", "--json")
    assert rc == 0 and "not valid UTF-8" in err, err
    assert json.loads(out)["prompt_token_ids"] == clean["prompt_token_ids"]


def test_invalid_utf8_through_a_real_process(cache):
    env = dict(os.environ, DSV4_CACHE=str(cache.parent))
    argv = [sys.executable, "-m", "dsv4.cli", "generate", "--max-tokens", "2", "--json"]
    for extra, stdin in (([b"caf\xe9 \xff"], b""), ([], b"caf\xe9 \xff\n")):
        proc = subprocess.run(argv + extra, input=stdin, env=env, capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode()
        assert b"Traceback" not in proc.stderr and b"not valid UTF-8" in proc.stderr


def test_broken_pipe_exits_quietly(cache):
    """`dsv4 generate ... | head -c 1`: no BrokenPipeError traceback, no 'Exception ignored'."""
    env = dict(os.environ, DSV4_CACHE=str(cache.parent))
    proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "generate", PROMPT, "--max-tokens", "4000",
                             "--ignore-eos", "--max-model-len", "8192"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away while generation is streaming
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert rc == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


def test_reading_stdin_on_a_terminal_says_so(cache, capsys, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stdin", Tty(PROMPT))
    rc, _, err = run(capsys, "generate", "--max-tokens", "2", "--json")
    assert rc == 0 and "reading the prompt from stdin" in err and "Ctrl-D" in err


def test_one_token_reports_no_rate(cache, capsys):
    rc, _, err = run(capsys, "generate", PROMPT, "--max-tokens", "1")
    assert rc == 0 and "n/a tok/s" in err and "0.0 tok/s" not in err, err
    assert generate_json(capsys, "--max-tokens", "1")["decode_tokens_per_s"] is None


def test_prompt_ids_and_a_checkpoint_without_tokenizer(cache, capsys, tmp_path):
    obj = generate_json(capsys, "--temperature", "0", "--prompt-ids", "0, 5 7", prompt=None)
    assert obj["prompt_token_ids"] == [0, 5, 7]
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(cache, bare)
    (bare / "tokenizer.json").unlink()
    rc, _, err = run(capsys, "generate", PROMPT, "--model", str(bare))
    _assert_clean_error(rc, err, "tokenizer.json", "--prompt-ids")
    rc, out, err = run(capsys, "generate", "--prompt-ids", "0,5,7", "--max-tokens", "3", "--ignore-eos",
                       "--temperature", "0", "--model", str(bare))
    assert rc == 0, err
    assert [int(t) for t in out.split()] == obj["token_ids"][:3]
    rc, _, err = run(capsys, "generate", PROMPT, "--prompt-ids", "1,2")
    _assert_clean_error(rc, err, "--prompt-ids", "not both")
    rc, _, err = run(capsys, "generate", "--prompt-ids", "1,x")
    assert rc == 2 and "--prompt-ids" in err
