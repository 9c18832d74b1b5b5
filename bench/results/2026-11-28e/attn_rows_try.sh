export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache
for cfg in "64,32,8,1" "64,64,8,1" "32,32,4,1" "64,32,8,2" "64,16,4,1"; do
  echo "== rows config $cfg"
  timeout 110 python3 -c "
import sys, runpy
import dsv4.ops.triton.attention as A
cfg = tuple(int(v) for v in '$cfg'.split(','))
A._rows_config = lambda H, hd, itemsize=2: cfg
sys.argv = ['prefill_bench.py', '--layers', '4', '--format', 'fp8-mxfp4', '--budget', '8192', '--lengths', '8192', '--no-hf', '--batch', '0']
runpy.run_path('bench/prefill_bench.py', run_name='__main__')
" 2>&1 | grep -E "one prompt|_attn_rows|Error|error" | head -5
done
