"""Triton sparse attention, indexer scores and top-k against their references (dsv4.ops.reference).

CPU: Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported) at small ragged
shapes, every store layout (plain, fp8 with e8m0 or fp32 scales; fp4 / plain indexer keys), fp32
and fp16 activations (the interpreter's bf16 is unreliable), decode and prefill, wrapped and
unwrapped rings, CSA (-1 and duplicate indices), HCA (lengths down to 0) and sliding layers,
split and unsplit key ranges, outputs poisoned with NaN. GPU (``-m gpu``): real DeepSeek-V4 shapes
in bf16, and a CUDA-graph replay equal to eager.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():       # CPU: the interpreter (must be set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from dsv4.model.cache import RowStore  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import attention as ka  # noqa: E402
from dsv4.ops.triton import indexer as ki  # noqa: E402
from dsv4.ops.triton import runtime  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if INTERPRET:
    from dsv4.ops.triton import fix_interpreter
    fix_interpreter()
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests run through Triton's interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU (no interpreter)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poison():
    """Kernel outputs and workspaces start as NaN (-1 integers): an element the kernel does not write shows."""
    with runtime.poisoned():
        yield


def _store(layout: str, vals: torch.Tensor, rope: int, dtype: torch.dtype) -> RowStore:
    """A K=V (or indexer key) store holding ``vals [slots, rows, dim]``, written through the cache's encoder."""
    n_slots, rows, dim = vals.shape
    kind, pow2 = {"plain": ("plain", True), "fp8": ("fp8", True), "fp8-f32": ("fp8", False),
                  "fp4": ("fp4", True)}[layout]
    st = RowStore.allocate(kind, n_slots, rows, dim, dtype, vals.device, rope_dim=rope, pow2=pow2)
    st.write(torch.arange(n_slots, device=vals.device).view(-1, 1), torch.arange(rows, device=vals.device).view(1, -1),
             vals)
    return st


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _rope_tables(start, S, rd2, seed, device="cpu"):
    """cos, sin ``[B, S, rd2]`` fp32 at the queries' positions (random frequencies)."""
    t = (start.view(-1, 1) + torch.arange(S, device=start.device)).float().unsqueeze(-1)
    ang = t * torch.rand(rd2, generator=_gen(seed)).to(start.device)
    return dict(cos=ang.cos().to(device), sin=ang.sin().to(device))


