#!/usr/bin/env bash
# The GPU checks of bench/gpu_check.sh cut to fit 10-minute device calls, each step under its own
# time limit so a slow step returns its partial log instead of eating the call; logs land in $OUT.
#   bash bench/gpu_quick.sh STEP [STEP ...]   (several steps fit one call; default: tests)
# steps: warmup (no compile after the start-up warm-up), small (numerics, small-op + attention kernels),
#   graphs (CUDA-graph/engine tests), moe, linear (kernel tests at real shapes; linear_fp4: the FP4
#   ones), parity (HF parity on CUDA), profile (graph replay: time outside kernels at 2 and 8
#   layers; prefill: one prompt's host vs device time; prefillbench: bench/prefill_bench.py at 512 and
#   8192 tokens a step), throughput (continuous batching vs waves, 64 requests x 16 seqs; throughput32: 256 x
#   32), serve (dsv4 bench serve on a random Flash slice; serve8k: 8000-token prompts, concurrency 16), decode (the decode step vs the floor),
#   fused (GPU tests of the decode fusions and split graphs, one pytest), agent (issue 27's agent workload + serve8k's TTFT on one server), spec_profile (verify step's kernels),
#   spec_zero (issue 25: engine tokens/s with always-wrong drafts vs plain, batch 1 and 32),
#   tune (decode GEMV tiling search), perf (per-kernel table; perf_moe: its MoE rows), humming (the
#   humming-kernels MoE peer vs our fused MoE: W4A16 MXFP4, Flash, 1/8/32 tokens; bench/humming_peer.py);
#   mixed (bench/profile_mixed.py: decode rows + one prompt chunk in one step, host vs device time),
#   struct (issue 26: the structured-outputs GPU tests, then decode tok/s 0/50/100% constrained),
#   graphs_engine (graph replay = eager steps through the engine, also with decode steps in prompt steps),
#   agent_users (64 users sharing a system prompt, then one conversation alone; caching off then on;
#   users: the first alone; agent_convs: 16 conversations x 10 turns, then one alone), spec_struct (the speculative and structured-outputs GPU tests),
#   prefill_kernels (issue 22: the prefill kernels' GPU tests, then prefill_bench at 2048 and 8192 tokens),
#   moe_wt (issue 22: the MXFP4 grouped GEMMs of moe_grouped._gemm_wt against the others, tests and tile search),
#   spec_tests (the verify step's GPU tests: rollback kernel, speculative graphs, the mixed varlen step),
#   prefix (issue 27: prefix-caching GPU tests + bench/prefix_cost.py: no-hit cost, one conversation's TTFT off/on),
#   nan_hunt / nan_hunt_fp32 (bench/nan_hunt.py: ops reading memory they do not own, on NaN-poisoned memory),
#   sampler (the sampler kernel's GPU tests, bench/sampler_bench.py, the decode step with every row sampling: torch sampler vs kernel),
#   prefill_gemms (the prefill MoE's bf16 tile decode, the W8A8 GEMM, wo_a's einsum: tests and timings),
#   indexer_tune (bench/indexer_tune.py: the indexer's prefill tiles at 8192 tokens, then its GPU tests),
#   moe_tune (bench/moe_decode_tune.py: the decode MoE's tiles), moe_paths (its GEMV against the grouped tiles at 1-32 tokens), router (bench/router_bench.py), mhc (bench/mhc_bench.py: the mHC ops of a decode step, the Sinkhorn's share), profile_b8 (the batch-8 step's kernels),
#   tcache_save / tcache_load (the Triton cache as $OUT/triton_cache.tgz.part*; copy them into .whl/, or
#   recompress them there as one .whl/triton_cache.txz: cat parts | gunzip | xz -9; load: a later call,
#   on a fresh machine, skips the compiles);
#   groups: tests = warmup small graphs moe linear, engine = throughput throughput32 serve decode
set -uo pipefail
steps=("${@:-tests}")
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 DSV4_CACHE=/tmp/dsv4cache
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
export DSV4_REPORT_AT_ONCE=1   # tests print each failure at once (tests/conftest.py)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/serve_up.sh
t() { local s=$1 f=$2; shift 2; echo "== $f ($(date +%T))"; timeout "$s" "$@" > "$OUT/$f" 2>&1; echo "rc=$?" >> "$OUT/$f"; tail -6 "$OUT/$f"; }
pt() { local s=$1 f=$2; shift 2; t "$s" "$f" python3 -m pytest -q -rf --tb=short --maxfail=4 -m gpu "$@"; }
run_step() {
case $1 in
tests) for x in warmup small graphs moe linear; do run_step $x; done ;;
engine) for x in throughput throughput32 serve decode; do run_step $x; done ;;
warmup) pt 300 warmup.log -s tests/test_gpu_warmup.py tests/test_gpu_no_stall.py ;;
small) pt 150 small_attn_tests.log tests/test_triton_numerics.py tests/test_triton_small.py \
  tests/test_triton_attention.py ;;
