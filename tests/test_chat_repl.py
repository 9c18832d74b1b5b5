"""`dsv4 chat` never goes silent (issue 8, item 3): held markup streams raw, a malformed block
stops the answer and generation, and /max changes the token limit."""

from __future__ import annotations

import io

import pytest

from dsv4.chat_repl import RAW_AFTER_CHARS, ChatSession, run_chat
from dsv4.engine.llm import CompletionOutput, StreamEvent
from dsv4.engine.sampling import SamplingParams
from dsv4.text.chat import DSML, EOS
from dsv4.text.tokenizer import Tokenizer


class ScriptedLLM:
    """An LLM stand-in whose stream "generates" a fixed text token by token, counting the pulls."""

    def __init__(self, tokenizer: Tokenizer, completion: str):
        self.tokenizer, self.path = tokenizer, "scripted"
        self.ids = tokenizer.encode(completion)
        self.pulled = 0

    def stream(self, prompt_ids, params):
        out = CompletionOutput(prompt_token_ids=list(prompt_ids))
        n = min(len(self.ids), params.max_tokens)
        for i, t in enumerate(self.ids[:n]):
            self.pulled += 1
            out.token_ids.append(t)
            last = i == n - 1
            if last:
                out.finish_reason = "stop" if t == self.tokenizer.eos_id else "length"
            yield StreamEvent(0, "", t, last, out)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


def ask(tokenizer, completion: str, max_tokens: int = 4000) -> tuple[str, ScriptedLLM, dict]:
    llm = ScriptedLLM(tokenizer, completion)
    out = io.StringIO()
    session = ChatSession(llm, SamplingParams(max_tokens=max_tokens), out=out)
    message = session.ask("hello")
    return out.getvalue(), llm, message


def test_malformed_block_is_shown_raw_and_stops_generation(tokenizer):
    block = f"\n\n<{DSML}tool_calls>this is not an invoke</{DSML}tool_calls>"
    rest = " and then a long ramble" * 60 + EOS
    printed, llm, message = ask(tokenizer, "Sure." + block + rest)
    assert printed.startswith("Sure.")
    assert "[raw] " in printed and f"<{DSML}tool_calls>this is not an invoke" in printed  # markup included
    assert "[malformed output:" in printed and "answer stopped" in printed
    assert "ramble" not in printed
    assert llm.pulled < len(tokenizer.encode("Sure." + block)) + 5 < len(llm.ids)  # generation stopped there
    assert message["content"] == "Sure."


def test_a_long_tool_call_streams_raw_before_it_completes(tokenizer):
    value = "x" * (3 * RAW_AFTER_CHARS)
    call = (f"\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"search\">\n<{DSML}parameter name=\"q\" string=\"true\">"
            f"{value}</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>{EOS}")
    printed, _, message = ask(tokenizer, "Looking." + call)
    raw_at, call_at = printed.find("[raw] "), printed.find("[tool call search(")
    assert 0 < raw_at < call_at, printed
    assert value[:RAW_AFTER_CHARS] in printed[raw_at:call_at]  # shown while the block was still open
    assert message["tool_calls"][0]["function"]["name"] == "search"


def test_short_markup_is_not_shown_raw(tokenizer):
    printed, _, message = ask(tokenizer, "Plain answer." + EOS)
    assert printed.strip() == "Plain answer." and "[raw]" not in printed


def test_token_limit_is_said_and_max_changes_it(tokenizer):
    printed, llm, _ = ask(tokenizer, "word " * 50, max_tokens=5)
    assert llm.pulled == 5 and "5-token limit" in printed and "/max N" in printed
    out = io.StringIO()
    session = ChatSession(ScriptedLLM(tokenizer, "hi"), SamplingParams(max_tokens=512), out=out)
    assert session.command("/max 64") and session.params.max_tokens == 64
    assert session.command("/max 0") and session.params.max_tokens == 64
    assert session.command("/max") and "64 tokens" in out.getvalue().splitlines()[-1]
    assert "/max N" in out.getvalue() or session.command("/help")


def test_help_line_shows_the_limit(tokenizer, capsys):
    run_chat(ScriptedLLM(tokenizer, "hi"), SamplingParams(max_tokens=77), stdin=io.StringIO("/help\n"))
    printed = capsys.readouterr().out
    assert "/max N" in printed and "now 77" in printed


# --------------------------------------------------------------------------- issue 21, item 6

class RecordingLLM(ScriptedLLM):
    def __init__(self, tokenizer: Tokenizer, completion: str):
        super().__init__(tokenizer, completion)
        self.seeds = []

    def stream(self, prompt_ids, params):
        self.seeds.append(params.seed)
        return super().stream(prompt_ids, params)


def test_a_fixed_seed_gives_each_turn_its_own_seed(tokenizer):
    llm = RecordingLLM(tokenizer, "ok" + EOS)
    stdin = io.StringIO("first\nsecond\nthird\n/reset\nagain\n")
    run_chat(llm, SamplingParams(max_tokens=8, seed=7), stdin=stdin)
    assert llm.seeds == [7, 8, 9, 7]            # base seed + turn number; /reset starts over
    llm = RecordingLLM(tokenizer, "ok" + EOS)
    run_chat(llm, SamplingParams(max_tokens=8), stdin=io.StringIO("a\nb\n"))
    assert llm.seeds == [None, None]            # no --seed: every answer draws its own


def test_piped_turns_are_echoed(tiny_checkpoint):
    """`dsv4 chat < file` prints each user turn after the prompt, so the output reads as a transcript."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, DSV4_CACHE=str(tiny_checkpoint.parent))
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "chat", "--max-tokens", "3", "--seed", "1"],
                       input="Hello there\n/think on\nAnd now?\n", env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "> Hello there" in lines and "> /think on" in lines and "> And now?" in lines, r.stdout
    assert lines.index("> Hello there") < lines.index("> /think on") < lines.index("> And now?")
