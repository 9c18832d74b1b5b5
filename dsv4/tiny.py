"""The embedded tiny model: a real checkpoint directory built once from deterministic weights.

``dsv4 generate`` without ``--model`` uses it, so anyone can run the engine on a CPU with no
download. It is stored like a real release (DSV4_FACTS section 4): FP8-block attention and shared
expert, MXFP4 routed experts with ue8m0 scales (DeepSeek's layout; ``tiny:nvfp4`` gives NVIDIA's
MIXED_PRECISION layout with NVFP4 experts, ``tiny:bf16`` a plain BF16 checkpoint), and BF16/FP32
precision-floor tensors. It is written under ``$DSV4_CACHE`` (default ``~/.cache/dsv4``) as
``config.json`` + ``model.safetensors`` + a byte-level ``tokenizer.json``, then loaded through the
same loader as any checkpoint. The directory is written to a temporary name and renamed when complete, so an
interrupted build never leaves a half-written model behind; its name carries a digest of the geometry
(:func:`tiny_name`), so a changed preset builds a new one instead of loading a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import preset
from .errors import UsageError
from .model.init import init_random
from .model.transformer import Transformer

#: bump when the build changes in a way the config does not show (initialisation, quantizer, tokenizer)
TINY_RECIPE = 3
TINY_SEED = 1234
TINY_VARIANTS = ("mxfp4", "nvfp4", "bf16")


def tiny_name() -> str:
    """The cache directory stem of the tiny checkpoint: ``tiny-v<recipe>-<digest>``, the digest taken
    over the preset's geometry and the seed, so a cache built from another geometry is never served."""
    recipe = json.dumps({"config": preset("tiny").to_dict(), "seed": TINY_SEED}, sort_keys=True)
    return f"tiny-v{TINY_RECIPE}-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"


def cache_dir() -> Path:
    """``$DSV4_CACHE``, or ``~/.cache/dsv4`` when it is unset or empty."""
    return Path(os.environ.get("DSV4_CACHE") or Path.home() / ".cache" / "dsv4")


def _make_cache_dir(root: Path) -> None:
    """Create ``root``; a :class:`UsageError` naming it (and ``DSV4_CACHE``) if that cannot be done."""
    where = f"{root} (DSV4_CACHE)" if os.environ.get("DSV4_CACHE") else str(root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"the dsv4 cache {where} is a file, not a directory; point DSV4_CACHE at a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the dsv4 cache directory {where}: {e.strerror or e}") from None


def write_checkpoint(model: Transformer, directory: Path) -> None:
    """Write ``model`` as an official-named checkpoint, each tensor in its in-memory dtype (a BF16
    model keeps norms, mHC, sinks and other precision-floor tensors in fp32)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in model.official_state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))


def build_tiny(directory: Path, variant: str = "mxfp4") -> None:
    """Build the tiny checkpoint (weights, config, tokenizer) into ``directory``: a BF16 checkpoint,
    then (unless ``variant == "bf16"``) ``dsv4 quantize`` with the precision-floor policy."""
    from .text.tiny_tokenizer import write_tiny_tokenizer
    from .weights.quantize import quantize_checkpoint

    config = preset("tiny")
    model = init_random(Transformer(config, torch.bfloat16), seed=TINY_SEED)
    if variant == "bf16":
        write_checkpoint(model, directory)
        write_tiny_tokenizer(directory, config.vocab_size)
        return
    with tempfile.TemporaryDirectory(dir=directory.parent) as src:
        write_checkpoint(model, Path(src))
        write_tiny_tokenizer(src, config.vocab_size)
        quantize_checkpoint(Path(src), directory, variant, policy="floor", dense_format="fp8", scale_fmt="ue8m0",
                            progress=False, overwrite=True)


def ensure_tiny(root: Path | None = None, variant: str = "mxfp4") -> Path:
    """Path of the tiny checkpoint ``variant``, building it first if it is not in the cache yet."""
    if variant not in TINY_VARIANTS:
        raise UsageError(f"unknown tiny model variant {variant!r}; known: {', '.join(TINY_VARIANTS)}")
    root = root or cache_dir()
    name = tiny_name()
    target = root / f"{name}-{variant}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    _make_cache_dir(root)
    print(f"building the embedded tiny model in {target} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build_tiny(tmp, variant)
        if target.exists():  # a concurrent build finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(model: str | Path | None) -> Path:
    """A checkpoint path from a ``--model`` value: a directory, or ``tiny`` / ``tiny:<variant>``
    (also the default when ``model`` is None)."""
    if model is None:
        return ensure_tiny()
    text = str(model)
    if not Path(text).exists() and (text == "tiny" or text.startswith("tiny:")):
        return ensure_tiny(variant=text.partition(":")[2] or "mxfp4")
    return Path(model)
