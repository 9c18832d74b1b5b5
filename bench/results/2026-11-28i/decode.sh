#!/usr/bin/env bash
# call 11 (main): the decode step against the bytes floor, batch 1 / 8 / 32 (bench/decode_bench.py)
bash bench/gpu_quick.sh tcache_load decode
