# call 5: the verify step's state saves and ring restores one launch a layer (fused.rows_save / rows_restore):
# the verify step's GPU tests, then its cost against a decode step with the saves as before
# (.whl/old_cache.py, .whl/old_runner.py = the files at 360b947) and after, batch 1 and 32, k = 3
bash bench/gpu_quick.sh tcache_load spec_tests
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 170 python3 bench/spec_bench.py --layers 4 --batch 1 32 --k 3 --tables cost --steps 20 > $OUT/call5_spec_cost_new.txt 2>&1; tail -4 $OUT/call5_spec_cost_new.txt
cp dsv4/model/cache.py /tmp/cache.py; cp dsv4/engine/runner.py /tmp/runner.py
cp .whl/old_cache.py dsv4/model/cache.py; cp .whl/old_runner.py dsv4/engine/runner.py
timeout 150 python3 bench/spec_bench.py --layers 4 --batch 1 32 --k 3 --tables cost --steps 20 > $OUT/call5_spec_cost_old.txt 2>&1; tail -4 $OUT/call5_spec_cost_old.txt
cp /tmp/cache.py dsv4/model/cache.py; cp /tmp/runner.py dsv4/engine/runner.py
