# call 7: the host's share of a batch-1 verify step (bench/results/2026-11-29/host_profile.py)
bash bench/gpu_quick.sh tcache_load
export PYTHONPATH=/tmp/site:$PWD DSV4_CACHE=/tmp/dsv4cache TRITON_CACHE_DIR=/tmp/triton_cache OUT=${OUT:-/tmp/out}
timeout 200 python3 bench/results/2026-11-29/host_profile.py > $OUT/call7_host_profile.txt 2>&1; grep -v "^$" $OUT/call7_host_profile.txt | head -80
