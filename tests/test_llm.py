"""The Python API (LLM.generate / stream / chat) and the terminal chat session on the tiny model."""

from __future__ import annotations

import io

import pytest

from dsv4.chat_repl import ChatSession, run_chat
from dsv4.engine.llm import LLM, resolve_qat_sim
from dsv4.engine.sampling import SamplingParams
from dsv4.errors import RequestError, UsageError
from dsv4.text.chat import ContentDelta, ReasoningDelta


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint, max_num_seqs=3, max_model_len=256, progress=False)


def test_generate_batch_matches_one_by_one(llm):
    prompts = ["Once upon a time", "The cat", "A much longer prompt about the sea and the stars"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        assert len(a.token_ids) == 12 and a.finish_reason == "length"
        assert a.text == llm.tokenizer.decode(a.token_ids, skip_special_tokens=True)


def test_more_prompts_than_slots_and_per_request_params(llm):
    prompts = [f"prompt number {i}" for i in range(5)]
    params = [SamplingParams(max_tokens=3 + i, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [3, 4, 5, 6, 7]
    again = llm.generate(prompts[3], params[3])[0]
    assert again.token_ids == outs[3].token_ids  # same seed, different batch: same tokens


def test_token_id_prompts_logprobs_and_stop_tokens(llm):
    ids = llm.tokenizer.encode("Hello world", add_bos=True)
    first = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert first.prompt_token_ids == ids
    assert len(first.logprobs) == 6 and all(lp <= 0 for lp in first.logprobs)
    assert all(len(t) == 3 and t[0][1] >= t[1][1] >= t[2][1] for t in first.top_logprobs)
    assert first.top_logprobs[0][0][0] == first.token_ids[0]  # greedy picks the top alternative
    stop_at = first.token_ids[2]
    cut = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_at]))[0]
    assert cut.token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1]
    assert cut.finish_reason == "stop"


def test_stream_yields_text_incrementally(llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    events = list(llm.stream("Once upon a time", params))
    assert len(events) == 10 and events[-1].finished and not any(e.finished for e in events[:-1])
    assert "".join(e.text for e in events) == events[-1].output.text


def test_context_limit_is_checked_at_admission(tiny_checkpoint):
    """A request that could not finish within max_model_len is refused before anything runs (both
    lengths named); one that fits exactly ends with reason "length" at the last position."""
    small = LLM(tiny_checkpoint, max_num_seqs=1, max_model_len=24, progress=False)
    with pytest.raises(ValueError, match=r"prompt 0: prompt \(\d+ tokens\) \+ max_tokens \(100\) = \d+ exceeds max_model_len \(24\)"):
        small.generate("Once upon a time", SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    n = len(small.tokenizer.encode("Once upon a time", add_bos=True))
    out = small.generate("Once upon a time", SamplingParams(max_tokens=24 - n, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 24
    with pytest.raises(ValueError, match="prompt 0 has .* tokens; max_model_len is 24"):
        small.generate("x" * 200)


def test_bad_prompts_name_the_problem(llm):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["fine", []])
    with pytest.raises(ValueError, match="outside"):
        llm.generate([[5, 99999]])
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_chat_and_chat_stream(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    params = SamplingParams(max_tokens=8, temperature=0)
    out = llm.chat(messages, params)
    assert out.completion.prompt_token_ids[0] == llm.tokenizer.bos_id
    assert out.reasoning is None and isinstance(out.content, str)
    events = list(llm.chat_stream(messages, params))
    streamed = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert streamed == out.content
    thinking = list(llm.chat_stream(messages, params, thinking=True))
    assert all(isinstance(e, ReasoningDelta) for e in thinking if not hasattr(e, "message"))


def test_qat_sim_auto_follows_the_checkpoint(tiny_config):
    assert resolve_qat_sim("auto", tiny_config) is (tiny_config.quantization_config is not None)
    assert resolve_qat_sim("on", tiny_config) is True and resolve_qat_sim("off", tiny_config) is False
    with pytest.raises(ValueError, match="qat_sim"):
        resolve_qat_sim("maybe", tiny_config)


def test_chat_session_commands_history_and_interrupt(llm, monkeypatch):
    out = io.StringIO()
    session = ChatSession(llm, SamplingParams(max_tokens=5, temperature=0), out=out)
    session.ask("Hello")
    assert [m["role"] for m in session.history] == ["user", "assistant"]
    assert session.command("/think on") and session.thinking
    assert session.command("/reset") and session.history == []
    assert session.command("/exit") is False

    def interrupted(*args, **kwargs):
        yield "partial", [ContentDelta("partial")], None
        raise KeyboardInterrupt
    monkeypatch.setattr(session, "_generate", interrupted)
    message = session.ask("Tell me a story")
    assert message["content"] == "partial" and "[stopped]" in out.getvalue()
    assert session.history[-1] == message  # the session goes on with the partial answer recorded


def test_run_chat_reads_until_eof(llm, capsys):
    code = run_chat(llm, SamplingParams(max_tokens=3, temperature=0),
                    stdin=io.StringIO("hi\n/think off\n/unknown\n"))
    assert code == 0
    printed = capsys.readouterr().out
    assert "(thinking off)" in printed and "commands:" in printed


def test_wrong_argument_types_name_the_argument(llm):
    with pytest.raises(TypeError, match=r"LLM.generate: `params` must be a SamplingParams.*dict.*SamplingParams\(\*\*params\)"):
        llm.generate(["a"], {"max_tokens": 3})
    with pytest.raises(TypeError, match=r"LLM.stream: `prompt` must be a str .*got list of str.*stream_many"):
        llm.stream(["a", "b"])
    with pytest.raises(TypeError, match=r"`prompts\[1\]` must be a str"):
        llm.generate(["a", 3.5])
    with pytest.raises(TypeError, match="`prompts` must be"):
        llm.generate(42)
    with pytest.raises(RequestError, match="prompt 0 is not valid Unicode.*offset 3"):
        llm.generate("abc\udcff")


def test_limits_are_checked_before_loading(tiny_checkpoint, monkeypatch):
    import dsv4.engine.llm as llm_mod

    def no_load(*a, **k):
        raise AssertionError("weights were read before the limits were checked")
    monkeypatch.setattr(llm_mod, "load_model", no_load)
    with pytest.raises(UsageError, match=r"max_model_len \(--max-model-len\) 10,000,000 exceeds.*65,536"):
        LLM(tiny_checkpoint, max_model_len=10_000_000, progress=False)
    for kwargs, word in (({"max_model_len": 0}, "max_model_len"), ({"max_num_seqs": 0}, "max_num_seqs")):
        with pytest.raises(UsageError, match=word):
            LLM(tiny_checkpoint, progress=False, **kwargs)
    import dsv4.engine.limits as limits
    monkeypatch.setattr(limits, "available_bytes", lambda device: 1 << 20)  # 1 MiB free
    with pytest.raises(UsageError, match=r"needs .* MiB, but only 1.0 MiB is free"):
        LLM(tiny_checkpoint, max_model_len=65536, progress=False)
