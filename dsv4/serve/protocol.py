"""The OpenAI wire format as pydantic models: requests, responses, errors (the server's OpenAPI
schema is generated from these).

Requests accept OpenAI's fields plus the usual engine extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``chat_template_kwargs``).
Unknown fields are accepted and logged (SDKs send fields we do not use), except vLLM's fields this
server does not implement, which are refused by name when a request asks for them
(``dsv4.serve.app``); values are range-checked here, so a bad value is a 400 naming the field before
anything runs. Streamed chunks are plain dicts built in the serving modules (their keys mirror the
models below).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import MAX_ALLOWED_TOKEN_IDS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

MAX_N = 128          # choices per prompt
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------ errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo


# ------------------------------------------------------------------ shared
class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk carries the "
                                                            "usage so far")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(None, description='{"name", "schema", "strict"} (json_schema)')


class StructuredOutputs(_Request):
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Request):
    """Sampling fields shared by completions and chat."""

    model: str | None = Field(None, description="a served model name (default: the first one)")
    n: int = Field(1, ge=1, le=MAX_N, description="choices to generate for each prompt")
    temperature: float | None = Field(None, ge=0, le=100, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = Field(None, description="up to 16 strings that end generation")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(False, description="vLLM's: keep the stop string (or stop token's "
                                                                "text) that ended the output at its end")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="vLLM's: keep only the last N prompt tokens "
                                                                        "(-1: max_model_len)")
    skip_special_tokens: bool = Field(True, description="leave special tokens (<｜User｜>, EOS, ...) out of the "
                                                        "returned text (vLLM's default)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string, as OpenAI sends it) -> a number in [-100, 100] added to its logit")
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
                                                description="vLLM's: only these token ids may be drawn")
    min_tokens: int = Field(0, ge=0, description="vLLM's: at least this many tokens before EOS, a stop token id or "
                                                 "a stop string may end the output")
    user: str | None = None
    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: the output is valid JSON (matching the schema), enforced")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extra: json (a schema), regex, choice, grammar (Lark or GBNF) or json_object")
    thinking_token_budget: int | None = Field(
        None, ge=0, description="thinking mode: at most this many reasoning tokens, then </think> is forced")
    cache_salt: str | None = Field(None, max_length=256, description="vLLM's: the prefix cache is shared only "
                                   "between requests with the same salt (none: shared by all)")


# ------------------------------------------------------------------ /v1/completions
class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="a string, a list of strings, token ids, or a list of token-id lists")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo (the prompt's logprobs)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="must equal n when given")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM's: the stop string or stop token id that ended "
                                                            "the output (None: the end token or max_tokens)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


# ------------------------------------------------------------------ /v1/chat/completions
class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(..., min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = Field(None, description="high or max (turns thinking on)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='{"thinking": true} turns thinking mode on')
    thinking: bool | dict[str, Any] | None = Field(
        None, description='DeepSeek API style: {"type": "enabled"} or {"type": "disabled"}')
    continue_final_message: bool = Field(False, description="vLLM's: the last (assistant) message is a prefix the "
                                                            "answer continues; needs add_generation_prompt: false")
    add_generation_prompt: bool = Field(True, description="vLLM's: false only with continue_final_message")


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="vLLM's: the stop string or stop token id that ended "
                                                            "the output (None: the end token or max_tokens)")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


# ------------------------------------------------------------------ models, tokenizer, health
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dsv4"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = Field(None, description="text to encode (or give messages)")
    messages: list[ChatMessage] | None = Field(None, description="a conversation, encoded as a chat prompt")
    add_special_tokens: bool = Field(True, description="prompt: add BOS")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str = "dsv4.Tokenizer"
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    model_max_length: int
    vocab_size: int


class Health(BaseModel):
    status: str
    running: int = 0
    waiting: int = 0
    slots_used: int = 0
    slots_total: int = 0
