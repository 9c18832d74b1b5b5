"""scripts/install.sh picks torch deliberately (issue 8, item 2), checked with a stand-in pip.

The script runs for real; `python -m pip` is replaced by a stub that records its arguments, and
`import torch` sees a stub package that exists only once the stub pip "installed" it. An unusable
proxy makes PyTorch's CPU index unreachable at once, whatever the network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

PY_STUB = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "${*:3}" >> "$STUB_LOG"
  case " ${*:3} " in *" torch"*) echo "$STUB_NEW_TORCH" > "$STUB_STATE/torch" ;; esac
  exit "${STUB_PIP_RC:-0}"
fi
exec "$STUB_REAL_PY" "$@"
"""

TORCH_STUB = """import os
_state = os.path.join(os.environ["STUB_STATE"], "torch")
if not os.path.exists(_state):
    raise ImportError("no torch here (stub)")
__version__ = open(_state).read().strip()
class version:
    cuda = "12.8" if "cu" in __version__ else None
"""


@pytest.fixture
def stubs(tmp_path):
    bin_dir, pkg, state = tmp_path / "bin", tmp_path / "site" / "torch", tmp_path / "state"
    for d in (bin_dir, pkg, state):
        d.mkdir(parents=True)
    (bin_dir / "python").write_text(PY_STUB)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 1\n")  # no GPU, whatever the machine has
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (pkg / "__init__.py").write_text(TORCH_STUB)
    return tmp_path


def install(stubs: Path, *args: str, torch: str | None = None, **env: str) -> tuple[list[str], str, float]:
    """Run scripts/install.sh; returns the stub pip's calls, the script's stderr and its duration."""
    state = stubs / "state"
    if torch is not None:
        (state / "torch").write_text(torch)
    full_env = {k: v for k, v in os.environ.items() if k not in ("DSV4_TORCH_INDEX", "no_proxy", "NO_PROXY")}
    full_env.update({
        "PATH": f"{stubs / 'bin'}:{os.environ['PATH']}", "PYTHON": str(stubs / "bin" / "python"),
        "PYTHONPATH": str(stubs / "site"), "STUB_REAL_PY": sys.executable, "STUB_STATE": str(state),
        "STUB_LOG": str(stubs / "pip.log"), "STUB_NEW_TORCH": "2.13.0+cpu",
        "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",  # nothing listens there
        **env})
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), *args], env=full_env,
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    log = stubs / "pip.log"
    return (log.read_text().splitlines() if log.exists() else []), proc.stderr, took


def test_unreachable_cpu_index_falls_back_fast_and_says_why(stubs):
    calls, err, took = install(stubs, "test")
    assert calls == ["install torch==2.13.0", "install -e .[test]"]
    assert CPU_INDEX in err and "cannot be used" in err and "default index" in err
    assert "took torch 2.13.0+cpu (CPU build) from the default index" in err
    assert took < 30


def test_fallback_to_a_cuda_build_is_flagged(stubs):
    _, err, _ = install(stubs, STUB_NEW_TORCH="2.13.0+cu128")
    assert "CUDA 12.8 build" in err and f"DSV4_TORCH_INDEX={CPU_INDEX}" in err


def test_torch_index_override(stubs):
    calls, err, _ = install(stubs, DSV4_TORCH_INDEX="https://example.invalid/whl/cu128")
    assert calls == ["install torch>=2.11 --index-url https://example.invalid/whl/cu128", "install -e ."]
    assert "DSV4_TORCH_INDEX" in err


def test_existing_torch_is_kept_and_an_old_one_replaced(stubs):
    calls, err, _ = install(stubs, torch="2.12.1+cu126")
    assert calls == ["install -e ."] and "keeping the installed torch 2.12.1+cu126" in err
    (stubs / "pip.log").unlink()
    calls, _, _ = install(stubs, torch="2.10.0")
    assert calls[0] == "install torch==2.13.0"


def test_bad_argument_installs_nothing(stubs):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "tests"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=str(stubs / "bin" / "python"), STUB_LOG=str(stubs / "pip.log")))
    assert proc.returncode == 2 and "usage" in proc.stderr and not (stubs / "pip.log").exists()
