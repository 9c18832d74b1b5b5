#!/usr/bin/env bash
# call 2: ncu of the decode-size MoE's GEMMs at 32 tokens, W4A8 vs bf16-dequantized 16-pair tiles; then the MoE GPU tests
set -uo pipefail
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
mkdir -p $OUT
N="ncu --clock-control none --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy"
timeout 150 $N -k regex:"_w13_w4a8_kernel|_w2_w4a8_kernel|_w13_grouped_kernel|_w2_grouped_kernel" -c 4 -o $OUT/dec python3 bench/results/2026-11-28i/ncu_driver.py 32 > $OUT/ncu_dec.log 2>&1
ncu -i $OUT/dec.ncu-rep --page raw > $OUT/dec.raw.txt 2>&1; ncu -i $OUT/dec.ncu-rep --page details > $OUT/dec.txt 2>&1
grep -E "^  [_a-z].*_kernel|issue_stalled.*_per_issue_active|gpu__time_duration.sum|dram__throughput.avg.pct|sm__warps_active.avg.pct|launch__registers|smsp__inst_executed.sum " $OUT/dec.raw.txt | awk '/_kernel|duration|dram|warps_active|registers|inst_executed/ || $NF+0 > 0.3' | cut -c1-150 | head -90
rm -f $OUT/*.ncu-rep
python3 -m pytest -q -rf --tb=short -m gpu tests/test_triton_moe.py > $OUT/moe_tests.log 2>&1; echo "rc=$?" >> $OUT/moe_tests.log; tail -5 $OUT/moe_tests.log
