# call 6: where a verify step's time goes: kernels of a decode step of 1 and 4 rows and of a verify step of 1 row x 4 tokens
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 300 python3 bench/spec_bench.py --layers 4 --batch 1 --k 3 --tables profile --steps 20 > $OUT/call6_spec_profile.txt 2>&1; cat $OUT/call6_spec_profile.txt | grep -v Warn
