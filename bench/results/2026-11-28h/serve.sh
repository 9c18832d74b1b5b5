# call 4: kernels a layer (honest count), the batch-32 step's kernels (the MoE at 32 tokens), serve8k TTFT
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 90 python3 bench/profile_decode.py --layers 4 --format fp8-mxfp4 --batch 1 --context 8192 --ops kernels --graph --top 12 > $OUT/profile4_b1.txt 2>&1; grep -v "it/s]" $OUT/profile4_b1.txt | tail -15
timeout 120 python3 bench/profile_decode.py --layers 4 --format fp8-mxfp4 --batch 32 --context 8192 --ops kernels --graph --top 40 > $OUT/profile4_b32.txt 2>&1; grep -v "it/s]" $OUT/profile4_b32.txt | tail -43
bash bench/gpu_quick.sh serve8k
