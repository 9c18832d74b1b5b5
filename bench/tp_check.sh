#!/usr/bin/env bash
# Tensor + expert parallel on the 2-GPU machine (nvidia-h200-x2), from the repo root:
#   bash bench/tp_check.sh [tests|flash|layers]      (no argument: all three; each fits one 10-minute call)
# tests:  NCCL collectives replayed in a CUDA graph; 2 GPUs vs 1 on the release layout (random weights)
# flash:  full V4-Flash (43 layers, 256 experts, FP8-block + MXFP4, random weights made on the GPUs), TP=2,
#         batch 1/8/32 at 8k context: ms/step, tok/s, bytes floor, per-GPU memory
# layers: 4 and 8 layers on one H200 vs TP=2 (the collectives' cost)
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 DSV4_CACHE=/tmp/dsv4cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # no NVLink multicast, ever
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
status=0
bench() { python3 bench/tp_decode_bench.py --preset flash --weights release --context 8192 --skip-prefill "$@"; }
tp2() { python3 -m torch.distributed.run --nproc-per-node 2 bench/tp_decode_bench.py --preset flash --weights release \
          --context 8192 --skip-prefill --tensor-parallel-size 2 "$@"; }
nvidia-smi -L
if [[ $what == all || $what == tests ]]; then
  nvidia-smi topo -m
  python3 -m pytest -q -rs -m gpu tests/test_parallel.py 2>&1 | tee "$OUT/tp_tests.log" || status=1
fi
if [[ $what == all || $what == flash ]]; then
  tp2 --layers 0 --batch 1 8 32 --steps 5 2>&1 | tee "$OUT/tp2_flash.txt" || status=1
fi
if [[ $what == all || $what == layers ]]; then
  for layers in 4 8; do
    bench --layers "$layers" --batch 1 8 32 --steps 10 2>&1 | tee "$OUT/tp1_flash_L$layers.txt" || status=1
    tp2 --layers "$layers" --batch 1 8 32 --steps 10 2>&1 | tee "$OUT/tp2_flash_L$layers.txt" || status=1
  done
fi
exit $status