graphs) pt 420 graphs.log tests/test_cuda_graph_capture.py tests/test_cuda_graphs_engine.py tests/test_gpu_batched_step.py ;;
moe) pt 150 moe_tests.log tests/test_triton_moe.py ;;
linear) pt 580 linear_tests.log tests/test_triton_linear.py ;;   # cold Triton cache: ~10 s a test
linear_fp4) pt 330 linear_fp4_tests.log tests/test_triton_linear.py -k "fp4 or cuda_graph" ;;
parity) pt 90 parity.log tests/test_parity_hf.py ;;
profile)
  for layers in 2 8; do
    t 60 "profile_$layers.txt" python3 bench/profile_decode.py --layers "$layers" --format fp8-mxfp4 --batch 1 --ops kernels --graph --top 12
  done
  ;;
prefill) t 240 profile_prefill.txt python3 bench/profile_prefill.py --layers 4 --format fp8-mxfp4
  ;;
prefillbench)   # one forward per step (8192 tokens) vs the old per-chunk shape (512), transformers as the peer
  t 200 prefill_bench_512.txt python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 512 \
    --lengths 512 2048 8192 --no-hf --profile-len 512
  t 380 prefill_bench.txt python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 \
    --lengths 512 2048 8192 32768 131072
  ;;
throughput)
  t 240 throughput.txt python3 bench/throughput.py --layers 4 --format fp8-mxfp4 --requests 64 --max-num-seqs 16 --out "$OUT"
  ;;
throughput32)
  t 300 throughput_256x32.txt python3 bench/throughput.py --layers 4 --format fp8-mxfp4 --requests 256 --max-num-seqs 32 \
    --out "$OUT/256x32"
  ;;
serve)
  start_random_server 32 150
  echo "server up ($(date +%T))"; grep -E "warm-up|captured" "$OUT/server.log"
  t 120 bench_serve.txt python3 -m dsv4.cli bench serve -n 128 --concurrency 32 --input-len 512 --output-len 128 \
    --plot "$OUT/bench_serve.png" --json "$OUT/bench_serve.json"
  # (a seed of its own: the first run's prompts again would hit the server's prefix cache)
  t 60 bench_serve_c1.txt python3 -m dsv4.cli bench serve -n 8 --concurrency 1 --input-len 512 --output-len 128 --seed 1
  kill -TERM $server; wait $server; tail -3 "$OUT/server.log"
  ;;
serve8k)   # the agents' workload: 8000-token prompts, 16 at a time (TTFT is what they wait for)
  start_random_server 16 200 12288   # the padded random-text tokenizer makes "8000" prompts of up to ~11K tokens
  echo "server up ($(date +%T))"; grep -E "warm-up|captured" "$OUT/server.log"
  t 150 bench_serve_8k.txt python3 -m dsv4.cli bench serve -n 32 --concurrency 16 --input-len 8000 --output-len 128 \
    --json "$OUT/bench_serve_8k.json"
  t 60 bench_serve_8k_c1.txt python3 -m dsv4.cli bench serve -n 4 --concurrency 1 --input-len 8000 --output-len 128 \
    --seed 1   # not the first run's prompts, which the server's prefix cache holds
  kill -TERM $server; wait $server; tail -3 "$OUT/server.log"
  ;;
