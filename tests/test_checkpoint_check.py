"""Checking a checkpoint without loading it (issue 8, items 5, 6, 8): one walk, two depths.

Header checks (names, shapes, dtypes, index, quantization config) read no tensor data; data
checks (NaN/Inf values and scales, FP8 NaN codes, expert ids) read every tensor and keep none.
`dsv4 inspect` runs the header checks by default, `--check-data` both; `dsv4 quantize` runs the
header checks on its source before writing anything.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4.weights.loader as loader
from dsv4.cli import main
from dsv4.config import ConfigError
from dsv4.text.tiny_tokenizer import write_tiny_tokenizer
from dsv4.tiny import write_checkpoint
from dsv4.weights.loader import CheckpointError, check_checkpoint
from dsv4.weights.quantize import QuantizeError, quantize_checkpoint

from conftest import parity_config, random_model

WKV = "layers.2.attn.wkv.weight"
TID = "layers.0.ffn.gate.tid2eid"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("check") / "bf16"
    write_checkpoint(random_model(parity_config(), torch.bfloat16, with_mtp=True), d)
    write_tiny_tokenizer(d, 512)
    return d


@pytest.fixture(scope="module")
def quantized(good: Path) -> Path:
    out = good.parent / "mxfp4"
    quantize_checkpoint(good, out, "mxfp4", progress=False)
    return out


def corrupt(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` whose (single or first) shard's tensors went through ``edit``."""
    shutil.copytree(src, dst)
    (shard,) = [p for p in dst.glob("*.safetensors")]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    index = dst / loader.INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: shard.name for k in tensors}
        index.write_text(json.dumps(data))
    return dst


def _set(name, make):
    return lambda s: s.__setitem__(name, make(s[name]))


def _poke(index, value):
    def make(t):
        t = t.clone()
        t.view(-1)[index] = value
        return t
    return make


STRUCTURE = {  # caught from the headers alone
    "missing_embed": (lambda s: s.pop("embed.weight"), "embed.weight"),
    "wrong_shape": (_set(WKV, lambda t: t[:, :-1].contiguous()), WKV),
    "extra_tensor": (lambda s: s.__setitem__("layers.1.attn.bogus.weight", torch.zeros(2, 2)), "bogus"),
    "int_weight": (_set(WKV, lambda t: t.to(torch.int32)), WKV),
    "fp8_without_scale": (_set(WKV, lambda t: t.to(torch.float8_e4m3fn)), WKV),
}
VALUES = {  # caught only when the data is read
    "nan_weight": (_set(WKV, _poke(5, float("nan"))), WKV),
    "inf_norm": (_set("norm.weight", _poke(0, float("inf"))), "norm.weight"),
    "expert_id_out_of_range": (_set(TID, _poke(7, 8)), TID),
}


@pytest.mark.parametrize("case", sorted(STRUCTURE))
def test_header_check_catches_structure(good, tmp_path, case):
    edit, word = STRUCTURE[case]
    bad = corrupt(good, tmp_path / case, edit)
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(bad)
    assert word in str(info.value) and str(bad) in str(info.value)  # full path of the file or directory


@pytest.mark.parametrize("case", sorted(VALUES))
def test_values_need_the_data(good, tmp_path, case):
    edit, word = VALUES[case]
    bad = corrupt(good, tmp_path / case, edit)
    check_checkpoint(bad)  # the headers are fine
    with pytest.raises(CheckpointError, match=word):
        check_checkpoint(bad, read_data=True)


def test_quantized_scales_and_fp8_codes(quantized, tmp_path):
    expert = "layers.3.ffn.experts.1.w2"
    bad = corrupt(quantized, tmp_path / "nan-scale", _set(f"{expert}.scale", lambda t: t.view(torch.uint8).clone()
                                                         .fill_(255).view(t.dtype)))
    check_checkpoint(bad)
    with pytest.raises(CheckpointError, match=f"{expert}.*255"):
        check_checkpoint(bad, read_data=True)
    attn = "layers.1.attn.wq_a.weight"
    bad = corrupt(quantized, tmp_path / "nan-fp8", _set(attn, lambda t: t.view(torch.uint8).clone()
                                                        .index_fill_(1, torch.tensor([3]), 0x7F).view(t.dtype)))
    check_checkpoint(bad)
    with pytest.raises(CheckpointError, match=f"{attn}.*NaN"):
        check_checkpoint(bad, read_data=True)


