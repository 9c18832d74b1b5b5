# call 9: wo_a's token-major batched GEMM against the einsum (bits) on the GPU; the linear and batched-step GPU
# tests; prefill_bench with the copies gone; continuous batching vs waves
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
python3 bench/results/2026-11-28g/bmm_gpu_check.py 2>&1 | tee $OUT/bmm_gpu_check.txt
timeout 200 python3 bench/prefill_bench.py --layers 4 --format fp8-mxfp4 --budget 8192 --lengths 2048 8192 --no-hf > $OUT/prefill_bench.txt 2>&1
grep -E "peaks|one prompt|16 prompts|profile of|^ +[0-9.]+%" $OUT/prefill_bench.txt | head -12
timeout 90 python3 -m pytest -q -rf --tb=short -x -m gpu tests/test_triton_linear.py -k "grouped or pair" > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log
timeout 120 python3 -m pytest -q -rf --tb=short -x -m gpu tests/test_gpu_batched_step.py > $OUT/gpu_batched.log 2>&1; tail -2 $OUT/gpu_batched.log
timeout 170 python3 bench/throughput.py --layers 4 --format fp8-mxfp4 --requests 64 --max-num-seqs 16 --out $OUT > $OUT/throughput.txt 2>&1; grep -E "^waves|^continuous" $OUT/throughput.txt | cut -c1-200