agent)   # issue 27's agent workload (caching off, then on): one conversation alone (a turn's own TTFT), 64 users
  # sharing a system prompt, 16 conversations at once; then the 8K-prompt TTFT against the same server
  start_random_server 16 200 36864
  echo "server up ($(date +%T))"; grep -E "warm-up|captured" "$OUT/server.log"
  t 120 bench_agent_1.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 1 --turns 10 --system-len 4096 \
    --turn-len 2560 --output-len 128 --plot "" --json "$OUT/bench_agent_1.json"
  t 90 bench_agent_users.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 64 --turns 1 \
    --system-len 4096 --turn-len 256 --output-len 64 --plot "" --json "$OUT/bench_agent_users.json"
  t 240 bench_agent.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 16 --turns 10 --system-len 4096 \
    --turn-len 2560 --output-len 128 --plot "" --json "$OUT/bench_agent.json"
  t 120 bench_serve_8k.txt python3 -m dsv4.cli bench serve -n 32 --concurrency 16 --input-len 8000 --output-len 128 \
    --json "$OUT/bench_serve_8k.json"
  kill -TERM $server; wait $server; tail -3 "$OUT/server.log"
  ;;
fused)   # the third session's decode fusions and split graphs: their GPU tests in one pytest (strict: no silent reference fallback)
  t 240 fused_tests.log env DSV4_STRICT_KERNELS=1 python3 -m pytest -q -rf --tb=short -m gpu --maxfail=10 \
    tests/test_triton_small.py tests/test_triton_moe.py tests/test_triton_attention.py tests/test_gpu_structured.py \
    tests/test_cuda_graphs_engine.py tests/test_triton_linear.py -k "not gpu_linear_real_shapes and not fp32_scales and not grouped_wo_a"
  ;;
spec_profile)   # the kernels of a verify step (1 + 3 tokens a row) against decode steps of 1 and 4 rows
  t 240 spec_profile.txt python3 bench/spec_bench.py --layers 4 --batch 1 --k 3 --tables cost profile --steps 20
  ;;
spec_zero)   # issue 25's batch-32 target: the engine with always-wrong drafts against plain decoding (<= 5% lost)
  t 400 spec_zero.txt python3 bench/spec_bench.py --layers 4 --batch 1 32 --k 3 --tables zero --tokens 512
  ;;
decode)
  t 170 decode_bench.txt python3 bench/decode_bench.py --layers 4 --batch 1 8 32 --context 8192 --format fp8-mxfp4 \
    --ops kernels-graph --steps 10
  ;;
mixed) t 150 profile_mixed.txt python3 bench/profile_mixed.py --layers 4 --format fp8-mxfp4 ;;
struct)
  pt 200 struct_tests.log tests/test_gpu_structured.py
  t 160 structured_bench.txt python3 bench/structured_bench.py --layers 4 --batch 32 --tokens 128 --context 256
  ;;
graphs_engine) pt 240 graphs_engine.log tests/test_cuda_graphs_engine.py ;;
users)   # issue 27's shared-system-prompt case alone (64 users, caching off then on)
  start_random_server 16 200 8192
  echo "server up ($(date +%T))"; grep -E "warm-up|captured" "$OUT/server.log"
  t 90 bench_agent_users.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 64 --turns 1 \
    --system-len 4096 --turn-len 256 --output-len 64 --plot "" --json "$OUT/bench_agent_users.json"
  kill -TERM $server; wait $server; tail -3 "$OUT/server.log"
  ;;
users8k)   # the users step and serve8k's TTFT on one server (12288 positions: both fit)
  start_random_server 16 200 12288
  echo "server up ($(date +%T))"; grep -E "warm-up|captured" "$OUT/server.log"
  t 90 bench_agent_users.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 64 --turns 1 \
    --system-len 4096 --turn-len 256 --output-len 64 --plot "" --json "$OUT/bench_agent_users.json"
  t 100 bench_serve_8k.txt python3 -m dsv4.cli bench serve -n 32 --concurrency 16 --input-len 8000 --output-len 128 \
    --json "$OUT/bench_serve_8k.json"
  kill -TERM $server; wait $server; tail -3 "$OUT/server.log"
  ;;
