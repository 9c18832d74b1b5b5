"""The engine loop: scheduler -> runner -> sampled ids -> text, one step at a time.

:class:`Engine` is what the Python API (:class:`dsv4.LLM`) and the server drive. ``add_request``
queues a tokenized prompt with its :class:`SamplingParams`; each :meth:`Engine.step` asks the
scheduler for a plan, runs its decode rows and prompt chunks as one runner step, and turns
the sampled ids into :class:`RequestOutput` deltas: new token ids, new text (incrementally
detokenized, never half a UTF-8 character, stop strings held back until they resolve), logprobs,
and the finish reason. A finished, stopped or aborted request frees its slot within the step.

Only the sampled ids of a step cross to the host. On a GPU the copy is started as soon as the step
is launched, and the host prepares the next step's plan while the device still runs this one: the
plan only needs what the host already knows (a request at ``max_tokens`` is not scheduled again).
A request that stops on a token or a stop string is seen one step late; the one extra token it was
given is dropped. A constrained request's next mask needs its previous token: a step with one
launches its forward first, then collects the previous step and stages the masks while the device
runs that forward, then launches its sampler, so constrained decoding keeps the overlap too.
``overlap`` (on for CUDA) may be set on the CPU to run this schedule in tests.

A failure inside one request's output handling (say its detokenizer raises) ends that request
alone with reason ``error``; the others keep going.

What a front end (the server's engine thread) may use is the public part: ``check``,
``add_request``, ``abort``, ``step``, ``has_unfinished``, ``fail_all``, ``stats`` and the read-only
sizes ``vocab_size``, ``max_num_seqs``, ``max_model_len``. The scheduler, the per-request output
state and the steps in flight are the engine's own.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import ContextOverflowError, RequestError
from ..text.tokenizer import IncrementalDetokenizer, Tokenizer
from .batch import NewSequence, Row, Save, ScheduledBatch
from .grammar import Constraint, GrammarCompiler
from .prefix_cache import CacheStats, Pending, PrefixCache
from .runner import Runner
from .sampling import SampleOutput, SamplingParams, StopChecker
from .scheduler import Request, Scheduler, StepPlan
from .speculative import Acceptance, SpecPolicy, SpecStats, ngram_propose, verify_cost_ratio


#: ``prefill_decode_steps`` unset: with CUDA graphs, the decode rows of a step whose prompt chunks
#: hold at most ``AUTO_DECODE_STEPS_MAX_CHUNK`` tokens take this many decode steps (graph replays
#: launched before the chunks). Such a step's eager forward is launch-bound: on an H100 (Flash x4
#: slice, bench/profile_mixed.py, 2026-11-27) launching it takes the host 28-32 ms at any chunk
#: size, while the chunk's kernels take 13 ms (64 tokens) to 22 ms (512) and 37 ms (2048, where it
#: turns GPU-bound) and a decode replay of 16 rows ~4.5 ms: four replays fill the GPU's idle time
#: of a short chunk's step instead of giving each running request one token. A fixed count, not a
#: live measurement, so that the same requests make the same steps (and tokens) run after run.
AUTO_DECODE_STEPS = 4
AUTO_DECODE_STEPS_MAX_CHUNK = 1024


@dataclass
class CompletionOutput:
    """One request's generation so far (cumulative). Times in seconds from its arrival."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id (of ``stop_token_ids``) that ended it, else None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: with ``SamplingParams.prompt_logprobs``: each prompt token's logprob (None for the first) and
    #: the top alternatives at its position; complete when the first output arrives
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    error: str | None = None
    #: speculative decoding: this request's acceptance (verify rows, drafts, accepted, per position)
    spec_decode: SpecStats | None = None
    #: prompt tokens whose state came from the prefix cache (not prefilled)
    num_cached_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Output tokens per second after the first (None when there was no second token)."""
        span = self.total_time - self.time_to_first_token
        return (len(self.token_ids) - 1) / span if len(self.token_ids) > 1 and span > 0 else None


@dataclass
class RequestOutput:
    """What one step produced for one request: the delta, and the cumulative output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    output: CompletionOutput

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason


