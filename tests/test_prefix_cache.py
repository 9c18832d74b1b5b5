"""Automatic prefix caching (dsv4/engine/prefix_cache.py, prefix_store.py): in fp32 on the CPU a
request gives the same greedy tokens and logprobs with caching on as off, and ``cached_tokens`` is
what the block arithmetic says.

The geometry is the tiny model's kind (window 8, CSA ratio 4, HCA ratio 16): block 16 tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import parity_config, random_model
from dsv4.engine.core import Engine
from dsv4.engine.prefix_cache import PrefixCache
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SamplingParams
from dsv4.model.cache import block_size

B = 16
CONTEXT = 256
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    m = random_model(parity_config(), seed=21)
    assert block_size(m.config) == B
    return m


def _engine(model, cache_bytes: int | None = 4 << 20, slots=3, chunk=64, budget=None) -> Engine:
    runner = Runner(model, max_num_seqs=slots, max_model_len=CONTEXT, max_num_batched_tokens=budget or chunk,
                    prefix_cache_bytes=cache_bytes or 0)
    return Engine(runner, None, eos_id=1, long_prefill_token_threshold=chunk)


def _params(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def _run(engine: Engine, prompts, params=None, together=True):
    """Run ``prompts`` (all queued at once, or one after the other); returns each request's
    (tokens, logprobs, cached_tokens)."""
    results = []

    def drain(ids):
        done = {}
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    outs = []
    if together:
        outs = drain([engine.add_request(p, params or _params()) for p in prompts])
    else:
        for p in prompts:
            outs += drain([engine.add_request(p, params or _params())])
    for o in outs:
        results.append((o.output.token_ids, o.output.logprobs, o.output.num_cached_tokens))
    return results


def _same(on, off):
    for (t1, lp1, _), (t2, lp2, _) in zip(on, off, strict=True):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) <= LOGPROB_TOL


def _tokens(rng, n):
    return [rng.randrange(2, 512) for _ in range(n)]


def _expected_hit(cached_len: int, prompt_len: int) -> int:
    """The block arithmetic: a boundary saved at ``cached_len`` serves a prompt that has at least one
    token after it."""
    return cached_len if cached_len <= prompt_len - 1 else 0


@pytest.mark.parametrize("extra", [-1, 0, 1, 5])
@pytest.mark.parametrize("base_blocks", [1, 3])
def test_shared_prefix_at_every_alignment(model, base_blocks, extra):
    """A second prompt that shares the first one's prompt, ending one before, on, one after and
    well after a block boundary, hits exactly the boundary arithmetic and equals caching off."""
    rng = random.Random(base_blocks * 10 + extra)
    first = _tokens(rng, base_blocks * B + 3)
    second = first[:base_blocks * B + extra] if extra <= 0 else first[:base_blocks * B] + _tokens(rng, extra)
    prompts = [first, second]
    on = _run(_engine(model), prompts, together=False)
    off = _run(_engine(model, None), prompts, together=False)
    _same(on, off)
    assert on[0][2] == 0
    assert on[1][2] == _expected_hit(base_blocks * B, len(second)), (len(second), on[1][2])
    assert all(c == 0 for *_, c in off)


def test_prompt_shorter_than_a_block_and_exact_blocks(model):
    rng = random.Random(3)
    short = _tokens(rng, B - 3)
    exact = _tokens(rng, 2 * B)
    prompts = [short, short, exact, exact, exact + _tokens(rng, 1)]
    on = _run(_engine(model), prompts, together=False)
    off = _run(_engine(model, None), prompts, together=False)
    _same(on, off)
    # a prompt of exactly 2 blocks saves at 16 and 32: sent again it reuses 16 (one token must
    # run), one token longer it reuses all 32
    assert [c for *_, c in on] == [0, 0, 0, B, 2 * B]


def test_multi_turn_conversation_hits_the_last_turns_full_blocks(model):
    """Each turn resends the conversation: the previous prompt, the model's answer and a new
    message. With caching on, turn k+1 starts at turn k's last full block (prompt and answer)."""
    rng = random.Random(5)
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True, logprobs=0)
    on_engine, off_engine = _engine(model), _engine(model, None)
    convo = _tokens(rng, 23)
    for turn in range(5):
        on = _run(on_engine, [convo], params)
        off = _run(off_engine, [convo], params)
        _same(on, off)
        if turn:
            # the state was saved where the previous turn ended: prompt + answer, less the last
            # sampled token (never fed), down to a block boundary
            assert on[0][2] == _expected_hit(prev_end // B * B, len(convo)), (turn, on[0][2])
        prev_end = len(convo) + len(on[0][0]) - 1
        convo = convo + on[0][0] + _tokens(rng, 7 + 4 * turn)


def test_same_new_prefix_twice_in_one_step_and_many_users(model):
    """Requests that arrive together with the same new prefix: the first one prefills it and saves
    its state where the others part from it; they wait (holding no slot) and start from that state
    instead of computing the prefix beside it; later users with the same system prompt hit it."""
    rng = random.Random(8)
    system = _tokens(rng, 3 * B + 2)
    prompts = [system + _tokens(rng, 9) for _ in range(3)]
    later = [system + _tokens(rng, 9) for _ in range(3)]
    on_engine = _engine(model, slots=3, budget=512)
    on = _run(on_engine, prompts) + _run(on_engine, later)
    off = _run(_engine(model, None, slots=3, budget=512), prompts + later)
    _same(on, off)
    assert [c for *_, c in on] == [0, 3 * B, 3 * B, 3 * B, 3 * B, 3 * B]
    stats = on_engine.stats().prefix_cache
    assert stats.hits == 15 * B and stats.queries == sum(len(p) for p in prompts + later)


def _arrive(engine: Engine, schedule: list[list[list[int]]], abort_first_at: int | None = None) -> list:
    """Add ``schedule[k]`` before step k (then step until done); ``abort_first_at``: abort the first
    request before that step. Each request's (tokens, logprobs, cached tokens, finish reason), in
    arrival order."""
    ids, done, k = [], {}, 0
    while k < len(schedule) or engine.has_unfinished:
        if k < len(schedule):
            ids += [engine.add_request(p, _params()) for p in schedule[k]]
        if k == abort_first_at:
            engine.abort(ids[0])
        k += 1
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.output
    return [(done[i].token_ids, done[i].logprobs, done[i].num_cached_tokens, done[i].finish_reason) for i in ids]


def test_a_request_arriving_mid_prefill_waits_for_the_prefix_it_shares(model):
    """A request that shares 4 blocks with a prompt still being prefilled (a block a step) waits for
    that prompt to reach them and save its state there (a save point added for it), then starts from
    it; an unrelated request arriving after it is not held up. Everything equals caching off."""
    rng = random.Random(29)
    long = _tokens(rng, 6 * B + 3)
    sharing = long[:4 * B] + _tokens(rng, 11)
    other = _tokens(rng, 2 * B + 1)
    schedule = [[long], [sharing], [other]]
    engine = _engine(model, chunk=B, budget=B + 4)
    admitted = []
    schedule_fn = engine.scheduler.schedule

    def spy():
        plan = schedule_fn()
        admitted.append({len(c.request.prompt_ids) for c in plan.prefill if c.first})
        return plan
    engine.scheduler.schedule = spy
    on = _arrive(engine, schedule)
    off = _arrive(_engine(model, None, chunk=B, budget=B + 4), schedule)
    for a, b in zip(on, off, strict=True):
        assert a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) <= LOGPROB_TOL
    assert [c for _, _, c, _ in on] == [0, 4 * B, 0]
    first_step = {n: next(i for i, a in enumerate(admitted) if n in a) for n in map(len, (sharing, other))}
    assert first_step[len(other)] < first_step[len(sharing)]       # the unrelated one went first


