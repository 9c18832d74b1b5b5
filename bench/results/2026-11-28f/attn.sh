# call 2: the prefill attention from key tables (pipelined gathers) against the kernel before it, then tests and prefill_bench
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT /tmp/old && cp -r dsv4 bench /tmp/old/ && git show f4ec7de:dsv4/ops/triton/attention.py > /tmp/old/dsv4/ops/triton/attention.py   # this call ran from a copy of that file
(cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old timeout 150 python3 bench/attention_prefill_tune.py --tokens 8192 --configs 64,32,8,1) > $OUT/attn_before.txt 2>&1
cat $OUT/attn_before.txt | grep -v Warn
timeout 200 python3 bench/attention_prefill_tune.py --tokens 8192 > $OUT/attn_after.txt 2>&1; cat $OUT/attn_after.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/test_triton_attention.py > $OUT/attn_tests.log 2>&1; tail -3 $OUT/attn_tests.log
timeout 200 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf > $OUT/prefill_bench.txt 2>&1
grep -E "one prompt|16 prompts|^ +[0-9.]+%" $OUT/prefill_bench.txt | head -14
