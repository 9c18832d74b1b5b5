"""The whole batched decode forward captures as one CUDA graph (DESIGN decision 3, issue 9).

Captured under ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises), for the BF16,
FP8+MXFP4 and FP8+NVFP4 tiny releases with the QAT simulation on and off. Replaying the graph on a
copy of the state gives exactly what the eager forward gives, logits and state bit for bit.
GPU only (skipped without CUDA); run by ``bench/gpu_check.sh``.
"""

from __future__ import annotations

import pytest
import torch
from dsv4.testing import prefill

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, cuda]


def _snapshot(runner):
    return [t.clone() for layer in runner.state.layers for t in layer.tensors()]


def _kept(runner, tensors):
    """The tensors without the entry stores' last row: the write sink for windows that did not
    close, written with duplicate indices (which write lands there is unspecified) and never read."""
    sinks = {id(t) for layer in runner.state.layers for comp in (layer.compressor, layer.indexer)
             if comp is not None for t in comp.entries.tensors()}
    live = [t for layer in runner.state.layers for t in layer.tensors()]
    return [t[:, :-1] if id(ref) in sinks else t for ref, t in zip(live, tensors)]


def _restore(runner, saved):
    tensors = [t for layer in runner.state.layers for t in layer.tensors()]
    for t, s in zip(tensors, saved):
        t.copy_(s)


@pytest.mark.parametrize("variant", ["bf16", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("qat", [False, True])
def test_decode_forward_captures_and_replays_exactly(tiny_checkpoint_dir, variant, qat):
    from dsv4 import ops
    from dsv4.engine.runner import Runner
    from dsv4.tiny import ensure_tiny
    from dsv4.weights.loader import load_model

    path = ensure_tiny(tiny_checkpoint_dir, variant)
    model, _ = load_model(path, "cuda", torch.bfloat16, load_mtp=False, progress=False)
    runner = Runner(model, max_num_seqs=4, max_model_len=256, qat_sim=qat)
    g = torch.Generator().manual_seed(0)
    for slot, n in ((0, 37), (1, 5), (2, 130), (3, 64)):
        prefill(runner, slot, torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist())
    slots = torch.tensor([2, 0, 3, 1], device="cuda")
    ids = torch.randint(2, model.config.vocab_size, (4, 1), generator=g).cuda()
    start = runner.state.positions[slots].clone()
    bound = runner.max_model_len

    def forward():
        with ops.sync_free():
            return model(ids, slots, start, runner.state.layers, qat, context_bound=bound)[0]

    saved = _snapshot(runner)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):          # warm-up: lazy init (kernels, tables) happens outside capture
                _restore(runner, saved)
                forward()
        torch.cuda.current_stream().wait_stream(side)
        _restore(runner, saved)
        eager = forward().clone()
        eager_state = _snapshot(runner)
        graph = torch.cuda.CUDAGraph()
        _restore(runner, saved)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph):
                out = forward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _restore(runner, saved)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager), f"replay differs: max {(out - eager).abs().max()}"
    for i, (a, b) in enumerate(zip(_kept(runner, _snapshot(runner)), _kept(runner, eager_state))):
        a, b = a.contiguous(), b.contiguous()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"state tensor {i} differs"  # bytes


@pytest.fixture(scope="module")
def tiny_checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dsv4cache_graph")
