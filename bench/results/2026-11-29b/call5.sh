# call 5: the decode GEMV with the FP4 weights' next K step loaded a step ahead (branch gemv-prefetch) against
# main (its moe_experts.py, in a copy of the tree): one Flash MoE layer call at 1-16 tokens, main's tiles and one more
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site DSV4_CACHE=/tmp/dsv4cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
T="bench/moe_decode_tune.py --tokens 1 2 4 8 16 --configs 0 5"
for v in new old; do mkdir -p /tmp/$v && cp -r dsv4 bench /tmp/$v/; cp -r /tmp/triton_cache /tmp/tc_$v 2>/dev/null; done
cp .whl/old_moe_experts.py /tmp/old/dsv4/ops/triton/moe_experts.py
# (each copy compiles in its own Triton cache dir, side by side)
for v in new old; do (cd /tmp/$v && TRITON_CACHE_DIR=/tmp/tc_$v timeout 200 python3 $T --compile-only > /dev/null 2>&1) & done
wait
for i in 1 2; do
  for v in new old; do echo "== $v"; (cd /tmp/$v && TRITON_CACHE_DIR=/tmp/tc_$v timeout 90 python3 $T 2>&1 | grep -v "^dsv4:" | tail -2); done
done > $OUT/call5_prefetch.txt
cat $OUT/call5_prefetch.txt