def test_a_waiting_request_goes_ahead_when_the_prefix_it_waits_for_is_aborted(model):
    rng = random.Random(31)
    long = _tokens(rng, 6 * B + 3)
    sharing = long[:4 * B] + _tokens(rng, 11)
    engine = _engine(model, chunk=B, budget=B + 4)
    on = _arrive(engine, [[long], [sharing]], abort_first_at=2)
    off = _arrive(_engine(model, None, chunk=B, budget=B + 4), [[long], [sharing]], abort_first_at=2)
    assert on[0][3] == off[0][3] == "abort"
    assert on[1][0] == off[1][0] and on[1][2] == 0 and on[1][3] == "length"


def test_eviction_keeps_results_and_cached_tokens_follow_what_is_left(model):
    """A cache of a few pages: saving new prefixes evicts old ones (least recently used first);
    every result still equals caching off, and nothing a scheduled request reads is evicted."""
    probe = _engine(model)
    store = probe.runner.prefix_store
    pages = 2 * (store.tail_pages + 3)          # two 3-block prefixes with their tails
    rng = random.Random(9)
    a, b, c = (_tokens(rng, 3 * B + 4) for _ in range(3))
    prompts = [a, b, a + [7], c, a + [9], b + [5]]
    engine = _engine(model, cache_bytes=pages * store.page_bytes)
    on = _run(engine, prompts, together=False)
    off = _run(_engine(model, None), prompts, together=False)
    _same(on, off)
    cached = [x for *_, x in on]
    assert cached[:3] == [0, 0, 3 * B]           # a still there
    assert cached[3] == 0 and cached[5] == 0     # c evicted b (LRU); b's prompt was evicted
    assert engine.stats().prefix_cache.evictions > 0
    assert engine.stats().prefix_cache.used_bytes <= pages * store.page_bytes
    # with all of them queued together, a cache that fits one prefix still gives the same results
    tight = _engine(model, cache_bytes=(store.tail_pages + 4) * store.page_bytes)
    _same(_run(tight, prompts), off)


