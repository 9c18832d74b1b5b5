# call 8: main at the end of the session: graph replay = eager steps (decode graphs at every bucket, now on the
# gemv / gemv_wide tiles; mixed varlen steps)
bash bench/gpu_quick.sh tcache_load graphs
