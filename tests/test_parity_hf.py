"""Parity with HuggingFace transformers' DeepseekV4ForCausalLM (the oracle nobody here wrote).

Same random weights in both; QAT simulation off; fp32. Prefill logits and >= 200 incremental
decode steps for a batch of 2 prompts of different lengths, decoded together in one batch on our
side (each slot at its own position), crossing the window wrap (8) and many compression windows
(CSA 4, HCA 16). Tolerance: max|diff| <= 1e-4 * max|logit|.
"""

from __future__ import annotations

import pytest
import torch

from conftest import parity_config, random_model
from hf_oracle import hf_logits_incremental, hf_model
from dsv4.engine.runner import Runner
from dsv4.testing import decode, prefill

transformers = pytest.importorskip("transformers", minversion="5.23", reason="the HF oracle needs transformers>=5.23")

STEPS = 210


def _ours(model, prompts, continuations) -> list[torch.Tensor]:
    runner = Runner(model, max_num_seqs=3, max_model_len=512, max_num_batched_tokens=16)
    slots = [2, 0][:len(prompts)]  # deliberately not 0..n-1
    logits = [[prefill(runner, s, p, all_logits=True)] for s, p in zip(slots, prompts)]
    for step in range(len(continuations[0])):
        toks = torch.tensor([c[step] for c in continuations])
        out = decode(runner, slots, toks)
        for i in range(len(slots)):
            logits[i].append(out[i:i + 1])
    return [torch.cat(rows) for rows in logits]


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_and_decode_match_transformers(seed):
    config = parity_config()
    model = random_model(config, seed=seed)
    hf = hf_model(config, model.official_state_dict())
    g = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=g).tolist() for n in (37, 11)]
    conts = [torch.randint(2, config.vocab_size, (STEPS,), generator=g).tolist() for _ in prompts]
    ours = _ours(model, prompts, conts)
    for prompt, cont, mine in zip(prompts, conts, ours):
        ref = hf_logits_incremental(hf, prompt, cont)
        assert mine.shape == ref.shape
        tol = 1e-4 * ref.abs().max()
        err = (mine - ref).abs().amax(-1)
        assert err[:len(prompt)].max() <= tol, f"prefill differs: {err[:len(prompt)].max()} > {tol}"
        worst = int(err.argmax())
        assert err.max() <= tol, f"decode step {worst - len(prompt)} differs: {err.max()} > {tol}"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_transformers(dtype):
    """Our model on the GPU (fp32: same bound as on CPU; bf16: bf16-sized bound) vs HF fp32 on CPU.

    In fp32 the indexer keeps every compressed entry (``index_topk`` 64 >= the 61 entries of 247
    positions): a GPU's last-bit differences from the CPU (another summation order in the indexer's
    query rotation, measured on an H100) flip a near-tie in a top-5 selection at one step, which no
    precision bound survives. The selection itself is checked bit-exactly on the CPU (the test
    above) and, in bf16 here, by the median bound."""
    config = parity_config(index_topk=64) if dtype == torch.float32 else parity_config()
    cpu_model = random_model(config, seed=5)
    hf = hf_model(config, cpu_model.official_state_dict())
    model = random_model(config, dtype, seed=5).cuda()
    model.init_rope("cuda")
    g = torch.Generator().manual_seed(105)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=g).tolist() for n in (37, 11)]
    conts = [torch.randint(2, config.vocab_size, (STEPS,), generator=g).tolist() for _ in prompts]
    ours = _ours(model, prompts, conts)
    for prompt, cont, mine in zip(prompts, conts, ours):
        ref = hf_logits_incremental(hf, prompt, cont)
        mine = mine.float().cpu()
        if dtype == torch.float32:
            assert (mine - ref).abs().max() <= 1e-4 * ref.abs().max()
        else:
            per_row = (mine - ref).abs().amax(-1) / ref.abs().amax(-1)
            assert per_row.median() < 0.03
            # top-1 on this random model's flat distributions is fragile under bf16 noise: measured
            # 0.90-0.94 before the bf16 operand rounding of DeepSeek's code (SwiGLU output to bf16
            # before w2) and 0.86-0.96 after, on CPU, with the same median error; 0.85 keeps the margin
            assert (mine.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def test_checkpoint_saved_by_transformers_loads_and_matches(tmp_path):
    """An HF model with HF's own initialisation, written by `save_pretrained` (its config.json with
    `rope_parameters`, its tensor spelling), loads through our loader and agrees on prefill and
    decode; `LLM` generates from it with token-id prompts (no tokenizer in that directory)."""
    from transformers import DeepseekV4ForCausalLM

    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling import SamplingParams
    from dsv4.weights.loader import load_model
    from hf_oracle import hf_config

    torch.manual_seed(0)
    hf = DeepseekV4ForCausalLM(hf_config(parity_config())).eval()
    hf.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(2, 512, (21,), generator=g).tolist()
    cont = torch.randint(2, 512, (40,), generator=g).tolist()
    ours = _ours(model, [prompt], [cont])[0]
    ref = hf_logits_incremental(hf, prompt, cont)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()

    llm = LLM(tmp_path, dtype="fp32", max_num_seqs=1, max_model_len=128, progress=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.token_ids[0] == int(ref[len(prompt) - 1].argmax())
    assert out.text == ""
    with pytest.raises(ValueError, match="no tokenizer.json"):
        llm.generate("text needs a tokenizer")
