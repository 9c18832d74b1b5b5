"""Tests for dsv4.engine.sampling: truncation support and mass, penalties, seeds, logprobs, stops."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from dsv4.engine.sampling import (
    SamplingBatch,
    SamplingParams,
    StopChecker,
    SlotSampling,
    _mix32,
    apply_penalties,
    sample,
    uniform_noise,
    unit_interval,
)

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add spin-wait overhead on a busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# A hand-built distribution over 8 tokens, placed at scrambled vocab ids so that nothing can
# pass by favouring low or high ids. Remaining vocab ids get tiny but nonzero mass.
PROBS = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]
V = 40
IDS = [17, 3, 29, 8, 36, 0, 22, 11]


def hand_logits(tail: float = 1e-4) -> torch.Tensor:
    """[V] fp32 logits: log PROBS at IDS, log(tail) elsewhere (so no token has zero mass)."""
    logits = torch.full((V,), math.log(tail))
    logits[IDS] = torch.log(torch.tensor(PROBS))
    return logits


def draw_many(logits: torch.Tensor, params: SamplingParams, seeds: int = 2000, steps: int = 10) -> torch.Tensor:
    """Token frequencies [V] over seeds x steps draws from one row's logits, with many seeds."""
    batch = SamplingBatch([replace(params, seed=s) for s in range(seeds)], V)
    hist = torch.zeros(V, dtype=torch.int64)
    for _ in range(steps):
        out = sample(logits.expand(seeds, V), batch)
        hist += torch.bincount(out.token_ids, minlength=V)
    return hist.double() / (seeds * steps)


def expected(keep: list[int], temperature: float = 1.0, tail: float = 1e-4) -> torch.Tensor:
    """[V] float64 renormalised probabilities at temperature over the kept vocab ids."""
    p = torch.full((V,), tail, dtype=torch.float64)
    p[IDS] = torch.tensor(PROBS, dtype=torch.float64)
    p = p ** (1 / temperature)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[keep] = True
    p = torch.where(mask, p, 0.0)
    return p / p.sum()


def assert_matches(freq: torch.Tensor, want: torch.Tensor, n: int = 20000) -> None:
    """Exact support, and each frequency within 5 standard errors (+1e-3) of its probability."""
    assert set(freq.nonzero().flatten().tolist()) == set(want.nonzero().flatten().tolist())
    bound = 5 * torch.sqrt(want * (1 - want) / n) + 1e-3
    assert torch.all((freq - want).abs() <= bound), (freq[IDS], want[IDS])


# ----------------------------------------------------------------------------- truncation


def test_plain_sampling_matches_softmax():
    freq = draw_many(hand_logits(tail=1e-2), SamplingParams())
    assert_matches(freq, expected(list(range(V)), tail=1e-2))


def test_temperature_reshapes_distribution():
    freq = draw_many(hand_logits(), SamplingParams(temperature=2.0))
    assert_matches(freq, expected(list(range(V)), temperature=2.0))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_support_and_mass(k):
    freq = draw_many(hand_logits(), SamplingParams(top_k=k))
    assert_matches(freq, expected(IDS[:k]))


@pytest.mark.parametrize(
    "top_p, n_kept",
    [(0.25, 1), (0.45, 2), (0.60, 3), (0.75, 4), (0.80, 5)],  # cum mass .30 .52 .68 .80 .89
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, n_kept):
    freq = draw_many(hand_logits(), SamplingParams(top_p=top_p))
    assert_matches(freq, expected(IDS[:n_kept]))


def test_top_p_applies_to_top_k_renormalised_distribution():
    # top-3 renormalised: .30/.68=.441, .22/.68=.324, .16/.68=.235 -> mass before: 0, .441, .765
    freq = draw_many(hand_logits(), SamplingParams(top_k=3, top_p=0.7))
    assert_matches(freq, expected(IDS[:2]))
    freq = draw_many(hand_logits(), SamplingParams(top_k=3, top_p=0.8))
    assert_matches(freq, expected(IDS[:3]))


def test_min_p_keeps_tokens_above_fraction_of_max():
    # floor 0.35 * 0.30 = 0.105: keeps .30 .22 .16 .12, drops .09 and below
    freq = draw_many(hand_logits(), SamplingParams(min_p=0.35))
    assert_matches(freq, expected(IDS[:4]))


