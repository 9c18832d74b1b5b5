"""What one engine step asks of the runner: a :class:`ScheduledBatch` of rows (DESIGN decision 6).

Each row is one slot's new tokens at its current length: a prompt chunk of any length, or one decode
token (the slot's last sampled id, which stays on the device). The scheduler fills one token budget
with such rows; the runner runs them as one forward and samples every row whose prompt is complete.
Plain host data (ints, tuples, :class:`SamplingParams`): under tensor parallel the whole batch is the
one plan rank 0 broadcasts per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import SampleOutput, SamplingParams


@dataclass(frozen=True)
class CachedPrefix:
    """A prefix-cache hit (:mod:`dsv4.engine.prefix_cache`): the first ``length`` tokens' state is
    in the cache's pages, ``blocks`` (one per block, in order) and ``tail``; ``keys`` are the
    blocks' ids (host bookkeeping)."""

    length: int
    blocks: tuple[int, ...]
    tail: tuple[int, ...]
    keys: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Save:
    """Copy ``slot``'s state into prefix-cache pages after the step's forward: the entries of blocks
    ``first_block ..`` into ``blocks`` (one page each) and, with ``tail``, the window pieces."""

    slot: int
    first_block: int
    blocks: tuple[int, ...]
    tail: tuple[int, ...]
    #: in a step of several decode steps (:attr:`ScheduledBatch.decode_steps`): run after this one
    #: (0-based) of them, where the slot's decode row reaches the block boundary; None: after the forward
    decode_step: int | None = None


@dataclass(frozen=True)
class NewSequence:
    """A row that starts a sequence: the slot is emptied and takes these sampling parameters (the
    whole prompt is needed for the repetition penalties). ``cached``: the slot first gets this
    cached prefix's state, and the row starts at its end. ``stop_ids``: the ids that would stop the
    sequence (EOS unless ``ignore_eos``, its ``stop_token_ids``), which ``min_tokens`` holds back;
    None: its ``stop_token_ids``."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]
    cached: CachedPrefix | None = None
    stop_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Row:
    """One slot's share of a step.

    ``token_ids``: the prompt tokens this step feeds, or ``None`` for a decode row (one token: the
    slot's last sampled id, on the device). ``start``: the slot's length before this row (the
    runner checks it against its own count). ``sample``: draw the slot's next token from the row's
    last position. ``logits``: also return the fp32 logits of every position of the row (prompt
    logprobs, tests). ``new``: set on the first row of a sequence (``start`` 0).
    """

    slot: int
    start: int
    token_ids: tuple[int, ...] | None = None
    sample: bool = True
    logits: bool = False
    new: NewSequence | None = None
    #: a verify row (speculative decoding): a decode row that also feeds these draft tokens (host)...
    draft: tuple[int, ...] = ()
    #: ... or this many drafts from the runner's device buffer (the MTP block's)
    device_draft: int = 0
    #: speculative MTP: the prompt token after a chunk that does not sample (the MTP block's input)
    next_token: int | None = None

    @property
    def num_tokens(self) -> int:
        return 1 + len(self.draft) + self.device_draft if self.token_ids is None else len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.token_ids is None

    @property
    def is_verify(self) -> bool:
        return self.token_ids is None and self.num_tokens > 1


@dataclass(frozen=True)
class ScheduledBatch:
    """The rows of one step, each slot at most once; ``saves`` run after its forward.

    ``decode_steps`` > 1: every decode row (plain, sampled) takes that many decode steps, each a
    replay of the captured decode step launched ahead of the other rows' forward, so the GPU decodes
    while the host launches that eager forward (its launch time is the same tens of ms for a short
    chunk as for a long one); each such row emits ``decode_steps`` tokens."""

    rows: tuple[Row, ...]
    saves: tuple[Save, ...] = ()
    decode_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def decode_only(self) -> bool:
        """Every row is a sampled decode row without logits: the step a captured graph replays."""
        return all(r.is_decode and not r.is_verify and r.sample and not r.logits and r.new is None
                   for r in self.rows)


@dataclass
class StepOutput:
    """What :meth:`Runner.run` returns: the sampled ids of the rows with ``sample`` (in row order;
    device tensors, valid until the next step), and the logits ``[n, vocab]`` of each row with
    ``logits``, by row index."""

    sampled: SampleOutput | None
    logits: dict[int, object]
    #: a step whose rows emit several tokens (verify rows; decode rows of a step of several decode
    #: steps): how many tokens each sampled row emits (host ints, in row order); ``sampled`` then
    #: holds ``[N, n]`` ids (logprobs ``[N, n]``, top ``[N, n, t]``), the first ``emitted[i]`` of row
    #: ``i`` valid
    emitted: list[int] | None = None
