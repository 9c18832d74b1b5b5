# call 10: the simulated-acceptance table with the acceptance drawn (spec_bench.ForcedAcceptance), batch 1 and 32,
# k = 3, with the verify cost in the same run
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 280 python3 bench/spec_bench.py --layers 4 --batch 1 32 --k 3 --tables cost simulated --tokens 128 > $OUT/call10_spec.txt 2>&1; grep -v Warn $OUT/call10_spec.txt