def test_min_p_after_temperature():
    # T=2: p ~ sqrt(PROBS); ratio to max = sqrt(p/.30): .856 .730 .632 .548 .447 .316 .258
    freq = draw_many(hand_logits(), SamplingParams(temperature=2.0, min_p=0.5))
    assert_matches(freq, expected(IDS[:5], temperature=2.0))


@pytest.mark.parametrize("with_top_p", [True, False])  # sort path / top-k-only path
def test_all_knobs_together_in_a_mixed_batch(with_top_p):
    """Rows with different knobs in one batch each get exactly their own support."""
    cases = [
        (SamplingParams(top_k=2), IDS[:2]),
        (SamplingParams(top_k=3, temperature=0.7), IDS[:3]),
        (SamplingParams(min_p=0.35), IDS[:4]),
        (SamplingParams(), list(range(V))),
        (SamplingParams(temperature=0.0, top_k=1), IDS[:1]),
    ]
    if with_top_p:  # the tail holds mass here: cumulative .227 .394 .515
        cases.append((SamplingParams(top_p=0.45), IDS[:3]))
    seeds = 600
    params = [replace(p, seed=s) for s in range(seeds) for p, _ in cases]
    batch = SamplingBatch(params, V)
    logits = hand_logits(tail=1e-2).expand(len(params), V)
    seen = [set() for _ in cases]
    for _ in range(3):
        ids = sample(logits, batch).token_ids.view(seeds, len(cases))
        for c in range(len(cases)):
            seen[c] |= set(ids[:, c].tolist())
    for (_, keep), got in zip(cases, seen):
        assert got == set(keep)


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_p=0.5, seed=i) for i in range(6)]
    out = sample(logits, SamplingBatch(params, 1000))
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))
    all_greedy = sample(logits, SamplingBatch([SamplingParams(temperature=0.0)] * 6, 1000))
    assert torch.equal(all_greedy.token_ids, logits.argmax(-1))
    assert all_greedy.token_ids.dtype == torch.int64


# ----------------------------------------------------------------------------- penalties


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # neutral row in the same batch
    ]
    batch = SamplingBatch(params, 5, prompt_ids=[[0, 1], [0, 1]])
    for tok in (3, 3, 1):
        batch.update(torch.tensor([tok, tok]))
    # seen = {0, 1, 3}; generated counts: 3 -> 2, 1 -> 1
    want = torch.tensor([
        2.0 / 2,  # seen in prompt, positive: divided
        -1.0 * 2 - 0.25 * 1 - 0.5,  # seen, negative: multiplied; then count 1
        0.5,  # never seen
        3.0 / 2 - 0.25 * 2 - 0.5,  # generated twice
        -2.0,  # never seen
    ])
    got = apply_penalties(logits, batch)
    assert torch.allclose(got[0], want)
    assert torch.equal(got[1], logits[1])
    assert batch.counts[0].tolist() == [0, 1, 0, 2, 0]
    assert batch.prompt_mask[0].tolist() == [True, True, False, True, False]
    # logprobs are reported from the penalised logits
    out = sample(logits[:1], SamplingBatch([replace(params[0], logprobs=0)], 5, prompt_ids=[[0, 1]],
                                       output_ids=[[3, 3, 1]]))
    assert torch.allclose(out.logprobs, torch.log_softmax(want, -1)[out.token_ids])


def test_resume_from_output_ids_equals_updates():
    params = [SamplingParams(presence_penalty=1.0, seed=5)] * 2
    a = SamplingBatch(params, 10, prompt_ids=[[1], [2]])
    for tok in ([4, 5], [4, 6]):
        a.update(torch.tensor(tok))
    b = SamplingBatch(params, 10, prompt_ids=[[1], [2]], output_ids=[[4, 4], [5, 6]])
    assert torch.equal(a.counts, b.counts) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert b.step.tolist() == [2, 2]


def test_no_penalty_state_without_penalties():
    batch = SamplingBatch([SamplingParams()], 10)
    assert batch.counts is None and batch.prompt_mask is None
    batch.update(torch.tensor([3]))  # no-op, no error
    with pytest.raises(ValueError, match="token ids"):
        SamplingBatch([SamplingParams(repetition_penalty=1.2)], 10, prompt_ids=[[10]])


# ----------------------------------------------------------------------------- seeds


