# call 9: 2048-token steps (48 pairs an expert, BM 64 tiles): the untransposed few-pairs config against the transposed gate/up GEMM
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 200 python3 bench/moe_prefill_tune.py --tokens 2048 --cases 7 26 32 33 14 --bm 64 > $OUT/moe_2048.txt 2>&1; cat $OUT/moe_2048.txt
