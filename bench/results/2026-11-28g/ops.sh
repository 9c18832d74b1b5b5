# call 8: which torch ops launch the prefill's unnamed elementwise kernels; the GPU's idle gaps (a whole-prompt step)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 200 python3 bench/profile_prefill.py --layers 4 --format fp8-mxfp4 --lengths 2048 8192 --reps 3 --cprofile --ops --top 12 > $OUT/profile_prefill_ops.txt 2>&1
grep -v "^\s*$" $OUT/profile_prefill_ops.txt | cut -c1-250 | tail -45