def run_steps(batch: SamplingBatch, row_logits, rows_of_other: int, row: int, steps: int):
    """Sample ``steps`` times; the probed row gets ``row_logits[t]``, others random logits."""
    gen = torch.Generator().manual_seed(99 + rows_of_other)
    tokens = []
    for t in range(steps):
        logits = torch.randn(len(batch), row_logits.shape[-1], generator=gen) * 3
        logits[row] = row_logits[t]
        ids = sample(logits, batch).token_ids
        batch.update(ids)
        tokens.append(int(ids[row]))
    return tokens


@pytest.mark.parametrize("probe", [
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=1234),
    SamplingParams(temperature=1.2, top_k=30, seed=7),  # top-k-only path when alone
    SamplingParams(min_p=0.05, seed=2**64 + 5),
])
def test_seed_independent_of_batch_composition_and_row(probe):
    vocab, steps = 257, 40
    row_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(3)) * 2
    prompt = [5, 6, 7]
    alone = run_steps(SamplingBatch([probe], vocab, prompt_ids=[prompt]), row_logits, 0, 0, steps)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, presence_penalty=1.0, frequency_penalty=0.5, seed=1234 + 1),
        SamplingParams(min_p=0.2, logprobs=5),  # unseeded
        SamplingParams(top_k=50, repetition_penalty=0.8, temperature=0.5),
    ]
    params = others[:3] + [probe] + others[3:]
    prompts = [[1, 2], [], [3] * 4, prompt, [9]]
    batch = SamplingBatch(params, vocab, prompt_ids=prompts)
    in_batch = run_steps(batch, row_logits, 4, 3, steps)
    assert alone == in_batch
    assert len(set(alone)) > 5  # really random, not stuck on one token


def test_different_seeds_and_steps_differ():
    vocab = 1000
    batch = SamplingBatch([SamplingParams(seed=1), SamplingParams(seed=2), SamplingParams(seed=1)], vocab)
    seqs = torch.stack([sample(torch.zeros(3, vocab), batch).token_ids for _ in range(20)], 1)
    assert not torch.equal(seqs[0], seqs[1])
    assert torch.equal(seqs[0], seqs[2])
    assert len(set(seqs[0].tolist())) > 15


def test_unseeded_rows_get_fresh_seeds():
    vocab = 1000
    a = SamplingBatch([SamplingParams()] * 2, vocab)
    assert a.seeds[0] != a.seeds[1]
    seqs = torch.stack([sample(torch.zeros(2, vocab), a).token_ids for _ in range(10)], 1)
    assert not torch.equal(seqs[0], seqs[1])
    # a host rng makes the drawn seeds reproducible
    assert SamplingBatch([SamplingParams()], vocab, rng=random.Random(1)).seeds == \
        SamplingBatch([SamplingParams()], vocab, rng=random.Random(1)).seeds


def test_select_keeps_each_rows_stream():
    vocab = 300
    params = [SamplingParams(seed=s, top_k=40, frequency_penalty=0.3) for s in (10, 11, 12)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    full = SamplingBatch(params, vocab)
    sample(logits, full)
    sub = full.select([2, 0])
    ref = SamplingBatch([params[2], params[0]], vocab, output_ids=[[0], [0]])  # step 1
    assert torch.equal(sub.step, ref.step)
    assert torch.equal(sample(logits[[2, 0]], sub).token_ids, sample(logits[[2, 0]], ref).token_ids)


def test_step_advances_every_sample():
    batch = SamplingBatch([SamplingParams(seed=0)], 10)
    sample(torch.zeros(1, 10), batch)
    sample(torch.zeros(1, 10), batch)
    assert batch.step.tolist() == [2]


def test_hash_matches_python_reference_and_is_uniform():
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF] + random.Random(0).sample(range(2**32), 200)
    assert _mix32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 4096)
    assert 0 < u.min() and u.max() < 1
    hist = torch.histc(u, bins=16, min=0, max=1)
    assert torch.all((hist / u.numel() - 1 / 16).abs() < 0.003)
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 0.01


def test_noise_is_finite_at_the_top_hash():
    """The largest hashes gave u == 1.0 in fp32 (the top bin's centre rounds up), whose Gumbel noise
    is +inf: that token won whatever its logit (one draw in 2**24 per vocabulary entry, ~0.8% of the
    rows of a 129K vocabulary), and a grammar's -inf mask plus +inf gave NaN, which argmax picks."""
    h = torch.tensor([0, 2**32 - 257, 2**32 - 256, 2**32 - 1])
    u = unit_interval(h)
    assert 0 < u.min() and u.max() < 1
    gumbel = -torch.log(-torch.log(u))
    assert torch.isfinite(gumbel).all()


