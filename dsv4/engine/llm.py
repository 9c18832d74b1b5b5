"""The Python API: ``LLM(model).generate(prompts, SamplingParams(...))``, streaming and chat.

Prompts are batched through the runner's slots: each wave prefills up to ``max_num_seqs`` prompts,
then decodes all of them together, one forward per step, each row with its own sampling params.
Text comes out through an incremental detokenizer and a stop checker per request, so streamed
text never contains half a UTF-8 character or the beginning of a stop string.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..devices import resolve_device
from ..errors import ContextOverflowError, RequestError, UsageError
from ..text.tokenizer import IncrementalDetokenizer, Tokenizer
from ..weights.loader import CheckpointError, LoadReport, load_model
from .inputs import check_text, params_list, prompt_list, single_prompt
from .limits import check_positive, check_state_fits, format_bytes, resolve_max_model_len
from .runner import Runner
from .sampler import SamplingBatch, SamplingParams, StopChecker, sample

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "ChatOutput", "StreamEvent", "resolve_qat_sim"]


@dataclass
class CompletionOutput:
    """One finished generation. Times in seconds; ``decode_tokens_per_s`` excludes the first token
    (None when there was no second token to time)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    time_to_first_token: float = 0.0
    total_time: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        span = self.total_time - self.time_to_first_token
        return (len(self.token_ids) - 1) / span if len(self.token_ids) > 1 and span > 0 else None


@dataclass
class StreamEvent:
    """A streamed step of one request: new text (possibly empty) and, at the end, the output."""

    index: int
    text: str
    token_id: int | None
    finished: bool
    output: CompletionOutput


@dataclass
class ChatOutput:
    """A chat answer split into reasoning, content and tool calls (see :mod:`dsv4.text.chat`)."""

    reasoning: str | None
    content: str
    tool_calls: list
    finish_reason: str | None
    error: str | None
    completion: CompletionOutput


def resolve_qat_sim(setting: str | bool, config: ModelConfig) -> bool:
    """``auto``: on for checkpoints quantized like DeepSeek's releases (FP8/FP4 weights, which were
    trained with the simulated FP8 KV cache and FP4 indexer), off for plain BF16 checkpoints."""
    if isinstance(setting, bool):
        return setting
    if setting in ("on", "true", "1"):
        return True
    if setting in ("off", "false", "0"):
        return False
    if setting != "auto":
        raise UsageError(f"qat_sim (--qat-sim) must be on, off or auto, got {setting!r}")
    return config.quantization_config is not None or config.expert_dtype is not None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise UsageError(f"unknown dtype (--dtype) {dtype!r}; use auto, bf16, fp16 or fp32")
    return table[dtype]


class _Request:
    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
                 eos_id: int):
        self.index, self.params = index, params
        self.out = CompletionOutput(prompt_token_ids=prompt_ids)
        if params.logprobs is not None:
            self.out.logprobs, self.out.top_logprobs = [], []
        # a checkpoint without a tokenizer still generates token ids (text stays empty)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True) if tokenizer else None
        self.stops = StopChecker.from_params(params, eos_id)
        self.t0 = time.perf_counter()

    def take(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
             context_full: bool) -> StreamEvent:
        out = self.out
        if not out.token_ids:
            out.time_to_first_token = time.perf_counter() - self.t0
        out.token_ids.append(token)
        if out.logprobs is not None:
            out.logprobs.append(logprob)
            out.top_logprobs.append(top or [])
        detok = self.detok
        emit, stopped, reason = self.stops.check(detok.push(token) if detok else "", token)
        if not stopped and context_full:
            emit, stopped, reason = emit + (detok.flush() if detok else "") + self.stops.finish(), True, "length"
        elif stopped and reason == "length" and detok:
            emit += detok.flush()
        out.text += emit
        if stopped:
            out.finish_reason = reason
            out.total_time = time.perf_counter() - self.t0
        return StreamEvent(self.index, emit, token, stopped, out)