@dataclass
class EngineStats:
    """How full the engine is right now (:meth:`Engine.stats`)."""

    running: int          # requests holding a slot
    waiting: int          # requests queued for a slot
    slots_used: int
    slots_total: int
    prefix_cache: CacheStats | None = None   # None: prefix caching off
    spec_decode: SpecStats | None = None      # None: speculative decoding off


class _Track:
    """Host-side output state of one request: detokenizer, stop checker, the output."""

    def __init__(self, request: Request, tokenizer: Tokenizer | None, eos_id: int, detokenize: bool,
                 skip_special_tokens: bool = True):
        self.request = request
        self.out = CompletionOutput(prompt_token_ids=request.prompt_ids)
        if request.params.logprobs is not None:
            self.out.logprobs, self.out.top_logprobs = [], []
        if request.params.prompt_logprobs is not None:
            self.out.prompt_logprobs, self.out.prompt_top_logprobs = [None], [[]]
        self.detok = (IncrementalDetokenizer(tokenizer, request.prompt_ids, skip_special_tokens=skip_special_tokens)
                      if tokenizer is not None and detokenize else None)
        # max_tokens is the scheduler's (it must not schedule past it); stops are ours
        p = request.params
        self.stops = StopChecker(p.stop, p.stop_token_ids, eos_id, p.ignore_eos, None, p.min_tokens,
                                 p.include_stop_str_in_output)
        self.pending = 0          # tokens launched on the device, not yet seen on the host
        self.constraint: Constraint | None = None     # the grammar / thinking budget, if any
        self.acceptance: Acceptance | None = None      # speculative decoding: the policy's state