def test_sample_has_no_host_sync():
    """On the meta device any .item()/.tolist()/bool(tensor) raises, so this proves no sync."""
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={3: 1.0}, min_tokens=2),
              SamplingParams(top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5, seed=1)]
    batch = SamplingBatch(params, 50, device="meta")
    assert batch.use_bias
    out = sample(torch.empty(2, 50, device="meta"), batch)
    batch.update(out.token_ids)
    assert out.token_ids.shape == (2,) and out.top_logprobs[0].shape == (2, 3)
    sub = SamplingBatch([SamplingParams(top_k=5, seed=1)], 50, device="meta")
    assert sample(torch.empty(1, 50, device="meta"), sub).logprobs is None


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_temperature_one_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 100) * 2
    params = [SamplingParams(temperature=0.3, top_k=10, logprobs=5, seed=0),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(seed=3)]
    out = sample(logits, SamplingBatch(params, 100))
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (3, 5)
    assert torch.all(values[:, :-1] >= values[:, 1:])
    assert torch.equal(ids, ref.argsort(-1, descending=True)[:, :5])
    assert torch.allclose(values, ref.gather(1, ids))


def test_logprobs_absent_unless_asked():
    logits = torch.randn(2, 20)
    out = sample(logits, SamplingBatch([SamplingParams(seed=1)] * 2, 20))
    assert out.logprobs is None and out.top_logprobs is None
    out = sample(logits, SamplingBatch([SamplingParams(seed=1, logprobs=0)] * 2, 20))
    assert out.logprobs is not None and out.top_logprobs is None


def test_logits_shape_checked():
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 10), SamplingBatch([SamplingParams()], 10))


# ----------------------------------------------------------------------------- stops


def feed(checker: StopChecker, pieces, ids=None):
    emitted, result = [], (None, False, None)
    for i, piece in enumerate(pieces):
        result = checker.check(piece, ids[i] if ids else 100 + i)
        emitted.append(result[0])
        if result[1]:
            break
    return emitted, result[1], result[2]


def test_stop_string_across_token_boundary():
    emitted, stopped, reason = feed(StopChecker(["STOP"]), ["Hello ", "ST", "OP", " more"])
    assert emitted == ["Hello ", "", ""] and stopped and reason == "stop"


def test_stop_string_inside_one_token_and_earliest_wins():
    emitted, stopped, _ = feed(StopChecker(["STOP", "cd"]), ["ab", "xSTOPcd!"])
    assert "".join(emitted) == "abx" and stopped
    emitted, _, _ = feed(StopChecker(["ABCD", "C"]), ["AB", "C"])
    assert "".join(emitted) == "AB"


def test_held_text_released_exactly():
    checker = StopChecker(["STOP"])
    out = [checker.check(t, i)[0] for i, t in enumerate(["a ST", "AR", "S", "TO"])]
    assert out == ["a ", "STAR", "", ""]
    assert checker.finish() == "STO"
    assert checker.finish() == ""


def test_stop_token_ids_eos_and_ignore_eos():
    # a stop token's text is not emitted, held text before it is
    emitted, stopped, reason = feed(StopChecker(["XYZ"], [7]), ["ok X", "<stop>"], ids=[1, 7])
    assert emitted == ["ok ", "X"] and stopped and reason == "stop"
    emitted, stopped, _ = feed(StopChecker(eos_id=2), ["a", "</s>"], ids=[1, 2])
    assert emitted == ["a", ""] and stopped
    emitted, stopped, _ = feed(StopChecker(eos_id=2, ignore_eos=True), ["a", "</s>", "b"], ids=[1, 2, 3])
    assert emitted == ["a", "</s>", "b"] and not stopped
    emitted, stopped, _ = feed(StopChecker([], [9], eos_id=2, ignore_eos=True), ["a", "!"], ids=[1, 9])
    assert emitted == ["a", ""] and stopped


def test_length_flushes_held_text():
    checker = StopChecker.from_params(SamplingParams(max_tokens=2, stop=["STOP"]), eos_id=0)
    assert checker.check("x S", 5) == ("x ", False, None)
    assert checker.check("T", 6) == ("ST", True, "length")
    with pytest.raises(RuntimeError):
        checker.check("y", 7)


# ----------------------------------------------------------------------------- logit bias, min_tokens


