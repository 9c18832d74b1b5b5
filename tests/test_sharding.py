"""Tensor/expert-parallel shards, one process: every rank's tensors are exactly its slice of the
checkpoint's (every format, official and HF names), it reads nothing else, and a size or block that
does not divide across the ranks is refused by name.

The expected slices are the issue's rule restated here (not imported from dsv4): ``wq_b``,
``attn_sink``, ``wo_a``, shared ``w1``/``w3``, ``embed`` and ``head`` split by rows; ``wo_b`` and
shared ``w2`` by columns; a split tensor's scale companions split the same way on their own blocks,
scalars replicated; routed experts owned whole (rank r: experts ``[r E/N, (r+1) E/N)``); the rest
replicated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import parity_config, random_model, tp_config
from dsv4.model.transformer import Transformer
from dsv4.parallel import SINGLE, ParallelGroup, ShardError
from dsv4.weights.loader import load_model
from dsv4.weights.names import to_hf_state_dict
from dsv4.weights.quantize import layout_of, quant_config_for, quantize_tensors

ROW_SPLIT = re.compile(r"^(embed|head)\.|(^|\.)attn\.(wq_b|wo_a)\.|(^|\.)attn\.attn_sink$|shared_experts\.w[13]\.")
COL_SPLIT = re.compile(r"(^|\.)attn\.wo_b\.|shared_experts\.w2\.")
EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(.*)$")


def expected_shard(full: dict[str, torch.Tensor], rank: int, world: int, n_experts: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors under local names, cut from the full on-disk (official-named) tensors."""
    per = n_experts // world
    out = {}
    for name, t in full.items():
        m = EXPERT.match(name)
        if m:
            e = int(m.group(2))
            if rank * per <= e < (rank + 1) * per:
                out[f"{m.group(1)}.{e - rank * per}.{m.group(3)}"] = t
            continue
        dim = 0 if ROW_SPLIT.search(name) else 1 if COL_SPLIT.search(name) else None
        out[name] = t if dim is None or t.dim() == 0 else t.chunk(world, dim)[rank]
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def tp_state():
    config = tp_config()
    model = random_model(config, torch.bfloat16, seed=3, with_mtp=True)
    return config, {k: v.contiguous() for k, v in model.official_state_dict().items()}