def test_header_check_reads_no_data_and_sees_truncation(good, quantized, tmp_path, monkeypatch):
    real_open = loader.safe_open
    reads = []

    class Spy:
        def __init__(self, *a, **k):
            self.handle = real_open(*a, **k)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return self.handle.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    report = check_checkpoint(quantized)
    assert reads == [] and report.tensors > 0
    monkeypatch.undo()
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    shard = cut / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=str(shard)):
        check_checkpoint(cut)


def test_config_contradicting_tensors(quantized, tmp_path):
    bad = tmp_path / "contradiction"
    shutil.copytree(quantized, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["expert_dtype"] = "fp8"  # the experts are MXFP4
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="expert_dtype"):
        check_checkpoint(bad)


# --------------------------------------------------------------------------- dsv4 inspect

def test_inspect_checks_by_default(good, tmp_path, capsys):
    assert main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert "check        ok" in out and "--check-data" in out
    bad = corrupt(good, tmp_path / "bad", STRUCTURE["wrong_shape"][0])
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert WKV in err and "Traceback" not in err
    assert main(["inspect", str(bad), "--no-check"]) == 0
    assert "check        skipped" in capsys.readouterr().out
    nan = corrupt(good, tmp_path / "nan", VALUES["nan_weight"][0])
    assert main(["inspect", str(nan)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(nan), "--check-data"]) == 2
    assert "NaN" in capsys.readouterr().err


def test_inspect_prints_the_state_size(good, capsys):
    assert main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert "state        " in out and "per token" in out


# --------------------------------------------------------------------------- dsv4 quantize validates its source

@pytest.mark.parametrize("case", ["missing_embed", "wrong_shape", "int_weight"])
def test_quantize_refuses_a_broken_source_and_writes_nothing(good, tmp_path, case):
    edit, word = STRUCTURE[case]
    bad = corrupt(good, tmp_path / case, edit)
    with pytest.raises(CheckpointError, match=word):
        quantize_checkpoint(bad, tmp_path / "out", "nvfp4", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [case]


def test_quantize_refuses_a_config_contradicting_the_tensors(good, tmp_path, capsys):
    bad = tmp_path / "src"
    shutil.copytree(good, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["moe_intermediate_size"] = 48
    (bad / "config.json").write_text(json.dumps(raw))
    rc = main(["quantize", str(bad), str(tmp_path / "out"), "--format", "fp8"])
    err = capsys.readouterr().err
    assert rc == 2 and "experts" in err and str(bad / "model.safetensors") in err, err
    assert not (tmp_path / "out").exists()


def test_quantize_names_an_unparseable_config(good, tmp_path, capsys):
    bad = tmp_path / "src"
    shutil.copytree(good, bad)
    (bad / "config.json").write_text("{not json")
    rc = main(["quantize", str(bad), str(tmp_path / "out"), "--format", "fp8"])
    err = capsys.readouterr().err
    assert rc == 2 and str(bad / "config.json") in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_quantize_refuses_nan_in_a_kept_tensor(good, tmp_path):
    bad = corrupt(good, tmp_path / "nan", VALUES["inf_norm"][0])
    with pytest.raises(CheckpointError, match="norm.weight"):
        quantize_checkpoint(bad, tmp_path / "out", "fp8", progress=False)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- terminal hygiene

def test_error_is_not_glued_to_the_progress_bar(good, tmp_path, capsys):
    nan = corrupt(good, tmp_path / "nan", VALUES["nan_weight"][0])  # fails while the data is being read
    rc = main(["generate", "hi", "--model", str(nan), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err
    before, sep, after = err.partition("dsv4 generate: error:")
    assert sep and before.endswith(("\n", "\r")), repr(err[-400:])  # the error starts its own line
    assert after.count("\n") == 1 and after.endswith("\n") and "loading" not in after  # no stale bar after it
    assert str(nan / "model.safetensors") in after and WKV in after