spec_struct) pt 300 spec_struct_tests.log tests/test_gpu_speculative.py tests/test_gpu_structured.py ;;
agent_convs)   # issue 27's agent workload through the server: 16 conversations x 10 turns, then one alone
  start_random_server 16 200 36864
  echo "server up ($(date +%T))"; grep -E "warm-up|captured" "$OUT/server.log"
  t 260 bench_agent.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 16 --turns 10 --system-len 4096 \
    --turn-len 2560 --output-len 128 --plot "" --json "$OUT/bench_agent.json"
  t 150 bench_agent_1.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 1 --turns 10 --system-len 4096 \
    --turn-len 2560 --output-len 128 --plot "" --json "$OUT/bench_agent_1.json"
  kill -TERM $server; wait $server; tail -3 "$OUT/server.log"
  ;;
agent_users)   # issue 27's shared-system-prompt case alone, and one conversation alone (a turn's own TTFT)
  start_random_server 16 200 36864
  echo "server up ($(date +%T))"; grep -E "warm-up|captured" "$OUT/server.log"
  t 90 bench_agent_users.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 64 --turns 1 \
    --system-len 4096 --turn-len 256 --output-len 64 --plot "" --json "$OUT/bench_agent_users.json"
  t 120 bench_agent_1.txt python3 -m dsv4.cli bench serve --dataset agent --conversations 1 --turns 10 --system-len 4096 \
    --turn-len 2560 --output-len 128 --plot "" --json "$OUT/bench_agent_1.json"
  kill -TERM $server; wait $server; tail -3 "$OUT/server.log"
  ;;
prefix)   # issue 27: the prefix-caching GPU tests, then bench/prefix_cost.py (no-hit cost, a conversation's TTFT)
  pt 300 prefix_tests.log tests/test_gpu_prefix_cache.py
  t 400 prefix_cost.txt python3 bench/prefix_cost.py --layers 4 --format fp8-mxfp4
  ;;
prefix_short)   # prefix_cost's decode (no-hit cost) and a conversation of shorter turns (768 tokens)
  t 200 prefix_cost_short.txt python3 bench/prefix_cost.py --layers 4 --format fp8-mxfp4 --lengths --burst 0 \
    --turns 12 --turn-len 768
  ;;
spec_cost_zero)   # issue 25: a verify step's cost against a decode step, then the zero-acceptance table
  t 400 spec_cost_zero.txt python3 bench/spec_bench.py --layers 4 --batch 1 32 --k 3 --tables cost zero --tokens 512
  ;;
nan_hunt)   # bench/nan_hunt.py: every op of many step shapes on NaN-poisoned memory (one dtype a step: nan_hunt_bf16 first)
  t 280 nan_hunt_bf16.txt python3 bench/nan_hunt.py --dtype bf16-qat ;;
nan_hunt_fp32) t 400 nan_hunt_fp32.txt python3 bench/nan_hunt.py --dtype fp32 ;;
spec_tests) pt 200 spec_tests.log tests/test_triton_rollback.py tests/test_gpu_speculative.py tests/test_gpu_batched_step.py ;;
sampler)   # the sampler kernel: its GPU tests, the sampler alone (reference vs kernel), the decode step sampling
  pt 120 sampler_tests.log tests/test_triton_sampling.py
  t 120 sampler_bench.txt python3 bench/sampler_bench.py
  t 150 decode_sampled_ref.txt env DSV4_KERNELS_OFF=draw_tokens python3 bench/decode_bench.py --layers 4 --batch 1 8 32 \
    --context 8192 --format fp8-mxfp4 --ops kernels-graph --steps 10 --no-hf --temperature 0.7
  t 150 decode_sampled.txt python3 bench/decode_bench.py --layers 4 --batch 1 8 32 --context 8192 --format fp8-mxfp4 \
    --ops kernels-graph --steps 10 --no-hf --temperature 0.7
  ;;
tcache_save)   # in parts of 15 MB (a file that comes back from the device is at most 16 MB; ~20 MB in all, 2026-11-27)
  tar czf - -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")" | split -b 15M - "$OUT/triton_cache.tgz.part"
  ls -la "$OUT"/triton_cache.tgz.part* ;;
