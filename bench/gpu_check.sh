#!/usr/bin/env bash
# Every GPU test and benchmark, in sections that each fit one 10-minute device call:
#   bash bench/gpu_check.sh tests      # the GPU tests (kernels vs reference, CUDA graphs, HF parity on CUDA)
#   bash bench/gpu_check.sh kernels    # bench/kernels.py: per-kernel table vs the roofline and the peers; humming MoE peer
#   bash bench/gpu_check.sh decode     # the decode step: reference/kernels, eager/graph, transformers, floor
#   bash bench/gpu_check.sh engine     # profile + graph overhead, continuous batching vs waves, prefill profile
#   bash bench/gpu_check.sh serve      # dsv4 serve on the Flash x4 slice + dsv4 bench serve
#   bash bench/gpu_check.sh agent      # the agent workload (multi-turn, shared system prompt), prefix caching off vs on
#   bash bench/gpu_check.sh spec       # speculative decoding: verify cost, simulated acceptance, MTP / n-gram
#   bash bench/gpu_check.sh struct     # structured outputs: decode tok/s with 0/50/100% of 32 requests constrained
#   bash bench/gpu_check.sh all        # all of the above (longer than one device call)
# Expects transformers>=5.23 (and its newer deps: huggingface_hub, tokenizers, httpx2, httpcore2, truststore)
# as wheels in .whl/ when the image's are older; humming-kernels as a wheel for the MoE peer; for the
# serve sections fastapi, starlette, uvicorn, prometheus-client and what they need that the image lacks
# (pydantic, pydantic-core, annotated-types, annotated-doc, typing-inspection, typing-extensions,
# opentelemetry-api, h11, click, anyio, sniffio: all were carried on 2026-11-25); llguidance (the
# grammars of structured outputs: tests/test_gpu_structured.py and the struct section) and, for the
# serve sections' client tests, anthropic (and its deps jiter, distro, docstring-parser).
set -uo pipefail
section=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 DSV4_CACHE=/tmp/dsv4cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/serve_up.sh
status=0
step() { echo; echo "== $1 =="; shift; "$@" || { echo "!! FAILED: $*"; status=1; }; }
tee_to() { local f=$1; shift; "$@" 2>&1 | tee "$OUT/$f"; return "${PIPESTATUS[0]}"; }
want() { [ "$section" = all ] || [ "$section" = "$1" ]; }

nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"

if want tests; then
  step "tiny model on cuda, bf16 (greedy, CUDA graphs)" python3 -m dsv4.cli generate "Once upon a time" --device cuda \
    --dtype bf16 --max-tokens 32 --temperature 0
  # one pytest per file, each with its own time limit, so a slow file cannot hide another's failures
  for f in $(grep -l "mark.gpu\|^gpu = " tests/test_*.py); do
    step "GPU tests: $f" tee_to "pytest_gpu_$(basename "$f" .py).log" timeout 300 python3 -m pytest -q -rf --tb=short -m gpu "$f"
  done
  step "fp32 logit drift per kernel (parity model, 40 decode steps)" tee_to kernel_drift.txt \
    python3 bench/kernel_drift.py --steps 40
  step "silent-corruption hunt: every op of 66 prompt lengths and 32 decode batches on NaN-poisoned memory" \
    tee_to nan_hunt.txt python3 bench/nan_hunt.py
fi
if want kernels; then
  step "per-kernel benchmark" tee_to kernels.txt python3 bench/kernels.py --out "$OUT"
  step "the sampler per decode step, torch vs the kernel" tee_to sampler_bench.txt python3 bench/sampler_bench.py
  step "the indexer's top-k, torch vs the kernel" tee_to topk_bench.txt python3 bench/topk_bench.py
  step "the mHC ops of a decode step (and the Sinkhorn's share)" tee_to mhc_bench.txt python3 bench/mhc_bench.py
  step "the decode router by K splits, torch as the peer" tee_to router_bench.txt python3 bench/router_bench.py
  if python3 -c "import humming" 2>/dev/null; then
    step "MoE vs humming-kernels" tee_to humming_peer.txt python3 bench/humming_peer.py
  else
    echo "(humming-kernels not installed: put its wheel in .whl/ for the MoE peer)"
  fi
