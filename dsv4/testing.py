"""Logits-returning steps for tests and benchmarks, built on the runner's one verb, :meth:`Runner.run`.

The engine never needs a slot's logits outside a step, so the runner has no verb for them; tests
(decode == prefill, parity with transformers, chunking) and benchmarks do. Each function here is one
or more :class:`~dsv4.engine.batch.ScheduledBatch` steps whose rows ask for their logits and sample
nothing, so they run the same varlen forward as serving does. Production code does not import this
module (``tests/test_testing_helpers.py`` checks).

    prefill(runner, 0, [5, 6, 7])                 # -> logits of the last token [vocab]
    decode(runner, [0], torch.tensor([9]))        # -> logits [1, vocab]
    generate(engine, [(ids, params), ...])        # -> each request's final output, in order
    generate_arriving(engine, [[req, ...], [], [req], ...])   # -> outputs by index; arrivals over steps

``runner`` may be a :class:`~dsv4.engine.runner.Runner` or a tensor-parallel
:class:`~dsv4.engine.distributed.ParallelRunner` (whose ``run`` reaches every rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .engine.batch import NewSequence, Row, ScheduledBatch
from .engine.sampling import SamplingParams


def _length(runner, slot: int) -> int:
    """The slot's length (0 for a slot out of range: the step then refuses it, naming the slot)."""
    return runner.lengths[slot] if 0 <= slot < runner.max_num_seqs else 0


def _ids(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.flatten().tolist()
    return [int(t) for t in token_ids]


@torch.inference_mode()
def prefill(runner, slot: int, token_ids: Sequence[int] | torch.Tensor, all_logits: bool = False,
            chunk: int | None = None, new: bool = False) -> torch.Tensor:
    """Append ``token_ids`` to ``slot`` in steps of at most ``chunk`` tokens (default the runner's
    ``max_num_batched_tokens``); return the fp32 logits of the last token ``[vocab]``, or of every token
    ``[n, vocab]`` with ``all_logits``. Samples nothing (the slot's next input is unchanged).
    ``new``: empty the slot first, as a step does (so on every rank of a tensor-parallel runner)."""
    ids = _ids(token_ids)
    if not ids:
        raise ValueError("prefill needs at least one token")
    chunk = chunk or runner.max_num_batched_tokens
    outs = []
    for lo in range(0, len(ids), chunk):
        first = NewSequence(SamplingParams(temperature=0.0), tuple(ids)) if new and lo == 0 else None
        start = 0 if first else _length(runner, slot)
        row = Row(slot, start, tuple(ids[lo:lo + chunk]), sample=False, logits=True, new=first)
        outs.append(runner.run(ScheduledBatch((row,))).logits[0])
    return torch.cat(outs) if all_logits else outs[-1][-1]


@torch.inference_mode()
def decode(runner, slots: Sequence[int], token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Feed one given token to each of ``slots`` (any mix of positions), in one step; return the fp32
    logits ``[len(slots), vocab]``. Samples nothing."""
    ids = _ids(token_ids)
    if len(ids) != len(slots):
        raise ValueError(f"decode got {len(ids)} token ids for {len(slots)} slots")
    rows = tuple(Row(s, _length(runner, s), (t,), sample=False, logits=True) for s, t in zip(slots, ids))
    out = runner.run(ScheduledBatch(rows))
    return torch.stack([out.logits[i][0] for i in range(len(rows))])


def generate_arriving(engine, arrivals: Sequence[Sequence[tuple[Sequence[int], SamplingParams]]]) -> dict:
    """Add the requests ``arrivals[k]`` before the engine's step k, then step until nothing is left;
    each request's final :class:`~dsv4.engine.core.CompletionOutput` by its index in the flattened
    arrivals (staggered arrivals: requests admitted while others decode)."""
    ids, done, k = {}, {}, 0
    while k < len(arrivals) or engine.has_unfinished:
        if k < len(arrivals):
            for prompt, params in arrivals[k]:
                ids[engine.add_request(prompt, params)] = len(ids)
            k += 1
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.output
    return done


def generate(engine, requests: Sequence[tuple[Sequence[int], SamplingParams]], **add_kwargs) -> list:
    """Add ``(prompt_ids, params)`` requests to an :class:`~dsv4.engine.core.Engine` (``add_kwargs``
    go to ``add_request``), step it until nothing is left, and return each request's final
    :class:`~dsv4.engine.core.CompletionOutput` in the order given."""
    ids = [engine.add_request(p, params, **add_kwargs) for p, params in requests]
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output
    return [done[i] for i in ids]
