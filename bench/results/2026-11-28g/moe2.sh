# call 3: one warpgroup a program (several programs a multiprocessor) for the MXFP4 prefill MoE's GEMMs
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
tune() { timeout "$1" python3 bench/moe_prefill_tune.py "${@:2}" 2>&1 | grep -v Warn; }
tune 200 --tokens 8192 --cases 23 35 36 37 > $OUT/moe_8192.txt; cat $OUT/moe_8192.txt
tune 150 --tokens 4096 --cases 26 38 39 > $OUT/moe_4096.txt; cat $OUT/moe_4096.txt
tune 100 --tokens 6144 --cases 23 38 39 > $OUT/moe_6144.txt; cat $OUT/moe_6144.txt