class LLM:
    """A loaded model ready to generate.

    Args:
        model: a checkpoint directory, or ``None`` / ``"tiny"`` / ``"tiny:nvfp4"`` / ``"tiny:bf16"``
            for the embedded tiny model.
        device: ``auto`` (a CUDA GPU when torch sees one, else the CPU), ``cpu``, ``cuda[:N]``.
        dtype: activations and unquantized weights: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16``,
            ``fp16``, ``fp32``.
        qat_sim: simulate the FP8 KV cache / FP4 indexer of quantized releases (``auto``: on for them).
        max_num_seqs: sequences generated together (the state holds this many).
        max_model_len: positions per sequence, prompt included (default: 4096, or the model's
            ``max_position_embeddings`` if smaller; more than that is refused).

    Both limits are checked against the config and the free memory before any weight is read.
    """

    def __init__(self, model: str | Path | None = None, *, device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", qat_sim: str | bool = "auto", max_num_seqs: int = 4,
                 max_model_len: int | None = None, load_mtp: bool = False, progress: bool = True):
        from ..tiny import resolve_model
        check_positive("max_num_seqs (--max-num-seqs)", max_num_seqs)
        dev = resolve_device(device)
        self.path = resolve_model(model)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        config = ModelConfig.from_file(self.path / "config.json")
        self.max_model_len = resolve_max_model_len(max_model_len, config)
        self.max_num_seqs = max_num_seqs
        act_dtype = resolve_dtype(dtype, dev)
        state_size = check_state_fits(config, max_num_seqs, self.max_model_len, act_dtype, dev)
        if progress:
            print(f"state: {max_num_seqs} x {self.max_model_len:,} positions, {format_bytes(state_size)} on {dev}",
                  file=sys.stderr)
        has_tokenizer = (self.path / "tokenizer.json").is_file()
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(self.path) if has_tokenizer else None
        net, report = load_model(self.path, dev, act_dtype, load_mtp=load_mtp, progress=progress)
        self.load_report: LoadReport = report
        if progress:
            print(self.load_report.one_line(), file=sys.stderr)
        self.model: torch.nn.Module = net
        self.config: ModelConfig = net.config
        self.qat_sim = resolve_qat_sim(qat_sim, self.config)
        self.runner = Runner(net, max_slots=max_num_seqs, max_context=self.max_model_len, qat_sim=self.qat_sim)

    # ------------------------------------------------------------------ inputs
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"{self.path} has no tokenizer.json, so a text prompt cannot be encoded: pass "
                               "token ids instead (LLM.generate([[0, 15, 27]]), or on the command line "
                               "dsv4 generate --prompt-ids 0,15,27)")
        return self.tokenizer

    def _prompt_ids(self, prompt: str | Sequence[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            check_text(prompt, index)
            ids = self._require_tokenizer().encode(prompt, add_bos=True)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"prompt {index} has token id(s) outside [0, {self.config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ContextOverflowError(f"prompt {index} has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                                       "(the prompt and at least one generated token must fit)")
        return ids

    # ------------------------------------------------------------------ generation
    def stream_many(self, prompts: Sequence[str | Sequence[int]],
                    params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Generate for every prompt, yielding a :class:`StreamEvent` per request per token."""
        prompts = prompt_list(prompts, "LLM.stream_many")
        params = params_list(params, len(prompts), "LLM.stream_many")
        return self._stream_many(prompts, params)

    def _stream_many(self, prompts: list, params: list[SamplingParams]) -> Iterator[StreamEvent]:
        requests = [_Request(i, self._prompt_ids(p, i), sp, self.tokenizer, self.config.eos_token_id)
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        for lo in range(0, len(requests), self.runner.max_slots):
            yield from self._wave(requests[lo:lo + self.runner.max_slots])

    def _wave(self, wave: list[_Request]) -> Iterator[StreamEvent]:
        runner, vocab = self.runner, self.config.vocab_size
        slots = list(range(len(wave)))
        runner.reset(slots)
        device = runner.device
        logits = torch.stack([runner.prefill(s, r.out.prompt_token_ids) for s, r in zip(slots, wave)])
        batch = SamplingBatch([r.params for r in wave], vocab, device,
                              prompt_ids=[r.out.prompt_token_ids for r in wave])
        active = list(range(len(wave)))  # rows of `batch` <-> wave indices
        while True:
            result = sample(logits, batch)
            batch.update(result.token_ids)
            tokens = result.token_ids.tolist()  # the one host read per step
            lps = result.logprobs.tolist() if result.logprobs is not None else None
            tops = None
            if result.top_logprobs is not None:
                ids, vals = result.top_logprobs
                tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            keep = []
            for row, w in enumerate(active):
                req = wave[w]
                n_top = req.params.logprobs or 0
                top = tops[row][:n_top] if tops is not None else None
                full = runner.lengths[slots[w]] + 1 >= runner.max_context
                event = req.take(tokens[row], lps[row] if lps else None, top, full)
                yield event
                if not event.finished:
                    keep.append(row)
            if not keep:
                return
            if len(keep) != len(active):
                batch = batch.select(keep)
                active = [active[r] for r in keep]
                tokens = [tokens[r] for r in keep]
            next_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
            logits = runner.decode([slots[w] for w in active], next_ids)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Generate for one prompt or a list of prompts (text or token ids)."""
        prompts = prompt_list(prompts, "LLM.generate")
        params = params_list(params, len(prompts), "LLM.generate")
        outputs: dict[int, CompletionOutput] = {}
        for event in self._stream_many(prompts, params):
            if event.finished:
                outputs[event.index] = event.output
        return [outputs[i] for i in range(len(prompts))]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Stream one prompt's generation."""
        prompt = single_prompt(prompt, "LLM.stream")
        return self._stream_many([prompt], params_list(params, 1, "LLM.stream"))

    # ------------------------------------------------------------------ chat
    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, thinking: bool = False,
             reasoning_effort: str | None = None, tools: list[dict] | None = None,
             response_format: dict | None = None) -> ChatOutput:
        """Answer a conversation; returns reasoning, content and tool calls."""
        from ..text.chat import parse_completion

        ids = self._chat_ids(messages, thinking, reasoning_effort, tools, response_format)
        out = self.generate([ids], params or SamplingParams())[0]
        parsed = parse_completion(self.tokenizer.decode(out.token_ids), thinking=thinking)
        reason = parsed.finish_reason if out.finish_reason == "stop" else out.finish_reason
        return ChatOutput(parsed.reasoning, parsed.content, parsed.tool_calls, reason, parsed.error, out)

    def chat_stream(self, messages: list[dict], params: SamplingParams | None = None, *, thinking: bool = False,
                    reasoning_effort: str | None = None, tools: list[dict] | None = None,
                    response_format: dict | None = None) -> Iterator:
        """Stream a chat answer as parser events (reasoning deltas, content deltas, tool calls)."""
        from ..text.chat import StreamingParser

        ids = self._chat_ids(messages, thinking, reasoning_effort, tools, response_format)
        parser = StreamingParser(thinking=thinking)
        # the parser needs the special tokens (</think>, EOS, DSML) in the text it reads
        detok = IncrementalDetokenizer(self.tokenizer, ids)
        for event in self.stream(ids, params or SamplingParams()):
            yield from parser.feed(detok.push(event.token_id))
            if event.finished:
                yield from parser.feed(detok.flush())
                yield from parser.finish()

    def _chat_ids(self, messages: list[dict], thinking: bool, reasoning_effort: str | None,
                  tools: list[dict] | None, response_format: dict | None) -> list[int]:
        """Prompt token ids of a conversation (DSV4 chat encoding, special tokens by string)."""
        from ..text.chat import encode_messages

        prompt = encode_messages(messages, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools,
                                 response_format=response_format)
        return self._require_tokenizer().encode(prompt)

