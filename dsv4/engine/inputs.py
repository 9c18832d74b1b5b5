"""What callers hand to :class:`~dsv4.engine.llm.LLM`, checked before any work starts.

A prompt is text (``str``) or token ids (a list/tuple of ints, or a 1-D integer tensor); a batch is
a list of prompts; sampling parameters are one :class:`SamplingParams` or one per prompt. A wrong
type is a ``TypeError`` naming the argument and what it got (``LLM.generate: `params` must be a
SamplingParams ..., got dict``), never an error from deep inside the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import RequestError
from .sampling import SamplingParams

Prompt = str | Sequence[int]


def _kind(value: Any) -> str:
    """``list of str``, ``dict``, ... for messages."""
    if isinstance(value, (list, tuple)) and value:
        inner = sorted({type(v).__name__ for v in value})
        return f"{type(value).__name__} of {'/'.join(inner)}"
    return type(value).__name__


def _is_ids(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 1 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def is_prompt(value: Any) -> bool:
    """True for text or a sequence of token ids."""
    return isinstance(value, str) or _is_ids(value)


def prompt_list(prompts: Any, where: str) -> list[Prompt]:
    """``prompts`` as a list of prompts: one prompt (text or ids) or a list of them."""
    if isinstance(prompts, str) or (_is_ids(prompts) and len(prompts) > 0):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        for i, p in enumerate(prompts):
            if not is_prompt(p):
                raise TypeError(f"{where}: `prompts[{i}]` must be a str or a list of token ids (ints), "
                                f"got {_kind(p)}")
        return list(prompts)
    raise TypeError(f"{where}: `prompts` must be a str, a list of token ids, or a list of those, "
                    f"got {_kind(prompts)}")


def single_prompt(prompt: Any, where: str) -> Prompt:
    """``prompt`` checked to be exactly one prompt."""
    if is_prompt(prompt):
        return prompt
    hint = ""
    if isinstance(prompt, (list, tuple)) and prompt and all(is_prompt(p) for p in prompt):
        hint = " (for several prompts use LLM.stream_many or LLM.generate)"
    raise TypeError(f"{where}: `prompt` must be a str or a list of token ids (ints), got {_kind(prompt)}{hint}")


def params_list(params: Any, n: int, where: str) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt from ``None``, one params object, or a list of them."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
        if len(params) != n:
            raise RequestError(f"{where}: {n} prompts but {len(params)} SamplingParams")
        return list(params)
    hint = " (build one with SamplingParams(**params))" if isinstance(params, dict) else ""
    raise TypeError(f"{where}: `params` must be a SamplingParams or a list of them, got {_kind(params)}{hint}")


def check_text(prompt: str, index: int) -> None:
    """Refuse text the tokenizer cannot take (lone surrogates, e.g. undecodable bytes kept by
    ``surrogateescape``), naming the prompt and offset."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"prompt {index} is not valid Unicode text: lone surrogate {prompt[e.start]!r} at "
                           f"offset {e.start} (decode bytes with errors='replace')") from None