def test_abort_mid_prefill_saves_nothing_half_written(model):
    rng = random.Random(11)
    prompt = _tokens(rng, 5 * B + 3)
    engine = _engine(model, chunk=B, budget=B + 4)   # a chunk of one block per step
    rid = engine.add_request(prompt, _params())
    engine.step()
    engine.step()                                   # two of five blocks prefilled
    engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    assert not engine.prefix_cache.nodes            # the save is at the prompt's end only
    on = _run(engine, [prompt, prompt], together=False)
    _same(on, _run(_engine(model, None), [prompt, prompt], together=False))
    assert [c for *_, c in on] == [0, 5 * B]


def test_caching_off_and_the_index_alone():
    cache = PrefixCache(block=4, num_pages=10, tail_pages=2, page_bytes=100)
    toks = list(range(20))
    assert cache.match(toks) is None
    save, pub = cache.plan_save(0, toks, 3)
    assert save.first_block == 0 and len(save.blocks) == 3 and len(save.tail) == 2
    cache.publish(*pub)
    hit = cache.match(toks[:13])
    assert hit.length == 12 and hit.blocks == save.blocks and hit.tail == save.tail
    assert cache.match(toks[:12]) is None             # boundary 12 needs a 13th token; 8 has no tail
    assert cache.match([99] + toks[1:]) is None       # a different first block: nothing matches after it
    cache.unref(hit)
    assert cache.stats.used_bytes == 500
    # a referenced prefix is never evicted: a save that needs its pages fails instead
    hit = cache.match(toks)
    assert cache.plan_save(1, [50 + t for t in toks], 4) is None
    cache.unref(hit)
    assert cache.plan_save(1, [50 + t for t in toks], 4) is not None
    assert cache.stats.evictions >= 1


@pytest.mark.parametrize("qat", [True])
def test_qat_storage_round_trips_through_the_cache(model, qat):
    """The QAT storage (FP8 entries and ring, FP4 indexer keys) is copied byte for byte: a cached
    run equals an uncached one."""
    rng = random.Random(13)
    system = _tokens(rng, 2 * B + 1)
    prompts = [system + _tokens(rng, 5), system + _tokens(rng, 9)]

    def engine(cache):
        runner = Runner(model, max_num_seqs=2, max_model_len=CONTEXT, max_num_batched_tokens=64, qat_sim=qat,
                        prefix_cache_bytes=cache)
        return Engine(runner, None, eos_id=1)

    on = _run(engine(4 << 20), prompts, together=False)
    off = _run(engine(0), prompts, together=False)
    assert [c for *_, c in on] == [0, 2 * B]
    for (t1, lp1, _), (t2, lp2, _) in zip(on, off):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) <= 1e-2    # FP8 steps between chunk shapes (test_generation_state)


