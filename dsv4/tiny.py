"""The embedded tiny model: a real checkpoint directory built once from deterministic weights.

``dsv4 generate`` without ``--model`` uses it, so anyone can run the engine on a CPU with no
download. It is written under ``$DSV4_CACHE`` (default ``~/.cache/dsv4``) as ``config.json`` +
``model.safetensors`` + a byte-level ``tokenizer.json``, then loaded through the same loader as any
checkpoint. The directory is written to a temporary name and renamed when complete, so an
interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import preset
from .model.init import init_random
from .model.transformer import Transformer

TINY_NAME = "tiny-v1"
TINY_SEED = 1234


def cache_dir() -> Path:
    return Path(os.environ.get("DSV4_CACHE") or Path.home() / ".cache" / "dsv4")


def write_checkpoint(model: Transformer, directory: Path) -> None:
    """Write ``model`` as an official-named checkpoint, each tensor in its in-memory dtype (a BF16
    model keeps norms, mHC, sinks and other precision-floor tensors in fp32)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))


def build_tiny(directory: Path) -> None:
    """Build the tiny checkpoint (weights, config, tokenizer) into ``directory``."""
    from .text.tiny_tokenizer import write_tiny_tokenizer

    config = preset("tiny")
    model = init_random(Transformer(config, torch.bfloat16), seed=TINY_SEED)
    write_checkpoint(model, directory)
    write_tiny_tokenizer(directory, config.vocab_size)


def ensure_tiny(root: Path | None = None) -> Path:
    """Path of the tiny checkpoint, building it first if it is not in the cache yet."""
    root = root or cache_dir()
    target = root / TINY_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file() \
            and (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    print(f"building the embedded tiny model in {target} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}-", dir=root))
    try:
        build_tiny(tmp)
        if target.exists():  # a concurrent build finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
