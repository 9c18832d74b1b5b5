# call 1 (cold machine): the CUDA-graph tests after the decode MoE threshold change, then the Triton cache
bash bench/gpu_quick.sh graphs tcache_save
