# call 4: around the gate/up tiles of one warpgroup a program (call 3: 8192 tokens 6.11 -> 5.68 ms)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
tune() { timeout "$1" python3 bench/moe_prefill_tune.py "${@:2}" 2>&1 | grep -v Warn; }
tune 200 --tokens 8192 --cases 23 40 41 42 43 44 > $OUT/moe_8192.txt; cat $OUT/moe_8192.txt
tune 100 --tokens 6144 --cases 23 41 26 > $OUT/moe_6144.txt; cat $OUT/moe_6144.txt
