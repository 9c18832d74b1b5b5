#!/usr/bin/env bash
# Tensor + expert parallel on the multi-GPU machines, from the repo root:
#   bash bench/tp_check.sh [tests|flash|layers|pro8]     (no argument: tests, flash, layers; each fits one 10-minute call)
# tests:  (2 GPUs) NCCL collectives replayed in a CUDA graph; 2 GPUs vs 1 on the release layout; LLM(tensor_parallel_size=2)
#         with CUDA graphs on both ranks vs one GPU
# flash:  (2 GPUs) full V4-Flash (43 layers, 256 experts, FP8-block + MXFP4, random weights made on the GPUs), TP=2,
#         batch 1/8/32 at 8k context: ms/step, tok/s, bytes floor, per-GPU memory, collective share
# layers: (2 GPUs) 4 and 8 layers on one GPU vs TP=2 (the collectives' cost)
# pro8:   (8 GPUs, nvidia-h200-x8) full V4-Pro (61 layers, 384 experts), TP=8: batch 1/8/32 at 8k and 64k, one 32k prefill
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 DSV4_CACHE=/tmp/dsv4cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # no NVLink multicast, ever
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
status=0
bench() { python3 bench/tp_decode_bench.py --preset flash --weights release --context 8192 "$@"; }
tpn() { local n=$1; shift; python3 -m torch.distributed.run --nproc-per-node "$n" bench/tp_decode_bench.py \
          --weights release --tensor-parallel-size "$n" "$@"; }
nvidia-smi -L
if [[ $what == all || $what == tests ]]; then
  nvidia-smi topo -m
  python3 -m pytest -q -rs -m gpu tests/test_parallel.py tests/test_parallel_llm.py 2>&1 | tee "$OUT/tp_tests.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == all || $what == flash ]]; then
  tpn 2 --preset flash --layers 0 --batch 1 8 32 --context 8192 --steps 10 --comm-share --json "$OUT/tp2_flash.jsonl" \
    2>&1 | tee "$OUT/tp2_flash.txt"; [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == all || $what == layers ]]; then
  for layers in 4 8; do
    bench --layers "$layers" --batch 1 8 32 --steps 10 2>&1 | tee "$OUT/tp1_flash_L$layers.txt" || status=1
    tpn 2 --preset flash --context 8192 --layers "$layers" --batch 1 8 32 --steps 10 2>&1 | tee "$OUT/tp2_flash_L$layers.txt" || status=1
  done
fi
if [[ $what == pro8 ]]; then
  tpn 8 --preset pro --layers 0 --batch 1 8 32 --context 8192 65536 --steps 10 --comm-share \
    --prefill-tokens 32768 --prefill-chunk 4096 --json "$OUT/pro8.jsonl" 2>&1 | tee "$OUT/pro8.txt"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
exit $status
