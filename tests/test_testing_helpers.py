"""The runner's verb is ``run``; the logits-only steps tests and benchmarks use live in dsv4.testing."""

from __future__ import annotations

import re
from pathlib import Path

import dsv4
from dsv4.engine.runner import Runner

PACKAGE = Path(dsv4.__file__).parent


def test_the_runner_has_no_test_only_verbs():
    for verb in ("prefill", "sample_first", "decode"):
        assert not hasattr(Runner, verb), f"Runner.{verb} is back: logits-only steps belong in dsv4.testing"


def test_production_code_does_not_import_the_test_helpers():
    importers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "testing.py"
                 and re.search(r"^\s*(from|import)\s+(dsv4|\.+)\.?testing\b|from \.+ import testing",
                               p.read_text(), re.M)]
    assert importers == []
