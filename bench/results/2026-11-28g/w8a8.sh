# call 6: the W8A8 GEMM with each block's promotion overlapping the next block's MMA (OVERLAP), then
# prefill_bench with OVERLAP on in the default tiles (patched in process)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 300 python3 bench/tune_linear.py w8a8 2>&1 | grep -v Warn > $OUT/tune_w8a8.txt; grep -E "cuBLAS|default|OVERLAP': True" $OUT/tune_w8a8.txt | cut -c1-150
timeout 220 python3 -c "
import sys, runpy
sys.path.insert(0, 'bench')
import dsv4.ops.triton.linear as L
orig = L._gemm_defaults
L._gemm_defaults = lambda code: dict(orig(code), OVERLAP=True) if code < 2 else orig(code)
sys.argv = ['prefill_bench.py', '--layers', '4', '--format', 'fp8-mxfp4', '--budget', '8192', '--lengths', '2048', '8192', '--no-hf']
runpy.run_path('bench/prefill_bench.py', run_name='__main__')
" > $OUT/prefill_bench_overlap.txt 2>&1
grep -E "peaks|one prompt|16 prompts|profile of|^ +[0-9.]+%" $OUT/prefill_bench_overlap.txt | head -8