fi
if want decode; then
  step "reference linear cost per format" tee_to ref_linear_cost.txt python3 bench/ref_linear_cost.py --rows 1 8
  step "decode step vs transformers and the bytes floor (Flash x4 slice)" tee_to decode_bench.txt \
    python3 bench/decode_bench.py --layers 4 --batch 1 8 32 --context 8192 --format bf16 fp8-mxfp4 fp8-nvfp4 \
      --ops reference-eager kernels-eager kernels-graph
fi
if want engine; then
  for layers in 2 4 8; do
    step "decode profile, graph replay, $layers layers" tee_to "profile_$layers.txt" \
      python3 bench/profile_decode.py --layers "$layers" --format fp8-mxfp4 --batch 1 --ops kernels --graph --top 12
  done
  step "continuous batching vs static waves (Flash x4 slice)" tee_to throughput.txt \
    python3 bench/throughput.py --layers 4 --format fp8-mxfp4 --requests 64 --max-num-seqs 16 --out "$OUT"
  step "continuous batching vs static waves, 256 requests x 32 seqs" tee_to throughput_256x32.txt \
    python3 bench/throughput.py --layers 4 --format fp8-mxfp4 --requests 256 --max-num-seqs 32 --out "$OUT/256x32"
  step "prefill: host vs device time per prompt length" tee_to profile_prefill.txt \
    python3 bench/profile_prefill.py --layers 4 --format fp8-mxfp4
  step "a mixed step (decode rows + one prompt chunk): host vs device time" tee_to profile_mixed.txt \
    python3 bench/profile_mixed.py --layers 4 --format fp8-mxfp4
  step "prefill through the engine vs the FLOP floor and transformers (one forward per step)" tee_to prefill_bench.txt \
    python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192
fi
if want spec; then
  step "speculative decoding vs plain decoding (Flash x4 slice, FP8 + MXFP4, QAT on, graphs)" tee_to spec_bench.txt \
    python3 bench/spec_bench.py --layers 4 --batch 1 8 32 --k 3 --accept 0.5 0.7 0.9 --tokens 128 --context 1024
fi
if want struct; then
  step "structured outputs: decode with 0/50/100% of a batch of 32 constrained by a JSON schema (Flash x4 slice, graphs)" \
    tee_to structured_bench.txt python3 bench/structured_bench.py --layers 4 --batch 32 --tokens 128 --context 256
fi
if want serve; then
  start_random_server 64 300
  step "dsv4 bench serve, 64 concurrent" python3 -m dsv4.cli bench serve -n 256 --concurrency 64 --input-len 512 \
    --output-len 128 --plot "$OUT/bench_serve.png" --json "$OUT/bench_serve.json"
  step "dsv4 bench serve, 1 at a time" python3 -m dsv4.cli bench serve -n 16 --concurrency 1 --input-len 512 \
    --output-len 128 --plot "$OUT/bench_serve_c1.png"
  kill -TERM $server; wait $server
  tail -5 "$OUT/server.log"
fi
if want agent; then
  start_random_server 16 300 36864
  step "agent workload: 16 conversations x 10 turns growing to ~31K tokens, caching off then on" tee_to bench_agent.txt \
    python3 -m dsv4.cli bench serve --dataset agent --conversations 16 --turns 10 --system-len 4096 --turn-len 2560 \
      --output-len 128 --plot "" --json "$OUT/bench_agent.json"
  step "64 users sharing a 4K-token system prompt, caching off then on" tee_to bench_agent_users.txt \
    python3 -m dsv4.cli bench serve --dataset agent --conversations 64 --turns 1 --system-len 4096 --turn-len 256 \
      --output-len 64 --plot "" --json "$OUT/bench_agent_users.json"
  kill -TERM $server; wait $server
  tail -5 "$OUT/server.log"
  step "prefix caching in one process: no-hit cost (prefill, decode), one conversation's TTFT off vs on" \
    tee_to prefix_cost.txt python3 bench/prefix_cost.py --layers 4 --format fp8-mxfp4
fi
exit $status
