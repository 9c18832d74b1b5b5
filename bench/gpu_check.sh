#!/usr/bin/env bash
# Every GPU test and benchmark in one call (run on the device machine from the repo root):
#   bash bench/gpu_check.sh
# Expects transformers>=5.23 wheels in .whl/ when the image's transformers is older.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 DSV4_CACHE=/tmp/dsv4cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
status=0
echo "== tiny model on cuda, bf16 and fp32 (greedy) =="
python3 -m dsv4.cli generate "Once upon a time" --device cuda --dtype bf16 --max-tokens 48 --temperature 0 || status=1
python3 -m dsv4.cli generate "Once upon a time" --device cuda --dtype fp32 --max-tokens 48 --temperature 0 --json \
  | tee "$OUT/tiny_cuda_fp32.json" || status=1
echo "== test suite (GPU tests included) =="
python3 -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest_gpu.log" || status=1
echo "== decode benchmark (reference ops; baseline for the kernels to come) =="
python3 bench/decode_bench.py --preset flash --layers 2 --batch 1 8 --context 1024 --steps 10 \
  | tee "$OUT/decode_bench.txt" || status=1
exit $status
