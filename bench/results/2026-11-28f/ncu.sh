# call 3: where the prefill MoE's and attention's time goes (ncu, one launch each), then the race fix's GPU tests
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
N="ncu --clock-control none --set full --import-source no"
timeout 200 $N -k regex:"_w13_wt_kernel|_w2_grouped_kernel" -c 2 -o $OUT/moe python3 bench/moe_prefill_tune.py --tokens 8192 --cases 20 --bm 256 --iters 1 > $OUT/ncu_moe.log 2>&1
tail -3 $OUT/ncu_moe.log
timeout 150 $N -k regex:"_attn_rows_kernel" -c 1 -o $OUT/attn python3 bench/attention_prefill_tune.py --tokens 8192 --kinds csa --configs 64,64,8,2 --iters 1 > $OUT/ncu_attn.log 2>&1
tail -3 $OUT/ncu_attn.log
for r in moe attn; do ncu -i $OUT/$r.ncu-rep --page details > $OUT/$r.txt 2>&1; done
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Stall|One or More Eligible|No Eligible" $OUT/moe.txt $OUT/attn.txt | head -50
rm -f $OUT/*.ncu-rep.tmp
bash bench/gpu_quick.sh moe
timeout 300 python3 -m pytest -q -rf --tb=short --maxfail=4 -m gpu tests/test_triton_linear.py -k "fp8 or skinny or cuda_graph" > $OUT/linear_tests.log 2>&1; tail -3 $OUT/linear_tests.log
