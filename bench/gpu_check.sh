#!/usr/bin/env bash
# Every GPU test and benchmark in one call (run on the device machine from the repo root):
#   bash bench/gpu_check.sh [quick]
# Expects transformers>=5.23 (and its newer deps) as wheels in .whl/ when the image's are older.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 DSV4_CACHE=/tmp/dsv4cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
status=0
step() { echo; echo "== $1 =="; shift; "$@" || { echo "!! FAILED: $*"; status=1; }; }
step "tiny model on cuda, bf16 (greedy)" python3 -m dsv4.cli generate "Once upon a time" --device cuda --dtype bf16 \
  --max-tokens 32 --temperature 0
python3 -c "import torch; a=torch.zeros(2,2,dtype=torch.bfloat16,device=\"cuda\"); print(\"mm out_dtype:\", torch.mm(a,a,out_dtype=torch.float32).dtype)" || echo "mm out_dtype: unsupported"
step "GPU tests" bash -c "python3 -m pytest -q -rs -m gpu tests 2>&1 | tee $OUT/pytest_gpu.log; exit \${PIPESTATUS[0]}"
step "reference linear cost per format" bash -c "python3 bench/ref_linear_cost.py 2>&1 | tee $OUT/ref_linear_cost.txt; exit \${PIPESTATUS[0]}"
step "decode step vs transformers and the bytes floor (Flash x4 slice)" bash -c \
  "python3 bench/decode_bench.py --layers 4 --batch 1 8 --context 1024 --format bf16 fp8-mxfp4 --ops reference 2>&1 | tee $OUT/decode_bench.txt; exit \${PIPESTATUS[0]}"
exit $status
