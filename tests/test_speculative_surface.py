"""Speculative decoding from the outside (issue 25): ``--speculative-config`` on the CLI (a
subprocess), ``LLM(speculative_config=...)``, and ``dsv4 serve``'s ``dsv4_spec_decode_*`` metrics
through the real ``openai`` client. The embedded tiny model on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from serve_util import ROOT, ServerProcess, metric

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
MTP = {"method": "mtp", "num_speculative_tokens": 2}
IDS = "5,6,7,8,5,6,7,8,5,6"


def _generate(*extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dsv4.cli", "generate", "--prompt-ids", IDS, "--max-tokens", "24",
           "--temperature", "0", "--ignore-eos", "--json", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_generate_json_with_speculation_equals_plain():
    plain, ngram, mtp = (_generate(), _generate("--speculative-config", NGRAM),
                         _generate("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'))
    for p in (plain, ngram, mtp):
        assert p.returncode == 0, p.stderr
    want = json.loads(plain.stdout)
    assert want["spec_decode"] is None
    for p, k in ((ngram, 3), (mtp, 2)):
        got = json.loads(p.stdout)
        assert got["token_ids"] == want["token_ids"]
        s = got["spec_decode"]
        assert s["num_draft_tokens"] == k * s["num_drafts"]
    s = json.loads(mtp.stdout)["spec_decode"]               # the MTP block drafts at every step
    assert s["num_drafts"] > 0 and len(s["acceptance_per_position"]) == 2
    assert s["mean_accepted_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-3)


def test_bad_speculative_config_is_one_line_before_loading():
    p = _generate("--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}')
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--speculative-config" in lines[0], lines
    assert lines[0].endswith("method must be one of ['ngram', 'mtp'], got 'medusa' (see dsv4 generate --help)")


def test_llm_speculative_config(tiny_checkpoint):
    from dsv4 import LLM
    from dsv4.engine.sampling import SamplingParams
    from dsv4.errors import UsageError
    with pytest.raises(UsageError, match="num_speculative_tokens must be an int >= 1"):
        LLM(tiny_checkpoint, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": -1},
            progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    with LLM(tiny_checkpoint, device="cpu", progress=False) as llm:
        want = llm.generate(prompt, params)[0].token_ids
    for spec in (json.loads(NGRAM), MTP):
        with LLM(tiny_checkpoint, device="cpu", progress=False, speculative_config=spec) as llm:
            out = llm.generate(prompt, params)[0]
        assert out.token_ids == want
    assert out.spec_decode.num_drafts > 0


def test_serve_metrics_count_speculation():
    server = ServerProcess("--max-num-seqs", "4", "--max-model-len", "256", "--served-model-name", "tiny",
                           "--speculative-config", json.dumps(MTP), env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ids = httpx.post(server.url + "/tokenize", json={"prompt": "a b c d a b c d a b c d a b"}).json()["tokens"]
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 40
        page = httpx.get(server.url + "/metrics").text
        drafts = metric(page, "dsv4_spec_decode_num_drafts_total")
        assert drafts > 0
        assert metric(page, "dsv4_spec_decode_num_draft_tokens_total") == 2 * drafts
        accepted = metric(page, "dsv4_spec_decode_num_accepted_tokens_total")
        assert metric(page, "dsv4_spec_decode_mean_accepted_length") == pytest.approx(1 + accepted / drafts)
        assert "dsv4_spec_decode_num_accepted_tokens_per_pos_total" in page
        # on the CPU (no CUDA graphs) the acceptance policy is off, and one request is below
        # disable_by_batch_size: no row decoded plainly by the policy
        assert metric(page, "dsv4_spec_decode_num_policy_plain_rows_total") == 0
    finally:
        server.stop()


def test_spec_bench_runs_on_the_cpu():
    """bench/spec_bench.py on the tiny preset (what gpu_check.sh runs on the Flash slice): its four
    tables, with the simulated acceptance's tokens per step within [1, 1 + k]."""
    p = subprocess.run([sys.executable, "bench/spec_bench.py", "--preset", "tiny", "--batch", "2", "--k", "2",
                        "--accept", "0.9", "--tokens", "8", "--steps", "2", "--context", "16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    for title in ("## verify cost", "## simulated acceptance", "## real drafts", "## zero acceptance"):
        assert title in p.stdout
    zero = p.stdout.split("## zero acceptance")[1].strip().splitlines()[-1].split()
    assert zero[0] == "2" and int(zero[4]) >= 1 and int(zero[5]) >= 1      # verify rows, then plain rows
    sim = p.stdout.split("## simulated acceptance")[1].split("##")[0].strip().splitlines()[-1].split()
    assert 1.0 <= float(sim[4]) <= 3.0
    real = p.stdout.split("## real drafts")[1]
    assert {"plain", "ngram", "mtp"} <= set(real.split())


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_tensor_parallel_two_ranks_speculate_like_one(method):
    """Two ranks over gloo with speculation: greedy gives plain decoding's tokens, and a seeded
    sampled request the same tokens as speculation on one process (rank 0's draws and acceptance);
    so do constrained requests (rank 0 stages their masks, its emitted tokens reach every rank)."""
    from dsv4 import LLM
    from dsv4.engine.grammar import StructuredOutputsParams
    from dsv4.engine.sampling import SamplingParams
    spec = json.loads(NGRAM) if method == "ngram" else MTP
    kw = dict(device="cpu", max_num_seqs=2, max_model_len=256, progress=False, max_num_batched_tokens=64)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [0, 400, 21, 9, 400, 21]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    with LLM("tiny:bf16", **kw) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, greedy)]
    # a grammar whose answers repeat themselves, so n-gram drafts find matches (and some break it)
    repeat = StructuredOutputsParams(regex="((ab|cd) ){12}")
    constrained = [SamplingParams(temperature=t, seed=3, max_tokens=40, structured_outputs=repeat)
                   for t in (0.0, 0.9)]
    with LLM("tiny:bf16", speculative_config=spec, **kw) as llm:
        one = [o.token_ids for o in llm.generate(prompts, sampled)]
        outs = llm.generate(prompts, constrained)
        one_constrained = [o.token_ids for o in outs]
        assert method == "mtp" or all(o.spec_decode.num_drafts > 0 for o in outs)
    with LLM("tiny:bf16", tensor_parallel_size=2, speculative_config=spec, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
        assert [o.token_ids for o in llm.generate(prompts, sampled)] == one
        assert [o.token_ids for o in llm.generate(prompts, constrained)] == one_constrained
