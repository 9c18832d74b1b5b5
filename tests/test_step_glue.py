"""The index bookkeeping of multi-token steps (prefill chunks, speculative verify) is made once per
step, not once per layer: the compressors' window plans once per forward and ratio, the rollback's
window indices once per step and ratio; the state saves and the ring's restore one op a layer
(issue 25: a verify step launched ~390 more small kernels than a decode step, most of them this
per-layer glue). Exactness is the other tests'
(tests/test_speculative.py, tests/test_generation_state.py, tests/test_batched_step.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SampleFlags
from dsv4.model import compressor
from dsv4.ops import reference
from dsv4.testing import prefill


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=5)


def _ratios(model) -> set[int]:
    return {model.config.layer_ratio(i) for i in range(model.config.num_hidden_layers)} - {0}


def _counting(monkeypatch, owner, name: str) -> list:
    calls, orig = [], getattr(owner, name)

    def fn(*a, **k):
        out = orig(*a, **k)
        calls.append(out)
        return out
    monkeypatch.setattr(owner, name, fn)
    return calls


def test_verify_step_makes_its_index_tensors_once(model, monkeypatch):
    ratios = _ratios(model)
    assert len(ratios) >= 2 and sum(1 for b in model.layers if b.attn.kind != "sliding") > len(ratios)
    r = Runner(model, max_num_seqs=2, max_model_len=128, speculative={"method": "ngram", "num_speculative_tokens": 3})
    prefill(r, 0, list(range(2, 41)))
    plans = _counting(monkeypatch, compressor, "WindowPlan")
    dicts = []
    orig = reference.window_rollback

    def rollback(state, saved, slots, start, S, kept, plans=None):
        dicts.append(plans)
        return orig(state, saved, slots, start, S, kept, plans)
    monkeypatch.setattr(reference, "window_rollback", rollback)
    saves = _counting(monkeypatch, reference, "rows_save")
    restores = _counting(monkeypatch, reference, "rows_restore")
    with torch.inference_mode():
        r._verify_step(torch.tensor([0]), torch.tensor([[5, 6, 7]]), SampleFlags(), r.max_model_len)
    assert len(plans) == 0              # the forward: its 4 tokens a row step the compressors in one op, no plan
    # the rollback (reference): every compressor's call shares one dict, one window plan per ratio
    n_comp = sum(1 for b in model.layers if b.attn.kind != "sliding") + \
        sum(1 for b in model.layers if b.attn.kind == "csa")
    assert len(dicts) == n_comp and all(d is dicts[0] for d in dicts)
    assert {k for k in dicts[0] if k[0] == "window"} == {("window", m) for m in ratios}
    # the state saves: one op for each layer's ring (all its tensors) and one for each compressor's
    # windows; the rollback puts each ring's rows back in one op
    assert len(saves) == model.config.num_hidden_layers + n_comp
    assert len(restores) == model.config.num_hidden_layers


def test_prefill_chunk_makes_its_window_plans_once(model, monkeypatch):
    r = Runner(model, max_num_seqs=2, max_model_len=256)
    plans = _counting(monkeypatch, compressor, "WindowPlan")
    prefill(r, 0, list(range(2, 102)))
    assert len(plans) == len(_ratios(model))