def _write(path, config, tensors, fmt=None, **quant):
    path.mkdir(parents=True, exist_ok=True)
    raw = config.to_dict()
    if fmt is not None:
        updates, hf = quant_config_for(fmt, "floor", quant.get("dense_format", "fp8"), quant.get("scale_fmt", "ue8m0"),
                                       layout_of(tensors))
        raw.update(updates)
        if hf is not None:
            (path / "hf_quant_config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _f4(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Packed FP4 bytes spelled as float4_e2m1fn_x2 (safetensors F4)."""
    return {k: v.view(torch.float4_e2m1fn_x2) if k.endswith(".weight") and v.dtype == torch.uint8 else v
            for k, v in tensors.items()}


LAYOUTS = {  # name: (experts format or None for BF16, quantize options, F4 spelling)
    "fp8-mxfp4": ("mxfp4", {}, False),                       # DeepSeek's release layout
    "fp8fp32-nvfp4": ("nvfp4", {"scale_fmt": "fp32"}, False),  # NVIDIA's mixed layout, fp32 FP8 scales
    "fp8-experts": ("fp8", {}, False),                        # the -Base layout
    "mxfp4-all": ("mxfp4", {"dense_format": "same"}, False),  # FP4 attention and shared expert: split FP4
    "nvfp4-all-f4": ("nvfp4", {"dense_format": "same"}, True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_shard_is_the_slice_of_the_full_tensor(tp_state, tmp_path, layout):
    config, state = tp_state
    fmt, options, f4 = LAYOUTS[layout]
    full = quantize_tensors(state, config, fmt, **options)
    full = _f4(full) if f4 else full
    path = _write(tmp_path, config, {k: v.contiguous() for k, v in full.items()}, fmt, **options)
    _check_shards(path, config, full, world=2)


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_hf_named_shards(tmp_path, world):
    config = tp_config(o_groups=4, o_lora_rank=32)
    state = {k: v.contiguous() for k, v in random_model(config, torch.bfloat16, seed=5).official_state_dict().items()}
    hf = to_hf_state_dict(state, config.num_hidden_layers, config.n_routed_experts)   # fused experts
    path = _write(tmp_path, config, {k: v.contiguous() for k, v in hf.items()})
    _check_shards(path, config, state, world, load_mtp=False)


def _check_shards(path, config, full, world, load_mtp=True):
    total = sum(t.numel() * t.element_size() for t in full.values())
    for rank in range(world):
        model, report = load_model(path, dtype=torch.bfloat16, progress=False, load_mtp=load_mtp,
                                   parallel=ParallelGroup.layout(rank, world))
        got = model.official_state_dict()
        want = expected_shard(full, rank, world, config.n_routed_experts)
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert tuple(got[name].shape) == tuple(t.shape), (name, got[name].shape, t.shape)
            assert torch.equal(as_bytes(got[name]), as_bytes(t)), name
        # it read its slices and nothing else: the bytes it holds, far less than the whole
        held = sum(t.numel() * t.element_size() for t in got.values())
        assert report.bytes == held < 0.75 * total
        assert report.rank == rank and report.world_size == world


# --------------------------------------------------------------------------- refused by name

@pytest.mark.parametrize("overrides, world, words", [
    (dict(vocab_size=513), 3, ["layers.0.attn.wo_a.weight", "o_groups", "3 ranks"]),
    (dict(o_groups=4, num_attention_heads=4, n_routed_experts=6), 4, ["layers.0.ffn.experts", "n_routed_experts", "6"]),
    (dict(vocab_size=511), 2, ["embed.weight", "vocab_size", "511"]),
    (dict(moe_intermediate_size=33), 2, ["layers.0.ffn.shared_experts.w1.weight", "moe_intermediate_size", "33"]),
])
def test_sizes_that_do_not_divide_are_named(overrides, world, words):
    config = parity_config(**overrides)
    with pytest.raises(ShardError) as info, torch.device("meta"):
        Transformer(config, parallel=ParallelGroup.layout(0, world))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def readme_tiny_tp_sizes() -> dict[str, list[int]]:
    """The README's table of the tensor-parallel sizes each tiny variant supports: variant -> sizes."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    claims = {}
    for models, sizes in re.findall(r"^\| ((?:`tiny[^`]*`[^|]*)+)\| ([\d, ]+) \|$", readme, re.M):
        for model in re.findall(r"`(tiny[^`]*)`", models):
            claims[model.partition(":")[2] or "mxfp4"] = [int(n) for n in sizes.split(",")]
    return claims


def test_readme_tiny_tensor_parallel_sizes_are_what_loads():
    """Every size the README claims for a tiny variant loads on each rank; every other size up to
    twice the largest claim is a ShardError naming the tensor (the next size up cuts a block or a
    count that does not divide)."""
    from dsv4.tiny import TINY_VARIANTS, resolve_model

    claims = readme_tiny_tp_sizes()
    assert sorted(claims) == sorted(TINY_VARIANTS)
    for variant, sizes in claims.items():
        path = resolve_model(f"tiny:{variant}")
        for world in range(1, 2 * max(sizes) + 1):
            if world in sizes:
                for rank in range(world):
                    model, _ = load_model(path, progress=False, parallel=ParallelGroup.layout(rank, world))
                    assert model.layers[0].attn.n_heads * world == model.config.num_attention_heads
            else:
                with pytest.raises(ShardError, match=rf"cannot shard `[\w.]+` .*across {world} ranks"):
                    load_model(path, progress=False, parallel=ParallelGroup.layout(0, world))
    # FP8 blocks are what limit the quantized variants: at the size after their largest, the message
    # says which block would be cut
    path = resolve_model("tiny:mxfp4")
    with pytest.raises(ShardError) as info:
        load_model(path, progress=False, parallel=ParallelGroup.layout(0, 2 * max(claims["mxfp4"])))
    assert re.search(r"`layers\.\d+\.attn\.(wq_b|wo_a|wo_b)\.weight` \(FP8 block.*multiple of 128", str(info.value))


def test_fp4_column_split_must_fall_on_activation_blocks(tmp_path):
    """An FP4 shared expert whose ``w2`` would split into 64-column halves: the QAT input quantization
    works in 1x128 blocks, so each rank's columns must be a multiple of 128."""
    config = tp_config(moe_intermediate_size=128)
    state = random_model(config, torch.bfloat16, seed=2).official_state_dict()
    full = quantize_tensors(state, config, "mxfp4", dense_format="same")
    path = _write(tmp_path, config, {k: v.contiguous() for k, v in full.items()}, "mxfp4", dense_format="same")
    with pytest.raises(ShardError, match=r"shared_experts\.w2\.weight.*MXFP4.*input quantization"):
        load_model(path, progress=False, load_mtp=False, parallel=ParallelGroup.layout(0, 2))


def test_random_sharded_applies_the_same_rule():
    from dsv4.config import preset
    from dsv4.random_weights import random_sharded

    # the tiny geometry's FP8 projections are two 128-blocks: they split in 2, not in 4
    random_sharded(preset("tiny"), parallel=ParallelGroup.layout(1, 2))
    with pytest.raises(ShardError, match=r"attn\.wq_b\.weight.*fp8"):
        random_sharded(preset("tiny"), parallel=ParallelGroup.layout(0, 4))
    random_sharded(preset("tiny"), parallel=ParallelGroup.layout(0, 4), dense="bf16")   # BF16 splits anywhere


def test_world_size_one_has_no_collectives():
    x = torch.arange(6.0).view(2, 3)
    assert SINGLE.all_reduce_sum(x) is x and SINGLE.all_gather(x) is x and SINGLE.broadcast(x) is x
    assert SINGLE.broadcast_object({"a": 1}) == {"a": 1} and SINGLE.all_gather_object(3) == [3]
    layout = ParallelGroup.layout(1, 2)
    with pytest.raises(RuntimeError, match="layout-only"):
        layout.all_reduce_sum(x)
    assert layout.local_range(8, "experts", "x") == (4, 8)