def _attn_case(kind, layout, dtype, B, S, H, hd, rope, W, n_ent, k, starts, seed, device="cpu", unrot=False):
    """Random inputs of one attention call: ``starts`` per batch row, slots permuted; ``unrot``: the
    output's inverse RoPE over the last ``max(rope, 8)`` dims at the query positions too."""
    g = _gen(seed)
    n_slots = B + 1
    slots = torch.randperm(n_slots, generator=g)[:B]
    start = torch.tensor(starts)
    q = torch.randn(B, S, H, hd, generator=g)
    kv_new = torch.randn(B, S, hd, generator=g)
    ring = _store(layout, torch.randn(n_slots, W, hd, generator=g).to(device), rope, dtype)
    sink = torch.randn(H, generator=g)
    comp = dict()
    if kind != "sliding":
        ents = _store(layout, torch.randn(n_slots, n_ent + 1, hd, generator=g).to(device), rope, dtype)
        visible = (start.view(-1, 1) + torch.arange(S) + 1) // 4               # [B, S] as a CSA layer would
        visible = visible.clamp(max=n_ent)
        if kind == "csa":
            idx = torch.randint(0, n_ent, (B, S, k), generator=g)
            idx = torch.where(idx < visible.unsqueeze(-1), idx, -1)
            idx[..., 0] = idx[..., 1]                                         # duplicates count twice
            idx[0, 0] = -1                                                    # a query without entries
            comp = dict(comp=ents, comp_idx=idx.to(device))
        else:
            comp = dict(comp=ents, comp_len=visible.to(device), comp_bound=int(visible.max().item()))
    args = (q.to(device, dtype), kv_new.to(device, dtype), ring, slots.to(device), start.to(device), W,
            sink.to(device), hd ** -0.5)
    if unrot:
        comp.update(_rope_tables(start, S, max(rope, 8) // 2, seed + 100, device))
    return args, comp


def _check_attention(args, comp, dtype, **split):
    out = ka.sparse_attention_triton(*args, **comp, **split)
    exp = ref.sparse_attention(*args, **comp)
    assert out.shape == exp.shape and out.dtype == exp.dtype
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert _rel(out, exp) < tol, _rel(out, exp)
    return out


# ----------------------------------------------------------------------------- CPU (interpreter)
@cpu_only
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("layout,dtype", [("plain", torch.float32), ("fp8", torch.float16),
                                          ("fp8-f32", torch.float32)])
def test_attention_decode(kind, layout, dtype, poison):
    """S = 1, slots at different positions: a fresh ring (start 0), a partly filled one, wrapped ones.
    Ragged head dim (nope 52: a short last scale block), 5 heads, key ranges split (flash decoding),
    the splits merged by the last program of each query, which also applies the output's inverse
    RoPE (against the reference attention then ``apply_rope(inverse=True)``)."""
    args, comp = _attn_case(kind, layout, dtype, B=4, S=1, H=5, hd=60, rope=8, W=8, n_ent=12, k=6,
                            starts=[0, 5, 19, 40], seed=1, unrot=True)
    _check_attention(args, comp, dtype)


@cpu_only
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_attention_decode_many_splits(kind, poison):
    """19 key blocks a query, one a split: the merge reads the splits' maxima 16 at a time and their
    partials 4 at a time (attention.MERGE_MAX_BLOCK / MERGE_UNROLL), both with a remainder."""
    args, comp = _attn_case(kind, "fp8", torch.float32, B=2, S=1, H=5, hd=60, rope=8, W=8, n_ent=288, k=280,
                            starts=[1150, 1163], seed=3, unrot=False)
    n_keys = comp["comp_idx"].shape[-1] if kind == "csa" else comp["comp_bound"]
    assert 1 + -(-n_keys // 16) == 19                                # blocks of 16 keys (interpreter tiles)
    _check_attention(args, comp, torch.float32, _target_programs=4096)


@cpu_only
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("layout,dtype,target", [("fp8", torch.float32, 1), ("plain", torch.float16, 64)],
                         ids=["fp8-fp32-unsplit", "plain-fp16-split"])
def test_attention_prefill(kind, layout, dtype, target, poison):
    """S > W (the chunk's own rows slide out of the window), a chunk after a wrapped ring and one
    from position 0; unsplit (one program per query and head block, softmax finished in-kernel)
    and split key ranges merged by the last program of each query."""
    args, comp = _attn_case(kind, layout, dtype, B=2, S=9, H=3, hd=40, rope=8, W=4, n_ent=12, k=5,
                            starts=[13, 0], seed=2, unrot=True)
    _check_attention(args, comp, dtype, _target_programs=target)


@cpu_only
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_attention_prefill_tables_by_groups(kind, poison, monkeypatch):
    """Key tables over the budget (``TABLE_BYTES``) go one group of sequences at a time: the same
    result as all at once."""
    args, comp = _attn_case(kind, "fp8", torch.float32, B=3, S=5, H=3, hd=40, rope=8, W=4, n_ent=12, k=5,
                            starts=[13, 0, 6], seed=8, unrot=True)
    whole = _check_attention(args, comp, torch.float32, _target_programs=1)
    monkeypatch.setattr(ka, "TABLE_BYTES", 1)
    assert torch.equal(_check_attention(args, comp, torch.float32, _target_programs=1), whole)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_prefill_csa_entry_bound(dtype, poison):
    """The unsplit kernel's compressed-entry table holds only ``comp_bound`` entries when the caller
    bounds the indices (the model passes its forward's entry bound): the same result as the whole
    store, and as the reference."""
    args, comp = _attn_case("csa", "fp8", dtype, B=2, S=9, H=3, hd=40, rope=8, W=4, n_ent=12, k=5,
                            starts=[13, 0], seed=7, unrot=True)
    bound = int(comp["comp_idx"].max()) + 1
    assert bound < comp["comp"].rows
    whole = _check_attention(args, comp, dtype, _target_programs=1)
    bounded = _check_attention(args, dict(comp, comp_bound=bound), dtype, _target_programs=1)
    assert torch.equal(bounded, whole)
    with pytest.raises(ka.AttentionKernelError, match="comp_bound"):
        ka.sparse_attention_triton(*args, **dict(comp, comp_bound=comp["comp"].rows + 1))


@cpu_only
@pytest.mark.parametrize("S,starts", [(1, [3, 30]), (6, [0, 9])])
def test_attention_rope_chunk(S, starts, poison):
    """fp8 rows whose rope dims fill exactly the last 64-dim chunk (like 448 + 64): the rope
    part is loaded once per key and placed as that chunk."""
    args, comp = _attn_case("csa", "fp8", torch.float16, B=2, S=S, H=3, hd=128, rope=64, W=8, n_ent=9, k=4,
                            starts=starts, seed=6)
    _check_attention(args, comp, torch.float16)


@cpu_only
def test_attention_mixed_layouts(poison):
    """An fp8 ring with plain compressed entries: one split of the dims (nope | rope) for both."""
    args, comp = _attn_case("csa", "fp8", torch.float32, B=2, S=2, H=3, hd=48, rope=16, W=4, n_ent=9, k=4,
                            starts=[6, 1], seed=5)
    plain = _store("plain", comp["comp"].read(torch.arange(3).view(-1, 1), torch.arange(10).view(1, -1)), 0,
                   torch.float32)
    _check_attention(args, dict(comp=plain, comp_idx=comp["comp_idx"]), torch.float32)


@cpu_only
@pytest.mark.parametrize("target", [1, 64])
def test_attention_sink_takes_the_weight(target, poison):
    """A dominant sink logit (zero value) drives the output to zero: unsplit, and split and merged
    by the last program."""
    split = dict(_target_programs=target)
    args, comp = _attn_case("hca", "plain", torch.float32, B=2, S=1, H=4, hd=32, rope=8, W=4, n_ent=8, k=4,
                            starts=[0, 3], seed=3)
    args = list(args)
    args[6] = torch.full((4,), 80.0)
    out = ka.sparse_attention_triton(*args, **comp, **split)
    assert out.abs().max() < 1e-20
    torch.testing.assert_close(out, ref.sparse_attention(*args, **comp))


@cpu_only
def test_attention_bad_inputs_raise():
    args, comp = _attn_case("csa", "fp8", torch.float32, B=1, S=1, H=2, hd=32, rope=8, W=4, n_ent=8, k=4,
                            starts=[3], seed=4)
    with pytest.raises(ka.AttentionKernelError, match="kv_new"):
        ka.sparse_attention_triton(args[0], args[1][:, :, :16], *args[2:], **comp)
    with pytest.raises(ka.AttentionKernelError, match="comp_idx"):
        ka.sparse_attention_triton(*args, comp=comp["comp"], comp_idx=comp["comp_idx"].float())
    with pytest.raises(ka.AttentionKernelError, match="ring"):
        ka.sparse_attention_triton(*args[:5], 8, *args[6:], **comp)
    fp4 = _store("fp4", torch.randn(2, 4, 32), 0, torch.float32)
    with pytest.raises(ka.AttentionKernelError, match="layout"):
        ka.sparse_attention_triton(*args[:2], fp4, *args[3:], **comp)


def _indexer_case(layout, dtype, B, S, NI, d, rows, seed, device="cpu"):
    g = _gen(seed)
    n_slots = B + 2
    slots = torch.randperm(n_slots, generator=g)[:B]
    q = torch.randn(B, S, NI, d, generator=g)
    if layout == "fp4":
        q = ref.fp4_sim(q)
    keys = _store(layout, torch.randn(n_slots, rows, d, generator=g).to(device), 0, dtype)
    w = torch.randn(B, S, NI, generator=g) * (d ** -0.5 * NI ** -0.5)
    return q.to(device, dtype), keys, slots.to(device), w.to(device)


@cpu_only
@pytest.mark.parametrize("layout,dtype", [("fp4", torch.float32), ("fp4", torch.float16), ("plain", torch.float32),
                                          ("plain", torch.float16)])
@pytest.mark.parametrize("S", [1, 6])
@pytest.mark.parametrize("masked", [False, True, "few"], ids=["all", "visible", "few_visible"])
def test_indexer_scores(layout, dtype, S, masked, poison):
    """Ragged heads (5 of a padded 16), a bound that is not a multiple of the entry tile, decode and
    query blocks with a ragged tail; head weights scaled in-kernel, and (``visible``) the entries
    past each query's visible count written as -inf (what the indexer's mask did in its own launches;
    ``few_visible``: whole key tiles past every query of a block, written without computing)."""
    q, keys, slots, w = _indexer_case(layout, dtype, B=2, S=S, NI=5, d=64, rows=40, seed=10 + S)
    bound, scale = 37, 64 ** -0.5 * 5 ** -0.5
    top = 12 if masked == "few" else bound + 3
    visible = torch.randint(0, top, (2, S), generator=_gen(40 + S)) if masked else None
    out = ki.indexer_scores_triton(q, keys, slots, w, bound, scale, visible)
    exp = ref.indexer_scores(q, keys, slots, w, bound, scale, visible)
    assert out.shape == exp.shape == (2, S, bound) and out.dtype == torch.float32
    assert not out.isnan().any()
    if masked:                                      # the mask is exact: -inf at the same entries
        hidden = torch.arange(bound) >= visible.unsqueeze(-1)
        assert torch.equal(out == float("-inf"), hidden) and torch.equal(exp == float("-inf"), hidden)
        out, exp = out.masked_fill(hidden, 0.0), exp.masked_fill(hidden, 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert _rel(out, exp) < tol


@cpu_only
def test_indexer_bad_inputs_raise():
    q, keys, slots, w = _indexer_case("fp4", torch.float32, B=1, S=1, NI=4, d=32, rows=8, seed=20)
    with pytest.raises(ka.AttentionKernelError, match="bound"):
        ki.indexer_scores_triton(q, keys, slots, w, 9)
    with pytest.raises(ka.AttentionKernelError, match="weights"):
        ki.indexer_scores_triton(q, keys, slots, w[..., :2], 4)
    with pytest.raises(ka.AttentionKernelError, match="keys"):
        ki.indexer_scores_triton(q.half(), keys, slots, w, 4)


def _scores_with_ties(shape, seed, device="cpu"):
    """Random scores with exact ties (zeros as ReLU makes them), -0.0 and -inf (masked entries)."""
    x = torch.randn(*shape, generator=_gen(seed)).to(device)
    x[..., ::5] = 0.0
    x[..., 1::9] = -0.0
    x[..., 2::7] = float("-inf")
    return x


@cpu_only
def test_topk_indices_single_chunk(poison):
    """Exactly the reference's picks, in its order (ascending index): ties to the lowest index, -0 ties
    +0, -inf picked last."""
    x = _scores_with_ties((2, 3, 37), 30)
    limit = torch.randint(0, 40, (2, 3), generator=_gen(33))
    for k in (5, 37):
        assert torch.equal(ki.topk_indices_triton(x, k), ref.topk_indices(x, k))
        got = ki.topk_indices_triton(x, k, limit)     # picks at or past a row's limit -> -1
        assert torch.equal(got, ref.topk_indices(x, k, limit))
        assert torch.equal(got, torch.where(ref.topk_indices(x, k) < limit.unsqueeze(-1), ref.topk_indices(x, k), -1))


@cpu_only
def test_topk_indices_tiles(poison, monkeypatch):
    """Rows longer than one tile: the histograms and the running counts of the last pass carry
    across tiles (picks in several tiles, ties of the k-th value split by a tile edge)."""
    monkeypatch.setattr(ki, "TOPK_BLOCK", 16)
    x = _scores_with_ties((1, 2, 70), 31)
    for k in (4, 33, 70):
        assert torch.equal(ki.topk_indices_triton(x, k), ref.topk_indices(x, k))
        limit = torch.tensor([[3, 70]])
        assert torch.equal(ki.topk_indices_triton(x, k, limit), ref.topk_indices(x, k, limit))
    x = torch.full((1, 1, 50), 1.5)                   # every score equal: the first k indices
    assert ki.topk_indices_triton(x, 20).tolist() == [[list(range(20))]]


@cpu_only
def test_topk_indices_levels(poison, monkeypatch):
    """Rows longer than TOPK_SPLIT: chunks ranked apart, then their picks (read through their
    indices, the padding of short chunks skipped), in up to three levels; ties across chunks still
    go to the lowest index."""
    monkeypatch.setattr(ki, "TOPK_BLOCK", 16)
    monkeypatch.setattr(ki, "TOPK_SPLIT", 24)
    # (1, 66): a short last chunk (2 scores, 2 padding slots), alone in the second level's last chunk
    for shape, k, seed in (((1, 2, 70), 4, 31), ((2, 300), 7, 32), ((1, 1, 1000), 5, 33), ((3, 200), 70, 34),
                           ((1, 66), 4, 35)):
        x = _scores_with_ties(shape, seed)
        assert torch.equal(ki.topk_indices_triton(x, k), ref.topk_indices(x, k)), (shape, k)
        limit = torch.randint(0, shape[-1] + 1, shape[:-1], generator=_gen(seed))
        assert torch.equal(ki.topk_indices_triton(x, k, limit), ref.topk_indices(x, k, limit)), (shape, k)
    x = torch.full((1, 500), 1.5)
    assert ki.topk_indices_triton(x, 20).tolist() == [list(range(20))]


# ----------------------------------------------------------------------------- GPU (real shapes)
FLASH, PRO = dict(H=64, topk=512), dict(H=128, topk=1024)


def _real_attention(kind, geo, layout, B, S, ctx, seed=0):
    """Real DeepSeek-V4 attention inputs on the GPU, bf16: hd 512 (448 FP8 + 64 rope when ``fp8``),
    window 128, CSA ratio 4 with the model's top-k (indices picked at random among the visible
    entries, -1 past them), HCA ratio 128. Slots permuted, positions ``ctx - S - 37 b``."""
    dev, W, hd, H = "cuda", 128, 512, geo["H"]
    g = torch.Generator(device=dev).manual_seed(seed)
    n_slots = B + 1
    slots = torch.randperm(n_slots, device=dev, generator=g)[:B]
    start = torch.tensor([max(0, ctx - S - 37 * b) for b in range(B)], device=dev)
    t = start.view(-1, 1) + torch.arange(S, device=dev)
    ratio = 4 if kind == "csa" else 128
    n_ent = max(1, ctx // ratio)
    ring = _store(layout, torch.randn(n_slots, W, hd, device=dev), 64, torch.bfloat16)
    ents = _store(layout, torch.randn(n_slots, n_ent + 1, hd, device=dev), 64, torch.bfloat16)
    visible = ((t + 1) // ratio).clamp(max=n_ent)
    if kind == "csa":
        k = min(geo["topk"], n_ent)
        scores = torch.rand(B, S, n_ent, device=dev, generator=g)
        scores = scores.masked_fill(torch.arange(n_ent, device=dev) >= visible.unsqueeze(-1), -1.0)
        idx = scores.topk(k, dim=-1).indices
        comp = dict(comp=ents, comp_idx=torch.where(idx < visible.unsqueeze(-1), idx, -1))
    else:
        comp = dict(comp=ents, comp_len=visible, comp_bound=n_ent)
    q = torch.randn(B, S, H, hd, device=dev, generator=g).bfloat16()
    kv_new = torch.randn(B, S, hd, device=dev, generator=g).bfloat16()
    sink = torch.randn(H, device=dev, generator=g)
    comp.update(_rope_tables(start, S, 32, seed + 100, dev))           # the output's inverse RoPE, as the model asks
    return (q, kv_new, ring, slots, start, W, sink, hd ** -0.5), comp


def _check_gpu(args, comp, **split):
    out = ka.sparse_attention_triton(*args, **comp, **split)
    exp = ref.sparse_attention(*args, **comp)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert _rel(out, exp) < 1e-2, _rel(out, exp)
    return out


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("geo", [FLASH, PRO], ids=["flash", "pro"])
@pytest.mark.parametrize("layout", ["fp8", "plain"])
@pytest.mark.parametrize("B,ctx", [(1, 8192), (8, 4096), (32, 700)])
def test_gpu_attention_decode(kind, geo, layout, B, ctx, poison):
    args, comp = _real_attention(kind, geo, layout, B, 1, ctx)
    _check_gpu(args, comp)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("S,ctx", [(384, 384), (640, 2000)])
def test_gpu_attention_prefill(kind, S, ctx, poison):
    """A first chunk from position 0 and one after a wrapped ring, Flash geometry, FP8 stores."""
    args, comp = _real_attention("csa" if kind == "sliding" else kind, FLASH, "fp8", 1, S, ctx)
    _check_gpu(args, dict(cos=comp["cos"], sin=comp["sin"]) if kind == "sliding" else comp)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind,B,S", [("csa", 1, 1), ("sliding", 1, 1), ("hca", 1, 1), ("csa", 8, 1), ("hca", 32, 1),
                                      ("csa", 1, 300)])
def test_gpu_attention_cuda_graph_replay_equals_eager(kind, B, S):
    """Replayed many times with new queries, the graph gives eager's output bitwise each time: the
    last program of each split query merges and re-arms its counter (a counter left armed would
    merge too early or never on the next replay)."""
    args, comp = _real_attention("csa" if kind == "sliding" else kind, FLASH, "fp8", B, S, 4096)
    if kind == "sliding":
        comp = dict(cos=comp["cos"], sin=comp["sin"])
    eager = ka.sparse_attention_triton(*args, **comp)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = ka.sparse_attention_triton(*args, **comp)
    for i in range(30):
        args[0].copy_(torch.randn_like(args[0]))      # new queries in the captured buffer
        static.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(static, ka.sparse_attention_triton(*args, **comp), rtol=0, atol=0)
        assert not torch.equal(static, eager)


@pytest.mark.gpu
@cuda
def test_gpu_attention_split_merge_is_deterministic():
    """Split keys merged by the last program (atomic counter): right, and bitwise the same on every
    run whichever program finishes last (a race would show)."""
    args, comp = _real_attention("csa", PRO, "fp8", 4, 1, 8192, seed=3)
    first = _check_gpu(args, comp)
    for _ in range(20):
        assert torch.equal(ka.sparse_attention_triton(*args, **comp), first)


def _real_indexer(layout, B, S, bound, dev="cuda", seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    n_slots = B + 1
    slots = torch.randperm(n_slots, device=dev, generator=g)[:B]
    q = torch.randn(B, S, 64, 128, device=dev, generator=g)
    if layout == "fp4":
        q = ref.fp4_sim(q)
    keys = _store(layout, torch.randn(n_slots, bound + 1, 128, device=dev, generator=g), 0, torch.bfloat16)
    w = torch.randn(B, S, 64, device=dev, generator=g) * (128 * 64) ** -0.5
    return q.bfloat16(), keys, slots, w


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout", ["fp4", "plain"])
@pytest.mark.parametrize("B,S,bound", [(1, 1, 2048), (8, 1, 16384), (32, 1, 500), (1, 700, 1024), (2, 4000, 1000)])
def test_gpu_indexer_scores(layout, B, S, bound, poison):
    """Real shapes; the last case a prompt's causal visibility (an entry per 4 tokens), so that most
    query blocks skip key tiles."""
    q, keys, slots, w = _real_indexer(layout, B, S, bound)
    scale = (128 * 64) ** -0.5
    if S >= 4000:
        visible = ((torch.arange(S, device="cuda") + 1) // 4).expand(B, S).contiguous()
    else:
        visible = torch.randint(0, bound + 1, (B, S), device="cuda")
    out = ki.indexer_scores_triton(q, keys, slots, w, bound, scale, visible)
    exp = ref.indexer_scores(q, keys, slots, w, bound, scale, visible)
    assert not out.isnan().any()
    hidden = torch.arange(bound, device="cuda") >= visible.unsqueeze(-1)
    assert torch.equal(out == float("-inf"), hidden)
    out, exp = out.masked_fill(hidden, 0.0), exp.masked_fill(hidden, 0.0)
    assert _rel(out, exp) < 1e-4, _rel(out, exp)     # exact products, fp32 sums in another order


@pytest.mark.gpu
@cuda
def test_gpu_indexer_cuda_graph_replay_equals_eager():
    """The indexer's decode launches as the model makes them (scaled weights, visibility mask, top-k
    with -1 past the visible entries), captured and replayed with new queries and positions."""
    q, keys, slots, w = _real_indexer("fp4", 8, 1, 4096)
    visible = torch.randint(0, 4097, (8, 1), device="cuda")
    scale = (128 * 64) ** -0.5

    def picks():
        return ki.topk_indices_triton(ki.indexer_scores_triton(q, keys, slots, w, 4096, scale, visible), 512, visible)
    picks()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = picks()
    for _ in range(3):
        q.copy_(ref.fp4_sim(torch.randn_like(q.float())).bfloat16())
        visible.random_(0, 4097)
        graph.replay()
        torch.testing.assert_close(static, picks(), rtol=0, atol=0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape,k", [((1, 1, 2048), 512), ((8, 1, 16384), 512), ((32, 1, 4096), 1024),
                                     ((1, 700, 1024), 512), ((1, 1, 65536), 1024)])
def test_gpu_topk_indices(shape, k, poison):
    x = _scores_with_ties(shape, 32, "cuda")
    assert torch.equal(ki.topk_indices_triton(x, k), ref.topk_indices(x, k))
    limit = torch.randint(0, shape[-1] + 1, shape[:-1], device="cuda")
    assert torch.equal(ki.topk_indices_triton(x, k, limit), ref.topk_indices(x, k, limit))


@pytest.mark.gpu
@cuda
def test_gpu_ops_dispatch_uses_the_kernels():
    """``dsv4.ops`` hands CUDA attention / indexer calls to these kernels."""
    from dsv4 import ops
    assert ops.implementation("sparse_attention", torch.device("cuda")) is ka.sparse_attention_triton
    assert ops.implementation("indexer_scores", torch.device("cuda")) is ki.indexer_scores_triton
    assert ops.implementation("topk_indices", torch.device("cuda")) is ki.topk_indices_triton
