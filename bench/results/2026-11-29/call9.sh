# call 9: speculation against plain decoding at simulated acceptance (the draft is the target's own token with
# probability p), batch 1 and 32, k = 3, main at the end of the session
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 280 python3 bench/spec_bench.py --layers 4 --batch 1 32 --k 3 --tables simulated --tokens 128 > $OUT/call9_spec_simulated.txt 2>&1; grep -v Warn $OUT/call9_spec_simulated.txt
