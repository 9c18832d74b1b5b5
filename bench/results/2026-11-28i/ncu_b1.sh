#!/usr/bin/env bash
# call 7 (main): ncu of the batch-1 MoE GEMV and the FP8 GEMV (wo_b): what bounds them
set -uo pipefail
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
mkdir -p $OUT
N="ncu --clock-control none --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy"
timeout 150 $N -k regex:"_w13_decode_kernel|_w2_decode_kernel|_skinny_kernel" -c 3 -o $OUT/b1 python3 bench/results/2026-11-28i/ncu_b1_driver.py > $OUT/ncu_b1.log 2>&1
ncu -i $OUT/b1.ncu-rep --page raw > $OUT/b1.raw.txt 2>&1; ncu -i $OUT/b1.ncu-rep --page details > $OUT/b1.txt 2>&1
grep -E "^  [_a-z].*_kernel|Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Theoretical Occupancy|Registers Per|Waves Per SM|Grid Size|Block Limit Reg" $OUT/b1.txt | head -60
grep -E "^  [_a-z].*_kernel|issue_stalled.*_per_issue_active" $OUT/b1.raw.txt | awk '/_kernel/ || $NF+0 > 0.3' | cut -c1-150 | head -50
rm -f $OUT/*.ncu-rep $OUT/b1.raw.txt
