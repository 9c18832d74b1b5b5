"""Triton's kernel cache lives under ``$DSV4_CACHE`` unless ``TRITON_CACHE_DIR`` says otherwise
(issue 23: a second start compiles nothing, one directory holds dsv4's caches)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from dsv4.ops.triton.runtime import triton_cache_dir  # noqa: E402


def test_default_is_under_dsv4_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "c"))
    got = triton_cache_dir()
    assert got == str(tmp_path / "c" / "triton")
    assert (tmp_path / "c" / "triton").is_dir()
    assert knobs.cache.dir == got            # what Triton itself will compile into


def test_an_explicit_triton_cache_dir_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "c"))
    assert triton_cache_dir() == str(tmp_path / "mine")
    assert not (tmp_path / "c").exists()


def test_an_unusable_dsv4_cache_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "file"))
    with pytest.warns(UserWarning, match="Triton's kernel cache"):
        got = triton_cache_dir()
    assert got == str(knobs.cache.dir) and "TRITON_CACHE_DIR" not in os.environ
