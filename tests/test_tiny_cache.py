"""The embedded tiny model's cache: a checkpoint built from one geometry is never served for another."""

from __future__ import annotations

import dsv4.tiny as tiny
from dsv4.config import ModelConfig, preset


def test_a_changed_geometry_builds_a_new_checkpoint(tmp_path, monkeypatch):
    old = tiny.ensure_tiny(tmp_path, "bf16")
    assert ModelConfig.from_file(old / "config.json") == preset("tiny")
    # a later version of the preset (here: two layers instead of four) must not load the old files
    monkeypatch.setattr(tiny, "preset", lambda name: preset(name, num_layers=2))
    new = tiny.ensure_tiny(tmp_path, "bf16")
    assert new != old and new.parent == tmp_path
    assert ModelConfig.from_file(new / "config.json") == preset("tiny", num_layers=2)
    assert ModelConfig.from_file(old / "config.json") == preset("tiny")      # the old one is left alone
    assert tiny.ensure_tiny(tmp_path, "bf16") == new                          # and the new one is reused
