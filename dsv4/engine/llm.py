"""The Python API: ``LLM(model).generate(prompts, SamplingParams(...))``, streaming and chat.

Prompts are batched through the runner's slots: each wave prefills up to ``max_num_seqs`` prompts,
then decodes all of them together, one forward per step, each row with its own sampling params.
Text comes out through an incremental detokenizer and a stop checker per request, so streamed
text never contains half a UTF-8 character or the beginning of a stop string.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..cpu_threads import apply_threads
from ..devices import resolve_device
from ..errors import ContextOverflowError, RequestError, UsageError
from ..text.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerNotFoundError
from ..weights.loader import CheckpointError, LoadReport, load_model, weight_bytes
from .inputs import check_text, params_list, prompt_list, single_prompt
from .config import EngineConfig
from .limits import format_bytes, prefix_cache_budget, resolve_max_model_len, size_state
from .runner import Runner
from .core import CompletionOutput, Engine
from .launch import RankSpec, torchrun_world_size
from .sampling import SamplingParams
from .speculative import SpeculativeConfig

__all__ = ["LLM", "EngineConfig", "SamplingParams", "CompletionOutput", "ChatOutput", "StreamEvent", "EnginePlan",
           "plan_engine", "resolve_qat_sim"]


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


def _world_size(requested: int | None) -> int:
    """``tensor_parallel_size``, checked against torchrun's ``WORLD_SIZE`` when both are given."""
    env = torchrun_world_size()
    if requested is None:
        return env
    if env > 1 and requested != env:
        raise UsageError(f"tensor_parallel_size (--tensor-parallel-size) {requested} differs from torchrun's "
                         f"WORLD_SIZE {env}")
    return requested


@dataclass(frozen=True)
class EnginePlan:
    """An :class:`EngineConfig` resolved against the machine and the checkpoint (see
    :func:`plan_engine`); nothing is loaded yet. ``max_num_seqs`` and ``max_model_len`` are the
    resolved values of the config's fields of the same names."""

    engine: EngineConfig
    path: Path
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    qat_sim: bool
    world_size: int
    max_num_seqs: int
    max_model_len: int
    state_bytes: int
    has_tokenizer: bool
    load_mtp: bool                               # asked for, or needed by speculative decoding
    prefix_cache_bytes: int = 0                  # 0: prefix caching off
    speculative: SpeculativeConfig | None = None


def plan_engine(engine: EngineConfig, *, require_tokenizer: bool = False) -> EnginePlan:
    """Check an engine config against the machine and the checkpoint's config, tokenizer and
    headers, reading no weight: the device, dtype, path, limits and the state's size (see
    :mod:`dsv4.engine.limits`). :class:`LLM` starts with it; ``dsv4 serve`` calls it before it
    binds its port. Raises a :class:`~dsv4.errors.Dsv4Error` naming the field at fault."""
    from ..tiny import resolve_model
    world = _world_size(engine.tensor_parallel_size)
    dev = resolve_device(engine.device)
    if world > 1 and dev.type == "cuda" and dev.index not in (None, 0):
        raise UsageError(f"with tensor_parallel_size {world} the ranks use cuda:0..{world - 1}; choose the "
                         f"GPUs with CUDA_VISIBLE_DEVICES, not device={engine.device!r}")
    if world > 1 and dev.type == "cuda":
        dev = torch.device("cuda", 0)
    act_dtype = resolve_dtype(engine.dtype, dev)
    path = resolve_model(engine.model)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    has_tokenizer = (path / "tokenizer.json").is_file()
    if require_tokenizer and not has_tokenizer:
        raise TokenizerNotFoundError(f"{path} has no tokenizer.json, so text cannot be encoded (without one only "
                                     "token-id prompts work: dsv4 generate --prompt-ids, LLM.generate([[0, 15]]))")
    config = ModelConfig.from_file(path / "config.json")
    spec = engine.speculative_config
    if spec is not None:
        spec.check_model(config, config.num_nextn_predict_layers > 0)
    load_mtp = engine.load_mtp or (spec is not None and spec.method == "mtp")
    context = resolve_max_model_len(engine.max_model_len, config)
    sim = resolve_qat_sim(engine.qat_sim, config)
    cache = prefix_cache_budget(engine.enable_prefix_caching, engine.prefix_cache_gib, dev,
                                engine.gpu_memory_utilization)
    weights = lambda: weight_bytes(path, act_dtype, load_mtp=load_mtp, world_size=world)   # noqa: E731
    mtp = spec is not None and spec.method == "mtp"
    try:
        slots, size = size_state(config, engine.max_num_seqs, context, act_dtype, dev, sim,
                                 engine.gpu_memory_utilization, weights, reserve=cache if dev.type == "cuda" else 0,
                                 include_mtp=mtp)
    except UsageError:
        if engine.prefix_cache_gib is not None or not cache:
            raise
        # the state asked for leaves no room for the default cache: serve without one
        slots, size = size_state(config, engine.max_num_seqs, context, act_dtype, dev, sim,
                                 engine.gpu_memory_utilization, weights, include_mtp=mtp)
        cache = 0
    if engine.max_num_batched_tokens <= slots:      # max_num_seqs None: checked once it is sized
        raise UsageError(f"max_num_batched_tokens (--max-num-batched-tokens) {engine.max_num_batched_tokens} must "
                         f"exceed max_num_seqs (--max-num-seqs) {slots}")
    return EnginePlan(engine, path, config, dev, act_dtype, sim, world, slots, context, size, has_tokenizer,
                      load_mtp, cache, spec)


