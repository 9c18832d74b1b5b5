"""The engine's prompt logprobs (what ``echo`` + ``logprobs`` and lm-eval's loglikelihood read),
checked against log_softmax of the model's logits over the whole prompt computed in one shot."""

from __future__ import annotations

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.engine.core import Engine
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SamplingParams
from dsv4.errors import RequestError
from dsv4.testing import prefill


@pytest.fixture(scope="module")
def model():
    return random_model(parity_config(), seed=5)


def _direct(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits, the prompt prefilled in one chunk: [len, vocab]."""
    runner = Runner(model, max_num_seqs=1, max_model_len=128, max_num_batched_tokens=128)
    runner.start(0, SamplingParams(), prompt)
    return torch.log_softmax(prefill(runner, 0, prompt, all_logits=True).float(), dim=-1)


def _run(engine: Engine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    first = final = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid:
                first = first or (list(out.output.prompt_logprobs or []), list(out.output.prompt_top_logprobs or []))
                final = out.output
    return first, final


def test_prompt_logprobs_match_a_direct_computation_across_chunks(model):
    prompt = list(range(3, 40))                                  # 37 tokens in chunks of 5
    direct = _direct(model, prompt)
    engine = Engine(Runner(model, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=8), None, eos_id=1,
                    long_prefill_token_threshold=5)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    (lps, tops), final = _run(engine, prompt, params)
    assert len(lps) == len(prompt) and lps[0] is None and tops[0] == []
    want = direct[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(lps[1:]), want, atol=1e-4, rtol=0)
    for pos in range(1, len(prompt)):
        ids, values = zip(*tops[pos])
        ref = direct[pos - 1].topk(3)
        assert list(ids) == ref.indices.tolist()
        torch.testing.assert_close(torch.tensor(values), ref.values, atol=1e-4, rtol=0)
    # asking for prompt logprobs changes nothing about the generated tokens
    plain = Engine(Runner(model, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=5), None, eos_id=1)
    _, alone = _run(plain, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert final.token_ids == alone.token_ids and alone.prompt_logprobs is None


def test_one_token_prompt_and_zero_top(model):
    engine = Engine(Runner(model, max_num_seqs=1, max_model_len=64), None, eos_id=1)
    (lps, tops), _ = _run(engine, [7], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert lps == [None] and tops == [[]]
    (lps, tops), _ = _run(engine, [7, 8, 9], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert len(lps) == 3 and all(t == [] for t in tops)


def test_prompt_logprobs_is_checked():
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
