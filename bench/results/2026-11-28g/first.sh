# call 1 (cold Triton cache): continuous batching vs waves now; a mixed step's host vs device time; save the Triton cache
export TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
bash bench/gpu_quick.sh throughput mixed
bash bench/gpu_quick.sh tcache_save