def test_logit_bias_is_the_dense_bias_added_first():
    """A row's logit_bias draws exactly what its logits plus the dense bias draw without one (same
    seeds, fp32), penalties and logprobs included; a row without one in the same batch is untouched."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g)
    bias = {IDS[0]: -100.0, IDS[5]: 2.5, 39: 0.75}
    dense = torch.zeros(V)
    dense[list(bias)] = torch.tensor(list(bias.values()))
    knobs = dict(seed=11, presence_penalty=0.5, repetition_penalty=1.3, logprobs=3)
    rows = [SamplingParams(logit_bias=bias, **knobs), SamplingParams(temperature=0, logit_bias=bias, **knobs),
            SamplingParams(**knobs)]
    plain = [replace(p, logit_bias=None) for p in rows]
    a = SamplingBatch(rows, V, prompt_ids=[[1, 2]] * 3)
    b = SamplingBatch(plain, V, prompt_ids=[[1, 2]] * 3)
    assert a.use_bias and not b.use_bias
    want_logits = logits + torch.stack([dense, dense, torch.zeros(V)])
    for _ in range(4):
        got, want = sample(logits, a), sample(want_logits, b)
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.logprobs, want.logprobs)
        assert torch.equal(got.top_logprobs[1], want.top_logprobs[1])
        a.update(got.token_ids)
        b.update(want.token_ids)
    forced = SamplingBatch([SamplingParams(seed=s, logit_bias={IDS[7]: 100.0}) for s in range(50)], V)
    assert sample(hand_logits().expand(50, V), forced).token_ids.eq(IDS[7]).all()


def test_allowed_token_ids_restrict_every_draw():
    """Rows with allowed ids draw only those (sampled and greedy) with the probabilities renormalised
    over them (the same draws as the logits with every other id at -inf); other rows are untouched."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g)
    allowed = [IDS[3], IDS[6], 2, 39]
    rows = [SamplingParams(seed=7, allowed_token_ids=allowed, logprobs=2),
            SamplingParams(temperature=0, allowed_token_ids=allowed[1:], logprobs=2), SamplingParams(seed=8, logprobs=2)]
    a = SamplingBatch(rows, V)
    b = SamplingBatch([replace(p, allowed_token_ids=None) for p in rows], V)
    masked = logits.clone()
    keep = torch.zeros(3, V, dtype=torch.bool)
    keep[0, allowed], keep[1, allowed[1:]], keep[2] = True, True, True
    masked[~keep] = -math.inf
    for _ in range(5):
        got, want = sample(logits, a), sample(masked, b)
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.logprobs, want.logprobs)
        assert got.token_ids[0].item() in allowed and got.token_ids[1].item() in allowed[1:]
    freq = draw_many(hand_logits(), SamplingParams(allowed_token_ids=[IDS[0], IDS[2], IDS[7]]), seeds=1000)
    assert_matches(freq, expected([IDS[0], IDS[2], IDS[7]]), n=10000)


def test_min_tokens_holds_the_stop_ids_back_until_then():
    """Rows whose logits all but force a stop id draw something else for their first min_tokens
    draws (EOS and stop_token_ids alike), then the stop id; a row without min_tokens stops at once."""
    logits = hand_logits().clone()
    logits[[5, 9]] = 30.0                                       # the stop ids: 5 (EOS here) and 9
    params = [SamplingParams(min_tokens=3, seed=1), SamplingParams(min_tokens=2, temperature=0),
              SamplingParams(seed=2)]
    batch = SamplingBatch(params, V, stop_ids=[[5, 9], [5, 9], [5, 9]])
    drawn = [sample(logits.expand(3, V), batch).token_ids.tolist() for _ in range(4)]
    stop = {5, 9}
    assert [d[0] in stop for d in drawn] == [False, False, False, True]
    assert [d[1] in stop for d in drawn] == [False, False, True, True]
    assert all(d[2] in stop for d in drawn)
    assert drawn[0][1] == IDS[0]                                # greedy: the best id that may be drawn
    # only the row's own stop ids are held back (its stop_token_ids when no stop_ids are given)
    own = SamplingBatch([SamplingParams(min_tokens=1, temperature=0, stop_token_ids=[9])], V)
    assert sample(logits[None], own).token_ids.item() == 5
    # an engine without an end token passes -1: nothing to hold back for it
    none = SamplingBatch([SamplingParams(min_tokens=1, temperature=0)], V, stop_ids=[[-1, 9]])
    assert sample(logits[None], none).token_ids.item() == 5