class LLM:
    """A loaded model ready to generate.

    ``LLM(model, **engine_args)``: ``model`` and the keyword arguments are the fields of
    :class:`~dsv4.engine.config.EngineConfig` (each documented there, and checked when it is built):
    ``device``, ``dtype``, ``qat_sim``, ``max_num_seqs``, ``max_model_len``,
    ``max_num_batched_tokens``, ``long_prefill_token_threshold``, ``tensor_parallel_size``,
    ``prefill_decode_steps``, ``enforce_eager``, ``warm_up``, ``gpu_memory_utilization``, ``threads``,
    ``load_mtp``,
    ``enable_prefix_caching``, ``prefix_cache_gib``,
    ``speculative_config`` (see :mod:`dsv4.engine.speculative`: greedy requests give exactly the tokens
    of plain decoding, sampled ones the same distribution); the CLI's
    flags of the same names set the same fields. ``model`` is a checkpoint directory, or ``None`` /
    ``"tiny"`` / ``"tiny:nvfp4"`` / ``"tiny:bf16"`` for the embedded tiny model. The config is
    ``self.engine_config``.

    Besides them:
        progress: print the state size, a loading progress bar and the load summary on stderr.
        require_tokenizer: refuse a checkpoint without ``tokenizer.json`` (before reading weights).

    With ``tensor_parallel_size`` N, this process is rank 0 and starts the others; :meth:`close`
    (or the end of a ``with`` block) stops them. Under ``torchrun`` the group comes from its
    environment instead, and on ranks other than 0 the constructor follows rank 0 until it closes,
    then exits the process (see :mod:`dsv4.engine.launch`). ``threads`` is a process-wide setting:
    :meth:`close` puts back the previous one.

    Every argument is checked (:func:`plan_engine`: limits against the config and the free memory)
    before any weight is read.
    """

    def __init__(self, model: str | Path | None = None, *, progress: bool = True, require_tokenizer: bool = False,
                 **engine_args):
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - names)
        if unknown:
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r} (its engine arguments are "
                            f"EngineConfig's fields: {', '.join(sorted(names - {'model'}))})")
        engine = EngineConfig(model=model, **engine_args)
        plan = plan_engine(engine, require_tokenizer=require_tokenizer)
        self.engine_config = engine
        self.path, self.max_model_len, self.max_num_seqs = plan.path, plan.max_model_len, plan.max_num_seqs
        dev = plan.device
        if progress:
            cache = (f"; prefix cache {format_bytes(plan.prefix_cache_bytes)}" if plan.prefix_cache_bytes
                     else "; prefix caching off")
            print(f"state: {self.max_num_seqs} x {self.max_model_len:,} positions, {format_bytes(plan.state_bytes)} "
                  f"on {dev}{cache}", file=sys.stderr)
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(self.path) if plan.has_tokenizer else None
        self.qat_sim = plan.qat_sim
        self.speculative = plan.speculative
        self.prefix_cache_bytes = plan.prefix_cache_bytes
        self.tensor_parallel_size = plan.world_size
        self.device, self.threads = dev, engine.threads
        self._group = None
        self._restore_threads = apply_threads(engine.threads, announce=progress)  # before the ranks copy it
        try:
            self._load(plan, progress)
        except BaseException:   # a failed load leaves the process as it found it
            self._restore_threads()
            raise

    @classmethod
    def from_config(cls, engine: EngineConfig, **kwargs) -> "LLM":
        """``LLM`` for an :class:`EngineConfig` (``kwargs``: ``progress``, ``require_tokenizer``)."""
        args = {f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)}
        return cls(args.pop("model"), **args, **kwargs)

    def _load(self, plan: EnginePlan, progress: bool) -> None:
        """Load the weights (this rank's, or start the group), capture, warm up, build the engine."""
        engine, dev = plan.engine, plan.device
        spec = RankSpec(str(self.path), dev.type, plan.dtype, self.qat_sim, self.max_num_seqs, self.max_model_len,
                        plan.load_mtp, torch.get_num_threads() if dev.type == "cpu" else None,
                        engine.max_num_batched_tokens, self.prefix_cache_bytes, self.speculative)
        if plan.world_size == 1:
            net, report = load_model(self.path, dev, plan.dtype, load_mtp=plan.load_mtp, progress=progress)
            runner = Runner(net, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            qat_sim=self.qat_sim, max_num_batched_tokens=engine.max_num_batched_tokens,
                            prefix_cache_bytes=self.prefix_cache_bytes, speculative=self.speculative)
        else:
            runner, report = self._start_group(spec, plan.world_size, progress)
        self.load_report: LoadReport = report
        if progress:
            print(self.load_report.one_line(), file=sys.stderr)
        self.model: torch.nn.Module = runner.model
        self.config: ModelConfig = runner.model.config
        self.runner = runner
        if dev.type == "cuda" and engine.warm_up and plan.world_size == 1:
            # the kernels of the capture and the warm-up, compiled side by side first (one process:
            # a tensor-parallel group's ranks run their forwards' collectives in lockstep)
            self.runner.precompile(graphs=not engine.enforce_eager, progress=progress)
        if dev.type == "cuda" and not engine.enforce_eager:
            self.runner.capture(progress=progress)
            if self.speculative is not None and plan.world_size == 1:
                self.runner.capture_verify(progress=progress)
        if dev.type == "cuda" and engine.warm_up:     # Triton compiles now, not in the middle of serving
            self.runner.warm_up(progress=progress)
        self.engine = Engine(self.runner, self.tokenizer, self.config.eos_token_id,
                             long_prefill_token_threshold=engine.long_prefill_token_threshold,
                             prefill_decode_steps=engine.prefill_decode_steps)

    # ------------------------------------------------------------------ tensor parallel
    def _start_group(self, spec: RankSpec, world: int, progress: bool):
        """Rank 0's side of a tensor-parallel group: start (or join) it, load this rank's shard, and
        wrap the runner so that every call is broadcast to the followers first."""
        from ..parallel import init_parallel
        from .distributed import ParallelRunner
        from .launch import SpawnedGroup, build_runner, check_gpus, serve_as_follower, torchrun_world_size

        if torchrun_world_size() > 1:
            check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", world)), spec.device_type)   # this node's ranks
            tp = init_parallel(device=None if spec.device_type == "cuda" else "cpu")
            if tp.rank != 0:             # a torchrun follower: serve rank 0, then leave
                try:
                    serve_as_follower(spec, tp)
                finally:
                    tp.close()
                sys.exit(0)
            health = None
        else:
            if progress:
                print(f"tensor parallel: starting {world - 1} more rank(s) on "
                      f"{'cuda:1..' + str(world - 1) if spec.device_type == 'cuda' else 'the CPU (gloo)'}",
                      file=sys.stderr)
            self._group = SpawnedGroup(spec, world)
            tp, health = self._group.tp, self._group.check_alive
        try:
            runner, report = build_runner(spec, tp, progress)
        except BaseException:
            if self._group is not None:
                self._group.terminate()
            tp.close()
            raise
        return ParallelRunner(runner, tp, health=health), report

    def close(self) -> None:
        """Release the other ranks of a tensor-parallel group (no-op for one rank) and put back
        torch's previous thread count. Idempotent."""
        restore, self._restore_threads = getattr(self, "_restore_threads", None), lambda: None
        if restore is not None:
            restore()
        close = getattr(self.runner, "close", None) if hasattr(self, "runner") else None
        broken = getattr(self.runner, "broken", False) if close is not None else False
        try:
            if close is not None:
                close()
        finally:
            if self._group is not None:
                if broken:              # interrupted mid-step: the followers cannot be told to stop
                    self._group.terminate()
                self._group.close()
                self._group = None
            elif close is not None:
                self.runner.tp.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        """Generate for every prompt, yielding a :class:`StreamEvent` per request per token.

        All prompts go through the engine's continuous batching: up to ``max_num_seqs`` run at once
        and a finished request's slot is taken by the next one in the same step. Every prompt is
        checked (and refused with a named error) before any is started.
        """
        prompts = prompt_list(prompts, "LLM.stream_many")
        params = params_list(params, len(prompts), "LLM.stream_many")
        return self._stream_many(prompts, params)

    def _stream_many(self, prompts: list, params: list[SamplingParams]) -> Iterator[StreamEvent]:
        ids = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]
        for i, (p, sp) in enumerate(zip(ids, params)):
            try:
                self.engine.scheduler.check(p, sp)
            except RequestError as e:
                raise type(e)(f"prompt {i}: {e}") from None
        index = {}
        try:
            for i, (p, sp) in enumerate(zip(ids, params)):
                index[self.engine.add_request(p, sp)] = i
            remaining = set(index)
            while remaining:
                for out in self.engine.step():
                    if out.request_id not in remaining:
                        continue
                    token = out.new_token_ids[-1] if out.new_token_ids else None
                    yield StreamEvent(index[out.request_id], out.new_text, token, out.finished, out.output)
                    if out.finished:
                        remaining.discard(out.request_id)
        finally:   # a caller that stops iterating (or an error) must not leave requests running
            for rid in index:
                self.engine.abort(rid)
            while self.engine.has_unfinished:
                self.engine.step()

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Generate for one prompt or a list of prompts (text or token ids); one params object for
        all or one per prompt."""
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

