"""`dsv4 quantize` never deletes what it did not write (issue 8, item 1).

The destination may be new, an empty directory, or a previous dsv4 output (it holds the
`.dsv4-output` marker); anything else is refused, as is a destination that holds the source or
lies inside it. A previous output is replaced only by renames of the finished new output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dsv4.cli import main
from dsv4.text.tiny_tokenizer import write_tiny_tokenizer
from dsv4.tiny import write_checkpoint
from dsv4.weights import output_dir
from dsv4.weights.quantize import OUTPUT_MARKER, QuantizeError, quantize_checkpoint

from conftest import parity_config, random_model


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qdst") / "src"
    write_checkpoint(random_model(parity_config(), torch.bfloat16), d)
    write_tiny_tokenizer(d, 512)
    return d


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> content hash)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def src_parent(src: Path, tmp_path: Path) -> Path:
    """The issue's layout: SRC_PARENT/src (a checkpoint) next to an unrelated file."""
    parent = tmp_path / "SRC_PARENT"
    shutil.copytree(src, parent / "src")
    (parent / "notes.txt").write_text("my notes")
    return parent


def test_destination_holding_the_source_is_refused(src_parent: Path, capsys) -> None:
    before = snapshot(src_parent)
    with pytest.raises(QuantizeError, match="contains the source"):
        quantize_checkpoint(src_parent / "src", src_parent, "nvfp4", progress=False, overwrite=True)
    assert snapshot(src_parent) == before
    rc = main(["quantize", str(src_parent / "src"), str(src_parent), "--format", "nvfp4", "--overwrite"])
    err = capsys.readouterr().err
    assert rc == 2 and "contains the source" in err and "Traceback" not in err
    assert snapshot(src_parent) == before
    assert sorted(p.name for p in src_parent.parent.iterdir()) == ["SRC_PARENT"]  # no temp dir left


def test_destination_inside_the_source_is_refused(src_parent: Path) -> None:
    before = snapshot(src_parent)
    for dst in (src_parent / "src" / "out", src_parent / "src"):
        with pytest.raises(QuantizeError, match="source"):
            quantize_checkpoint(src_parent / "src", dst, "mxfp4", progress=False, overwrite=True)
    assert snapshot(src_parent) == before


def test_foreign_directory_is_never_replaced(src: Path, tmp_path: Path) -> None:
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    before = snapshot(other)
    with pytest.raises(QuantizeError, match=f"not a dsv4 output.*{OUTPUT_MARKER}"):
        quantize_checkpoint(src, other, "fp8", progress=False, overwrite=True)
    assert snapshot(other) == before
    file_dst = tmp_path / "a-file"
    file_dst.write_text("x")
    with pytest.raises(QuantizeError, match="not a directory"):
        quantize_checkpoint(src, file_dst, "fp8", progress=False, overwrite=True)
    assert file_dst.read_text() == "x"


def test_empty_directory_and_previous_output(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()  # an empty directory holds nothing to lose: no --overwrite needed
    quantize_checkpoint(src, dst, "fp8", progress=False)
    marker = json.loads((dst / OUTPUT_MARKER).read_text())
    assert marker["format"] == "fp8" and marker["policy"] == "floor" and marker["source"] == str(src.resolve())
    with pytest.raises(QuantizeError, match="already exists.*--overwrite"):
        quantize_checkpoint(src, dst, "nvfp4", progress=False)
    quantize_checkpoint(src, dst, "nvfp4", progress=False, overwrite=True)
    assert json.loads((dst / OUTPUT_MARKER).read_text())["format"] == "nvfp4"
    assert (dst / "hf_quant_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old output and temp dirs are gone


def test_replacement_is_by_rename_and_survives_a_failed_swap(src: Path, tmp_path: Path, monkeypatch) -> None:
    dst = tmp_path / "out"
    quantize_checkpoint(src, dst, "fp8", progress=False)
    before = snapshot(dst)
    removed = []
    real_rmtree, real_rename = shutil.rmtree, os.rename

    def spy_rmtree(path, *a, **k):
        removed.append(Path(path))
        return real_rmtree(path, *a, **k)

    def failing_rename(a, b):
        if Path(b) == dst and ".tmp-" in Path(a).name:  # moving the finished output into place
            raise OSError("rename failed (simulated)")
        return real_rename(a, b)

    monkeypatch.setattr(output_dir.shutil, "rmtree", spy_rmtree)
    monkeypatch.setattr(output_dir.os, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        quantize_checkpoint(src, dst, "nvfp4", progress=False, overwrite=True)
    assert snapshot(dst) == before  # the old output is back where it was
    assert all(dst.resolve() != p.resolve() for p in removed if p.exists())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_modes_follow_the_umask(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Issue 21, item 8: the output was mkdtemp's private 0700 (files 0600); a shared checkpoint
    gets the modes the umask gives any new file."""
    import stat
    import subprocess
    import sys
    dst = tmp_path / "shared"
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "quantize", str(tiny_checkpoint), str(dst), "--format",
                        "fp8"], capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o002))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(dst.stat().st_mode) == 0o775
    files = list(dst.iterdir())
    assert any(p.suffix == ".safetensors" for p in files) and (dst / OUTPUT_MARKER) in files
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(0o664) for p in files}