class _PinnedPool:
    """Reusable page-locked host buffers for the per-step device -> host copies (allocating pinned
    memory every step would cost more than the copy)."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def copy(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        key = (tuple(t.shape), t.dtype)
        pool = self.free.setdefault(key, [])
        buf = pool.pop() if pool else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return buf.copy_(t, non_blocking=True)

    def release(self, sampled: SampleOutput) -> None:
        top = sampled.top_logprobs or ()
        for t in (sampled.token_ids, sampled.logprobs, *top):
            if t is not None:
                self.free.setdefault((tuple(t.shape), t.dtype), []).append(t)


class Engine:
    """Continuous batching over one model: ``max_num_seqs`` slots of ``max_model_len`` positions."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer | None, eos_id: int, *,
                 long_prefill_token_threshold: int = 0, prefill_decode_steps: int | None = None):
        self.runner, self.tokenizer, self.eos_id = runner, tokenizer, eos_id
        if prefill_decode_steps is not None and prefill_decode_steps < 1:
            raise ValueError(f"prefill_decode_steps must be >= 1 or None, got {prefill_decode_steps}")
        #: decode steps the running requests take in a step with prompt chunks (None: AUTO_DECODE_STEPS
        #: with CUDA graphs when the chunks are short, else 1; see EngineConfig.prefill_decode_steps)
        self.prefill_decode_steps = prefill_decode_steps
        # one step's tokens (decode rows + prompt chunks) run as one forward of at most the runner's
        # max_num_batched_tokens; one prompt's chunk may fill what decodes leave, or the threshold
        budget = runner.max_num_batched_tokens
        if budget <= runner.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({budget}) must exceed max_num_seqs ({runner.max_num_seqs})")
        store = runner.prefix_store
        #: the prefix cache's index (None: caching off); its pages live in the runner
        self.prefix_cache = (PrefixCache(store.block, store.num_pages, store.tail_pages, store.page_bytes)
                             if store is not None else None)
        self.scheduler = Scheduler(runner.max_num_seqs, runner.max_model_len, budget, long_prefill_token_threshold,
                                   prefix_cache=self.prefix_cache, snapshots=store.snapshots if store else 0)
        self.tracks: dict[str, _Track] = {}
        self._ids = itertools.count()
        self._inflight: list[tuple[list[_Track], SampleOutput, torch.cuda.Event | None, list[int] | None]] = []
        #: speculative decoding (the runner's config): verify rows instead of decode rows, and the
        #: acceptance over all requests
        self.speculative = runner.speculative
        self.spec_stats = SpecStats()
        #: n-gram drafts: ``propose(request) -> k ids or None`` (None: a plain decode row); tests inject
        #: drafts of a chosen quality here
        self.propose = self._ngram_draft
        #: when a request speculates (its acceptance against the verify step's cost, probes); on
        #: where its cost table was measured, CUDA graph replays (eager steps, on the CPU or with
        #: enforce_eager, cost otherwise); None: every step it can
        self.spec_policy = SpecPolicy() if self.speculative is not None and runner.use_graphs else None
        self._spec_step = 0                 # engine steps with decode rows (the probe schedule)
        self._verified = False              # the last step had verify rows
        #: steps of decode rows only are all verify or all plain rows (None: when the runner has
        #: verify graphs, which replay steps of one kind)
        self.one_kind_steps: bool | None = None
        if self.speculative is not None:
            self.scheduler.decode_tokens = 1 + self.speculative.k
        # the next plan needs the host to know this step's tokens when verify rows keep a varying count
        # (with speculation only while no request verifies: see _may_verify)
        self.overlap = runner.device.type == "cuda"
        self._pinned = _PinnedPool()
        self._collected: list[RequestOutput] = []       # outputs of steps collected inside a step's launch
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size) if tokenizer is not None else None

    # ------------------------------------------------------------------ sizes (read-only)
    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    @property
    def max_num_seqs(self) -> int:
        """Requests that can run at once (``max_num_seqs``)."""
        return self.runner.max_num_seqs

    @property
    def max_model_len(self) -> int:
        """Positions per request, prompt and output together."""
        return self.runner.max_model_len

    # ------------------------------------------------------------------ requests
    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise a :class:`RequestError` naming the problem (a :class:`ContextOverflowError` when
        it is too long) if this request can never run; changes nothing. Safe from any thread."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        self._check_ids(prompt_ids)
        if len(prompt_ids) >= self.max_model_len:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len} (the prompt "
                "and at least one generated token must fit)")
        self.scheduler.check(list(prompt_ids), params)
        for what, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"{what}: token ids outside [0, {self.vocab_size}): {sorted(bad)[:5]}", param=what)
        stops = StopChecker.from_params(params, self.eos_id).stop_ids
        if params.allowed_token_ids and params.min_tokens and set(params.allowed_token_ids) <= stops:
            raise RequestError("allowed_token_ids: every allowed id stops the request, so min_tokens leaves none "
                               "to draw", param="allowed_token_ids")
        if params.structured_outputs is not None:      # the grammar decides which ids may come, and the end
            for what, given in (("min_tokens", params.min_tokens), ("allowed_token_ids", params.allowed_token_ids)):
                if given:
                    raise RequestError(f"{what} and structured outputs: the grammar decides which tokens may come "
                                       "and where the answer ends; give one of them", param=what)
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise RequestError("structured outputs need a tokenizer", param=params.structured_outputs.param)
            self.grammars.check(params.structured_outputs)

    def _check_ids(self, ids: Sequence[int]) -> None:
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids outside [0, {vocab}): {bad[:5]}")

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    detokenize: bool = True, skip_special_tokens: bool = True, cache_salt: str | None = None) -> str:
        """Queue a tokenized prompt; returns its request id. Raises a ``RequestError`` naming the
        problem (and changes nothing) when the request can never run.

        ``skip_special_tokens=False`` keeps special tokens (``</think>``, DSML) in the output text,
        which the chat parser needs; stop strings are then matched against that text. ``cache_salt``:
        the request shares cached prefixes only with requests of the same salt (vLLM's)."""
        ids = [int(t) for t in prompt_ids]
        self._check_ids(ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(rid, ids, params, cache_salt=cache_salt)
        track = _Track(request, self.tokenizer, self.eos_id, detokenize, skip_special_tokens)
        if params.constrained:
            if self.grammars is None:
                raise RequestError("structured outputs need a tokenizer", param="structured_outputs")
            limit = min(params.max_tokens, self.max_model_len - len(ids))
            track.constraint = self.grammars.constraint(params, ids, limit)     # a bad grammar raises here
        self.scheduler.add(request)
        self.tracks[rid] = track
        if self.speculative is not None:
            track.out.spec_decode = SpecStats()
            track.acceptance = (self.spec_policy or SpecPolicy()).start(self.speculative.k)
        return rid

    def prepare_grammars(self) -> None:
        """Start building what constrained decoding needs for this tokenizer (about two seconds for a
        129K vocabulary) on a thread; otherwise the first constrained request builds it."""
        if self.grammars is not None:
            self.grammars.prepare()

    def abort(self, request_id: str) -> None:
        """End a request (safe from any thread; takes effect at the next step)."""
        self.scheduler.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._inflight)

    def fail_all(self, reason: str = "error") -> list[str]:
        """End every request (running, waiting, or only still known to the output side) with
        finish reason ``reason`` and drop the steps in flight; returns the ended request ids. For
        a front end whose step raised: the engine's state of those requests is not to be trusted,
        the engine itself stays usable."""
        sched = self.scheduler
        ended = []
        for req in list(sched.running) + list(sched.waiting):
            sched.finish(req, reason)
            ended.append(req.request_id)
        for rid in list(self.tracks):
            self.tracks.pop(rid, None)
            if rid not in ended:
                ended.append(rid)
        self._inflight.clear()
        self._collected.clear()
        return ended

    def stats(self) -> EngineStats:
        """Running and waiting requests and slots in use, now (from the thread that steps)."""
        sched = self.scheduler
        cache = None if self.prefix_cache is None else dataclasses.replace(self.prefix_cache.stats)
        spec = None if self.speculative is None else dataclasses.replace(
            self.spec_stats, accepted_per_pos=list(self.spec_stats.accepted_per_pos or []))
        return EngineStats(len(sched.running), len(sched.waiting), self.max_num_seqs - len(sched.free_slots),
                           self.max_num_seqs, cache, spec)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Plan, launch and collect one step; returns the outputs that changed."""
        outputs: list[RequestOutput] = []
        if self._inflight and self._may_verify():
            # n-gram drafts and verify rows need the host to know every token: collect first (a
            # constrained row does not: its masks are staged between this step's forward and sampler)
            for tracks, sampled, event, emitted in self._inflight:
                outputs += self._collect(tracks, sampled, event, emitted)
            self._inflight = []
        plan = self._plan()
        for req in plan.finished:                      # aborted since the last step
            outputs.append(self._end(self.tracks[req.request_id], "abort"))
        launched = self._launch(plan)
        outputs += self._collected                     # collected while this step's forward ran
        self._collected = []
        # with overlap, collect the previous step while this one runs on the device
        ready = self._inflight[:-1] if (self.overlap and launched) else self._inflight
        keep = self._inflight[len(ready):]
        for tracks, sampled, event, emitted in ready:
            outputs += self._collect(tracks, sampled, event, emitted)
        self._inflight = keep
        return outputs

    def _plan(self) -> StepPlan:
        plan = self.scheduler.schedule()
        # a decode row whose previous token is still in flight and already reached max_tokens is
        # not run again (the host knows that count without waiting for the device)
        plan.decode = [r for r in plan.decode
                       if len(r.output_ids) + self.tracks[r.request_id].pending < r.params.max_tokens]
        return plan

    def _launch(self, plan: StepPlan) -> bool:
        """Run the plan as one runner step (decode rows first, then prompt chunks in arrival order);
        queue the sampled ids of the decode rows and of the prompts that completed. A step with a
        constrained row collects the steps in flight and stages the grammar masks while the device
        runs its forward (:meth:`_stage_masks`)."""
        rows, tracks, chunks, saves, published = [], [], {}, [], []
        cache = self.prefix_cache
        spec = self.speculative
        off = self._policy_off(plan)
        for req in plan.decode:
            track = self.tracks[req.request_id]
            row = self._decode_row(req, spec if self._may_draft(track) else None, off.get(req.request_id, False))
            rows.append(row)
            tracks.append(track)
        steps = self._decode_steps(plan, rows, tracks)
        for req, row in zip(plan.decode, rows):
            # a verify row's kept length is known after the step: decode-time saves are for plain rows
            for j in range(0 if cache is None or row.is_verify else steps):
                if (row.start + j + 1) % cache.block == 0:
                    found = self._save_decoded(req, (row.start + j + 1) // cache.block)
                    saves += [dataclasses.replace(sv, decode_step=j) for sv in found] if steps > 1 else found
        mtp = self.speculative is not None and self.speculative.method == "mtp"
        restored = []
        for chunk in plan.prefill:
            req = chunk.request
            new = None
            if chunk.first:
                new = NewSequence(req.params, tuple(req.prompt_ids), req.cached,
                                  tuple(sorted(self.tracks[req.request_id].stops.stop_ids)))
                restored.append(req)
                self.tracks[req.request_id].out.num_cached_tokens = req.num_cached_tokens
            end = chunk.start + len(chunk.token_ids)
            # the save boundaries this chunk reaches: its end, or inside it (the forward snapshots those)
            for q in [q for q in req.save_at if chunk.start < q <= end] if cache is not None else ():
                planned = cache.plan_save(req.slot, req.prompt_ids, q // cache.block, req.cache_salt)
                if planned is not None:
                    saves.append(planned[0])
                    published.append(planned[1])
                    req.saved_blocks = q // cache.block
                elif cache.has_tail(req.prompt_ids, q // cache.block, req.cache_salt):
                    req.saved_blocks = q // cache.block
            want_logits = req.params.prompt_logprobs is not None
            if want_logits:
                chunks[len(rows)] = chunk
            end = chunk.start + len(chunk.token_ids)
            rows.append(Row(req.slot, chunk.start, tuple(chunk.token_ids), sample=chunk.last, logits=want_logits,
                            new=new, next_token=req.prompt_ids[end] if mtp and not chunk.last else None))
            if chunk.last:
                tracks.append(self.tracks[req.request_id])
        if not rows:
            return False
        before_sample = None
        # the sampler applies masks when a row's params are constrained (SampleFlags.grammar), even
        # one without a Constraint (a thinking budget without thinking): every row gets a fresh one
        if any(t.request.params.constrained for t in tracks):
            sampled = [r for r in rows if r.sample]
            before_sample = lambda: self._stage_masks(sampled, tracks)   # noqa: E731
        batch = ScheduledBatch(tuple(rows), tuple(saves), steps)
        try:
            out = self.runner.run(batch) if before_sample is None else self.runner.run(batch, before_sample)
        except BaseException:
            for _, _, blocks, tail in published:      # planned saves that never ran
                cache.release(list(blocks) + list(tail))
            raise
        for req in restored:
            if req.cached is not None:
                cache.unref(req.cached)
                req.cached = None
        for p in published:
            cache.publish(*p)
        for i, logits in out.logits.items():
            _add_prompt_logprobs(self.tracks[chunks[i].request.request_id].out, chunks[i], logits)
        self._verified = any(r.is_verify for r in rows)
        if out.sampled is None:
            return False
        if out.emitted is not None:
            sampled_rows = [r for r in rows if r.sample]
            for track, row, n in zip(tracks, sampled_rows, out.emitted):
                if row.is_verify:
                    k = row.num_tokens - 1
                    self.spec_stats.add(k, n - 1)
                    track.out.spec_decode.add(k, n - 1)
                    if self.spec_policy is not None:
                        self.spec_policy.verified(track.acceptance, n - 1)
        if mtp and (batch.decode_only or steps > 1):
            # a plain decode step does not run the MTP block: these rows' drafts are now stale
            for track, row in zip(tracks, [r for r in rows if r.sample]):
                if row.is_decode:
                    track.acceptance.stale = True
        self._queue(tracks, out.sampled, out.emitted)
        return True

    def _decode_steps(self, plan: StepPlan, rows: list[Row], tracks: list[_Track]) -> int:
        """How many decode steps the decode rows take in this step: 1, unless the step also runs
        prompt chunks, every decode row is a plain row and no sampled row is constrained (a mask per
        token needs the host between tokens); then ``prefill_decode_steps`` (None: see
        :data:`AUTO_DECODE_STEPS`), no more than any decode row's context allows nor than the most
        tokens a decode row still wants."""
        if not plan.prefill or not rows or any(r.is_verify for r in rows):
            return 1
        if any(t.request.params.constrained for t in tracks) or \
                any(c.last and c.request.params.constrained for c in plan.prefill):
            return 1
        n = self.prefill_decode_steps
        if n is None:
            short = sum(len(c.token_ids) for c in plan.prefill) <= AUTO_DECODE_STEPS_MAX_CHUNK
            n = AUTO_DECODE_STEPS if self.runner.use_graphs and short else 1
        room = min(self.runner.max_model_len - r.start for r in rows)
        wanted = max(req.params.max_tokens - len(req.output_ids) - self.tracks[req.request_id].pending
                     for req in plan.decode)
        return max(1, min(n, room, wanted))

    def _stage_masks(self, rows: list[Row], tracks: list[_Track]) -> None:
        """Between a step's forward and its sampler: collect the steps still in flight (a mask needs
        its request's previous token; the device meanwhile runs this step's forward), then write
        and upload each sampled row's mask, a verify row's one per position (its drafts accepted
        before each: :meth:`Constraint.draft_masks`; its request has no token in flight). A request
        that ended on a collected token gets an all-allowed row: its token in this step is dropped."""
        for tracks_, sampled, event, emitted in self._inflight:
            self._collected += self._collect(tracks_, sampled, event, emitted)
        self._inflight = []
        self.runner.sampling.bitmask.stage(
            [(r.slot, None if t.request.finished else t.constraint) for r, t in zip(rows, tracks)],
            {r.slot: r.draft for r in rows if r.is_verify})

    def _may_draft(self, track: _Track) -> bool:
        """Whether a request may get verify rows: any with n-gram drafts (the host has them before it
        stages the masks of every draft position); a constrained one with MTP drafts decodes plainly
        (its drafts are on the device, and the masks would need them on the host first)."""
        spec = self.speculative
        return spec is not None and (track.constraint is None or spec.method != "mtp")

    def _policy_off(self, plan: StepPlan) -> dict[str, bool]:
        """Which decode rows the speculation policy keeps plain this step, by request id: all of
        them above ``disable_by_batch_size``, else those whose acceptance does not pay for a verify
        step (:class:`~dsv4.engine.speculative.SpecPolicy`). With verify graphs (``one_kind_steps``)
        a step of decode rows only is all verify or all plain rows, since a mix runs eagerly at
        several times a graph step's cost: all verify when the rows' expected extra tokens pay for
        the verify step of the whole batch, else all plain."""
        spec, policy, b = self.speculative, self.spec_policy, len(plan.decode)
        if spec is None or not b:
            return {}
        self._spec_step += 1
        rows = {r.request_id: self.tracks[r.request_id] for r in plan.decode
                if self._may_draft(self.tracks[r.request_id])}
        if spec.disable_by_batch_size is not None and b > spec.disable_by_batch_size:
            return dict.fromkeys(rows, True)
        if policy is None:
            return {}
        off = {rid: not policy.speculate(t.acceptance, b, spec.k, self._spec_step) for rid, t in rows.items()}
        one_kind = bool(self.runner.verify_graphs) if self.one_kind_steps is None else self.one_kind_steps
        if one_kind and not plan.prefill and 0 < sum(off.values()) < len(off):
            extra = sum(t.acceptance.ema - 1 for t in rows.values())
            plain = extra < (verify_cost_ratio(b, spec.k, policy.cost) - 1) * b
            off = dict.fromkeys(off, plain)
        return off

    def _may_verify(self) -> bool:
        """Whether the next step may have a verify row (n-gram drafts and the kept counts need the
        host to know every token: the steps in flight are collected first). Plain steps of a
        speculating engine overlap like a plain engine's while the policy keeps every request off."""
        policy, spec = self.spec_policy, self.speculative
        if spec is None:
            return False
        if policy is None or self._verified or (self._spec_step + 1) % policy.probe_every == 0:
            return True         # (the scheduler counts a verify row in flight as one token: collect it)
        running = [self.tracks[r.request_id] for r in self.scheduler.running if r.request_id in self.tracks]
        # the policy's ratio falls with the batch: at the running count it is at most the next step's
        return any(self._may_draft(t) and (t.acceptance.follow or policy.pays(t.acceptance, len(running), spec.k))
                   for t in running)

    def _decode_row(self, req: Request, spec, policy_off: bool) -> Row:
        """A decode row, or with speculation a verify row of ``k`` drafts when they fit the context,
        more than one token is still wanted (MTP drafting runs ``k - 1`` positions further) and the
        policy (batch size, acceptance: ``policy_off``) lets it; those it does not are counted."""
        start = self.runner.lengths[req.slot]
        if spec is None or req.params.max_tokens - len(req.output_ids) <= 1 or \
                start + 2 * spec.k + 1 > self.runner.max_model_len:
            return Row(req.slot, start)
        if policy_off:
            self.spec_stats.num_policy_plain_rows += 1
            self.tracks[req.request_id].out.spec_decode.num_policy_plain_rows += 1
            return Row(req.slot, start)
        if spec.method == "mtp":
            return Row(req.slot, start, device_draft=spec.k)
        if self.tracks[req.request_id].pending:
            return Row(req.slot, start)          # a token still in flight: the host cannot draft after it
        draft = self.propose(req)
        if draft is None:
            return Row(req.slot, start)
        if len(draft) != spec.k:
            raise ValueError(f"a draft of {len(draft)} tokens, num_speculative_tokens is {spec.k}")
        return Row(req.slot, start, draft=tuple(draft))

    def _ngram_draft(self, req: Request) -> list[int] | None:
        spec = self.speculative
        return ngram_propose(req.prompt_ids + req.output_ids, spec.k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _save_decoded(self, req, n_blocks: int) -> list:
        """Decoding brings ``req``'s slot to the end of block ``n_blocks``: save the blocks since its
        last save and the tail there (entered into the cache when the request ends, when the host
        knows every token; the previous decode-time tail is given back)."""
        cache = self.prefix_cache
        pend = req.pending or Pending(req.saved_blocks)
        new = n_blocks - pend.first_block - len(pend.pages)
        pages = cache.reserve(new + cache.tail_pages) if new > 0 else None
        if pages is None:
            return []
        first = pend.first_block + len(pend.pages)
        cache.release(list(pend.tail))
        pend.pages += pages[:new]
        pend.tail = tuple(pages[new:])
        req.pending = pend
        return [Save(req.slot, first, tuple(pages[:new]), pend.tail)]

    def _queue(self, tracks: list[_Track], sampled: SampleOutput, emitted: list[int] | None = None) -> None:
        """Start the device -> host copy of a step's sampled ids (into pinned buffers, so it runs
        asynchronously); remember whose they are."""
        for i, t in enumerate(tracks):
            t.pending += 1 if emitted is None else emitted[i]
        event = None
        if sampled.token_ids.is_cuda:
            top = sampled.top_logprobs
            sampled = SampleOutput(self._pinned.copy(sampled.token_ids), self._pinned.copy(sampled.logprobs),
                                   None if top is None else (self._pinned.copy(top[0]), self._pinned.copy(top[1])))
            event = torch.cuda.Event()
            event.record()
        self._inflight.append((tracks, sampled, event, emitted))

    def _collect(self, tracks: list[_Track], sampled: SampleOutput, event, emitted: list[int] | None = None
                 ) -> list[RequestOutput]:
        if event is not None:
            event.synchronize()
        ids = sampled.token_ids.tolist()
        lps = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        tops = None
        if sampled.top_logprobs is not None:
            pairs = lambda i, v: list(zip(i, v))     # noqa: E731
            if emitted is not None:                  # [N, n, t]: per row, per emitted token
                pairs = lambda i, v: [list(zip(a, b)) for a, b in zip(i, v)]   # noqa: E731
            tops = [pairs(i, v) for i, v in zip(sampled.top_logprobs[0].tolist(), sampled.top_logprobs[1].tolist())]
        if event is not None:
            self._pinned.release(sampled)
        outputs = []
        for row, track in enumerate(tracks):
            track.pending -= 1 if emitted is None else emitted[row]
            if emitted is None:
                step = [(ids[row], lps[row] if lps else None, tops[row] if tops else None)]
            else:      # a verify step: [N, n] ids, the first emitted[row] of them this row's
                step = [(ids[row][j], lps[row][j] if lps else None, tops[row][j] if tops else None)
                        for j in range(emitted[row])]
            merged = None
            for token, lp, top in step:
                if track.request.finished and track.out.finish_reason is not None:
                    break                     # stopped (a step ago, or on an earlier token of this row)
                try:
                    out = self._take(track, token, lp, top)
                except Exception as e:  # one request's failure ends it alone
                    track.out.error = f"{type(e).__name__}: {e}"
                    out = self._end(track, "error")
                if merged is None:
                    merged = out
                else:
                    merged = RequestOutput(out.request_id, merged.new_token_ids + out.new_token_ids,
                                           merged.new_text + out.new_text, out.finished, out.output)
            if merged is not None:
                outputs.append(merged)
        return outputs

    def _take(self, track: _Track, token: int, logprob: float | None, top: list | None) -> RequestOutput:
        req, out = track.request, track.out
        now = time.monotonic() - req.arrival
        if not out.token_ids:
            out.time_to_first_token = now
        out.token_ids.append(token)
        if track.constraint is not None:
            track.constraint.accept([token])
        if out.logprobs is not None:
            out.logprobs.append(logprob)
            out.top_logprobs.append((top or [])[:req.params.logprobs or 0])
        new_text = track.detok.push(token) if track.detok else ""
        emit, stopped, reason = track.stops.check(new_text, token)
        self.scheduler.append_token(req, token)        # finishes the request at max_tokens
        if stopped:
            self.scheduler.finish(req, reason)
            out.stop_reason = track.stops.stop_reason
        elif req.finished:                              # length
            emit += (track.detok.flush() if track.detok else "") + track.stops.finish()
            reason = "length"
        out.text += emit
        if req.finished:
            out.finish_reason, out.total_time = req.finish_reason or reason, now
            self.tracks.pop(req.request_id, None)
        return RequestOutput(req.request_id, [token], emit, req.finished, out)

    def _end(self, track: _Track, reason: str) -> RequestOutput:
        req = track.request
        self.scheduler.finish(req, reason)
        track.out.finish_reason = reason
        track.out.total_time = time.monotonic() - req.arrival
        self.tracks.pop(req.request_id, None)
        return RequestOutput(req.request_id, [], "", True, track.out)


def _add_prompt_logprobs(out: CompletionOutput, chunk, logits: torch.Tensor) -> None:
    """Append the logprobs of the prompt tokens that ``chunk``'s logits ``[n, vocab]`` predict: row
    j gives position ``start + j + 1`` (the last chunk's last row predicts the first output token,
    not a prompt token). Raw model distribution: no penalties, temperature 1."""
    prompt = chunk.request.prompt_ids
    targets = prompt[chunk.start + 1:chunk.start + 1 + len(chunk.token_ids)]
    if not targets:
        return
    logp = torch.log_softmax(logits[:len(targets)].float(), dim=-1)             # [t, vocab]
    ids = torch.tensor(targets, dtype=torch.int64, device=logp.device)
    out.prompt_logprobs += logp.gather(1, ids[:, None])[:, 0].tolist()
    k = chunk.request.params.prompt_logprobs
    if k:
        top = logp.topk(k, dim=-1)
        out.prompt_top_logprobs += [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        out.prompt_top_logprobs += [[] for _ in targets]
