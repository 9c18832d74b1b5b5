"""The MTP block: its own forward (``predict``) composed exactly as DSV4_FACTS section 2 says,
decode == prefill with its own generation state, and the main model untouched by it."""

from __future__ import annotations

import torch

from conftest import parity_config, random_model
from dsv4 import ops
from dsv4.engine.state import GenerationState


def _setup(seed=6):
    config = parity_config()
    model = random_model(config, seed=seed, with_mtp=True)
    return config, model


def _main_streams(model, state, ids, start, slot=0):
    ctx = model.context(ids, torch.tensor([slot]), torch.tensor([start]), qat_sim=False,
                        context_bound=start + ids.shape[1])
    return ctx, model.hidden_streams(ctx, state.layers)


@torch.inference_mode()
def test_mtp_predict_is_the_documented_composition():
    config, model = _setup()
    state = GenerationState(config, 1, 64, torch.float32, "cpu", include_mtp=True)
    ids = torch.randint(2, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    ctx, h = _main_streams(model, state, ids, 0)
    nxt = torch.randint(2, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    mtp = model.mtp[0]
    logits, _ = mtp.predict(h, model.embed(nxt), ctx, state.layers[-1], model.head.weight)

    # independent composition from the parts, with a fresh state for the block's attention
    fresh = GenerationState(config, 1, 64, torch.float32, "cpu", include_mtp=True)
    e = model.embed(nxt)
    e = ops.reference.rms_norm(e, mtp.enorm.weight, config.rms_norm_eps) @ mtp.e_proj.weight.T
    hh = ops.reference.rms_norm(h, mtp.hnorm.weight, config.rms_norm_eps) @ mtp.h_proj.weight.T
    x = torch.nn.Module.__call__(mtp, hh + e.unsqueeze(2), ctx, fresh.layers[-1])  # Block.forward
    y = ops.reference.hc_head(x, mtp.hc_head.fn, mtp.hc_head.base, mtp.hc_head.scale, config.rms_norm_eps,
                              config.hc_eps)
    y = ops.reference.rms_norm(y, mtp.norm.weight, config.rms_norm_eps)
    expected = y.float() @ model.head.weight.float().T
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert logits.shape == (1, 24, config.vocab_size)


@torch.inference_mode()
def test_mtp_decode_equals_prefill():
    config, model = _setup(7)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 512, (1, 40), generator=g)
    nxt = torch.randint(2, 512, (1, 40), generator=g)

    one = GenerationState(config, 1, 64, torch.float32, "cpu", include_mtp=True)
    ctx, h = _main_streams(model, one, ids, 0)
    full, _ = model.mtp[0].predict(h, model.embed(nxt), ctx, one.layers[-1], model.head.weight)

    inc = GenerationState(config, 1, 64, torch.float32, "cpu", include_mtp=True)
    rows = []
    for t in range(40):
        ctx, h = _main_streams(model, inc, ids[:, t:t + 1], t)
        out, _ = model.mtp[0].predict(h, model.embed(nxt[:, t:t + 1]), ctx, inc.layers[-1], model.head.weight)
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows, dim=1), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


def test_main_model_logits_do_not_depend_on_the_mtp_block():
    config, model = _setup(8)
    plain = random_model(config, seed=0, with_mtp=False)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    ids = torch.randint(2, 512, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a, _ = model(ids, torch.tensor([0]), torch.tensor([0]), GenerationState(config, 1, 32, torch.float32, "cpu").layers)
        b, _ = plain(ids, torch.tensor([0]), torch.tensor([0]), GenerationState(config, 1, 32, torch.float32, "cpu").layers)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