def test_slot_rows_bias_like_a_batch():
    """The runner's per-slot rows (gathered by a device index, the captured decode step's way) apply
    the same bias and min_tokens as a SamplingBatch of the same params."""
    from dsv4.engine.sampling import SampleFlags

    logits = hand_logits().clone()
    logits[5] = 30.0
    params = [SamplingParams(seed=4, logit_bias={IDS[1]: 3.0}, min_tokens=2), SamplingParams(seed=6)]
    slots = SlotSampling(4, V, "cpu")
    for slot, p in zip((2, 0), params):
        slots.assign(slot, p, [1], stop_ids=[5])
    flags = SampleFlags.of(params, V)
    assert flags.bias
    batch = SamplingBatch(params, V, prompt_ids=[[1], [1]], stop_ids=[[5], [5]])
    idx = torch.tensor([2, 0])
    for _ in range(3):
        assert torch.equal(slots.sample(logits.expand(2, V), idx, flags).token_ids,
                           sample(logits.expand(2, V), batch).token_ids)


def test_stop_checker_includes_the_stop_when_asked():
    inc = dict(include_stop=True)
    assert feed(StopChecker(["YZ", "XYZ"], **inc), ["ok X", "YZ tail"], ids=[1, 2])[0] == ["ok ", "XYZ"]  # earliest
    assert feed(StopChecker(["XY", "XYZ"], **inc), ["ok X", "YZ"], ids=[1, 2])[0] == ["ok ", "XY"]  # first listed
    emitted, stopped, reason = feed(StopChecker(["XYZ"], [7], **inc), ["ok X", "<stop>"], ids=[1, 7])
    assert emitted == ["ok ", "X<stop>"] and stopped and reason == "stop"
    p = SamplingParams(stop=["b"], include_stop_str_in_output=True)
    assert StopChecker.from_params(p, eos_id=0).check("abc", 3) == ("ab", True, "stop")


def test_stop_reason_names_the_stop_string_or_stop_token_id():
    by_string = StopChecker(["XY"], [7], eos_id=2)
    feed(by_string, ["aX", "Yb"], ids=[1, 3])
    assert by_string.stop_reason == "XY"
    by_id, by_eos = StopChecker(["XY"], [7], eos_id=2), StopChecker(["XY"], [7], eos_id=2)
    feed(by_id, ["a", "b"], ids=[1, 7])
    feed(by_eos, ["a", "b"], ids=[1, 2])
    assert by_id.stop_reason == 7 and by_eos.stop_reason is None
    both = StopChecker([], [2], eos_id=2)     # EOS listed as a stop token id too: the id is named
    feed(both, ["a"], ids=[2])
    assert both.stop_reason == 2


def test_stop_checker_waits_for_min_tokens():
    checker = StopChecker(["AB"], [7], eos_id=2, min_tokens=3)
    assert checker.check("AB", 7) == ("AB", False, None)           # token 1: no stop id, no string
    assert checker.check("x", 2) == ("x", False, None)              # token 2
    assert checker.check("AB", 1) == ("", True, "stop")             # token 3: strings count again
    assert StopChecker(eos_id=2, max_tokens=2, min_tokens=5).check("a", 1) == ("a", False, None)
    short = StopChecker(max_tokens=1, min_tokens=1)
    assert short.check("a", 1) == ("a", True, "length")
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


# ----------------------------------------------------------------------------- params


def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=(1, 2))
    assert p.stop == ["END"] and p.stop_token_ids == [1, 2]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 2.5), ("temperature", -0.1),
    ("temperature", float("nan")), ("top_k", -1), ("top_k", True), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("seed", 1.5), ("logprobs", 21), ("logprobs", -1),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", list(range(65))), ("stop", [""]),
    ("stop", [3]), ("ignore_eos", 1), ("min_tokens", -1), ("min_tokens", 1.0), ("logit_bias", {3: 101}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", {3: float("nan")}),
    ("logit_bias", {t: 1.0 for t in range(1025)}), ("allowed_token_ids", []), ("allowed_token_ids", [-2]),
    ("allowed_token_ids", list(range(1025))),
])
def test_params_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*got {re_escape(value)}"):
        SamplingParams(**{field: value})


def re_escape(value) -> str:
    import re

    return re.escape(repr(value))
