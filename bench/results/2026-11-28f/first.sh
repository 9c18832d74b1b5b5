# 2026-11-28 fifth session, call 1: the race fix on a GPU for the first time
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
python3 -c "import triton; from dsv4.ops.triton import moe; print('triton', triton.__version__, 'register_mma_safe', moe.register_mma_safe())" 2>&1 | tee $OUT/safe.txt
bash bench/gpu_quick.sh moe decode prefill_kernels
bash bench/gpu_quick.sh tcache_save >/dev/null
