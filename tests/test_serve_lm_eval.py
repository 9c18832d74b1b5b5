"""lm-eval-harness end to end against `dsv4 serve`: `local-completions` on a loglikelihood task
(remote tokenizer through /tokenizer_info and /tokenize, prompt logprobs through echo), and
`local-chat-completions` on a generate task. The tasks are tiny files in tests/lm_eval_tasks; the
scores of random weights mean nothing, the harness running through does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

TASKS = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture
def lm_eval(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(TASKS.parent)          # the task files name their data relative to tests/
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    return lm_eval, TaskManager(include_path=str(TASKS), include_defaults=False)


def test_loglikelihood_with_local_completions(served, lm_eval):
    harness, tasks = lm_eval
    out = harness.simple_evaluate(
        model="local-completions", tasks=["dsv4_tiny_choice"], task_manager=tasks,
        model_args=f"base_url={served.url}/v1/completions,model=tiny,num_concurrent=4,max_retries=1,"
                   "tokenized_requests=True,max_length=256")
    result = out["results"]["dsv4_tiny_choice"]
    assert 0.0 <= result["acc,none"] <= 1.0
    # each choice's loglikelihood is a real, negative number summed from the prompt's logprobs
    lls = [resp[0][0] for sample in out["samples"]["dsv4_tiny_choice"] for resp in sample["resps"]]
    assert len(lls) == 8 and all(math.isfinite(x) and x < 0 for x in lls)


def test_generate_with_local_chat_completions(served, lm_eval):
    harness, tasks = lm_eval
    out = harness.simple_evaluate(
        model="local-chat-completions", tasks=["dsv4_tiny_gen"], task_manager=tasks, apply_chat_template=True,
        model_args=f"base_url={served.url}/v1/chat/completions,model=tiny,num_concurrent=2,max_retries=1")
    samples = out["samples"]["dsv4_tiny_gen"]
    assert len(samples) == 2 and all(isinstance(s["resps"][0][0], str) for s in samples)
    assert "exact_match,none" in out["results"]["dsv4_tiny_gen"]
