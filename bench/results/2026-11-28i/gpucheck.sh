#!/usr/bin/env bash
# call 5 (main, 01be9a4): last session's open GPU check of the 64-pair MoE tiles
bash bench/gpu_quick.sh tcache_load moe graphs warmup