tcache_load)   # gzip parts as tcache_save writes them, or one xz file (recompressed here: ~4x smaller, 2026-11-28)
  if [ -f .whl/triton_cache.txz ]; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' .whl/triton_cache.txz \
      | tar xf - -C "$(dirname "$TRITON_CACHE_DIR")" && echo "triton cache loaded"
  else
    ls .whl/triton_cache.tgz.part* >/dev/null 2>&1 && cat .whl/triton_cache.tgz.part* | tar xzf - -C "$(dirname "$TRITON_CACHE_DIR")" \
      && echo "triton cache loaded"
  fi ;;
prefill_kernels)   # issue 22, third session: the prefill kernels' GPU tests (MoE transposed, mHC on tensor cores, indexer blocks), then prefill_bench
  pt 300 prefill_kernel_tests.log tests/test_triton_moe.py tests/test_triton_small.py tests/test_triton_attention.py \
    -k "weight_rows or (real_shapes and mxfp4) or gpu_mhc or gpu_indexer"
  t 240 prefill_bench_8192.txt python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf
  ;;
moe_wt)   # issue 22: the MXFP4 grouped GEMMs transposed (moe_grouped._gemm_wt) against untransposed, then their tests
  t 150 moe_wt_3000.txt python3 bench/moe_prefill_tune.py --tokens 3000 --cases 7 11 --bm 64 128
  t 150 moe_wt_8192.txt python3 bench/moe_prefill_tune.py --tokens 8192 --cases 2 11
  pt 240 moe_wt_tests.log tests/test_triton_moe.py -k "weight_rows or (real_shapes and mxfp4)"
  ;;
prefill_gemms)   # the third session of 2026-11-28: MXFP4 tiles in bf16, the W8A8 GEMM, wo_a's einsum (tests, then timings)
  pt 240 prefill_gemm_tests.log tests/test_triton_numerics.py tests/test_triton_moe.py tests/test_triton_linear.py \
    -k "gpu_numerics or bf16_decode or weight_rows_on_the_mma_m_side_real or grouped_wo_a or (real_shapes and flash and fp8)"
  t 200 moe_prefill_bf16_decode.txt python3 bench/moe_prefill_tune.py --tokens 8192 --cases 11 --decode both
  t 150 tune_w8a8.txt python3 bench/tune_linear.py w8a8 ;;
indexer_tune)   # the indexer's prefill scores: tile configs at one 8192-token prompt's shape, then its GPU tests
  t 200 indexer_tune.txt python3 bench/indexer_tune.py --tokens 8192
  pt 150 indexer_tests.log tests/test_triton_attention.py -k indexer ;;
tune) t 420 tune_skinny.txt python3 bench/tune_skinny.py --geo flash --batch 1 ;;
perf_moe) t 300 kernels_moe.txt python3 bench/kernels.py --families moe --out "$OUT/moe" ;;
perf) t 560 kernels.txt python3 bench/kernels.py --out "$OUT" ;;
humming) t 200 humming_peer.txt python3 bench/humming_peer.py ;;
mhc) t 150 mhc_bench.txt python3 bench/mhc_bench.py ;;
router) t 120 router_bench.txt python3 bench/router_bench.py ;;
moe_tune)   # the decode MoE's tiles by measurement: compile the grid in 8 processes, then time it in one
  for i in 0 1 2 3 4 5 6 7; do timeout 400 python3 bench/moe_decode_tune.py --compile-only --part $i/8 > "$OUT/moe_tune_compile_$i.log" 2>&1 & done; wait
  t 300 moe_decode_tune.txt python3 bench/moe_decode_tune.py ;;
moe_paths)   # the decode MoE at 1-32 tokens: the decode GEMV kernels against the grouped tiles (moe.MXFP4_DECODE_MAX_PAIRS)
  t 80 moe_decode_gemv.txt python3 bench/moe_decode_tune.py --tokens 1 8 16 32 --configs 0 --max-pairs 192
  t 200 moe_decode_grouped.txt python3 bench/moe_decode_tune.py --path grouped --tokens 1 8 16 32 ;;
profile_b8) t 120 profile4_b8.txt python3 bench/profile_decode.py --layers 4 --format fp8-mxfp4 --batch 8 --context 8192 \
  --ops kernels --graph --top 14 ;;
*) echo "unknown step $1"; exit 2 ;;
esac
}
for step in "${steps[@]}"; do run_step "$step"; done