def test_llm_tensor_parallel_2_with_caching_equals_one_process_without():
    """``LLM(tensor_parallel_size=2)`` over gloo: every rank restores and saves its own state from
    the plan rank 0 broadcasts; a shared prefix and a conversation's next turn give what one
    process gives with caching off, and ``num_cached_tokens`` says what was reused."""
    from dsv4.engine.llm import LLM
    rng = random.Random(17)
    system = [0] + _tokens(rng, 2 * B + 3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    kw = dict(device="cpu", max_num_seqs=2, max_model_len=256, progress=False, max_num_batched_tokens=128)

    def turns(llm):
        out, convo = [], system + _tokens(random.Random(1), 4)
        for p in ([system + [5, 6, 7]], [system + [9, 9]], [convo]):
            o = llm.generate(p, params)[0]
            out.append((o.token_ids, o.logprobs, o.num_cached_tokens))
        convo = convo + out[-1][0] + [11, 12, 13]
        o = llm.generate([convo], params)[0]
        return out + [(o.token_ids, o.logprobs, o.num_cached_tokens)]

    with LLM("tiny:bf16", enable_prefix_caching=False, **kw) as llm:
        off = turns(llm)
    with LLM("tiny:bf16", tensor_parallel_size=2, prefix_cache_gib=0.01, **kw) as llm:
        assert llm.runner.prefix_store is not None
        on = turns(llm)
    _same(on, off)
    # the conversation's turn: 40 prompt tokens, saved at 32; decoding saved it again at 48
    assert [c for *_, c in on] == [0, 2 * B, 2 * B, 3 * B]


@pytest.mark.parametrize("qat, dtype", [(True, torch.bfloat16), (False, torch.float32), (True, torch.float32)])
def test_store_save_restore_is_byte_exact(qat, dtype):
    """Pages hold a slot's entry rows and window pieces byte for byte, whatever the storage (FP8 +
    e8m0 scales + BF16 rope rows, FP4 keys, fp32 windows: pieces of odd byte sizes)."""
    from dsv4.config import preset
    from dsv4.engine.prefix_store import PrefixStore
    from dsv4.engine.state import GenerationState
    config = preset("tiny")
    state = GenerationState(config, 3, 128, dtype, "cpu", qat_sim=qat)
    g = torch.Generator().manual_seed(0)
    for p in state.pieces():
        p.tensor.view(torch.uint8).copy_(torch.randint(0, 256, p.tensor.view(torch.uint8).shape, generator=g,
                                                       dtype=torch.uint8))
    store = PrefixStore(state, block_size(config), 1 << 20)
    bsz = store.block
    tail = list(range(store.tail_pages + 10, 9, -1))[:store.tail_pages]
    store.save(0, 0, [5, 2], tail)
    store.save(0, 2, [4], [])
    store.restore(2, [5, 2, 4], tail)
    for p in state.pieces():
        if p.kind == "entries":
            n = 3 * bsz // p.ratio
            assert torch.equal(p.tensor[2, :n].view(torch.uint8), p.tensor[0, :n].view(torch.uint8)), p.name
        elif p.kind == "window":
            assert torch.equal(p.tensor[2].view(torch.uint8), p.tensor[0].view(torch.uint8)), p.name
    assert store.pool.shape[1] % 16 == 0


def test_users_sharing_a_system_prompt_save_where_they_part(model):
    """The first user saves at the end of its prompt; the second finds the system prompt's blocks
    cached without a state at their end, so it saves one where the prompts part; every later user
    starts there."""
    rng = random.Random(19)
    system = _tokens(rng, 3 * B + 5)
    users = [system + _tokens(rng, 20) for _ in range(4)]
    on = _run(_engine(model), users, together=False)
    off = _run(_engine(model, None), users, together=False)
    _same(on, off)
    assert [c for *_, c in on] == [0, 0, 3 * B, 3 * B]


def test_prompt_logprobs_requests_reuse_nothing(model):
    """A request that asks for its prompt's logprobs needs every position's logits: it is not
    served from the cache (and gets the same logprobs as the first time)."""
    rng = random.Random(23)
    prompt = _tokens(rng, 2 * B + 7)
    engine = _engine(model)
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    _run(engine, [prompt], scored)
    assert _run(engine, [prompt])[0][2] == 2 * B            # it is cached, for requests without them
    outs = []
    for _ in range(2):
        rid = engine.add_request(prompt, scored)
        while engine.has_unfinished:
            for o in engine.step():
                if o.finished and o.request_id == rid:
                    outs.append(o.output)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert len(outs[1].prompt_logprobs) == len(prompt)
    assert outs[1].prompt_logprobs[1:] == pytest.approx(outs[0].prompt_logprobs[1:], abs=1e-5)
