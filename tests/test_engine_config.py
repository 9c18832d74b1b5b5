"""EngineConfig: one checked dataclass for every engine knob, the CLI flags of generate, chat and
serve generated from it, and the same config from ``LLM(...)`` and from the command line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from dsv4.cli import build_parser
from dsv4.engine.config import _RULES, EngineConfig, field_docs, flag
from dsv4.errors import UsageError

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]
COMMANDS = ("generate", "chat", "serve")

# one value each field's rule refuses: (Python value, the same on the command line or None)
BAD = {
    "model": ("", ""),
    "device": ("tpu", "tpu"),
    "dtype": ("fp8", "fp8"),
    "qat_sim": ("maybe", "maybe"),
    "max_num_seqs": (0, "0"),
    "max_model_len": (-3, "-3"),
    "max_num_batched_tokens": (0, "0"),
    "long_prefill_token_threshold": (-1, "-1"),
    "prefill_decode_steps": (0, "0"),
    "tensor_parallel_size": (0, "0"),
    "enforce_eager": ("yes", None),        # a boolean flag takes no value
    "warm_up": (1, None),
    "gpu_memory_utilization": (1.5, "1.5"),
    "threads": (0, "0"),
    "load_mtp": ("no", None),
    "enable_prefix_caching": ("on", None),
    "prefix_cache_gib": (0, "0"),
    "speculative_config": ('{"method": "medusa", "num_speculative_tokens": 2}',
                           '{"method": "medusa", "num_speculative_tokens": 2}'),
}


def _subparser(command: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[command]


def test_every_field_has_a_docstring_a_rule_and_a_bad_value_here():
    """Adding a field means adding its docstring and its rule (the module docstring says so)."""
    docs = field_docs()
    assert set(docs) == set(FIELDS) == set(_RULES) == set(BAD)
    assert all(len(docs[name]) > 20 for name in FIELDS)


def test_defaults_are_valid_and_vllm_named():
    config = EngineConfig()
    assert (config.max_num_batched_tokens, config.gpu_memory_utilization, config.max_num_seqs) == (8192, 0.9, 4)


@pytest.mark.parametrize("name", FIELDS)
def test_each_field_is_checked_with_one_line_naming_field_and_flag(name):
    bad = BAD[name][0]
    with pytest.raises(UsageError) as e:
        EngineConfig(**{name: bad})
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{name} ({flag(name)})"), message
    assert repr(bad) in message or "medusa" in message


def test_fields_that_depend_on_each_other_are_checked_together():
    with pytest.raises(UsageError, match=r"max_num_batched_tokens \(--max-num-batched-tokens\) 8 must exceed "
                                         r"max_num_seqs \(--max-num-seqs\) 8"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=8)
    EngineConfig(max_num_seqs=None, max_num_batched_tokens=8)    # sized later: checked by plan_engine


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_of_generate_chat_and_serve(command):
    parser = _subparser(command)
    by_dest = {a.dest: a for a in parser._actions}
    for name in FIELDS:
        assert flag(name) in by_dest[name].option_strings, (command, name)
        default = {"generate": 1, "chat": 1, "serve": None}[command] if name == "max_num_seqs" else \
            getattr(EngineConfig(), name)
        assert by_dest[name].default == default, (command, name)
    help_text = " ".join(parser.format_help().split())
    assert all(" ".join(field_docs()[name].split()[:4]) in help_text for name in FIELDS)   # help = docstring
    assert "-tp" in by_dest["tensor_parallel_size"].option_strings        # vLLM's short form
    assert "--no-warm-up" in by_dest["warm_up"].option_strings            # the flag it always had


# every field on generate; chat and serve build the same flags with the same function
CLI_CASES = [("generate", name) for name in FIELDS if BAD[name][1] is not None] + \
    [("chat", "max_model_len"), ("serve", "gpu_memory_utilization")]


def test_a_bad_flag_value_is_one_line_naming_the_flag_and_exit_status_2():
    """A bad value of each field, each in its own process (all started at once: the flags are
    checked before torch is imported, so each takes a fraction of a second)."""
    procs = {}
    for command, name in CLI_CASES:
        argv = [sys.executable, "-m", "dsv4.cli", command, f"{flag(name)}={BAD[name][1]}"]
        procs[command, name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True)
    for (command, name), proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and out == "", (command, name, err)
        assert len(lines) == 1 and flag(name) in lines[0] and "Traceback" not in err, (command, name, err)


def test_a_cross_field_error_on_the_command_line_is_one_line_and_exit_status_2():
    proc = subprocess.run([sys.executable, "-m", "dsv4.cli", "generate", "x", "--max-num-seqs", "8",
                           "--max-num-batched-tokens", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--max-num-batched-tokens" in proc.stderr and "--max-num-seqs" in proc.stderr


ARGS = dict(device="cpu", dtype="fp32", qat_sim="off", max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64,
            long_prefill_token_threshold=16, tensor_parallel_size=1, prefill_decode_steps=3, enforce_eager=True,
            warm_up=False,
            gpu_memory_utilization=0.5, threads=1, load_mtp=False, enable_prefix_caching=True, prefix_cache_gib=0.25,
            speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')


def _argv(model: str) -> list[str]:
    argv = ["--model", model]
    for name, value in ARGS.items():
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        else:
            argv += [flag(name), str(value)]
    return argv


@pytest.mark.parametrize("command", COMMANDS)
def test_the_cli_and_the_python_api_build_the_same_config(command, tiny_checkpoint):
    from dsv4.engine.llm import LLM
    args = build_parser().parse_args([command, *_argv(str(tiny_checkpoint))])
    from_cli = EngineConfig.from_args(args)
    assert from_cli == EngineConfig(model=str(tiny_checkpoint), **ARGS)
    if command == "generate":     # one load is enough: LLM keeps the config it was given
        with LLM(str(tiny_checkpoint), progress=False, **ARGS) as llm:
            assert llm.engine_config == from_cli
            # ... and hands the resolved values down under the same names
            assert (llm.runner.max_num_seqs, llm.runner.max_model_len, llm.runner.max_num_batched_tokens) == (2, 256, 64)
            assert llm.engine.scheduler.long_prefill_token_threshold == 16
            assert llm.engine.prefill_decode_steps == 3
        with LLM.from_config(from_cli, progress=False) as again:
            assert again.engine_config == from_cli


def test_llm_names_an_unknown_engine_argument():
    from dsv4.engine.llm import LLM
    with pytest.raises(TypeError, match="'max_slots'.*max_num_seqs"):
        LLM(max_slots=2)
