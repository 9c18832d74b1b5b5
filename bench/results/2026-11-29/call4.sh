# call 4: main at b33ad8f: no compile after start-up with the new decode tiles (gemv_wide), the verify step's GPU tests
bash bench/gpu_quick.sh tcache_load warmup spec_tests
