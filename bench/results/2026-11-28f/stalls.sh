# call 6: stall reasons of the prefill MoE's two GEMMs (production configs, 8192 tokens) and the CSA attention (ncu raw metrics)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
mkdir -p $OUT
N="ncu --clock-control none --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section MemoryWorkloadAnalysis"
timeout 100 $N -k regex:"_w13_wt_kernel|_w2_grouped_kernel" -c 2 -o $OUT/moe2 python3 bench/moe_prefill_tune.py --tokens 8192 --cases 23 --iters 1 > $OUT/ncu_moe2.log 2>&1
timeout 80 $N -k regex:"_attn_rows_kernel" -c 1 -o $OUT/attn2 python3 bench/attention_prefill_tune.py --tokens 8192 --kinds csa --configs 64,64,8,2 --iters 1 > $OUT/ncu_attn2.log 2>&1
for r in moe2 attn2; do ncu -i $OUT/$r.ncu-rep --page raw > $OUT/$r.raw.txt 2>&1; ncu -i $OUT/$r.ncu-rep --page details > $OUT/$r.txt 2>&1; done
grep -E "^  [_a-z].*_kernel|issue_stalled.*_per_issue_active|pipe_tensor.*pct|gpu__time_duration.sum" $OUT/moe2.raw.txt $OUT/attn2.raw.txt | awk '/_kernel|duration/ || $NF+0 > 0.2' | cut -c1-150 | head -70
rm -f $OUT/*.ncu-rep
